"""Token-load balancing across data-parallel ranks: Karmarkar-Karp (largest differencing), as verl does.

A batch handed to ``dp_size`` ranks is cut into ``dp_size`` equal chunks of rows. Rows differ in
length, so a naive cut gives one rank far more tokens than another, and every rank waits for the
slowest. ``balanced_order`` reorders the batch so the chunks carry nearly equal load.

Run on the client, after sampling: the order of a batch already handed out needs no atomicity, so
the sampling script stays as cheap as it is; the lengths come from the dock's length arrays, one
BITFIELD per column in one round trip (see ``Handouts._row_costs`` in handout.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from broker.api.delivery import like, reordered
from broker.api.dp_padding import PAD_INDEX
from broker.errors import InvalidExperienceError


def karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool) -> list[list[int]]:
    """Split item indexes into ``k`` partitions of nearly equal total cost (largest differencing).

    Each item starts as a partial solution of ``k`` partitions (with ``equal_size``, ``k`` items at a
    time, one per partition, so every partition ends with ``len(costs) / k`` items). The two partial
    solutions whose partitions differ most are merged, the heaviest partition of one with the lightest
    of the other, until one is left. Partitions come back heaviest first, indexes ascending within each.

    Ties are broken as verl's ``seqlen_balancing.karmarkar_karp`` breaks them (TransferQueue's
    ``SeqlenBalancedSampler`` copies it), so the same costs give the same partitions in the same order:
    a TransferQueue sampler on the broker hands each DP rank the rows TransferQueue's would.
    """
    n = len(costs)
    if k < 1 or n < k:
        raise InvalidExperienceError(f"cannot split {n} items into {k} partitions")
    if equal_size and n % k:
        raise InvalidExperienceError(f"{n} items do not split into {k} partitions of equal size")
    order = sorted(range(n), key=lambda i: (costs[i], i))
    if equal_size:
        seeds = [[[i] for i in order[s : s + k]] for s in range(0, n, k)]
    else:
        seeds = [[[i]] + [[] for _ in range(k - 1)] for i in order]
    heap: list[_Partial] = []
    for parts in seeds:  # pushed one by one, as verl does: the heap's order of equal spreads follows it
        heapq.heappush(heap, _Partial([_Part.of([(i, costs[i]) for i in items]) for items in parts]))
    while len(heap) > 1:
        a = heapq.heappop(heap)
        b = heapq.heappop(heap)
        # a is sorted heaviest first; pair it with b lightest first.
        heapq.heappush(heap, _Partial([pa.merged(pb) for pa, pb in zip(a.parts, reversed(b.parts))]))
    return [sorted(i for i, _ in part.items) for part in heap[0].parts]


class _Part:
    """One partition of a partial solution: its ``(index, cost)`` items in joining order and their total.

    Partitions order by (total, item count, items), as verl's ``Set`` does. The total is the running
    sum of the items in joining order, as there, so that float costs round the same way.
    """

    __slots__ = ("items", "total")

    def __init__(self, items: list[tuple[int, float]], total: float = 0) -> None:
        self.items = items
        self.total = total

    @classmethod
    def of(cls, items: list[tuple[int, float]]) -> _Part:
        return cls([], 0).merged(cls(items))

    def merged(self, other: _Part) -> _Part:
        total = self.total
        for _, c in other.items:
            total += c
        return _Part(self.items + other.items, total)

    def key(self) -> tuple[float, int, list[tuple[int, float]]]:
        return self.total, len(self.items), self.items


class _Partial:
    """A partial solution: ``k`` partitions, heaviest first. The heap pops the widest spread first and,
    among equal spreads, the one whose heaviest partition is heavier (verl's ``State.__lt__``)."""

    __slots__ = ("parts", "spread")

    def __init__(self, parts: list[_Part]) -> None:
        self.parts = sorted(parts, key=_Part.key, reverse=True)
        self.spread = self.parts[0].total - self.parts[-1].total

    def __lt__(self, other: _Partial) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.parts[0].key() > other.parts[0].key()


def balanced_order(costs: Sequence[float], dp_size: int) -> list[int]:
    """A permutation of ``range(len(costs))`` whose ``dp_size`` equal consecutive chunks balance the load.

    Karmarkar-Karp, then swaps: with few items per chunk and a long tail of lengths (a whole group of
    n long responses is one item), equal-size KK can leave the heaviest chunk well above the mean, so
    items are swapped between the heaviest and the lightest chunk while that lowers the heavier of
    the two (sizes stay equal).
    """
    parts = karmarkar_karp(costs, dp_size, equal_size=True)
    _swap_down(parts, costs)
    return [i for part in parts for i in part]


def _swap_down(parts: list[list[int]], costs: Sequence[float], rounds: int = 1000) -> None:
    """Swap one item each between the heaviest and the lightest partition while it lowers the heaviest."""
    loads = [sum(costs[i] for i in p) for p in parts]
    for _ in range(rounds):
        hi = max(range(len(parts)), key=loads.__getitem__)
        lo = min(range(len(parts)), key=loads.__getitem__)
        gap = loads[hi] - loads[lo]
        best, pick = gap, None
        for a in parts[hi]:
            for b in parts[lo]:
                d = costs[a] - costs[b]
                if 0 < d < gap and abs(gap - 2 * d) < best:  # both ends strictly inside the old range
                    best, pick = abs(gap - 2 * d), (a, b, d)
        if pick is None:
            break
        a, b, d = pick
        parts[hi][parts[hi].index(a)] = b
        parts[lo][parts[lo].index(b)] = a
        loads[hi] -= d
        loads[lo] += d
    for p in parts:
        p.sort()


def imbalance(costs: Sequence[float], dp_size: int, order: Sequence[int] | None = None) -> float:
    """max / mean of the chunk loads when ``costs`` (in ``order``) is cut into ``dp_size`` equal chunks."""
    ordered = [costs[i] for i in order] if order is not None else list(costs)
    size = len(ordered) // dp_size
    loads = [sum(ordered[r * size : (r + 1) * size]) for r in range(dp_size)]
    mean = sum(loads) / dp_size
    return max(loads) / mean if mean else 1.0


def dp_padded(batch: dict[str, list[Any]], rows: list[int], ranks: int) -> tuple[dict[str, list[Any]], list[int]]:
    """``batch`` filled up to a multiple of ``ranks`` rows by repeating its last row as ``PAD_INDEX``.

    MindSpeed's DP padding: every rank gets the same number of rows; the repeats are the same objects
    as the last row, and puts skip their index, so a worker's results for them are dropped.
    """
    extra = -len(rows) % ranks
    padded = {c: values + [values[-1]] * extra for c, values in batch.items()}
    return padded, like(rows, list(rows) + [PAD_INDEX] * extra)


def balanced_batch(
    batch: dict[str, list[Any]], rows: list[int], ranks: int, cost: Sequence[float], n: int, groups: bool,
) -> tuple[dict[str, list[Any]], list[int]]:
    """``batch`` (rows ``rows``, each costing ``cost``) reordered so that ``ranks`` equal chunks of it carry
    nearly equal load: whole groups of ``n`` rows together when ``groups`` and the batch is whole groups that
    split evenly, else rows; a batch that does not split into ``ranks`` equal chunks is left as it is."""
    # A sampled batch is whole groups, but for a group that came back with only its unacked rows (see
    # lua/include/leases.lua): then every n consecutive rows are not one group, and rows are balanced.
    whole = groups and len(rows) % n == 0 and all(r // n == rows[i - i % n] // n for i, r in enumerate(rows))
    if whole and (len(rows) // n) % ranks == 0:
        # Rows of one group are consecutive in the batch: order whole groups.
        group_cost = [sum(cost[g * n : (g + 1) * n]) for g in range(len(rows) // n)]
        order = [g * n + j for g in balanced_order(group_cost, ranks) for j in range(n)]
    elif len(rows) % ranks == 0:
        order = balanced_order(cost, ranks)
    else:
        return batch, rows
    return reordered(batch, rows, order)
