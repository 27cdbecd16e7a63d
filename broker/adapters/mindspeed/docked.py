"""``Docked``: what ``GRPOTransferDock`` and ``TransferQueueClient`` share, MindSpeed's checks and calls on
one native dock (puts, gets, leases, durability, metrics and status)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from broker.adapters.mindspeed.defaults import COMPLETED, RESPONSE_COLUMNS, SEQLEN_BALANCED
from broker.adapters.mindspeed.helpers import as_dict, bad, int_rows, narrowed
from broker.adapters.mindspeed.metric import Metric
from broker.adapters.mindspeed.padding import remove_padding_tensor_dict_to_dict
from broker.api.checks import check_durability, check_lease, is_int
from broker.api.delivery import HandedRows, LeasedRows
from broker.api.dock import TransferDock
from broker.api.dp_padding import PAD_INDEX, drop_padding
from broker.errors import FencedError, InvalidExperienceError, UnknownColumnError, UnknownConsumerError

log = logging.getLogger(__name__)
T = TypeVar("T")


class Docked:
    """What the dock and the queue share: MindSpeed's checks and calls on one native dock."""

    def _named(self, dock: TransferDock, call: Callable[[], T], what: str, consumer: Any = None,
               columns: Sequence[Any] = ()) -> T:
        """``call`` on ``dock``, with the names the dock does not know raised as MindSpeed's ValueErrors
        (the dock's are KeyErrors). A name this object has not seen may have been added by another
        process (grow): the schema is read again and the call made once more. That is safe because the
        dock checks names before it touches Redis: the first try changed nothing. ``consumer`` and
        ``columns`` only name what was unknown."""
        def mindspeeds(exc: Exception) -> InvalidExperienceError:
            if isinstance(exc, UnknownConsumerError):
                return bad(f"{what} ERROR: {consumer} not in TD experience_consumers {list(dock.consumers)}")
            return unknown_columns(dock, what, columns)

        schema = dock.schema
        try:
            return call()
        except (UnknownColumnError, UnknownConsumerError) as exc:
            if dock.refresh() is schema:
                raise mindspeeds(exc) from None
        try:
            return call()
        except (UnknownColumnError, UnknownConsumerError) as exc:
            raise mindspeeds(exc) from None

    @staticmethod
    def _check_divides(dock: TransferDock, count: Any) -> None:
        """MindSpeed's rule for a sampling call of a dock without partial rollout, beyond the dock's own
        checks of ``experience_count`` (which it leaves to them): the count divides the dock's rows."""
        if is_int(count) and 0 < count <= dock.capacity and dock.capacity % count:
            raise bad(f"TD max_len:{dock.capacity} need be divisible by experience_count: {count}")

    def _put(self, dock: TransferDock, data_dict: Any, indexes: Any, unpad: bool = True, *,
             is_prompt: bool | None = False, finished: bool | None = None) -> None:
        """A MindSpeed put. ``finished`` (the queue's ``data_status``) stands for ``rollout_completed``;
        ``is_prompt=None``: a put of the ``prompts`` column is a prompt put (the queue has no flag)."""
        delivery = indexes if isinstance(indexes, HandedRows) else None
        rows = None if indexes is None else int_rows(indexes)
        if not rows:
            raise bad("put experience into TD without indexes, indexes must be provided")
        data = narrowed(as_dict(data_dict))  # before unpadding: a padded column in one conversion
        if unpad:
            data = remove_padding_tensor_dict_to_dict(data)
        data = {column: value for column, value in data.items() if value is not None}  # as MindSpeed skips them
        partial = dock.rollout.partial
        data, rows = drop_padding(data, rows, every_negative=True)
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
                raise bad("partial rollout enabled, when putting responses, rollout_completed status must be "
                          "provided in data dict")
        if partial and is_prompt:
            # The put would name unknown columns only after the groups below are claimed: name them first.
            if not set(data) <= set(dock.columns) and not set(data) <= set(dock.refresh().columns):
                raise unknown_columns(dock, "put experience", list(data))
            rows, delivery = self._free_rows(dock, rows), None  # new prompts, wherever there is room
        try:  # a put naming a leased delivery acks its rows with it: the stage's result is written
            self._named(dock, lambda: dock.put_experience(data, rows, is_prompt=bool(is_prompt),
                                                          rollout_completed=flags, delivery=delivery),
                        "put experience", columns=list(data))
        except FencedError as exc:
            # MindSpeed's workers have no handler for this: the late result is dropped, the worker goes on.
            log.warning("put of rows %s dropped: %s", rows[:8], exc)

    #: Seconds rows are leased for when handed out; None: for good, as MindSpeed (see the package docstring).
    lease: float | None
    #: Leased deliveries handed out through this object and not acked yet, per (dock, consumer).
    _leased: dict[tuple[str, str], list[LeasedRows]]

    def _init_leases(self, lease: float | None) -> None:
        check_lease(lease)  # refused now, not at the first get
        self.lease, self._leased = lease, {}

    #: ``wait_replicas`` and ``wait_timeout`` of every dock this object opens (see the package docstring).
    _durability: tuple[int, float] = (0, 1.0)

    def _init_durability(self, wait_replicas: int, wait_timeout: float) -> None:
        self._durability = check_durability(wait_replicas, wait_timeout)  # refused now, not at the first dock

    def _durable(self) -> dict[str, Any]:
        """The keywords that open a dock with this object's durability."""
        return {"wait_replicas": self._durability[0], "wait_timeout": self._durability[1]}

    def _done(self, dock: TransferDock, consumer: str) -> None:
        """Ack what ``consumer`` was handed through this object before: it asks for more, so it is done
        with that (Kafka's auto-commit; see the package docstring)."""
        for rows in self._leased.pop((dock.name, consumer), []):
            dock.ack(consumer, rows)

    @staticmethod
    def _free_rows(dock: TransferDock, rows: list[int]) -> list[int]:
        """Rows of free groups for new prompts, in place of the rows given (partial rollout: see
        docs/mindspeed.md). The groups are claimed atomically, so concurrent writers never share one."""
        n = dock.n_samples_per_prompt
        if len(rows) % n:
            raise bad(f"is_prompt put of {len(rows)} rows: under partial rollout prompts come as whole groups "
                      f"of n_samples_per_prompt={n}")
        groups = dock.reserve_groups(len(rows) // n, "prompts")
        if groups is None:
            raise bad(f"no room for {len(rows) // n} more prompt groups in TD of {dock.prompts_num} groups "
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
            rows = [r for r in int_rows(indexes) if r != PAD_INDEX]
            got = dock.get_experience(consumer, columns, indexes=rows, timeout=timeout, lease=self.lease)
        else:
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
    def _status(masks: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Row masks as MindSpeed's status vectors: int32 tensors of 0 and 1, one element per row."""
        return {name: mask.to(torch.int32) for name, mask in masks.items()}


def unknown_columns(dock: TransferDock, what: str, columns: Sequence[Any]) -> InvalidExperienceError:
    """MindSpeed's error for a column the dock does not have (the first of ``columns`` it lacks)."""
    column = next((c for c in columns if c not in dock.columns), None)
    return bad(f"{what} ERROR: {column} not in TD experience_column {list(dock.columns)}")
