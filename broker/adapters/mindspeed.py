"""MindSpeed-RL's data APIs on the broker: swap one import, keep the workers.

``GRPOTransferDock`` takes MindSpeed-RL's constructor and has every public method of its
``mindspeed_rl.trainer.utils.transfer_dock.GRPOTransferDock``, with the same parameters, return
values (padded batches as its ``padding_dict_to_tensor_dict`` builds them, a TensorDict where
``tensordict`` is installed, ``(None, None)`` when nothing is ready, indexes as lists of ints) and
error classes (``ValueError`` for bad input). ``TransferQueueClient`` has the methods of its
TransferQueue client (``mindspeed_rl/utils/transfer_queue/tq_client.py``); a topic is a dock on the
same server. Both keep everything in Redis, so any number of processes on any number of machines
may hold one, all attached to the same dock::

    from broker.adapters.mindspeed import GRPOTransferDock          # was: from mindspeed_rl.trainer.utils import ...
    td = GRPOTransferDock(prompts_num, n_samples_per_prompt, metrics=Metric(), url="redis://host:6379/0")

Recommended: create one in each worker process (no actor hop: each call goes straight to Redis).
Wrapped as a Ray actor, ``ray.remote(GRPOTransferDock).remote(...)``, it also runs existing
``ray.get(td.get_experience.remote(...))`` code unchanged, with every call through that one actor.

Deliberate differences from MindSpeed-RL (where its behaviour is a defect, ours is kept):

* ``get_experience`` with explicit ``indexes`` waits at most ``timeout`` seconds (MindSpeed's logging
  threshold, default 300 for the dock, the topic's ``timeout`` for the queue) for the rows and then
  raises ``ExperienceTimeoutError`` naming the missing cells, having marked nothing; MindSpeed's dock
  logs and waits forever, and its queue returns whichever subset was ready.
* ``GBS_train`` limits sampling only with partial rollout (``max_age > 1``). MindSpeed's newest dock
  also applies it without, so with the default ``GBS_train=0`` every sampling call with
  ``get_n_samples=True`` returns ``(None, None)``.
* Indexes come back as the delivery they are (a list of ints that also carries the rows' generations,
  :class:`broker.HandedRows`), and a put naming them is fenced by it, as on the native dock: a slow
  worker whose rows were cleared (and refilled with the next batch's prompts) or, under a lease, given
  to another worker, writes nothing. MindSpeed's workers have no handler for that, so the put logs a
  warning and returns: the late result is dropped and the worker goes on. Pass the indexes object the
  get returned (a tensor or ``list(indexes)`` made from it carries no delivery: such a put is not fenced).
* ``lease=S`` (a keyword of ``GRPOTransferDock`` and ``TransferQueueClient``) hands rows out at least
  once: rows not done within S seconds are offered again, so a worker that dies loses nothing (a crashed
  MindSpeed actor loses the batch). MindSpeed's workers never ack, so this object acks for them, as
  Kafka's auto-commit does: a put of a delivery's rows acks them (in the same step), and a consumer's next
  ``get_experience`` or ``all_consumed`` through this object acks what it was handed before (a consumer
  that writes nothing, the trainer, is done with a batch when it asks for the next). That holds when each
  worker process has its own object, as recommended; through one shared Ray actor, one worker's next get
  would ack another's rows early (they are then at most once, as without a lease).
* ``wait_replicas=k`` and ``wait_timeout=S`` (keywords of ``GRPOTransferDock`` and ``TransferQueueClient``)
  are the native dock's durability (see ``TransferDock``): every call that writes waits until k replicas
  have it, and one that hands nothing out raises ``ReplicationError`` (a ``ClusterError``) on a shortfall.
  MindSpeed has no replicas to wait for.
* Puts of rows past the dock's end raise (``RowIndexError``, a ``IndexError``); negative indexes
  (the ``-2`` DP padding) are skipped, as MindSpeed does. MindSpeed's queue drops rows past the end
  with a warning; its dock also lets a ``-2`` wrap to row ``max_len - 2`` in one path.
* A sampling call that finds too few rows waits up to ``empty_wait`` seconds (default 0.05; set the
  attribute to 0 for none) for a put before it returns ``(None, None)``: MindSpeed's workers call
  again at once, and a dozen of them spinning on a shared server would starve it (measured: 35 x
  slower in ``broker bench --concurrent`` without the wait).
* ``all_consumed`` returns a Python bool (MindSpeed's dock: a 0-d tensor, which ``not`` treats alike).
* ``register_consumer_columns_dict`` replaces the columns of the consumers it names and keeps the
  others (MindSpeed replaces the whole mapping).
* Metric values are numbers or lists of numbers, shared through Redis; ``get_metrics()`` returns a
  ``Metric`` holding a snapshot. ``cumulate=True`` with a number appends it (MindSpeed: TypeError).
* Partial rollout (``max_age > 1``) keeps MindSpeed's semantics (placeholders, oldest first, fewer
  rows for the rollout, ``rollout_completed``, finished groups only for the others, ``GBS_train``,
  ages, the stop signal) without its re-sort of the whole dock after each iteration: rows never move,
  and "oldest first" comes from age bitmaps. So the free rows after a ``clear`` are wherever the
  trained groups were, not at ``[GBS_train*n, 2*GBS_train*n)``: a prompt put (``is_prompt=True``;
  on the queue, a put of ``prompts`` to a partial-rollout topic) lands in free groups, claimed
  atomically, whatever indexes it names. Indexes handed out afterwards are where the rows are.
  ``sort_every_n_samples_by_age`` has nothing to do. ``GBS_train=0`` with ``max_age > 1`` is refused
  when the dock is made (MindSpeed: at the first put). Groups older than ``max_age`` share its age
  bitmap, so ``age`` reads at most ``max_age``. On the queue, ``data_status`` stands for
  ``rollout_completed`` (``"ready"`` finished, ``"partial_ready"`` not) unless the data carries it,
  and ``allow_partial_ready_data`` is for the rollout consumer only (the others never see unfinished
  rows).
* ``clear_and_resize_topic`` works (MindSpeed's raises TypeError).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

from broker.api.balance import dp_padded
from broker.api.batches import padding_dict_to_tensor_dict, remove_padding_tensor_dict_to_dict
from broker.api.checks import PAD_INDEX, check_durability, check_lease, drop_padding, is_int
from broker.api.delivery import HandedRows, LeasedRows, reordered
from broker.api.dock import TransferDock
from broker.connection import Client, connect, default_url, disconnect
from broker.control.rollout import Rollout
from broker.control.status import dock_names
from broker.errors import (
    DockNotFoundError,
    FencedError,
    InvalidExperienceError,
    RowIndexError,
    SchemaError,
    UnknownConsumerError,
)

__all__ = [
    "DEFAULT_COLUMNS",
    "DEFAULT_CONSUMERS",
    "DEFAULT_TOPIC",
    "GRPOTransferDock",
    "Metric",
    "TransferQueueClient",
    "get_transfer_queue_client",
]

log = logging.getLogger(__name__)

try:  # imported once, here: it takes about a second, which a first get_experience should not pay
    from tensordict import TensorDict
except ImportError:  # the "mindspeed" extra is not installed: batches are plain dicts
    TensorDict = None  # type: ignore[misc, assignment]

#: MindSpeed-RL's default columns and consumers, in its order.
DEFAULT_COLUMNS = (
    "prompts", "prompt_length", "responses", "response_length", "attention_mask", "labels", "input_ids",
    "input_ids_length", "actor_rollout", "rm_scores", "token_level_rewards", "old_log_prob", "ref_log_prob",
    "advantages", "returns",
)
DEFAULT_CONSUMERS = (
    "trainer", "actor_rollout", "actor_image_embeds", "actor_log_prob", "ref_log_prob", "actor_train",
    "compute_advantage", "rule_reward", "reward_scores", "grpo_metrics",
)
#: Consumers whose ``use_batch_seqlen_balance`` weighs rows by these columns (MindSpeed's mapper).
SEQLEN_BALANCED = ("ref_log_prob", "actor_log_prob", "reward_scores", "actor_train")
LENGTHS = ("prompt_length", "response_length")
#: Under partial rollout: the consumer that generates, the columns it writes, and its completion flag.
ROLLOUT_CONSUMER = "actor_rollout"
AGE = "age"
RESPONSE_COLUMNS = ("responses", "response_length")
COMPLETED = "rollout_completed"
DEFAULT_TOPIC = "default_topic"
#: Dock name of a ``GRPOTransferDock`` made without ``name=``; topics are docks named ``tq.TOPIC``.
DEFAULT_DOCK = "grpo_transfer_dock"


class Metric:
    """MindSpeed-RL's ``Metric``: a dict of named values; ``get_metrics()`` returns one as a snapshot.

    Passed to the constructors, its values are written to the shared metrics of the dock once.
    """

    def __init__(self) -> None:
        self.metric: dict[str, Any] = {}

    def update(self, key: str = "", value: Any = None, cumulate: bool = False) -> None:
        pairs = value if isinstance(value, Mapping) else {key: value}
        for k, v in pairs.items():
            if cumulate:
                more = list(v) if isinstance(v, (list, tuple)) else [v]
                stored = self.metric.get(k)
                self.metric[k] = stored + more if isinstance(stored, list) else more
            else:
                self.metric[k] = v

    def reset(self) -> None:
        self.metric = {}

    def compute_mean(self, key: str, value: Any = None) -> float:
        values = self._numbers(key if value is None else value)
        return sum(values) / len(values)

    def compute_max(self, key: str, value: Any = None) -> float:
        return max(self._numbers(key if value is None else value))

    def compute_min(self, key: str, value: Any = None) -> float:
        return min(self._numbers(key if value is None else value))

    def _numbers(self, value: Any) -> list[float]:
        value = self.metric[value] if isinstance(value, str) else value
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def __repr__(self) -> str:
        return f"Metric({self.metric!r})"


def _bad(message: str) -> InvalidExperienceError:
    return InvalidExperienceError(message)


def _as_dict(data: Any) -> dict[str, Any]:
    """A data dict from what MindSpeed's workers hand over: a dict or a TensorDict."""
    if isinstance(data, Mapping):
        return dict(data)
    if hasattr(data, "to_dict") and hasattr(data, "keys"):  # a TensorDict, without importing tensordict
        return {k: data[k] for k in data.keys()}
    raise _bad(f"data_dict must be a dict or a TensorDict of columns, got {type(data).__name__}")


def _narrowed(data: Mapping[str, Any]) -> dict[str, Any]:
    """int64 rows become int32, as MindSpeed's ``trans_input_to_experience`` stores them."""
    def narrow(v: Any) -> Any:
        return v.to(torch.int32) if isinstance(v, torch.Tensor) and v.dtype == torch.int64 else v

    out = {}
    for column, value in data.items():
        if value is None:
            continue  # MindSpeed skips None columns
        out[column] = [narrow(v) for v in value] if isinstance(value, (list, tuple)) else narrow(value)
    return out


def _mindspeed_batch(batch: Mapping[str, list[Any]]) -> Any:
    """MindSpeed's return format: padded tensors plus ``original_length``, as a TensorDict if possible."""
    padded = padding_dict_to_tensor_dict(batch)
    if TensorDict is None:
        return padded
    tensors = {k: v for k, v in padded.items() if isinstance(v, torch.Tensor)}
    if len(tensors) != len(padded):
        return padded  # label columns: a plain dict, as MindSpeed's queue builds around them
    return TensorDict.from_dict(tensors)


def _rows(indexes: Any) -> list[int]:
    """Row indexes as ints; anything else raises (int() would turn 0.5 into row 0 silently)."""
    if isinstance(indexes, (torch.Tensor, np.ndarray)):
        indexes = indexes.tolist()
    if isinstance(indexes, (str, bytes)) or not isinstance(indexes, Sequence):
        raise RowIndexError(f"indexes must be a list of row numbers, got {type(indexes).__name__}")
    bad = [i for i in indexes if not is_int(i)]
    if bad:
        raise RowIndexError(f"indexes must be ints, got {bad[:5]!r}")
    return [int(i) for i in indexes]


class _Docked:
    """What the dock and the queue share: MindSpeed's checks and calls on one native dock."""

    def _check_count(self, dock: TransferDock, count: Any, get_n_samples: bool, divides: bool) -> int:
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise _bad(f"experience_count must be a positive int, got {count!r}")
        if count > dock.capacity:
            raise _bad(f"TD max_len: {dock.capacity} need >= experience_count: {count}")
        if divides and dock.capacity % count:
            raise _bad(f"TD max_len:{dock.capacity} need be divisible by experience_count: {count}")
        if get_n_samples and count % dock.n_samples_per_prompt:
            raise _bad(
                f"get_n_samples need experience_count:{count} must be divisible by n_samples_per_prompt: "
                f"{dock.n_samples_per_prompt}"
            )
        return count

    def _check_names(self, dock: TransferDock, consumer: Any, columns: Sequence[Any]) -> None:
        # MindSpeed raises ValueError for both; ours are KeyErrors, so name them here first. A name this
        # object has not seen may have been added by another process (grow): read the schema again.
        if consumer not in dock.consumers or not set(columns) <= set(dock.columns):
            dock.refresh()
        if consumer not in dock.consumers:
            raise _bad(f"get experience ERROR: {consumer} not in TD experience_consumers {list(dock.consumers)}")
        for column in columns:
            if column not in dock.columns:
                raise _bad(f"get experience ERROR: {column} not in TD experience_column {list(dock.columns)}")

    def _put(self, dock: TransferDock, data_dict: Any, indexes: Any, unpad: bool = True, *,
             is_prompt: bool | None = False, finished: bool | None = None) -> None:
        """A MindSpeed put. ``finished`` (the queue's ``data_status``) stands for ``rollout_completed``;
        ``is_prompt=None``: a put of the ``prompts`` column is a prompt put (the queue has no flag)."""
        delivery = indexes if isinstance(indexes, HandedRows) else None
        rows = None if indexes is None else _rows(indexes)
        if not rows:
            raise _bad("put experience into TD without indexes, indexes must be provided")
        data = _as_dict(data_dict)
        if unpad:
            data = remove_padding_tensor_dict_to_dict(data)
        partial = dock.rollout.partial
        if partial and COMPLETED in data:
            data = {**data, COMPLETED: data[COMPLETED]}  # kept aside below, with its padding rows dropped
        data, rows = drop_padding(_narrowed(data), rows, every_negative=True)
        if not rows:
            return
        flags = None
        if is_prompt is None:
            is_prompt = partial and "prompts" in data
        if partial:
            data = dict(data)
            flags = data.pop(COMPLETED, None)
            if is_prompt:
                flags = None  # placeholders: not a response, finished or not
            elif flags is None and finished is not None and any(c in data for c in RESPONSE_COLUMNS):
                flags = [finished] * len(rows)
            if flags is None and any(c in data for c in RESPONSE_COLUMNS) and not is_prompt:
                raise _bad("partial rollout enabled, when putting responses, rollout_completed status must be "
                           "provided in data dict")
        if not set(data) <= set(dock.columns):
            dock.refresh()
        for column in data:
            if column not in dock.columns:
                raise _bad(f"put experience ERROR: {column} not in TD experience_column {list(dock.columns)}")
        if partial and is_prompt:
            rows, delivery = self._free_rows(dock, rows), None  # new prompts, wherever there is room
        try:  # a put naming a leased delivery acks its rows with it: the stage's result is written
            dock.put_experience(data, rows, is_prompt=is_prompt, rollout_completed=flags, delivery=delivery)
        except FencedError as exc:
            # MindSpeed's workers have no handler for this: the late result is dropped, the worker goes on.
            log.warning("put of rows %s dropped: %s", rows[:8], exc)

    #: Seconds rows are leased for when handed out; None: for good, as MindSpeed (see the module docstring).
    lease: float | None
    #: Leased deliveries handed out through this object and not acked yet, per (dock, consumer).
    _leased: dict[tuple[str, str], list[LeasedRows]]

    def _init_leases(self, lease: float | None) -> None:
        check_lease(lease)  # refused now, not at the first get
        self.lease, self._leased = lease, {}

    #: ``wait_replicas`` and ``wait_timeout`` of every dock this object opens (see the module docstring).
    _durability: tuple[int, float] = (0, 1.0)

    def _init_durability(self, wait_replicas: int, wait_timeout: float) -> None:
        self._durability = check_durability(wait_replicas, wait_timeout)  # refused now, not at the first dock

    def _durable(self) -> dict[str, Any]:
        """The keywords that open a dock with this object's durability."""
        return {"wait_replicas": self._durability[0], "wait_timeout": self._durability[1]}

    def _done(self, dock: TransferDock, consumer: str) -> None:
        """Ack what ``consumer`` was handed through this object before: it asks for more, so it is done
        with that (Kafka's auto-commit; see the module docstring)."""
        for rows in self._leased.pop((dock.name, consumer), []):
            dock.ack(consumer, rows)

    @staticmethod
    def _free_rows(dock: TransferDock, rows: list[int]) -> list[int]:
        """Rows of free groups for new prompts, in place of the rows given (partial rollout: see the
        module docstring). The groups are claimed atomically, so concurrent writers never share one."""
        n = dock.n_samples_per_prompt
        if len(rows) % n:
            raise _bad(f"is_prompt put of {len(rows)} rows: under partial rollout prompts come as whole groups "
                       f"of n_samples_per_prompt={n}")
        groups = dock.reserve_groups(len(rows) // n, "prompts")
        if groups is None:
            raise _bad(f"no room for {len(rows) // n} more prompt groups in TD of {dock.prompts_num} groups "
                       "(train and clear some first)")
        return [g * n + j for g in groups for j in range(n)]

    #: How long a sampling call that finds too few rows waits for a put before it returns (None, None).
    empty_wait: float = 0.05

    def _get(
        self, dock: TransferDock, consumer: str, columns: list[str], count: int | None, indexes: Any,
        get_n_samples: bool, seqlen: bool, timeout: float | None,
    ) -> tuple[dict[str, list[Any]], list[int]] | tuple[None, None]:
        self._done(dock, consumer)
        if indexes is not None:
            rows = [r for r in _rows(indexes) if r != PAD_INDEX]
            got = dock.get_experience(consumer, columns, indexes=rows, timeout=timeout, lease=self.lease)
        else:
            assert count is not None
            policy = "seqlen" if seqlen and consumer in SEQLEN_BALANCED and dock.schema.length_columns else "random"
            # MindSpeed's workers call again at once when they get (None, None): a short wait for a put
            # (woken by the dock's pub/sub) keeps a dozen such loops from spinning on the server.
            got = dock.get_experience(consumer, columns, count, get_n_samples=get_n_samples, policy=policy,
                                      timeout=self.empty_wait or None, lease=self.lease)
        if isinstance(got[1], LeasedRows):
            self._leased.setdefault((dock.name, consumer), []).append(got[1])
        return got

    @staticmethod
    def _metric(dock: TransferDock) -> Metric:
        snapshot = Metric()
        snapshot.metric = dock.get_metrics()
        return snapshot

    @staticmethod
    def _update_metrics(dock: TransferDock, key: Any, value: Any, cumulate: bool) -> None:
        if isinstance(value, Mapping):
            dock.update_metrics(dict(value), cumulate=cumulate)
        else:
            dock.update_metrics(key, value, cumulate=cumulate)

    @staticmethod
    def _bits(dock: TransferDock, keys: Sequence[str]) -> list[torch.Tensor]:
        """Row bitmaps as int32 tensors of 0 and 1, one row per element (MindSpeed's status vectors)."""
        out = []
        for raw in cast("list[bytes | None]", dock.client.mget(list(keys))):
            bits = np.unpackbits(np.frombuffer(raw or b"", dtype=np.uint8))[: dock.capacity]
            status = np.zeros(dock.capacity, dtype=np.int32)
            status[: len(bits)] = bits
            out.append(torch.from_numpy(status))
        return out

    def _status(self, dock: TransferDock) -> dict[str, torch.Tensor]:
        return dict(zip(dock.columns, self._bits(dock, [dock.keys.ready(c) for c in dock.columns])))


def _rollout(max_age: int, gbs_train: int) -> Rollout | None:
    """MindSpeed's partial rollout (``max_age > 1``) as the native dock's settings."""
    if max_age == 1:
        return None
    return Rollout(consumer=ROLLOUT_CONSUMER, response_columns=RESPONSE_COLUMNS, max_age=max_age,
                   gbs_train=gbs_train)


def _open(url: str | Client | None, name: str, prompts_num: int, n: int, columns: Sequence[str],
          consumers: Sequence[str], rollout: Rollout | None = None, durable: Mapping[str, Any] = {}) -> TransferDock:
    """Create the dock, or attach to it and grow it to hold ``columns`` and ``consumers``; ``durable``: its
    ``wait_replicas`` and ``wait_timeout``."""
    target = url or default_url()
    lengths = [c for c in LENGTHS if c in columns]
    try:
        return TransferDock(target, name, prompts_num, n, columns, consumers, policy="random",
                            length_columns=lengths, rollout=rollout, **durable)
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


class GRPOTransferDock(_Docked):
    """MindSpeed-RL's ``GRPOTransferDock``, every method, on a dock in Redis (see the module docstring)."""

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
    ) -> None:
        if not is_int(max_age) or max_age < 1:
            raise _bad(f"max_age must be a positive int, got {max_age!r}")
        self.experience_columns = list(dict.fromkeys([*DEFAULT_COLUMNS, *(addition_columns or [])]))
        self.experience_consumers = list(dict.fromkeys([*DEFAULT_CONSUMERS, *(addition_consumers or [])]))
        self.prompts_num, self.n_samples_per_prompt = prompts_num, n_samples_per_prompt
        self.max_len = prompts_num * n_samples_per_prompt
        self.max_age, self.GBS_train = max_age, GBS_train
        self.timeout = 300.0 if timeout is None else float(timeout)
        self.empty_wait = _Docked.empty_wait
        self.timeout_interval = 5.0 if timeout_interval is None else float(timeout_interval)
        self._url, self._name = url, name
        self._init_leases(lease)
        self._init_durability(wait_replicas, wait_timeout)
        self.enable_partial_rollout = max_age > 1
        self.dock = _open(url, name, prompts_num, n_samples_per_prompt, self.experience_columns,
                          self.experience_consumers, _rollout(max_age, GBS_train), self._durable())
        self.metrics = metrics
        if metrics is not None and getattr(metrics, "metric", None):
            self._update_metrics(self.dock, "", dict(metrics.metric), False)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # pickles as its arguments: attaches again
        return _grpo_dock, (self.prompts_num, self.n_samples_per_prompt, self.experience_columns,
                            self.experience_consumers, self.timeout, self.timeout_interval, self._url, self._name,
                            self.max_age, self.GBS_train, self.lease, self._durability)

    # -- data ---------------------------------------------------------------------------------

    def put_experience(self, data_dict: Any, indexes: Sequence[int] | None = None, is_prompt: bool = False) -> None:
        """Write rows (MindSpeed's padded format or a TensorDict); negative indexes are skipped.

        Under partial rollout, responses come with ``rollout_completed`` (one ``[0]``/``[1]`` per row),
        and prompts put with ``is_prompt=True`` get placeholder responses and land in free groups (see
        the module docstring)."""
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
        self._check_names(self.dock, consumer, [c for c in columns if not (generating and c == AGE)])
        if generating and get_n_samples:
            raise _bad("get_n_samples not supported for rollout when actor_rollout enables partial_rollout")
        if indexes is None:
            self._check_count(self.dock, experience_count, get_n_samples, divides=not self.enable_partial_rollout)
        batch, rows = self._get(self.dock, consumer, columns, experience_count, indexes,
                                get_n_samples, use_batch_seqlen_balance, self.timeout)
        if batch is None or rows is None:
            return None, None
        if generating and experience_count is not None and 0 < len(rows) < experience_count and dp_size > 1:
            # MindSpeed's rollout takes what is there and pads it for its DP ranks with index -2.
            batch, rows = dp_padded(batch, rows, dp_size)
        return _mindspeed_batch(batch), rows

    def all_consumed(self, consumer: str, get_n_samples: bool = True) -> bool:
        self._done(self.dock, consumer)
        return self.dock.all_consumed(consumer)

    def clear(self, consumer: str = "actor_train") -> None:
        """Forget the batch: rows, every consumer's marks, metrics and the request cursor.

        Under partial rollout: forget what ``consumer`` trained on, age every group kept, reset the
        cursor and metrics (MindSpeed's ``clear``, without its re-sort: see the module docstring)."""
        if self.enable_partial_rollout:
            if consumer not in self.dock.consumers:
                self._check_names(self.dock, consumer, [])
            self.dock.clear(consumer=consumer)
            self._done(self.dock, consumer)  # the trained rows are gone: nothing of theirs to ack
        else:
            self.dock.clear()
            self._leased.clear()  # every lease ended with the rows

    def get_consumer_status(self) -> dict[str, torch.Tensor]:
        """Per consumer, an int32 tensor with 1 for every row handed to it."""
        consumers = self.dock.consumers
        return dict(zip(consumers, self._bits(self.dock, [self.dock.keys.consumed(c) for c in consumers])))

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
        return self._status(self.dock)

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
            raise _bad(f"Consumer {consumer} is not supported for partial rollout stop signal.")
        self._partial("find_all_consumed_n_samples_groups")
        (mask,) = self._bits(self.dock, [self.dock.keys.rows_finished])
        n = self.n_samples_per_prompt
        starts = [g * n for g in range(self.prompts_num) if bool(mask[g * n])]
        return len(starts), mask, starts

    def sort_every_n_samples_by_age(self) -> None:
        """Nothing to do: sampling already goes oldest group first (age bitmaps), and rows never move."""
        self._partial("sort_every_n_samples_by_age")

    def _partial(self, what: str) -> None:
        if not self.enable_partial_rollout:
            raise _bad(f"{what} needs partial rollout (max_age > 1); this dock has max_age={self.max_age}")


def _grpo_dock(prompts_num: int, n: int, columns: list[str], consumers: list[str], timeout: float,
               interval: float, url: str | Client | None, name: str, max_age: int = 1,
               gbs_train: int = 0, lease: float | None = None,
               durability: tuple[int, float] = (0, 1.0)) -> GRPOTransferDock:
    defaults = set(DEFAULT_COLUMNS), set(DEFAULT_CONSUMERS)
    return GRPOTransferDock(prompts_num, n, None, max_age, gbs_train, [c for c in columns if c not in defaults[0]],
                            [c for c in consumers if c not in defaults[1]], timeout, interval, url=url, name=name,
                            lease=lease, wait_replicas=durability[0], wait_timeout=durability[1])


class TransferQueueClient(_Docked):
    """MindSpeed-RL's TransferQueue client: topics, each a dock named ``tq.TOPIC`` on one Redis server."""

    def __init__(self, url: str | Client | None = None, *, prefix: str = "tq.", lease: float | None = None,
                 wait_replicas: int = 0, wait_timeout: float = 1.0) -> None:
        self._url: str | Client = url or default_url()
        self._prefix = prefix
        self._init_leases(lease)
        self._init_durability(wait_replicas, wait_timeout)
        self._docks: dict[str, TransferDock] = {}
        self._timeouts: dict[str, float] = {}
        self._timings: dict[str, float] = {"put": 0.0, "get": 0.0, "dispatch": 0.0}

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _tq_client, (self._url, self._prefix, self.lease, self._durability)

    def _dock(self, topic: str | None) -> TransferDock:
        topic = topic or DEFAULT_TOPIC
        dock = self._docks.get(topic)
        if dock is None:
            try:
                dock = TransferDock.attach(self._url, self._prefix + topic, policy="random", **self._durable())
            except DockNotFoundError:
                raise _bad(f"Unknown topic '{topic}'") from None
            self._docks[topic] = dock
        return dock

    def _timeout(self, dock: TransferDock) -> float:
        """The topic's ``timeout`` (add_topic's), read once per topic: it does not change."""
        if dock.name not in self._timeouts:
            raw = dock.client.hget(dock.keys.meta, "tq_timeout")
            self._timeouts[dock.name] = float(raw) if raw else 5.0
        return self._timeouts[dock.name]

    # -- topics -------------------------------------------------------------------------------

    def add_topic(
        self, prompts_num: int, n_samples_per_prompt: int, experience_columns: Sequence[str],
        experience_consumers: Sequence[str], timeout: float = 5.0, metrics: Metric | None = None,
        topic: str = DEFAULT_TOPIC, max_age: int = 1, GBS_train: int = 0,  # noqa: N803
    ) -> None:
        if not topic:
            raise _bad("Topic must be non-empty")
        if not is_int(max_age) or max_age < 1:
            raise _bad(f"max_age must be a positive int, got {max_age!r}")
        lengths = [c for c in LENGTHS if c in experience_columns]
        rollout = _rollout(max_age, GBS_train)
        if rollout is not None:
            rollout = Rollout(consumer=ROLLOUT_CONSUMER, max_age=max_age, gbs_train=GBS_train,
                              response_columns=tuple(c for c in RESPONSE_COLUMNS if c in experience_columns))
        dock = TransferDock(self._url, self._prefix + topic, prompts_num, n_samples_per_prompt,
                            experience_columns, experience_consumers, policy="random", length_columns=lengths,
                            rollout=rollout, **self._durable())
        if not dock.created:
            dock.close()
            raise _bad(f"Topic '{topic}' already exists")
        # Not part of the schema; written through the dock's one way of writing, which waits for replicas.
        dock._session.write("add_topic", lambda: dock.client.hset(dock.keys.meta, "tq_timeout", str(float(timeout))),
                    returns=False)
        self._docks[topic] = dock
        if metrics is not None and getattr(metrics, "metric", None):
            self._update_metrics(dock, "", dict(metrics.metric), False)

    def delete_topic(self, topic: str = DEFAULT_TOPIC) -> None:
        dock = self._dock(topic)
        dock.delete()
        self._timeouts.pop(dock.name, None)
        self._docks.pop(topic or DEFAULT_TOPIC).close()

    def clear_topic(self, topic: str = DEFAULT_TOPIC) -> None:
        self._dock(topic).clear()

    def clear_and_resize_topic(self, prompts_num: int, n_samples_per_prompt: int, topic: str = DEFAULT_TOPIC) -> None:
        old = self._dock(topic)
        columns, consumers, timeout = list(old.columns), list(old.consumers), self._timeout(old)
        rollout = old.rollout
        registered = {c: old.consumer_columns(c) for c in consumers if self._registered(old, c)}
        self.delete_topic(topic)
        self.add_topic(prompts_num, n_samples_per_prompt, columns, consumers, timeout, topic=topic,
                       max_age=rollout.max_age, GBS_train=rollout.gbs_train)
        if registered:
            self.register_consumer_columns_dict(registered, topic)

    @staticmethod
    def _registered(dock: TransferDock, consumer: str) -> bool:
        return bool(dock.client.hexists(dock.keys.consumer_columns, consumer))

    def register_consumer_columns_dict(self, columns_dict: Mapping[str, Sequence[str]],
                                       topic: str = DEFAULT_TOPIC) -> None:
        self._dock(topic).register_consumer_columns(columns_dict)

    def get_columns(self, consumer: str | None = None, topic: str = DEFAULT_TOPIC) -> list[str]:
        return self._dock(topic).consumer_columns(consumer)

    def get_max_len(self, topic: str = DEFAULT_TOPIC) -> int:
        return self._dock(topic).capacity

    def reset_all(self) -> None:
        """Delete every topic of this client's prefix on the server."""
        for key in self._dock_names():
            TransferDock.attach(self._url, key, **self._durable()).delete()
        self._docks.clear()
        self._timeouts.clear()
        self._timings = {"put": 0.0, "get": 0.0, "put_prompt": 0.0, "dispatch": 0.0}

    def _dock_names(self) -> list[str]:
        client, url = connect(self._url)
        try:
            return [n for n in dock_names(client) if n.startswith(self._prefix)]
        finally:
            if isinstance(self._url, str) and url is not None:
                disconnect(url)

    # -- data ---------------------------------------------------------------------------------

    def put_experience(self, data_dict: Any, indexes: Sequence[int] | None = None, unpad: bool = True,
                       topic: str = DEFAULT_TOPIC, data_status: str = "ready") -> None:
        """Write rows. On a partial-rollout topic, responses put with ``data_status="partial_ready"`` are
        unfinished and ``"ready"`` ones finished, unless the data carries ``rollout_completed``."""
        if data_status not in ("ready", "partial_ready"):
            raise _bad(f"data_status must be 'ready' or 'partial_ready', got {data_status!r}")
        if indexes is None or (isinstance(indexes, Sequence) and len(indexes) == 0):
            raise _bad("No indexes provided for put_experience")
        dock = self._dock(topic)
        if data_status == "partial_ready" and not dock.rollout.partial:
            raise _bad(f"data_status='partial_ready' needs partial rollout (max_age > 1) on topic '{topic}'")
        start = time.perf_counter()
        self._put(dock, data_dict, indexes, unpad, is_prompt=None, finished=data_status == "ready")
        self._timings["put"] += time.perf_counter() - start

    def get_experience(
        self, consumer: str, experience_columns: list[str] | None = None, experience_count: int | None = None,
        indexes: list[int] | None = None, get_n_samples: bool = True, pad: bool = True, topic: str = DEFAULT_TOPIC,
        use_batch_seqlen_balance: bool = False, dp_size: int = 1, require_dp_padding: bool = False,
        allow_partial_ready_data: bool = False,
    ) -> tuple[Any, list[int]] | tuple[None, None]:
        dock = self._dock(topic)
        if allow_partial_ready_data and not (dock.rollout.partial and consumer == ROLLOUT_CONSUMER):
            raise _bad(f"allow_partial_ready_data: only '{ROLLOUT_CONSUMER}' of a partial-rollout topic reads "
                       "unfinished rows here")
        if experience_columns is None:
            try:
                experience_columns = dock.consumer_columns(consumer)
            except (InvalidExperienceError, UnknownConsumerError):
                raise _bad(
                    f"No experience_columns provided, and no experience columns registered for consumer "
                    f"'{consumer}' in topic '{topic}'."
                ) from None
        if experience_count is None and indexes is None:
            raise _bad("Either experience_count or indexes must be provided for get_experience")
        self._check_names(dock, consumer, experience_columns)
        if indexes is None:
            self._check_count(dock, experience_count, get_n_samples, divides=False)
        start = time.perf_counter()
        batch, rows = self._get(dock, consumer, list(experience_columns), experience_count, indexes,
                                get_n_samples, use_batch_seqlen_balance, self._timeout(dock))
        self._timings["get"] += time.perf_counter() - start
        if batch is None or rows is None:
            log.debug("Get none experience.")
            return None, None
        # The queue returns rows by index; under partial rollout oldest first, as the dock picked them.
        order = list(range(len(rows))) if dock.rollout.partial else sorted(range(len(rows)), key=rows.__getitem__)
        out, rows = reordered(batch, rows, order)
        if require_dp_padding and experience_count and 0 < len(rows) < experience_count:  # MindSpeed's rule
            out, rows = dp_padded(out, rows, dp_size)
        return (_mindspeed_batch(out) if pad else out), rows

    def all_consumed(self, consumer: str, topic: str = DEFAULT_TOPIC, get_n_samples: bool = True) -> bool:
        dock = self._dock(topic)
        self._done(dock, consumer)
        return dock.all_consumed(consumer)

    def all_updated(self, column: str, topic: str = DEFAULT_TOPIC) -> bool:
        dock = self._dock(topic)
        if column not in dock.columns:
            raise _bad(f"Column '{column}' not recognized.")
        return bool(dock.status()["columns"][column]["ready"] == dock.capacity)

    def reset_consumer_status(self, consumer: str, topic: str = DEFAULT_TOPIC,
                              indexes: Sequence[int] | None = None) -> None:
        self._dock(topic).reset_consumer(consumer, list(indexes) if indexes else None)

    # -- shared state -------------------------------------------------------------------------

    def get_metrics(self, topic: str = DEFAULT_TOPIC) -> Metric:
        return self._metric(self._dock(topic))

    def update_metrics(self, key: str = "", value: Any = None, cumulate: bool = False,
                       topic: str = DEFAULT_TOPIC) -> None:
        self._update_metrics(self._dock(topic), key, value, cumulate)

    def prefetch_request_index(self, experience_num: int, topic: str = DEFAULT_TOPIC) -> list[int] | None:
        return self._dock(topic).prefetch_request_index(experience_num)

    def get_cur_index(self, topic: str = DEFAULT_TOPIC) -> int:
        return self._dock(topic).get_cur_index()

    # -- multimodal labels: a column of plain values -------------------------------------------

    def put_mm_labels(self, topic: str, labels: Sequence[Any], index: Sequence[int]) -> None:
        if not labels or not index:
            raise _bad("Both mm_labels and index should be provided.")
        self._dock(topic).put_experience({"labels": list(labels)}, _rows(index))

    def get_mm_labels(self, topic: str, index: Sequence[int]) -> list[Any] | None:
        if not index:
            return None
        return self._dock(topic).read_rows(["labels"], _rows(index))["labels"]

    # -- partial rollout ----------------------------------------------------------------------

    def increment_ages(self, topic: str = DEFAULT_TOPIC) -> None:
        """Every group that has started generating grows one iteration older."""
        self._partial_dock(topic, "increment_ages").age_groups()

    def refine_topic_for_partial_rollout(self, topic: str = DEFAULT_TOPIC) -> None:
        """Forget the rows ``actor_train`` trained on; reset the cursor and metrics. Nothing moves:
        sampling goes oldest first by the age bitmaps (see the module docstring)."""
        self._partial_dock(topic, "refine_topic_for_partial_rollout").clear(consumer="actor_train", age=False)

    def clear_data_status(self, columns: Sequence[str], indexes: Sequence[int], topic: str = DEFAULT_TOPIC) -> None:
        """Mark rows of columns not ready, keeping their data."""
        dock = self._dock(topic)
        self._check_names(dock, dock.consumers[0], list(columns))
        dock.unready(list(columns), [r for r in _rows(indexes) if r >= 0])

    def get_partial_rollout_stop_signal(self, require_max_age_all_finished: bool = True,
                                        topic: str = DEFAULT_TOPIC) -> bool:
        """``GBS_train`` groups finished, and (if required) every group of age ``max_age - 1``."""
        dock = self._partial_dock(topic, "get_partial_rollout_stop_signal")
        return dock.get_update_ready(require_max_age_all_finished)

    def _partial_dock(self, topic: str | None, what: str) -> TransferDock:
        dock = self._dock(topic)
        if not dock.rollout.partial:
            raise _bad(f"{what} needs partial rollout (max_age > 1) on topic '{topic or DEFAULT_TOPIC}'")
        return dock

    def get_incomplete_response_num(self, topic: str = DEFAULT_TOPIC) -> int:
        """Prompt rows written minus response rows written, as MindSpeed's queue counts them (under
        partial rollout: minus responses finished)."""
        dock = self._dock(topic)
        if dock.rollout.partial:
            return dock.get_incomplete_response_num()
        ready = {c: v["ready"] for c, v in dock.status()["columns"].items()}
        return int(ready.get("prompts", 0) - ready.get("responses", 0))

    # -- timings (kept in this client, as MindSpeed's are per client) ---------------------------

    def create_timing_item(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise _bad("Timing item name must be a non-empty string")
        if name in self._timings:
            raise _bad(f"Timing item '{name}' already exists")
        self._timings[name] = 0.0

    def accumulate_timing(self, name: str, seconds: float) -> None:
        if name not in self._timings:
            raise _bad(f"Unknown timing name '{name}'")
        self._timings[name] += float(seconds)

    def get_timing(self, name: str) -> float:
        if name not in self._timings:
            raise _bad(f"Unknown timing name '{name}'")
        return round(self._timings[name], 6)

    def get_timings(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in self._timings.items()}

    def reset_timings(self) -> None:
        self._timings = dict.fromkeys(self._timings, 0.0)


def _tq_client(url: str | Client, prefix: str, lease: float | None = None,
               durability: tuple[int, float] = (0, 1.0)) -> TransferQueueClient:
    return TransferQueueClient(url, prefix=prefix, lease=lease, wait_replicas=durability[0],
                               wait_timeout=durability[1])


def get_transfer_queue_client(name: str | None = None, *, url: str | None = None) -> TransferQueueClient:
    """MindSpeed's factory; ``name`` (its manager actor's name) is accepted and unused: there is no manager."""
    return TransferQueueClient(url or os.environ.get("REDIS_URL"))

