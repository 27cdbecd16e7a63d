"""Which partition of a partitioned dock holds a row, and the row's index there: pure arithmetic.

Groups are dealt to the partitions in blocks of ``block`` consecutive groups, round robin (block-cyclic, as
ScaLAPACK deals matrix blocks): group g is in block ``g // block``, and block b in partition ``b % P``. A group
never spans partitions. Consecutive blocks (the calls of a FIFO pipeline, a producer's puts of consecutive
prompts) fall on different partitions, on a cluster on different primaries, while one call's consecutive groups
mostly stay in one block: one script call in one partition rather than one per partition it touches (with
``block`` 1, every group its own block, a call of 16 groups on 16 partitions was 16 script calls). A partition
numbers its groups in order: its j-th block's groups are its groups ``j*block ..``. The dock's own row indexes
are the only ones users see; a partition's are its own (it is a dock of its own, ``NAME~pK``, see
``broker/control/keys.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from broker.errors import InvalidExperienceError

__all__ = ["PartitionMap", "Split", "default_block"]


@dataclass(frozen=True)
class Split:
    """Rows of one call cut by partition: for each partition touched (ascending), the positions in the call's
    rows and the rows as that partition numbers them, in the call's order."""

    parts: dict[int, tuple[list[int], list[int]]]


@dataclass(frozen=True)
class PartitionMap:
    """The partitions of a dock of ``prompts_num`` groups of ``n`` rows each, ``count`` of them, dealt in blocks
    of ``block`` groups."""

    count: int
    prompts_num: int
    n: int
    block: int = 1

    def prompts_of(self, partition: int) -> int:
        """Groups held by ``partition``."""
        blocks = -(-self.prompts_num // self.block)
        held = len(range(partition, blocks, self.count)) * self.block
        if (blocks - 1) % self.count == partition:  # the last block may be short
            held -= blocks * self.block - self.prompts_num
        return held

    def partition_of(self, row: int) -> int:
        return (row // self.n // self.block) % self.count

    def local_group(self, group: int) -> tuple[int, int]:
        """``(partition, group there)`` of the dock's group ``group``."""
        b, within = divmod(group, self.block)
        return b % self.count, (b // self.count) * self.block + within

    def local(self, row: int) -> int:
        """``row`` as its partition numbers it."""
        group, j = divmod(row, self.n)
        return self.local_group(group)[1] * self.n + j

    def global_group(self, partition: int, local_group: int) -> int:
        """Group ``local_group`` of ``partition`` as the dock numbers it."""
        lb, within = divmod(local_group, self.block)
        return (lb * self.count + partition) * self.block + within

    def global_row(self, partition: int, local: int) -> int:
        """Row ``local`` of ``partition`` as the dock numbers it."""
        group, j = divmod(local, self.n)
        return self.global_group(partition, group) * self.n + j

    def global_rows(self, partition: int, local: Sequence[int]) -> list[int]:
        return [self.global_row(partition, r) for r in local]

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


def default_block(partitions: int, prompts_num: int) -> int:
    """The block a partitioned dock is made with: the largest power of two up to 16 that still gives every
    partition at least two blocks (so that consecutive calls go round the partitions), at least 1."""
    block = 16
    while block > 1 and partitions * block * 2 > prompts_num:
        block //= 2
    return block
