"""MindSpeed-RL's ``GRPOTransferDock`` on a dock in Redis (see the package docstring)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from broker.adapters.mindspeed.defaults import (
    AGE,
    DEFAULT_COLUMNS,
    DEFAULT_CONSUMERS,
    DEFAULT_DOCK,
    LENGTHS,
    ROLLOUT_CONSUMER,
)
from broker.adapters.mindspeed.docked import Docked
from broker.adapters.mindspeed.helpers import (
    bad,
    check_names,
    check_seconds,
    mindspeed_batch,
    partial_rollout,
    pickled_url,
)
from broker.adapters.mindspeed.metric import Metric
from broker.api.balance import dp_padded
from broker.api.checks import is_int
from broker.api.dock import TransferDock
from broker.connection import Client, default_url
from broker.control.rollout import Rollout
from broker.errors import SchemaError


def _open(url: str | Client | None, name: str, prompts_num: int, n: int, columns: Sequence[str],
          consumers: Sequence[str], rollout: Rollout | None = None, durable: Mapping[str, Any] = {},
          partitions: int = 1) -> TransferDock:
    """Create the dock, or attach to it and grow it to hold ``columns`` and ``consumers``; ``durable``: its
    ``wait_replicas`` and ``wait_timeout``; ``partitions``: see ``TransferDock``."""
    target = url or default_url()
    lengths = [c for c in LENGTHS if c in columns]
    try:
        return TransferDock(target, name, prompts_num, n, columns, consumers, policy="random",
                            length_columns=lengths, rollout=rollout, partitions=partitions, **durable)
    except SchemaError as exc:
        if "exists with a different schema" not in str(exc):
            raise  # our own arguments are wrong (GBS_train=0 with partial rollout, ...)
        dock = TransferDock.attach(target, name, policy="random", **durable)
    if (dock.prompts_num, dock.n_samples_per_prompt) != (prompts_num, n):
        dock.close()
        raise SchemaError(
            f"dock {name!r} holds {dock.prompts_num} prompts x {dock.n_samples_per_prompt} samples, "
            f"not {prompts_num} x {n}; delete it with `broker clear {name} --yes --delete`, or pass another name="
        )
    if dock.rollout != (rollout or Rollout()):
        stored, wanted = dock.rollout, rollout or Rollout()
        dock.close()
        raise SchemaError(
            f"dock {name!r} was made with max_age={stored.max_age}, GBS_train={stored.gbs_train}, not "
            f"max_age={wanted.max_age}, GBS_train={wanted.gbs_train}; delete it with "
            f"`broker clear {name} --yes --delete`, or pass another name="
        )
    dock.grow(columns, consumers)
    return dock


class GRPOTransferDock(Docked):
    """MindSpeed-RL's ``GRPOTransferDock``, every method, on a dock in Redis (see the package docstring)."""

    def __init__(
        self,
        prompts_num: int,
        n_samples_per_prompt: int,
        metrics: Metric | None = None,
        max_age: int = 1,
        GBS_train: int = 0,  # noqa: N803 - MindSpeed's name
        addition_columns: Sequence[str] | None = None,
        addition_consumers: Sequence[str] | None = None,
        timeout: float | None = None,
        timeout_interval: float | None = None,
        *,
        url: str | Client | None = None,
        name: str = DEFAULT_DOCK,
        lease: float | None = None,
        wait_replicas: int = 0,
        wait_timeout: float = 1.0,
        partitions: int = 1,
    ) -> None:
        if not is_int(max_age) or max_age < 1:
            raise bad(f"max_age must be a positive int, got {max_age!r}")
        columns = check_names("addition_columns", addition_columns or [])
        consumers = check_names("addition_consumers", addition_consumers or [])
        self.experience_columns = list(dict.fromkeys([*DEFAULT_COLUMNS, *columns]))
        self.experience_consumers = list(dict.fromkeys([*DEFAULT_CONSUMERS, *consumers]))
        self.prompts_num, self.n_samples_per_prompt = prompts_num, n_samples_per_prompt
        self.max_len = prompts_num * n_samples_per_prompt
        self.max_age, self.GBS_train = max_age, GBS_train
        self.timeout = 300.0 if timeout is None else check_seconds("timeout", timeout)
        self.empty_wait = Docked.empty_wait
        self.timeout_interval = 5.0 if timeout_interval is None else check_seconds("timeout_interval",
                                                                                   timeout_interval)
        # The URL now, not $REDIS_URL where it is unpickled: a Ray worker's may name another server.
        self._url, self._name = url or default_url(), name
        self._init_leases(lease)
        self._init_durability(wait_replicas, wait_timeout)
        self.enable_partial_rollout = max_age > 1
        self.partitions = partitions
        self.dock = _open(url, name, prompts_num, n_samples_per_prompt, self.experience_columns,
                          self.experience_consumers, partial_rollout(max_age, GBS_train), self._durable(), partitions)
        self.metrics = metrics
        if metrics is not None and getattr(metrics, "metric", None):
            self._update_metrics(self.dock, "", dict(metrics.metric), False)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # pickles as its arguments: attaches again
        pickled_url("GRPOTransferDock", self._url)
        return _grpo_dock, (self.prompts_num, self.n_samples_per_prompt, self.experience_columns,
                            self.experience_consumers, self.timeout, self.timeout_interval, self._url, self._name,
                            self.max_age, self.GBS_train, self.lease, self._durability, self.partitions)

    # -- data ---------------------------------------------------------------------------------

    def put_experience(self, data_dict: Any, indexes: Sequence[int] | None = None, is_prompt: bool = False) -> None:
        """Write rows (MindSpeed's padded format or a TensorDict); negative indexes are skipped.

        Under partial rollout, responses come with ``rollout_completed`` (one ``[0]``/``[1]`` per row),
        and prompts put with ``is_prompt=True`` get placeholder responses and land in free groups (see
        docs/mindspeed.md)."""
        self._put(self.dock, data_dict, indexes, is_prompt=is_prompt)

    def get_experience(
        self,
        consumer: str,
        experience_columns: list[str],
        experience_count: int | None = None,
        dp_size: int = 1,
        indexes: list[int] | None = None,
        get_n_samples: bool = True,
        use_batch_seqlen_balance: bool = False,
        allow_partial_ready_data: bool = False,
    ) -> tuple[Any, list[int]] | tuple[None, None]:
        """Hand ready rows to ``consumer`` as a padded batch, or ``(None, None)`` at once if too few are ready."""
        columns = list(experience_columns)
        generating = self.enable_partial_rollout and consumer == ROLLOUT_CONSUMER
        if indexes is None and not self.enable_partial_rollout:
            self._check_divides(self.dock, experience_count)
        # The dock checks the rest (names, counts, get_n_samples for the rollout), before it touches Redis.
        batch, rows = self._named(self.dock, lambda: self._get(
            self.dock, consumer, columns, experience_count, indexes, get_n_samples, use_batch_seqlen_balance,
            self.timeout), "get experience", consumer, [c for c in columns if not (generating and c == AGE)])
        if batch is None or rows is None:
            return None, None
        if generating and experience_count is not None and 0 < len(rows) < experience_count and dp_size > 1:
            # MindSpeed's rollout takes what is there and pads it for its DP ranks with index -2.
            batch, rows = dp_padded(batch, rows, dp_size)
        return mindspeed_batch(batch), rows

    def all_consumed(self, consumer: str, get_n_samples: bool = True) -> bool:
        self._done(self.dock, consumer)
        return self.dock.all_consumed(consumer)

    def clear(self, consumer: str = "actor_train") -> None:
        """Forget the batch: rows, every consumer's marks, metrics and the request cursor.

        Under partial rollout: forget what ``consumer`` trained on, age every group kept, reset the
        cursor and metrics (MindSpeed's ``clear``, without its re-sort: see docs/mindspeed.md)."""
        if self.enable_partial_rollout:
            self._named(self.dock, lambda: self.dock.clear(consumer=consumer), "clear", consumer)
            self._done(self.dock, consumer)  # the trained rows are gone: nothing of theirs to ack
        else:
            self.dock.clear()
            self._leased.clear()  # every lease ended with the rows

    def get_consumer_status(self) -> dict[str, torch.Tensor]:
        """Per consumer, an int32 tensor with 1 for every row handed to it."""
        return self._status(self.dock.consumed_rows())

    # -- shared state -------------------------------------------------------------------------

    def get_metrics(self) -> Metric:
        return self._metric(self.dock)

    def update_metrics(self, key: str = "", value: Any = None, cumulate: bool = False) -> None:
        self._update_metrics(self.dock, key, value, cumulate)

    def prefetch_request_index(self, experience_num: int) -> list[int] | None:
        return self.dock.prefetch_request_index(experience_num)

    def get_cur_index(self) -> int:
        return self.dock.get_cur_index()

    # -- inspection ---------------------------------------------------------------------------

    def get_experience_data(self) -> dict[str, list[Any]]:
        """Every row of every column (None where unwritten): a whole read, for debugging."""
        return self.dock.read_rows(list(self.dock.columns), range(self.max_len))

    def get_experience_status(self) -> dict[str, torch.Tensor]:
        """Per column, an int32 tensor with 1 for every row written."""
        return self._status(self.dock.ready_rows())

    def get_experience_len(self) -> int:
        return self.max_len

    # -- partial rollout (max_age > 1) --------------------------------------------------------

    def get_incomplete_response_num(self) -> int:
        """Prompt rows written minus responses finished, as MindSpeed counts them.

        Without partial rollout MindSpeed marks no response finished, so this is the number of prompt
        rows written (its own value then).
        """
        if self.enable_partial_rollout:
            return self.dock.get_incomplete_response_num()
        return int(self.dock.status()["columns"]["prompts"]["ready"])

    def get_update_ready(self, require_max_age_all_finished: bool = True) -> bool:
        """MindSpeed's stop signal: ``GBS_train`` groups finished, and (if required) every group of age
        ``max_age - 1`` finished."""
        self._partial("get_update_ready")
        return self.dock.get_update_ready(require_max_age_all_finished)

    def find_all_consumed_n_samples_groups(self, consumer: str) -> tuple[int, torch.Tensor, list[int]]:
        """Finished groups: (how many, an int32 row mask of their rows, their first rows), as MindSpeed's."""
        if consumer != ROLLOUT_CONSUMER:
            raise bad(f"Consumer {consumer} is not supported for partial rollout stop signal.")
        self._partial("find_all_consumed_n_samples_groups")
        mask = self.dock.finished_rows().to(torch.int32)
        n = self.n_samples_per_prompt
        starts = [g * n for g in range(self.prompts_num) if bool(mask[g * n])]
        return len(starts), mask, starts

    def sort_every_n_samples_by_age(self) -> None:
        """Nothing to do: sampling already goes oldest group first (age bitmaps), and rows never move."""
        self._partial("sort_every_n_samples_by_age")

    def _partial(self, what: str) -> None:
        if not self.enable_partial_rollout:
            raise bad(f"{what} needs partial rollout (max_age > 1); this dock has max_age={self.max_age}")


def _grpo_dock(prompts_num: int, n: int, columns: list[str], consumers: list[str], timeout: float,
               interval: float, url: str | Client | None, name: str, max_age: int = 1,
               gbs_train: int = 0, lease: float | None = None,
               durability: tuple[int, float] = (0, 1.0), partitions: int = 1) -> GRPOTransferDock:
    defaults = set(DEFAULT_COLUMNS), set(DEFAULT_CONSUMERS)
    return GRPOTransferDock(prompts_num, n, None, max_age, gbs_train, [c for c in columns if c not in defaults[0]],
                            [c for c in consumers if c not in defaults[1]], timeout, interval, url=url, name=name,
                            lease=lease, wait_replicas=durability[0], wait_timeout=durability[1],
                            partitions=partitions)
