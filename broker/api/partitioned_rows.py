"""The rows a partitioned dock hands out: the dock's row indexes, naming the delivery of each partition they came from.

A get on a partitioned dock may take from several partitions (``partitioned.py``), each take a delivery of that
partition (``HandedRows`` / ``LeasedRows`` of its own rows, with its epoch, generations and lease token). The
rows the caller gets are the dock's indexes of all of them, as one list that carries those parts: a put, a drop,
an ack or a read naming it is cut by partition, and each partition's part is fenced by that partition's delivery,
exactly as on a dock of one partition. A slice or a reordering (a DP rank's chunk, a balanced batch) still names
the parts, as ``HandedRows``'s do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from broker.api.delivery import HandedRows, LeasedRows
from broker.api.partition_map import PartitionMap
from broker.errors import InvalidExperienceError

__all__ = ["PartitionedRows", "PartitionedLeasedRows", "partitioned_rows"]


class _Parts:
    """What both kinds share: the partitions' deliveries (``parts[p]``: partition p's, or None) and the map."""

    __slots__ = ()
    parts: tuple[HandedRows | None, ...]
    pmap: PartitionMap

    def part(self, partition: int, local: Sequence[int]) -> HandedRows:
        """Partition ``partition``'s delivery, as rows ``local`` of it: what a write of those rows names there.
        InvalidExperienceError if these rows took nothing from that partition."""
        handed = self.parts[partition] if partition < len(self.parts) else None
        if handed is None:
            raise InvalidExperienceError(
                f"rows {list(local)[:8]} of partition {partition} were not handed out in the delivery this call names")
        return handed.with_rows(list(local))

    def generations_of(self, rows: Sequence[int]) -> bytes:
        raise InvalidExperienceError(
            "these rows came from a partitioned dock: name them to that dock (its calls cut them by partition)")


class PartitionedRows(_Parts, HandedRows):
    """Rows of a partitioned dock handed out for good: the dock's indexes, with each partition's delivery."""

    __slots__ = ("parts", "pmap")

    def __init__(self, rows: Iterable[int], parts: Sequence[HandedRows | None], pmap: PartitionMap):
        super().__init__(rows, -1, (), b"")
        self.parts = tuple(parts)
        self.pmap = pmap

    def with_rows(self, rows: list[int]) -> PartitionedRows:
        return PartitionedRows(rows, self.parts, self.pmap)

    def _state(self) -> tuple[Any, ...]:
        return (list(self), self.parts, self.pmap)


class PartitionedLeasedRows(_Parts, LeasedRows):
    """Rows of a partitioned dock handed out under a lease: each partition's part under that partition's lease.
    ``token`` names them all (``K:TOKEN`` per partition K, joined by ``|``), so that ``ack(consumer, rows,
    token=delivery.token)`` with a plain list of rows works as on a dock of one partition (``tokens_of``)."""

    __slots__ = ("parts", "pmap")

    def __init__(self, rows: Iterable[int], consumer: str, parts: Sequence[HandedRows | None], pmap: PartitionMap):
        token = "|".join(f"{k}:{p.token}" for k, p in enumerate(parts) if isinstance(p, LeasedRows))
        super().__init__(rows, token, consumer, -1, (), b"")
        self.parts = tuple(parts)
        self.pmap = pmap

    def with_rows(self, rows: list[int]) -> PartitionedLeasedRows:
        return PartitionedLeasedRows(rows, self.consumer, self.parts, self.pmap)

    def _state(self) -> tuple[Any, ...]:
        return (list(self), self.consumer, self.parts, self.pmap)

    def __repr__(self) -> str:
        return f"PartitionedLeasedRows({list(self)!r}, consumer={self.consumer!r})"


def partitioned_rows(rows: list[int], parts: Sequence[HandedRows | None], pmap: PartitionMap,
                     consumer: str | None) -> PartitionedRows | PartitionedLeasedRows:
    """``rows`` (the dock's indexes) as the delivery made of ``parts``; leased when ``consumer`` is given."""
    if consumer is not None:
        return PartitionedLeasedRows(rows, consumer, parts, pmap)
    return PartitionedRows(rows, parts, pmap)


def tokens_of(token: str) -> dict[int, str]:
    """Partition -> its lease token, from a ``PartitionedLeasedRows.token``; InvalidExperienceError if it is not one."""
    out: dict[int, str] = {}
    for part in token.split("|") if isinstance(token, str) else [None]:
        index, sep, own = part.partition(":") if isinstance(part, str) else ("", "", "")
        if not sep or not index.isdigit() or not own:
            raise InvalidExperienceError(f"token {token!r:.80} is not a partitioned dock's lease token "
                                         "(PartitionedLeasedRows.token)")
        out[int(index)] = own
    return out
