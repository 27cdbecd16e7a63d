"""Token-load balancing across data-parallel ranks: Karmarkar-Karp (largest differencing), as verl does.

A batch handed to ``dp_size`` ranks is cut into ``dp_size`` equal chunks of rows. Rows differ in
length, so a naive cut gives one rank far more tokens than another, and every rank waits for the
slowest. ``balanced_order`` reorders the batch so the chunks carry nearly equal load.

Run on the client, after sampling: the order of a batch already handed out needs no atomicity, so
the sampling script stays as cheap as it is; the lengths come from the dock's length arrays in the
same round trip as the rows' bytes (see ``TransferDock._read``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from broker.api.checks import PAD_INDEX
from broker.api.delivery import like
from broker.errors import InvalidExperienceError


def karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool) -> list[list[int]]:
    """Split item indexes into ``k`` partitions of nearly equal total cost (largest differencing).

    Each item starts as a partial solution of ``k`` partitions (with ``equal_size``, ``k`` items at a
    time, one per partition, so every partition ends with ``len(costs) / k`` items). The two partial
    solutions whose partitions differ most are merged, the heaviest partition of one with the lightest
    of the other, until one is left. Partitions come back heaviest first, indexes ascending within each.
    """
    n = len(costs)
    if k < 1 or n < k:
        raise InvalidExperienceError(f"cannot split {n} items into {k} partitions")
    if equal_size and n % k:
        raise InvalidExperienceError(f"{n} items do not split into {k} partitions of equal size")
    order = sorted(range(n), key=lambda i: (costs[i], i))
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    if equal_size:
        seeds = [order[i : i + k] for i in range(0, n, k)]
        starts = [[(costs[i], [i]) for i in chunk] for chunk in seeds]
    else:
        starts = [[(costs[i], [i])] + [(0.0, [])] * (k - 1) for i in order]
    for tie, parts in enumerate(starts):
        parts.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), tie, parts))
    tie = len(starts)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a is sorted heaviest first; pair it with b lightest first.
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda p: -p[0])
        tie += 1
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
    return [sorted(items) for _, items in heap[0][2]]


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
