"""Rows in and out of a partitioned dock: puts, gets, reads, takes, acks and drops, cut by partition.

A base of ``PartitionedDock`` (partitioned.py, whose docstring says what is per partition). Every call here
cuts the dock's rows by partition (``PartitionMap.split``), makes one call of a partition's dock per partition
touched, each atomic there, and puts the answers back in the caller's order.

The interleavings of a sampled get that takes from several partitions (``_sample``):

- take from partition a, then b has too few: a's take is given back (lua/release.lua under a's lease token, or
  its epoch and generations when not leased). Between the take and the give-back, a's rows are held by this
  call: another caller of the consumer does not see them (it may find too few and wait, then is woken by
  nothing; its re-check, every second, finds them). Given back, they are offered again as they were.
- take from a, then a clear of a, then the give-back: the clear reset a's rows; release.lua gives back only rows
  no clear touched since the take, so it gives back nothing of them, and the clear's new rows stay untouched.
- take from a under a lease, the lease runs out before the give-back, another worker takes the rows: the
  give-back finds them leased under another token and leaves them (release.lua), so they are not handed out twice.
- take from a and b, the call returns, the caller dies: as on a dock of one partition, each part's lease runs
  out and its rows go back to the consumer (each partition's own reclaim).
- the process dies between a's take and its give-back: a's rows stay handed out: under a lease, until it runs
  out (the usual recovery); without one, for good, as a dock of one partition loses a batch whose caller died
  after the sampling script ran. Use leases where workers may die.

Partitions found drained are asked last (``drained.py``): a take's sampling script says, atomically with its
pick, how many units still qualify in its partition for this consumer and these columns; with none left the
partition is marked, and this object's gets of that consumer and those columns ask it after the others. What
that relies on:

- a mark only reorders a get's partitions. A get gives its takes back and returns None (or waits) only after
  asking every partition, marked ones included, exactly as before: it never comes back short because of a mark
  while the partitions it asked held enough when it asked them.
- a mark out of date (the partition was refilled after it was made): by this object's put into it, give-back to
  it (``_give_back``, ``give_back``), ``reset_consumer`` or ``clear``, the mark is dropped then; by another
  process's put or give-back, or a lease there running out (which the partition's next sampling script reclaims),
  the partition is still asked whenever the others fall short, and in its turn again once the mark runs out
  (``drained.DRAINED_SECONDS``, as long as a lost put wake-up can delay a reader): never starved.
- a partition drained after the mark was made on another thread, or by another process: the take asked there
  finds nothing, as without marks; its script says so, and it is marked.
- two threads of one object marking and reading marks at once: a lost update only reorders a later get.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import torch

from broker.api.balance import balanced_batch, dp_padded
from broker.api.checks import DockChecks, check_flag, check_lease, check_timeout
from broker.api.delivery import HandedRows, LeasedRows, check_delivery
from broker.api.dock import TransferDock
from broker.api.dp_padding import drop_padding
from broker.api.drained import Drained, DrainKey
from broker.api.get_request import GetRequest
from broker.api.partition_map import PartitionMap
from broker.api.partitioned_rows import PartitionedLeasedRows, PartitionedRows, partitioned_rows, tokens_of
from broker.api.puts import Prepared, value_count
from broker.control.put_listener import PutListener
from broker.data import collector
from broker.data.row_count import row_count_error
from broker.data.stacking import stack_decoded
from broker.errors import BrokerError, ExperienceTimeoutError, InvalidExperienceError, ReplicationError

T = TypeVar("T")

#: Longest a waiting get sleeps between attempts without a wake-up (as a dock of one partition: a lost
#: pub/sub message costs at most this).
_RECHECK_SECONDS = 1.0

Parts = dict[int, tuple[Any, HandedRows]]


class PartitionedMoves:
    """Rows in and out, cut by partition: a base of ``PartitionedDock``."""

    _name: str
    _parts: list[TransferDock]
    _pmap: PartitionMap
    _check: DockChecks
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

    # -- gets ----------------------------------------------------------------------------------

    def get_experience(
        self, consumer: str, experience_columns: Sequence[str] | None = None, experience_count: int | None = None,
        indexes: Sequence[int] | None = None, get_n_samples: bool = True, timeout: float | None = None,
        policy: str | None = None, lease: float | None = None, *, dp_size: int = 1,
        balance: bool | Sequence[str] = False, dp_padding: bool = False, max_staleness: int | None = None,
        stack: bool = False,
    ) -> tuple[Any, list[int]] | tuple[None, None]:
        """Hand rows to ``consumer`` (see ``TransferDock.get_experience``; how partitions take part: this
        module's docstring). A get that one partition's take answers whole returns that take as it is; a get
        joined from several takes is balanced, padded and stacked here, over the whole batch."""
        self._check.consumer(consumer)
        if max_staleness is not None:
            raise InvalidExperienceError(f"dock {self._name!r} is partitioned: the staleness bound is not "
                                         "supported on a partitioned dock yet")
        columns = self._check.columns_to_read(
            self._parts[0].consumer_columns(consumer) if experience_columns is None else experience_columns)
        check_timeout(timeout)
        check_lease(lease)
        groups = check_flag("get_n_samples", get_n_samples)
        ranks = self._check.dp_size(dp_size)
        weigh_by = self._check.balance(balance)
        check_flag("dp_padding", dp_padding)
        stack = check_flag("stack", stack)
        got: tuple[Any, list[int], bool] | None
        if indexes is not None:
            rows = self._check.rows(indexes)
            self._check.take_count(experience_count, rows)
            got = (*self._get_rows(consumer, columns, rows, groups, timeout, policy, lease), True)
        else:
            count = self._check.sample_count(experience_count, groups)
            got = self._listener.wait(lambda: self._sample(consumer, columns, count, groups, policy, lease, stack),
                                      timeout, _RECHECK_SECONDS)
        if got is None:
            return None, None
        batch, handed, joined = got
        if joined:
            if ranks > 1 and weigh_by and len(handed) >= ranks:
                cost = self._row_costs(list(handed), weigh_by)
                batch, handed = balanced_batch(batch, handed, ranks, cost, self._pmap.n, groups and indexes is None)
            if ranks > 1 and dp_padding and len(handed) % ranks:
                batch, handed = dp_padded(batch, handed, ranks)
            if stack:
                batch = {c: stack_decoded(list(values)) for c, values in batch.items()}
        return batch, handed

    def _sample(self, consumer: str, columns: list[str], count: int, groups: bool, policy: str | None,
                lease: float | None, stack: bool) -> tuple[Any, list[int], bool] | None:
        """One attempt: takes from the partitions in turn until ``count`` rows (whole groups when ``groups``)
        are taken, or every take given back and None (see the module docstring)."""
        key = Drained.key(consumer, groups, columns)
        order = self._order(key)
        n = self._pmap.n
        # ``count`` is in units (groups in group mode): a group offered again with some rows acked hands out only
        # the rest of its rows, and still counts as one.
        wanted = count
        taken: Parts = {}
        for p in order:
            held = self._pmap.prompts_of(p)  # no partition is asked for more than it holds
            ask = min(wanted, held) * n if groups else min(wanted, held * n)
            if not taken:  # the first partition's take may be the whole call: then returned as it is
                batch, rows = self._take_some(p, consumer, columns, ask, groups, policy, lease, stack, key)
                if rows is not None and _units(rows, n, groups) == wanted:
                    return batch, self._delivered(consumer, lease, {p: (batch, rows)}, [p]), False
                if batch is not None and stack:  # a part of a larger batch: rows, to be joined, then stacked
                    batch = {c: _unstacked(v) for c, v in batch.items()}
            else:
                batch, rows = self._take_some(p, consumer, columns, ask, groups, policy, lease, False, key)
            if rows is None:
                continue
            taken[p] = (batch, rows)
            wanted -= _units(rows, n, groups)
            if wanted <= 0:
                break
        if wanted > 0:
            self._give_back(consumer, taken, groups)
            return None
        visited = [p for p in order if p in taken]
        joined = {c: list(itertools.chain.from_iterable(taken[p][0][c] for p in visited)) for c in columns}
        return joined, self._delivered(consumer, lease, taken, visited), True

    def _take_some(self, p: int, consumer: str, columns: list[str], count: int, groups: bool, policy: str | None,
                   lease: float | None, stack: bool, key: DrainKey) -> tuple[Any, HandedRows] | tuple[None, None]:
        """One take of partition ``p``, no wait: up to ``count`` rows, what qualifies there (at least one unit);
        a partition left with nothing that qualifies is marked drained for ``key``."""
        left: list[int] = []
        request = GetRequest(consumer, columns, count, None, groups, None, policy, lease, stack=stack, fewer=True,
                             on_left=left.append)
        got = self._parts[p]._handouts.get(request)
        # Nothing handed out: with ``fewer`` that means nothing qualified (its script said 0 left too).
        self._drained.saw(key, p, left[-1] if left and got[1] is not None else 0)
        return got  # type: ignore[return-value]  # a hand-out: HandedRows

    def _get_rows(self, consumer: str, columns: list[str], rows: list[int], groups: bool, timeout: float | None,
                  policy: str | None, lease: float | None) -> tuple[dict[str, list[Any]], list[int]]:
        """Explicit rows, partition by partition (each waits up to ``timeout``); a part that fails gives back
        the parts taken before it."""
        split = self._pmap.split(rows).parts
        taken: Parts = {}
        missing: dict[str, list[int]] = {}
        wait = timeout
        try:
            for p, (_, local) in split.items():
                try:
                    batch, handed = self._parts[p].get_experience(consumer, columns, len(local), local, groups, wait,
                                                                  policy, lease)
                except ExperienceTimeoutError as short:  # the other partitions' missing cells too, without waiting
                    for c, unwritten in short.missing.items():
                        missing.setdefault(c, []).extend(self._pmap.global_row(p, r) for r in unwritten)
                    wait = None
                    continue
                assert isinstance(handed, HandedRows)  # explicit rows: all handed out, or an error
                taken[p] = (batch, handed)
        except BaseException:
            self._give_back(consumer, taken, False)
            raise
        if missing:
            self._give_back(consumer, taken, False)
            order = {r: i for i, r in enumerate(rows)}
            cells = {c: sorted(found, key=order.__getitem__) for c, found in missing.items()}
            detail = "; ".join(f"{c}: rows {where[:8]}" for c, where in cells.items())
            raise ExperienceTimeoutError(f"dock {self._name!r}, consumer {consumer!r}: rows not written within "
                                         f"timeout={timeout}: {detail}", cells)
        out = _in_order(columns, len(rows), {p: (positions, taken[p][0]) for p, (positions, _) in split.items()})
        return out, self._delivered(consumer, lease, taken, list(split), rows)

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

    def _row_costs(self, rows: list[int], columns: list[str]) -> list[int]:
        cost = [0] * len(rows)
        for p, (positions, local) in self._pmap.split(rows).parts.items():
            for i, c in zip(positions, self._parts[p]._handouts._row_costs(local, columns)):
                cost[i] = c
        return cost

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
        out = _in_order(cols, len(rows), read)
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


def _in_order(columns: Sequence[str], count: int,
              parts: Mapping[int, tuple[list[int], Mapping[str, Sequence[Any]]]]) -> dict[str, list[Any]]:
    """Each partition's values (its positions in the call's rows, and its batch) put back in the call's order."""
    out: dict[str, list[Any]] = {c: [None] * count for c in columns}
    for positions, batch in parts.values():
        for c in columns:
            for i, value in zip(positions, batch[c]):
                out[c][i] = value
    return out


def _units(rows: Sequence[int], n: int, groups: bool) -> int:
    """Groups (group mode) or rows a take handed out."""
    return len({r // n for r in rows}) if groups else len(rows)


def _picked(values: Any, positions: list[int]) -> Any:
    """The rows at ``positions`` of one column of a put: a stacked tensor's rows (one copy), a list's, an array's."""
    if isinstance(values, torch.Tensor):
        return values.index_select(0, torch.tensor(positions, dtype=torch.long)) if values.dim() else values
    if isinstance(values, np.ndarray):
        return values[positions]
    if isinstance(values, Sequence) and not isinstance(values, (str, bytes)):
        return [values[i] for i in positions]
    return values  # malformed: the partition's put names what is wrong


def _unstacked(values: Any) -> list[Any]:
    """A column a partition stacked, as its rows again (views: no copy)."""
    if isinstance(values, torch.Tensor):
        return list(values.unbind(0))
    return list(values)
