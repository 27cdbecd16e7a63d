"""Gets of a partitioned dock: a sampled get taking from partitions in turn, and explicit rows cut by partition.

A base of ``PartitionedDock`` (partitioned.py, whose docstring says what is per partition), over
``PartitionedMoves`` (partitioned_moves.py: puts, reads, takes, acks, drops, and the give-back they share).

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
- an error in a later partition's take (the server went away, a name that partition does not know yet while a
  ``grow`` goes round): the takes before it are given back before the error is raised, as when they fall short.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from broker.api.balance import balanced_batch, dp_padded
from broker.api.checks import check_flag, check_lease, check_timeout, check_version
from broker.api.delivery import HandedRows
from broker.api.drained import Drained, DrainKey
from broker.api.generation import AGE_COLUMN, asks_age, check_rollout_get
from broker.api.get_request import GetRequest
from broker.api.partitioned_moves import PartitionedMoves, Parts, in_order
from broker.data.stacking import stack_decoded
from broker.errors import ExperienceTimeoutError

#: Longest a waiting get sleeps between attempts without a wake-up (as a dock of one partition: a lost
#: pub/sub message costs at most this).
_RECHECK_SECONDS = 1.0


@dataclass(frozen=True)
class Take:
    """What each partition's take of one sampled get asks for (checked by ``get_experience``)."""

    consumer: str
    columns: list[str]
    groups: bool
    policy: str | None
    lease: float | None
    max_staleness: int | None
    #: The rollout consumer of a partial rollout: keeps what the partitions had, at least one row.
    fewer: bool = False



class PartitionedGets(PartitionedMoves):
    """Gets over the partitions: a base of ``PartitionedDock``."""

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
        rollout = self._rollout
        generating = rollout.partial and consumer == rollout.consumer
        asked = self._parts[0].consumer_columns(consumer) if experience_columns is None else experience_columns
        # The rollout consumer may ask for its rows' ages beside the columns: each partition's take adds them.
        with_age = asks_age(rollout, consumer, asked, self._parts[0].columns)
        columns = self._check.columns_to_read([c for c in asked if c != AGE_COLUMN] if with_age else asked)
        if with_age:
            columns.append(AGE_COLUMN)
        check_timeout(timeout)
        check_lease(lease)
        if max_staleness is not None:
            check_version(max_staleness, "max_staleness")
        groups = check_flag("get_n_samples", get_n_samples)
        check_rollout_get(self._name, rollout, consumer, groups, indexes is not None)
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
            take = Take(consumer, columns, groups, policy, lease, max_staleness, fewer=generating)
            got = self._listener.wait(lambda: self._sample(take, count, stack), timeout, _RECHECK_SECONDS)
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

    def _sample(self, take: Take, count: int, stack: bool) -> tuple[Any, list[int], bool] | None:
        """One attempt: takes from the partitions in turn until ``count`` rows (whole groups when ``groups``)
        are taken, or every take given back and None (see the module docstring). The rollout consumer of a
        partial rollout (``take.fewer``) keeps what it took, at least one row, as on a dock of one partition."""
        consumer, columns, groups, lease = take.consumer, take.columns, take.groups, take.lease
        key = Drained.key(consumer, groups, columns)
        order = self._order(key)
        n = self._pmap.n
        # ``count`` is in units (groups in group mode): a group offered again with some rows acked hands out only
        # the rest of its rows, and still counts as one.
        wanted = count
        taken: Parts = {}
        try:
            for p in order:
                held = self._pmap.prompts_of(p)  # no partition is asked for more than it holds
                ask = min(wanted, held) * n if groups else min(wanted, held * n)
                if not taken:  # the first partition's take may be the whole call: then returned as it is
                    batch, rows = self._take_some(p, take, ask, stack, key)
                    if rows is not None and _units(rows, n, groups) == wanted:
                        return batch, self._delivered(consumer, lease, {p: (batch, rows)}, [p]), False
                    if batch is not None and stack:  # a part of a larger batch: rows, to be joined, then stacked
                        batch = {c: _unstacked(v) for c, v in batch.items()}
                else:
                    batch, rows = self._take_some(p, take, ask, False, key)
                if rows is None:
                    continue
                taken[p] = (batch, rows)
                wanted -= _units(rows, n, groups)
                if wanted <= 0:
                    break
        except BaseException:  # a later partition's take failed: what the earlier ones took goes back first
            self._give_back(consumer, taken, groups)
            raise
        if not taken or (wanted > 0 and not take.fewer):
            self._give_back(consumer, taken, groups)
            return None
        visited = [p for p in order if p in taken]
        joined = {c: list(itertools.chain.from_iterable(taken[p][0][c] for p in visited)) for c in columns}
        return joined, self._delivered(consumer, lease, taken, visited), True

    def _take_some(self, p: int, take: Take, count: int, stack: bool,
                   key: DrainKey) -> tuple[Any, HandedRows] | tuple[None, None]:
        """One take of partition ``p``, no wait: up to ``count`` rows, what qualifies there (at least one unit);
        the partition applies its staleness bound (and drops or regenerates what it finds stale). A partition
        left with nothing that qualifies is marked drained for ``key``."""
        left: list[int] = []
        request = GetRequest(take.consumer, take.columns, count, None, take.groups, None, take.policy, take.lease,
                             max_staleness=take.max_staleness, stack=stack, fewer=True, on_left=left.append)
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
        out = in_order(columns, len(rows), {p: (positions, taken[p][0]) for p, (positions, _) in split.items()})
        return out, self._delivered(consumer, lease, taken, list(split), rows)

    def _row_costs(self, rows: list[int], columns: list[str]) -> list[int]:
        cost = [0] * len(rows)
        for p, (positions, local) in self._pmap.split(rows).parts.items():
            for i, c in zip(positions, self._parts[p]._handouts._row_costs(local, columns)):
                cost[i] = c
        return cost


def _units(rows: Sequence[int], n: int, groups: bool) -> int:
    """Groups (group mode) or rows a take handed out."""
    return len({r // n for r in rows}) if groups else len(rows)


def _unstacked(values: Any) -> list[Any]:
    """A column a partition stacked, as its rows again (views: no copy)."""
    if isinstance(values, torch.Tensor):
        return list(values.unbind(0))
    return list(values)
