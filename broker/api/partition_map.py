"""Which partition of a partitioned dock holds a row, and the row's index there: pure arithmetic.

Group g (rows ``[g*n, (g+1)*n)``) lives in partition ``g % P`` as that partition's group ``g // P``, so a group
never spans partitions, and consecutive groups (a FIFO batch, a producer's put of consecutive prompts) fall on
different partitions, on a cluster on different primaries. Partition p holds ``len(range(p, prompts_num, P))``
groups. The dock's own row indexes are the only ones users see; a partition's are its own (it is a dock of its
own, ``NAME~pK``, see ``broker/control/keys.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from broker.errors import InvalidExperienceError

__all__ = ["PartitionMap", "Split"]


@dataclass(frozen=True)
class Split:
    """Rows of one call cut by partition: for each partition touched (ascending), the positions in the call's
    rows and the rows as that partition numbers them, in the call's order."""

    parts: dict[int, tuple[list[int], list[int]]]


@dataclass(frozen=True)
class PartitionMap:
    """The partitions of a dock of ``prompts_num`` groups of ``n`` rows each, ``count`` of them."""

    count: int
    prompts_num: int
    n: int

    def prompts_of(self, partition: int) -> int:
        """Groups held by ``partition``."""
        return len(range(partition, self.prompts_num, self.count))

    def partition_of(self, row: int) -> int:
        return (row // self.n) % self.count

    def local(self, row: int) -> int:
        """``row`` as its partition numbers it."""
        group, j = divmod(row, self.n)
        return (group // self.count) * self.n + j

    def global_row(self, partition: int, local: int) -> int:
        """Row ``local`` of ``partition`` as the dock numbers it."""
        group, j = divmod(local, self.n)
        return (group * self.count + partition) * self.n + j

    def global_rows(self, partition: int, local: Sequence[int]) -> list[int]:
        return [self.global_row(partition, r) for r in local]

    def local_group(self, group: int) -> tuple[int, int]:
        """``(partition, group there)`` of the dock's group ``group``."""
        return group % self.count, group // self.count

    def split(self, rows: Sequence[int]) -> Split:
        """``rows`` (checked: ints in range, or the DP padding index -2 which puts skip) cut by partition."""
        parts: dict[int, tuple[list[int], list[int]]] = {}
        for position, row in enumerate(rows):
            if row < 0:
                raise InvalidExperienceError(f"row {row} is not a row of the dock")
            p = self.partition_of(row)
            positions, local = parts.setdefault(p, ([], []))
            positions.append(position)
            local.append(self.local(row))
        return Split(dict(sorted(parts.items())))
