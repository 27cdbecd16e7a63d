"""A column of rows decoded straight into one tensor: stacked, or jagged when the rows' first dims differ.

``decode_rows`` (codec.py) gives one tensor per row, views on one joined copy of the reply. A caller
that wants the batch as one tensor would stack them: a second copy and a tensor per row on the way.
Here the rows are checked first, all of them, with ``decode``'s checks (row_header's prefix caches make that
a dict lookup per row), and only then is the result allocated once and each row's payload copied from
the reply bytes into its slice: one copy, no per-row tensor, no joined buffer. Checking everything
before allocating is what lets a get give back unreadable rows exactly as the list form does
(``api/reads.py``): a corrupt row raises DecodeError naming it before anything is built.

What a column becomes (``decode_stacked``):

- every row a tensor of one dtype and one shape: a tensor of shape ``(rows, *shape)``;
- every row a tensor of one dtype with at least one dim, equal trailing dims and different first dims:
  a jagged nested tensor (``torch.nested.nested_tensor_from_jagged``, layout ``torch.jagged``) whose
  ``unbind()`` gives the rows;
- anything else (plain values, mixed dtypes or ranks, 0-d rows beside others, no rows): the list of
  rows ``decode_rows`` gives.

The result is writable and owns its memory (``torch.empty``): writing into it changes nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import redis
import torch

from broker.connection.replies import RespReader
from broker.data import codec, fit, row_header
from broker.errors import DecodeError


class Checked(NamedTuple):
    """One row checked for stacking: its bytes, where its payload starts, its dtype and shape."""

    value: bytes | bytearray
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def checked_rows(values: Sequence[Any], *, where: str, fields: Sequence[str]) -> list[Checked] | None:
    """Every value checked as ``decode`` would (DecodeError naming the first bad one), as rows that stack
    (see the module docstring); None if they do not, which does not say they are readable: decode those
    with ``codec.decode_rows``, which checks them all (a value row, for one, is not read here)."""
    if not values or not all(type(v) is bytes or type(v) is bytearray for v in values):
        return None
    out: list[Checked] = []
    guess = 32  # the prefix length of the last row; the common one for 1-d tensors
    for value, field in zip(values, fields):
        layout = row_header.tensor_layout(value, guess, where, field)
        if layout is None:
            return None
        guess = layout[0]
        out.append(Checked(value, *layout))
    first = out[0]
    dims = len(first.shape)
    if any(row.dtype is not first.dtype or len(row.shape) != dims for row in out):
        return None
    ragged = any(row.shape != first.shape for row in out)
    if ragged and (dims == 0 or any(row.shape[1:] != first.shape[1:] for row in out)):
        return None
    return out


def stacked(rows: Sequence[Checked]) -> torch.Tensor:
    """The rows ``checked_rows`` accepted, in one tensor allocated once: stacked, or jagged nested."""
    first = rows[0]
    uniform = all(row.shape == first.shape for row in rows)
    if uniform:
        out = torch.empty((len(rows), *first.shape), dtype=first.dtype)
    else:
        out = torch.empty((sum(row.shape[0] for row in rows), *first.shape[1:]), dtype=first.dtype)
    if out.numel():
        target = _bytes_of(out)  # each row one memcpy from the reply bytes
        at = 0
        for row in rows:
            size = len(row.value) - row.offset
            target[at : at + size] = memoryview(row.value)[row.offset :]
            at += size
    if uniform:
        return out
    return _jagged(out, [row.shape[0] for row in rows])


def decode_stacked(values: Sequence[Any], *, where: str, fields: Sequence[str]) -> torch.Tensor | list[Any]:
    """A column's values (``bytes``, as a Redis client returns them) as one tensor (see the module
    docstring), or as the list ``codec.decode_rows`` gives when they do not stack. ``where`` is their key
    and ``fields`` their fields, named by the DecodeError a corrupt value raises."""
    rows = checked_rows(values, where=where, fields=fields)
    return codec.decode_rows(values, where=where, fields=fields) if rows is None else stacked(rows)


def stack_decoded(rows: list[Any]) -> torch.Tensor | list[Any]:
    """Rows already decoded (tensors made by the broker, such as a get's ``age``), stacked by the same rule."""
    if not rows or not all(isinstance(r, torch.Tensor) for r in rows):
        return rows
    first = rows[0]
    if any(r.dtype is not first.dtype or r.dim() != first.dim() for r in rows):
        return rows
    if all(r.shape == first.shape for r in rows):
        return torch.stack(rows)
    if first.dim() == 0 or any(r.shape[1:] != first.shape[1:] for r in rows):
        return rows
    return _jagged(torch.cat(rows), [r.shape[0] for r in rows])


def _jagged(values: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """A jagged nested tensor over ``values`` (no copy), its rows ``lengths`` long along dim 0."""
    offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    # The bounds given, so that torch does not scan the offsets for them when a kernel asks.
    return torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=min(lengths), max_seqlen=max(lengths))


class InBuffer(NamedTuple):
    """One row of a column received straight into one tensor (``receive_column``): row ``position`` of it."""

    tensor: torch.Tensor
    position: int


def gathered(rows: Sequence[InBuffer]) -> torch.Tensor:
    """Rows received into one tensor, in the order given: the tensor itself when that is its own order (no
    copy), else its rows picked out into a new one (a reordered or padded batch, a group column's rows)."""
    first = rows[0].tensor
    if len(rows) == len(first) and all(r.tensor is first and r.position == i for i, r in enumerate(rows)):
        return first
    return torch.stack([r.tensor[r.position] for r in rows])


def receive_column(
    reader: RespReader, *, where: str, fields: Sequence[str], tails: bool = False,
) -> torch.Tensor | list[bytes | bytearray | None]:
    """One HMGET reply read off the socket: rows that stack (one dtype and shape, a prefix ``decode``
    accepted before) received straight into one tensor allocated once, each row's payload into its
    slice; else (a nil, a row of another layout, a value, a row that fails a check) the values as
    ``bytes``, as a Redis client gives them, for the usual decoding to judge. Reads the whole reply.

    With ``tails``, the HMGET of the data hash is followed by the HMGET of the same fields in the column's
    tail hash (data/fit.py), and a row may come in two: its head into the start of its slice, its tail
    into the rest. A head whose tail is missing, or of another length, makes the column ``bytes``."""
    count = reader.array_length()
    out: torch.Tensor | None = None
    target: memoryview | None = None
    size = 0
    prefix = b""
    values: list[bytes | bytearray | None] | None = None  # once rows do not stack: every value as bytes
    filled: list[int] = []  # payload bytes of each row received into ``out`` so far
    short: dict[int, int] = {}  # row -> bytes of its head, of the values sized for their tails (``tails``)
    head = bytearray(_HEAD)
    for i in range(count):
        length = reader.bulk_length()
        if values is not None or length < 0:
            if values is None:
                values = _as_values(out, prefix, i, filled)
            if length < 0:
                values.append(None)
            elif tails:  # a cut head is received into a buffer with room for its tail, which follows into it
                first = _first(reader, length)
                declared = fit.whole_of_head(first, length) or 0
                values.append(_rest(reader, first, length, declared))
                if declared:
                    short[i] = length
            else:
                values.append(_rest(reader, b"", length))
            continue
        whole = length == len(prefix) + size
        if out is not None and (whole or (tails and len(prefix) < length < len(prefix) + size)):
            reader.exactly(memoryview(head)[: len(prefix)])
            if head[: len(prefix)] == prefix:  # the same prefix as row 0's, which decode's checks accepted
                got = length - len(prefix)
                reader.exactly(target[i * size : i * size + got])  # type: ignore[index]
                reader.crlf()
                filled.append(got)
                continue
            values = _as_values(out, prefix, i, filled)
            values.append(_rest(reader, bytes(head[: len(prefix)]), length))
            continue
        value: bytes | bytearray = _rest(reader, b"", length)
        if out is None and i == 0:
            layout = _stacking_layout(value, where, fields[0], tails)
            if layout is not None:
                start, dtype, shape = layout
                out = torch.empty((count, *shape), dtype=dtype)
                size, prefix = out[0].nbytes, bytes(value[:start])
                target = _bytes_of(out)
                target[: length - start] = memoryview(value)[start:]
                filled.append(length - start)
                continue
        values = _as_values(out, prefix, i, filled)
        values.append(value)
    if tails:
        values = _receive_tails(reader, count, out, prefix, size, filled, values, short)
    if values is not None:
        return values
    return out if out is not None else []


def _receive_tails(
    reader: RespReader, count: int, out: torch.Tensor | None, prefix: bytes, size: int, filled: list[int],
    values: list[bytes | bytearray | None] | None, short: dict[int, int],
) -> list[bytes | bytearray | None] | None:
    """The tails' HMGET reply (see ``receive_column``): each into the rest of its row, in its slice of
    ``out`` while rows stack, else in the buffer its head was received into with room for it (``short``:
    row -> head's length), else joined to its head. Returns ``values`` (None: every row is whole in ``out``).
    A tail of another length than its head lacks is not the row's: the head stays short, for decoding to
    name; a tail beside a row stored whole is left from an older value of the row, and skipped."""
    if reader.array_length() != count:
        raise redis.ConnectionError("protocol error: the tails' reply has another length than the heads'")
    target = _bytes_of(out) if out is not None else None
    rest: list[bytes | bytearray | None] = [None] * count  # tails to join to heads received before them
    for i in range(count):
        length = reader.bulk_length()
        if values is None and target is not None:
            missing = size - filled[i]
            if missing and length == missing:
                reader.exactly(target[i * size + filled[i] : (i + 1) * size])
                reader.crlf()
                filled[i] = size
                continue
            if not missing:
                if length >= 0:
                    _rest(reader, b"", length)
                continue
            values = _as_values(out, prefix, count, filled)  # rows before i are whole in it
        if i in short:
            row = values[i]  # type: ignore[index]
            assert isinstance(row, bytearray)
            if length == len(row) - short[i]:
                reader.exactly(memoryview(row)[short[i] :])
                reader.crlf()
                continue
            del row[short[i] :]  # not its tail: the head alone, as stored
        if length >= 0:
            rest[i] = _rest(reader, b"", length)
    if values is None:
        return None
    return fit.joined(values, rest)


#: Bytes read ahead of a row's payload: its prefix (magic, header, padding), 32 for most tensors.
_HEAD = 256


def _stacking_layout(
    value: bytes | bytearray, where: str, field: str, head: bool = False,
) -> tuple[int, torch.dtype, tuple[int, ...]] | None:
    """(payload offset, dtype, shape) of a row whose like can be received straight into a tensor: a tensor
    ``decode`` accepts, not empty, not bool (a bool payload is checked byte by byte); else None. With
    ``head``, ``value`` may also be a cut row's head (data/fit.py), whose prefix alone is checked here:
    its payload is checked whole once its tail is in."""
    if head and fit.whole_of_head(value, len(value)) is not None:
        layout = row_header.prefix_layout(value)
        if layout is not None:
            start, dtype, shape, whole = layout
            return None if dtype is torch.bool or start > _HEAD or start == whole else (start, dtype, shape)
    try:
        found = row_header.tensor_layout(value, 32, where, field)
    except DecodeError:
        return None  # the usual decoding names it
    if found is None or found[1] is torch.bool or len(value) == found[0] or found[0] > _HEAD:
        return None
    return found


def _first(reader: RespReader, length: int) -> bytearray:
    """The first bytes of a bulk string of ``length`` bytes: enough for a row's prefix (``_HEAD``)."""
    first = bytearray(min(length, _HEAD))
    reader.exactly(memoryview(first))
    return first


def _rest(reader: RespReader, head: bytes | bytearray, length: int, room: int = 0) -> bytearray:
    """A bulk string of ``length`` bytes whose first ``head`` bytes were read already, then its CRLF; in a
    buffer of ``room`` bytes where that is more (the rest left for a cut row's tail). A bytearray: the
    decoding reads it as it would bytes, and a copy to bytes cost as much as receiving it."""
    out = bytearray(max(length, room))
    out[: len(head)] = head
    reader.exactly(memoryview(out)[len(head) : length])
    reader.crlf()
    return out


def _as_values(
    out: torch.Tensor | None, prefix: bytes, count: int, filled: Sequence[int],
) -> list[bytes | bytearray | None]:
    """The first ``count`` rows received into ``out`` (``filled`` bytes of each), as the bytes they were sent as."""
    if out is None or not count:
        return []
    raw = _bytes_of(out)
    size = raw.nbytes // len(out)
    return [prefix + bytes(raw[i * size : i * size + filled[i]]) for i in range(count)]


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a fresh tensor's memory (bool and bfloat16 included): slice assignments into
    it are plain memcpys, with no tensor or array made per row."""
    return memoryview(tensor.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # an ndarray is a buffer
