"""Partial rollout and the staleness bound on a partitioned dock: each partition keeps them for its own groups.

A base of ``PartitionedDock`` (partitioned.py). A group never spans partitions, so everything a dock keeps per
group for generation (ages, completion, the placeholders, a group's version, stale drops and regeneration) is
kept by the partition holding it, in its own scripts, unchanged. What is one count over the whole dock on a dock
of one partition is cut into shares here:

- **An iteration's batch** (``gbs_train`` groups, partial rollout): each partition takes ``shares(...)[k]`` of
  them, in proportion to the groups it holds (``gbs_train`` split as evenly as it goes). Every consumer but the
  rollout takes at most its share of each partition per iteration, and the first share handed out in a
  partition is that partition's part of the iteration's batch (``td:{NAME~pK}:gbatch``), so stages in parallel
  hold the same groups in every partition. ``get_update_ready`` is true once every partition is ready: its
  share finished (and, as asked, none of age ``max_age - 1`` unfinished). A get of the whole batch joins the
  partitions' shares (partitioned_gets.py); one partition short, it gives back what it took and waits.
- **New prompts go where the batch will be taken**: ``reserve_groups(count)`` deals the groups to the
  partitions by their shares (``_reservation_parts``), so each partition gets prompts for its share; one
  partition with too few free groups gives back the others' claims and the call returns None, as a dock of
  one partition does when too few are free. A caller putting prompts at rows of its own choosing should
  spread them likewise, or a partition may never fill its share (and, as on a dock of one partition, a run
  whose last prompts cannot fill a batch waits for the prompts it lacks).
- **The rollout consumer** takes unfinished rows oldest first within each partition, from the partitions in
  turn (this object's rotation), as many as there are (at least one row): oldest first holds per partition.
- **The staleness bound** holds per partition against the version that partition has seen: ``set_version``
  reaches the partitions in order (partitioned.py), so between two of them a partition not yet told may
  still hand out a group that the next version makes stale there: at most one version's lag, during the call.
  Admission control (``prefetch_request_index``) counts each partition's batches of its share.
- **The iteration's end** (``clear(consumer=...)``) reaches every partition in order; between two of them a
  partition not yet aged hands out by its old ages, which is what it would have done just before. On a dock
  of one partition a clear that trained nothing ages nothing (MindSpeed's first clear); here the groups of
  every partition age if the consumer was handed rows in any partition (lua/clear.lua's "share"), so a
  partition whose share was not taken this iteration ages with the others. Whether any was is read before
  the clears, not with them: a get of that consumer racing the iteration's end (which MindSpeed's loop never
  does) may find a partition cleared or not yet, and the partitions age as that read found.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from broker.api.checks import is_int
from broker.api.dock import TransferDock
from broker.api.partition_map import PartitionMap
from broker.api.partitioned_moves import every
from broker.api.partitioned_parts import PartitionedParts
from broker.control.rollout import Rollout
from broker.control.scripts import Reservation
from broker.errors import InvalidExperienceError, SchemaError

__all__ = ["PartitionedGeneration", "partition_rollouts", "shares"]


def shares(total: int, pmap: PartitionMap) -> list[int]:
    """``total`` groups cut into one share per partition, in proportion to the groups each holds (largest
    remainders first, ties to the lower partition): as even as it goes, summing to ``total``."""
    held = [pmap.prompts_of(p) for p in range(pmap.count)]
    exact = [total * h for h in held]
    out = [e // pmap.prompts_num for e in exact]
    by_remainder = sorted(range(pmap.count), key=lambda p: (-(exact[p] % pmap.prompts_num), p))
    for p in by_remainder[:total - sum(out)]:
        out[p] += 1
    return out


def partition_rollouts(name: str, rollout: Rollout, pmap: PartitionMap) -> list[Rollout]:
    """Each partition's settings: the dock's, with ``gbs_train`` its share; SchemaError where a share cannot
    be kept (a partition's share of a partial rollout's batch is at least one group, and at most what it holds)."""
    if rollout == Rollout():
        return [rollout] * pmap.count
    cut = shares(rollout.gbs_train, pmap)
    if rollout.partial and min(cut) < 1:
        raise SchemaError(f"dock {name!r}: gbs_train={rollout.gbs_train} is below partitions={pmap.count}: each "
                          "partition takes its share of an iteration's batch, at least one group (make fewer "
                          "partitions, or a larger batch)")
    over = [p for p, s in enumerate(cut) if s > pmap.prompts_of(p)]
    if over:
        raise SchemaError(f"dock {name!r}: gbs_train={rollout.gbs_train} exceeds the groups partition {over[0]} "
                          f"holds ({pmap.prompts_of(over[0])}), whose share is {cut[over[0]]}")
    return [dataclasses.replace(rollout, gbs_train=s) for s in cut]


def dock_rollout(name: str, parts: Sequence[TransferDock], pmap: PartitionMap) -> Rollout:
    """The dock's settings from its partitions' (``gbs_train`` the sum of their shares); SchemaError if the
    partitions disagree, which a dock made by ``TransferDock(..., partitions=P)`` never does."""
    first = parts[0].rollout
    whole = dataclasses.replace(first, gbs_train=sum(p.rollout.gbs_train for p in parts))
    if [p.rollout for p in parts] != partition_rollouts(name, whole, pmap):
        raise SchemaError(f"dock {name!r}: its partitions' rollout settings disagree "
                          f"({[p.rollout for p in parts]}); delete the dock and make it again")
    return whole


class PartitionedGeneration(PartitionedParts):
    """Partial rollout, the stop signal and reservations over the partitions: a base of ``PartitionedDock``."""

    #: The smooth weighted round robin's counters of ``reserve_groups`` (one per partition).
    _dealt: list[int]

    @property
    def rollout(self) -> Rollout:
        """The dock's settings, ``gbs_train`` the whole batch (each partition holds its share)."""
        return self._rollout

    def _partial(self, what: str) -> Rollout:
        if not self._rollout.partial:
            raise InvalidExperienceError(f"dock {self._name!r} has no partial rollout (max_age > 1): {what} needs it")
        return self._rollout

    def _end_iteration(self, consumer: str) -> None:
        """``clear(consumer=...)`` of a partial rollout: forget what ``consumer`` trained in every partition,
        and age every partition's groups if it trained in any (see the module docstring)."""
        self._check.consumer(consumer)
        trained = any(part.session.run(functools.partial(part.client.bitcount, part.keys.consumed(consumer)))
                      for part in self._parts)
        every([functools.partial(part._admin.clear, consumer=consumer, trained_elsewhere=trained)
               for part in self._parts])

    def finished_rows(self) -> torch.Tensor:
        """A bool tensor of ``capacity`` rows, True on every row of a finished group (see ``TransferDock``)."""
        self._partial("finished_rows")
        out = torch.zeros(self._pmap.prompts_num * self._pmap.n, dtype=torch.bool)
        for p, part in enumerate(self._parts):
            local = part.finished_rows().nonzero().flatten().tolist()
            out[self._pmap.global_rows(p, local)] = True
        return out

    def age_groups(self) -> None:
        """Make every generated group one iteration older, partition by partition."""
        self._partial("age_groups")
        every([part.age_groups for part in self._parts])

    def unready(self, columns: Sequence[str], indexes: Sequence[int]) -> int:
        """Mark rows of columns not ready, keeping their bytes (see ``TransferDock.unready``), by partition."""
        rows = self._check.rows(indexes)
        return sum(every([functools.partial(self._parts[p].unready, columns, local)
                          for p, (_, local) in self._pmap.split(rows).parts.items()]))

    def get_update_ready(self, require_max_age_all_finished: bool = True) -> bool:
        """The stop signal: every partition has its share of the batch finished (see the module docstring)."""
        self._partial("get_update_ready")
        return all(part.get_update_ready(require_max_age_all_finished) for part in self._parts)

    def get_incomplete_response_num(self) -> int:
        """Rows holding a prompt whose response is not finished, over every partition."""
        self._partial("get_incomplete_response_num")
        return sum(part.get_incomplete_response_num() for part in self._parts)

    def reserve_groups(self, count: int, column: str) -> list[int] | None:
        """Claim ``count`` free groups, each partition its part in proportion to its share (see the module
        docstring); None, claiming nothing, if a partition has too few free for its part."""
        if not is_int(count) or count < 1:
            raise InvalidExperienceError(f"count must be a positive int, got {count!r:.40}")
        self._check.columns([column])
        parts = self._reservation_parts(int(count))
        claimed: dict[int, Reservation] = {}
        try:
            for p, wanted in parts.items():
                got = self._parts[p]._generation.reserve(wanted, column)
                if got is None:
                    break
                claimed[p] = got
        finally:
            if len(claimed) < len(parts):  # too few free in one partition, or an error: give back the claims
                for p, reservation in claimed.items():
                    self._parts[p]._generation.unreserve(reservation)
        if len(claimed) < len(parts):
            return None
        return sorted(self._pmap.global_group(p, g) for p, got in claimed.items() for g in got.groups)

    def _reservation_parts(self, count: int) -> dict[int, int]:
        """How many of ``count`` groups each partition claims: dealt one at a time by smooth weighted round
        robin (nginx's upstream balancing), weights the shares of the batch (without partial rollout, the
        groups each partition holds). Any run of ``gbs_train`` groups this object reserves, in one call or in
        calls of one, gives each partition its share exactly, so an iteration that refills what the last one
        trained refills each partition's share and every partition can finish it (the stop signal waits for
        all). Threads sharing the object may race on the counters: that only shifts which partition is next."""
        weights = ([p.rollout.gbs_train for p in self._parts] if self._rollout.partial
                   else [self._pmap.prompts_of(p) for p in range(self._pmap.count)])
        total = sum(weights)
        current = self._dealt
        out = [0] * len(weights)
        for _ in range(count):
            for p, w in enumerate(weights):
                current[p] += w
            chosen = max(range(len(weights)), key=current.__getitem__)
            current[chosen] -= total
            out[chosen] += 1
        return {p: c for p, c in enumerate(out) if c}
