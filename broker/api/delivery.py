"""The rows a ``get_experience`` returns: a list of row indexes that also names the delivery they came in.

A delivery is one hand-out of rows to one consumer. It is identified by what the dock's clears had made
of the rows when they were handed out (the dock's epoch and each row's generation, see
lua/include/generations.lua) and, under a lease, by the lease's token (lua/include/leases.lua). Writes
that name a delivery are fenced by it (lua/include/delivery.lua): a put of a stage's results into the
rows it was handed, or a drop of the groups a filter rejected, lands only while the delivery is still
current, so a slow worker whose rows were cleared, dropped, or given to another worker cannot write
its late result over somebody else's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, SupportsIndex, overload

from broker.control.scripts import Fence, Handout, rows_of, runs_of
from broker.errors import InvalidExperienceError


class HandedRows(list[int]):
    """Row indexes handed out by one ``get_experience`` call, with the delivery's ``epoch`` and generations.

    It is a plain list in every other way (compares, indexes, pickles and crosses Ray as one), so
    MindSpeed-style code keeps working, and ``put_experience(data, rows)`` is fenced by it without
    more arguments. A slice, or the list reordered or padded by the dock, still names the delivery;
    a list built anew from it (``list(rows)``, ``rows + [...]``, a tensor) does not: pass the original
    as ``delivery=`` then.
    """

    __slots__ = ("epoch", "_runs", "_generations")

    def __init__(self, rows: Iterable[int], epoch: int, runs: Sequence[int], generations: bytes):
        super().__init__(rows)
        self.epoch = epoch
        #: The delivery's rows as flattened runs (ascending) and their generations, 4 bytes each, in that
        #: order: as sample.lua / take.lua returned them. Read through ``generations_of``.
        self._runs = tuple(runs)
        self._generations = bytes(generations)

    def generations_of(self, rows: Sequence[int]) -> bytes:
        """The generations of ``rows`` (ascending, as a write's runs list them), 4 bytes per row.

        Raises InvalidExperienceError naming the rows that were not handed out in this delivery.
        """
        runs = self._runs
        if len(rows) * 2 >= len(runs) and list(runs_of(rows)) == list(runs):  # the whole delivery, as usual
            return self._generations
        handed = set(rows_of(runs))
        foreign = [r for r in rows if r not in handed]
        if foreign:
            shown = ", ".join(map(str, foreign[:8])) + (", ..." if len(foreign) > 8 else "")
            raise InvalidExperienceError(
                f"rows {shown} were not handed out in the delivery this write names; name the delivery they "
                "came in, or pass a plain list of rows for an unfenced write"
            )
        return Handout(runs, self.epoch, self._generations).only(rows).generations

    @overload
    def __getitem__(self, index: SupportsIndex) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> int | list[int]:
        if isinstance(index, slice):  # a DP rank's chunk is still part of the delivery
            return like(self, list.__getitem__(self, index))
        return list.__getitem__(self, index)

    def with_rows(self, rows: list[int]) -> HandedRows:
        """``rows`` (a reordering, part or padding of these) as the same delivery."""
        return HandedRows(rows, self.epoch, self._runs, self._generations)

    def shifted(self, by: int) -> HandedRows:
        """The same delivery with every row moved by ``by``: for a slice that numbers a dock's rows its own way
        (the TransferQueue slice's global indexes), and back before it names the delivery to the dock."""
        return self.with_rows([r + by for r in self])._moved(by)

    def _moved(self, by: int) -> HandedRows:
        runs = list(self._runs)
        runs[0::2] = [start + by for start in runs[0::2]]
        self._runs = tuple(runs)
        return self

    def _state(self) -> tuple[Any, ...]:
        return (list(self), self.epoch, self._runs, self._generations)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # list's would drop the slots
        return type(self), self._state()

    # Printed, it is the list it is (MindSpeed-style code logs its indexes); LeasedRows shows its lease.
    __repr__ = list.__repr__


class LeasedRows(HandedRows):
    """Rows handed out under a lease: a :class:`HandedRows` that also carries the lease's ``token`` and ``consumer``.

    ``dock.ack(consumer, rows)`` reads the token from it. The token identifies this one delivery, like an
    SQS receipt handle: once the lease expired and the rows went to another call, or a clear made way
    for new rows, an ack naming it releases nothing, and a put naming it writes nothing. Ack or put part
    of a delivery by slicing it, or with ``token=rows.token`` / ``delivery=rows``.
    """

    __slots__ = ("token", "consumer")

    def __init__(self, rows: Iterable[int], token: str, consumer: str, epoch: int, runs: Sequence[int],
                 generations: bytes):
        super().__init__(rows, epoch, runs, generations)
        self.token = token
        self.consumer = consumer

    def with_rows(self, rows: list[int]) -> LeasedRows:
        return LeasedRows(rows, self.token, self.consumer, self.epoch, self._runs, self._generations)

    def _state(self) -> tuple[Any, ...]:
        return (list(self), self.token, self.consumer, self.epoch, self._runs, self._generations)

    def __repr__(self) -> str:
        return f"LeasedRows({list(self)!r}, token={self.token!r}, consumer={self.consumer!r})"


def like(rows: list[int], new_rows: list[int]) -> list[int]:
    """``new_rows`` (a reordering, part or padding of ``rows``) in the same delivery as ``rows``, if it named one."""
    if isinstance(rows, HandedRows):
        return rows.with_rows(new_rows)
    return new_rows


def reordered(
    batch: Mapping[str, list[Any]], rows: list[int], order: Sequence[int],
) -> tuple[dict[str, list[Any]], list[int]]:
    """A batch and its rows in ``order`` (positions in them), the rows in their delivery (see ``like``)."""
    plain = list(rows)  # indexing a HandedRows goes through Python (its slices keep the delivery)
    return {c: [values[i] for i in order] for c, values in batch.items()}, like(rows, [plain[i] for i in order])


def check_delivery(delivery: Any, consumer: str | None = None) -> HandedRows:
    """``delivery`` if it is the rows of a hand-out (and, leased, a lease of ``consumer`` if given)."""
    if not isinstance(delivery, HandedRows):
        raise InvalidExperienceError(
            f"delivery must be the rows get_experience returned (HandedRows), got {type(delivery).__name__}"
        )
    if consumer is not None and isinstance(delivery, LeasedRows) and delivery.consumer != consumer:
        raise InvalidExperienceError(f"these rows were leased to consumer {delivery.consumer!r}, not to {consumer!r}")
    return delivery


def fence_of(delivery: HandedRows, rows: list[int]) -> Fence:
    """What a write of ``rows`` (ascending) naming ``delivery`` checks (see lua/include/delivery.lua)."""
    if isinstance(delivery, LeasedRows):
        return Fence(delivery.epoch, delivery.generations_of(rows), delivery.consumer, delivery.token)
    return Fence(delivery.epoch, delivery.generations_of(rows))


def put_id(delivery: LeasedRows, columns: Iterable[str], runs: Sequence[int]) -> str:
    """The request id of a put that writes rows ``runs`` of ``columns`` for leased ``delivery`` and acks them:
    the same for the same put sent again, so that a put cut short (its time bound passed, its connection
    lost) and sent again writes only the slices that did not land (see ``PutRequest.request_id``). Only one
    such put can land anyway: it ends the lease of its rows, and another is refused (FencedError)."""
    digest = hashlib.blake2b(digest_size=16)
    for part in (delivery.consumer, delivery.token, *sorted(columns)):
        digest.update(part.encode() + b"\0")
    digest.update(",".join(map(str, runs)).encode())
    return "p" + digest.hexdigest()


def fenced_handout(delivery: HandedRows, rows: list[int]) -> Handout:
    """The handout a read of ``rows`` naming ``delivery`` checks (their runs, the delivery's epoch and their
    generations): InvalidExperienceError for rows the delivery did not hand out."""
    runs = tuple(runs_of(rows))
    return Handout(runs, delivery.epoch, delivery.generations_of(rows_of(runs)))
