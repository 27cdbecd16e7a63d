"""Rows in and out of a partitioned dock: puts, reads, takes, acks and drops, cut by partition (the gets are
partitioned_gets.py's).

A base of ``PartitionedDock`` (partitioned.py, whose docstring says what is per partition). Every call here
cuts the dock's rows by partition (``PartitionMap.split``), makes one call of a partition's dock per partition
touched, each atomic there, and puts the answers back in the caller's order. A take of explicit rows that fails
in a later partition gives back the parts taken before it (``_give_back``, as a get's, partitioned_gets.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import torch

from broker.api.checks import check_flag
from broker.api.delivery import HandedRows, LeasedRows, check_delivery
from broker.api.dp_padding import drop_padding
from broker.api.drained import Drained, DrainKey
from broker.api.partitioned_parts import PartitionedParts
from broker.api.partitioned_rows import PartitionedLeasedRows, PartitionedRows, partitioned_rows, tokens_of
from broker.api.puts import Prepared, value_count
from broker.control.put_listener import PutListener
from broker.data import collector
from broker.data.row_count import row_count_error
from broker.data.stacking import stack_decoded
from broker.errors import BrokerError, InvalidExperienceError, ReplicationError

T = TypeVar("T")


Parts = dict[int, tuple[Any, HandedRows]]


class PartitionedMoves(PartitionedParts):
    """Rows in and out, cut by partition: a base of ``PartitionedDock``."""

    _listener: PutListener
    _turn: int
    _drained: Drained

    def _ours(self, delivery: Any) -> PartitionedRows | PartitionedLeasedRows:
        """``delivery`` if it is rows this kind of dock handed out, else InvalidExperienceError."""
        if not isinstance(delivery, (PartitionedRows, PartitionedLeasedRows)):
            raise InvalidExperienceError(f"dock {self._name!r} is partitioned: name the rows its own get_experience "
                                         f"returned, got {type(delivery).__name__}")
        return delivery

    @contextmanager
    def _at(self, p: int, local: Sequence[int]) -> Iterator[None]:
        """Calls of partition ``p`` about its rows ``local``: an error it raises says which of the dock's rows
        those are (a partition names its own rows, numbered its own way)."""
        try:
            yield
        except BrokerError as exc:
            if len(exc.args) == 1 and isinstance(exc.args[0], str) and local:
                shown = list(local)[:8]
                exc.args = (f"{exc.args[0]} [partition {p} of dock {self._name!r}, whose rows {shown} are the dock's "
                            f"rows {self._pmap.global_rows(p, shown)}]",)
            raise

    def _order(self, key: DrainKey | None = None) -> list[int]:
        """The partitions in the order this call visits them: from this object's next turn round; with ``key``
        (a sampled get's), those found drained for it last (see the module docstring)."""
        count = self._pmap.count
        start = self._turn
        self._turn = (start + 1) % count  # a race between threads only shifts where a call starts
        order = [(start + k) % count for k in range(count)]
        return order if key is None else self._drained.order(key, order)

    # -- puts ----------------------------------------------------------------------------------

    def put_experience(
        self, data_dict: Mapping[str, Any], indexes: Sequence[int], *, is_prompt: bool = False,
        rollout_completed: Any = None, version: int | None = None, delivery: HandedRows | None = None,
        ack: bool = True,
    ) -> None:
        """Write rows (see ``TransferDock.put_experience``): one put per partition touched, each atomic and
        fenced by that partition's part of the delivery. Every part is checked and encoded before any is sent,
        so a put refused for its input writes nothing anywhere."""
        if delivery is None and isinstance(indexes, HandedRows):
            delivery = indexes
        if delivery is not None:
            delivery = self._ours(check_delivery(delivery))
        with collector.paused(value_count(data_dict, indexes)):  # as a dock of one partition's put (puts.py)
            self._put(data_dict, indexes, is_prompt, rollout_completed, version, delivery, ack)

    def _put(self, data_dict: Mapping[str, Any], indexes: Sequence[int], is_prompt: bool, rollout_completed: Any,
             version: int | None, delivery: PartitionedRows | PartitionedLeasedRows | None, ack: bool) -> None:
        """The put, its delivery checked: every part prepared, then every part sent."""
        self._check.data(data_dict)
        given = indexes
        data_dict, indexes = drop_padding(data_dict, indexes)
        if not indexes and indexes is not given:
            return  # padding rows only
        rows = self._check.rows(indexes)
        for column, values in data_dict.items():  # before the rows are picked by partition
            wrong = row_count_error(column, values, len(rows))
            if wrong is not None:
                raise wrong
        split = self._pmap.split(rows).parts
        whole = len(split) == 1
        prepared = []
        for p, (positions, local) in split.items():
            part_data = data_dict if whole else {c: _picked(v, positions) for c, v in data_dict.items()}
            done = rollout_completed if whole or rollout_completed is None else _picked(rollout_completed, positions)
            with self._at(p, local):
                prepared.append((p, local, self._parts[p]._puts.prepare(
                    part_data, local, is_prompt=is_prompt, rollout_completed=done, version=version,
                    delivery=None if delivery is None else delivery.part(p, local), ack=ack)))
        try:
            every([functools.partial(self._send, p, local, put) for p, local, put in prepared if put is not None])
        finally:  # even a put that failed part way may have made rows ready there
            self._drained.refilled(split, data_dict)

    def _send(self, p: int, local: list[int], put: Prepared) -> None:
        with self._at(p, local):
            self._parts[p]._puts.send(put)

    def _delivered(self, consumer: str, lease: float | None, taken: Parts, order: list[int],
                   rows: list[int] | None = None) -> PartitionedRows | PartitionedLeasedRows:
        """The rows taken (the dock's indexes; ``rows`` if given, else the parts' in ``order``) as one delivery."""
        parts: list[HandedRows | None] = [None] * self._pmap.count
        for p, (_, handed) in taken.items():
            parts[p] = handed
        if rows is None:
            rows = [r for p in order for r in self._pmap.global_rows(p, taken[p][1])]
        return partitioned_rows(rows, parts, self._pmap, consumer if lease else None)

    def _give_back(self, consumer: str, taken: Parts, groups: bool) -> None:
        """Give back what a call took and will not deliver (see the module docstring)."""
        try:
            for p, (_, handed) in taken.items():
                self._parts[p]._handouts.give_back(consumer, handed, groups)
        finally:
            self._drained.refilled(taken)

    # -- reads, takes, acks, drops --------------------------------------------------------------

    def read_rows(self, columns: Sequence[str], indexes: Sequence[int], *, stack: bool = False,
                  delivery: HandedRows | None = None) -> Any:
        """The rows' values as stored now (see ``TransferDock.read_rows``), read partition by partition."""
        rows = self._check.rows(indexes)
        cols = self._check.columns_to_read(columns)
        stack = check_flag("stack", stack)
        if delivery is not None:
            delivery = self._ours(delivery)
        read: dict[int, tuple[list[int], Mapping[str, list[Any]]]] = {}
        for p, (positions, local) in self._pmap.split(rows).parts.items():
            part = None if delivery is None else delivery.part(p, local)
            with self._at(p, local):
                read[p] = (positions, self._parts[p].read_rows(cols, local, delivery=part))
        out = in_order(cols, len(rows), read)
        if stack:
            return {c: v if any(x is None for x in v) else stack_decoded(v) for c, v in out.items()}
        return out

    def take(self, consumer: str, indexes: Sequence[int], columns: Sequence[str] | None = None, *,
             lease: float | None = None, exclusive: bool = False, name: str | None = None,
             name_ttl: float = 86400.0) -> HandedRows | None:
        """Hand explicit rows out without reading them (see ``TransferDock.take``), partition by partition; a
        part refused (exclusive) or failing gives back the parts taken."""
        rows = self._check.rows(indexes)
        self._check.consumer(consumer)
        split = self._pmap.split(rows).parts
        taken: Parts = {}
        try:
            for p, (_, local) in split.items():
                with self._at(p, local):
                    handed = self._parts[p].take(consumer, local, columns, lease=lease, exclusive=exclusive,
                                                 name=name, name_ttl=name_ttl)
                if handed is None:
                    self._give_back(consumer, taken, False)
                    return None
                taken[p] = ({}, handed)
        except BaseException:
            self._give_back(consumer, taken, False)
            raise
        recorded = any(list(taken[p][1]) != split[p][1] for p in split)  # a named take's record answered
        return self._delivered(consumer, lease, taken, list(split), None if recorded else rows)

    def ack(self, consumer: str, indexes: Sequence[int], token: str | None = None) -> int:
        """Release leased rows (see ``TransferDock.ack``): each partition's part under its own lease."""
        self._check.consumer(consumer)
        rows = self._check.rows(drop_padding({}, indexes)[1])
        split = self._pmap.split(rows).parts
        if token is None:
            if not isinstance(indexes, PartitionedLeasedRows):
                raise InvalidExperienceError(f"dock {self._name!r}: ack the rows get_experience returned under a "
                                             "lease, or pass token=rows.token")
            return sum(self._parts[p].ack(consumer, indexes.part(p, local)) for p, (_, local) in split.items())
        tokens = tokens_of(token)  # a partition the delivery took nothing from has no lease of these rows there
        return sum(self._parts[p].ack(consumer, local, token=tokens[p]) for p, (_, local) in split.items()
                   if p in tokens)

    def give_back(self, consumer: str, rows: LeasedRows) -> int:
        """Offer leased rows to ``consumer`` again now (see ``TransferDock.give_back``)."""
        if not isinstance(rows, PartitionedLeasedRows):
            raise InvalidExperienceError(f"dock {self._name!r} is partitioned: give back rows its get_experience "
                                         "returned under a lease")
        plain = self._check.rows(drop_padding({}, rows)[1])
        given = 0
        split = self._pmap.split(plain).parts
        try:
            for p, (_, local) in split.items():
                part = rows.part(p, local)
                assert isinstance(part, LeasedRows)  # a leased call's parts are leased
                with self._at(p, local):
                    given += self._parts[p].give_back(consumer, part)
        finally:
            self._drained.refilled(split)
        return given

    def drop_groups(self, consumer: str, groups: Sequence[int], *, delivery: HandedRows | None = None) -> int:
        """Discard whole groups (see ``TransferDock.drop_groups``), partition by partition."""
        wanted = self._check.groups(groups)
        if delivery is not None:
            delivery = self._ours(delivery)
        by_part: dict[int, list[int]] = {}
        for g in wanted:
            p, local = self._pmap.local_group(g)
            by_part.setdefault(p, []).append(local)
        dropped = 0
        for p, local_groups in sorted(by_part.items()):
            part = None if delivery is None else delivery.part(p, [])
            with self._at(p, [g * self._pmap.n for g in local_groups]):  # each group's first row
                dropped += self._parts[p].drop_groups(consumer, local_groups, delivery=part)
        return dropped


def every(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Each of ``calls`` (one per partition) in order; their results. A ReplicationError (the call applied,
    replicas short) does not stop the rest: the first is raised once every call ran, so that its "applied"
    holds for the whole dock."""
    results: list[T] = []
    short: ReplicationError | None = None
    for call in calls:
        try:
            results.append(call())
        except ReplicationError as exc:
            short = short or exc
    if short is not None:
        raise short
    return results


def in_order(columns: Sequence[str], count: int,
              parts: Mapping[int, tuple[list[int], Mapping[str, Sequence[Any]]]]) -> dict[str, list[Any]]:
    """Each partition's values (its positions in the call's rows, and its batch) put back in the call's order."""
    out: dict[str, list[Any]] = {c: [None] * count for c in columns}
    for positions, batch in parts.values():
        for c in columns:
            for i, value in zip(positions, batch[c]):
                out[c][i] = value
    return out


def _picked(values: Any, positions: list[int]) -> Any:
    """The rows at ``positions`` of one column of a put: a stacked tensor's rows (one copy), a list's, an array's."""
    if isinstance(values, torch.Tensor):
        return values.index_select(0, torch.tensor(positions, dtype=torch.long)) if values.dim() else values
    if isinstance(values, np.ndarray):
        return values[positions]
    if isinstance(values, Sequence) and not isinstance(values, (str, bytes)):
        return [values[i] for i in positions]
    return values  # malformed: the partition's put names what is wrong
