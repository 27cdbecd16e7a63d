"""One row to bytes and back: a tensor (its header, then its raw bytes) or a plain value (msgpack).

A value is ``None``, ``bool``, ``int`` (64-bit), ``float``, ``str``, ``bytes`` and lists and dicts of those;
what comes back equals what went in, except that tuples come back as lists, numpy scalars as Python
numbers, and numpy arrays nested inside a value as (nested) lists. Dict keys may be strings, bytes or
ints. The rows' headers (layout, checks, caches) are ``row_header.py``.

Nothing here ever unpickles: a shared Redis is an attack surface, so decoding accepts only this
layout and checks every field against the bytes actually present before touching the payload.

What a reader gets: plain CPU tensors that are writable and own their memory. The bytes a Redis client
returns are immutable, so each read copies them once, one column at a time, into a fresh buffer that
the column's tensors view (see ``decode_rows``); writing into a returned tensor corrupts nothing: no
other row, nothing in Redis, nothing another call returned. The decoder never hands torch a read-only
buffer, so torch's "The given buffer is not writable" warning, which it shows once per process, is
left to the user's own calls, and nothing here filters warnings. A column wanted as one tensor is
decoded straight into it by ``stacking.py``, with the same checks (``row_header.tensor_layout``).

What a writer may pass: torch tensors of a dtype in ``DTYPES`` (bool; uint8 to uint64, int8 to int64;
float8_e4m3fn, float8_e5m2, float16, bfloat16, float32, float64; complex64, complex128), on any device,
strided or not (lazy negation and conjugation are resolved), and numpy arrays of those dtypes numpy has
(all but bfloat16 and the float8s) in any byte order and memory layout (copied first where torch cannot
view them). Anything else (sparse, nested, meta, quantized, mkldnn, other dtypes such as complex32 or
the float8 "fnuz" variants, data-less subclasses such as FakeTensor, tensors whose storage was freed,
numpy object, string, structured, datetime or extended-precision arrays, scalars) raises
``InvalidExperienceError`` naming what is wrong; no torch or numpy error escapes. A value cannot hold
complex numbers (msgpack has none): a complex array is stored as a row of its own.

``encode_column`` turns one column of a put into its rows' bytes; errors name the column.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from broker.connection.framing import LARGE, Framed
from broker.data import row_header as header
from broker.data.row_count import row_count_error
from broker.data.row_header import DTYPES, KIND_TENSOR, KIND_VALUE, KIND_VERSION, MAGIC, VERSION, dtype_name
from broker.errors import DecodeError, InvalidExperienceError


def _numpy_as(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype to view a tensor of ``dtype`` as before ``.numpy()``: None where numpy has ``dtype``; for one
    it lacks (bfloat16, the float8s; uint16 and wider on a torch that cannot hand them to numpy), the integer
    dtype of the same size. A view reinterprets the bits, with no arithmetic: the bytes stored are the same."""
    try:
        torch.zeros(1, dtype=dtype).numpy()
        return None
    except (TypeError, RuntimeError):  # "Got unsupported ScalarType ..."
        size = torch.empty((), dtype=dtype).element_size()
        return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size]


#: Dtypes a tensor is viewed as before ``.numpy()`` (see ``_numpy_as``); dtypes numpy has are not listed.
_NUMPY_AS = {dtype: view for dtype in DTYPES.values() if (view := _numpy_as(dtype)) is not None}

# Decoded tensors are views on a writable buffer of their own (see decode_rows), never on the
# immutable bytes the Redis client returned: torch warns once per process about views on read-only
# buffers, and a filter silencing it would also silence it for the user's own unrelated calls.


def _dense_cpu(tensor: object) -> torch.Tensor:
    """``tensor`` as a plain strided CPU tensor the codec can copy, or InvalidExperienceError saying why not.

    Torch has many kinds of tensors that hold no plain array of numbers (meta, sparse, nested,
    quantized) and raises its own errors, of several types, when asked for their bytes; they are named
    here instead. Lazy views (negated, conjugated) are materialized.
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidExperienceError(f"expected a torch.Tensor, got {_type_name(tensor)}")
    if tensor.is_nested:
        raise InvalidExperienceError("a nested tensor cannot be stored; put its rows as a list of tensors")
    if tensor.layout != torch.strided:
        raise InvalidExperienceError(f"a {tensor.layout} tensor cannot be stored; convert it with .to_dense()")
    if tensor.device.type == "meta":
        raise InvalidExperienceError("a tensor on the meta device holds no data to store")
    dtype_name(tensor.dtype)  # quantized dtypes, and others the broker does not store, end here
    try:
        _check_storage(tensor)
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        if tensor.requires_grad:
            tensor = tensor.detach()
        if tensor.is_conj():
            tensor = tensor.resolve_conj()
        if tensor.is_neg():
            tensor = tensor.resolve_neg()
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
    except InvalidExperienceError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:  # a kind of tensor not foreseen above
        raise InvalidExperienceError(f"cannot store this {_type_name(tensor)} ({type(exc).__name__}: {exc})") from None
    return tensor


def _check_storage(tensor: torch.Tensor) -> None:
    """Refuse a strided tensor whose elements reach past the end of its storage.

    That is what a tensor looks like after ``tensor.untyped_storage().resize_(0)`` (FSDP frees sharded
    parameters so): torch keeps its shape, and ``.numpy()`` then hands out whatever memory lies there.
    """
    if not tensor.numel():
        return
    last = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    needed, held = (last + 1) * tensor.element_size(), tensor.untyped_storage().nbytes()
    if needed > held:
        raise InvalidExperienceError(
            f"the tensor's storage holds {held} bytes, its shape needs {needed} (was the storage freed or resized?)"
        )


def _type_name(value: Any) -> str:
    """``int`` for builtins, ``numpy.float32`` or ``torch._subclasses.fake_tensor.FakeTensor`` otherwise."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def encode(tensor: torch.Tensor) -> bytes:
    """Encode one tensor. The payload is copied exactly once, into the bytes handed to Redis."""
    tensor = _dense_cpu(tensor)
    prefix = header.encoded_prefix(tensor.dtype, tuple(tensor.shape))
    if tensor.numel() == 0:
        return prefix
    # numpy has no bfloat16 nor float8: reinterpret their bits as integers (a view, no arithmetic).
    view = _NUMPY_AS.get(tensor.dtype)
    try:
        array = (tensor if view is None else tensor.view(view)).numpy()
    except (RuntimeError, TypeError, ValueError) as exc:  # subclasses without data (FakeTensor, ...)
        raise InvalidExperienceError(f"cannot store a {_type_name(tensor)} ({exc})") from None
    # Bytes, not a memoryview: redis-py would copy a memoryview into bytes once more before sending.
    # join reads the contiguous array through the buffer protocol: the payload's one copy.
    return b"".join((prefix, array))  # type: ignore[arg-type]  # an ndarray is a buffer; numpy's stubs say so only on 3.12+


def is_tensor_like(row: Any) -> bool:
    """Whether ``row`` is stored as a tensor: a torch tensor or a numeric numpy array."""
    return isinstance(row, torch.Tensor) or (isinstance(row, np.ndarray) and row.dtype.kind in "biufc")


def encode_row(row: Any) -> bytes:
    """Encode one row: a tensor (or numeric numpy array) as a tensor, anything else as a value."""
    return encode(as_tensor(row)) if is_tensor_like(row) else encode_value(row)


def encode_value(value: Any) -> bytes:
    """Encode a plain value (see the module docstring for what is accepted and what changes)."""
    try:
        packed: bytes = msgpack.packb(value, use_bin_type=True, default=_plain, datetime=False)
    except InvalidExperienceError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:  # msgpack's own: int out of range, nesting too deep
        raise InvalidExperienceError(f"cannot store this {_type_name(value)} as a value ({exc})") from None
    if len(packed) > 0xFFFFFFFF:
        raise InvalidExperienceError(f"a value of {len(packed):,} bytes is too large (4 GiB at most)")
    try:  # what a reader could not decode is refused now, not found later: e.g. a tuple as a dict key
        _unpack(packed)
    except Exception as exc:
        raise InvalidExperienceError(
            f"this {_type_name(value)} would not read back ({type(exc).__name__}: {exc})"
        ) from None
    return header.PREFIX.pack(MAGIC, KIND_VERSION, KIND_VALUE, len(packed)) + packed


def _plain(obj: Any) -> Any:
    """msgpack's fallback for types it does not know: numpy scalars and arrays become Python ones."""
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind == "c":  # (as a row, a complex array is a tensor)
        raise InvalidExperienceError(
            f"a numpy {'array' if isinstance(obj, np.ndarray) else 'scalar'} of dtype {obj.dtype} cannot be stored "
            "in a value (msgpack has no complex numbers); put complex arrays in a column of their own, one per row"
        )
    if isinstance(obj, np.generic) and obj.dtype.kind in "biufUS":
        return obj.item()
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufUSO":
        return obj.tolist()
    if isinstance(obj, (np.ndarray, np.generic)):
        raise InvalidExperienceError(
            f"a numpy array of dtype {obj.dtype} cannot be stored; use one of {', '.join(DTYPES)}"
        )
    if isinstance(obj, int):
        raise InvalidExperienceError(f"int {obj} is outside the 64-bit range a value can hold")
    if isinstance(obj, torch.Tensor):
        raise InvalidExperienceError(
            "a tensor nested inside a value cannot be stored; put it in a column of its own (one tensor per row)"
        )
    raise InvalidExperienceError(
        f"a {_type_name(obj)} cannot be stored in a value; use None, bool, int, float, str, bytes, "
        "and lists and dicts of those"
    )


def _refuse_ext(code: int, data: bytes) -> Any:
    raise DecodeError(f"msgpack extension type {code} (the broker writes none)")


def _unpack(packed: bytes | memoryview) -> Any:
    """A value's msgpack, refusing every extension type. msgpack decodes its Timestamp (type -1) itself,
    without asking ``ext_hook``, so extensions are refused by size (``max_ext_len=0``), and only then
    unpacked again to name the type."""
    try:
        return msgpack.unpackb(packed, raw=False, strict_map_key=False, ext_hook=_refuse_ext, max_ext_len=0)
    except ValueError as exc:
        if "max_ext_len" not in str(exc):
            raise
    msgpack.unpackb(packed, raw=False, strict_map_key=False, ext_hook=_refuse_ext)  # names any type but -1
    raise DecodeError("msgpack extension type -1, a Timestamp (the broker writes none)")


def _decode_value(data: bytes | bytearray | memoryview, length: int, size: int, where: Any) -> Any:
    if 8 + length != size:
        raise DecodeError(f"{where}: value of {length} bytes declared, {size - 8} stored")
    try:
        return _unpack(memoryview(data)[8:])
    except Exception as exc:  # msgpack raises several unrelated types for garbage; a list as a dict key is a TypeError
        raise DecodeError(f"{where}: unreadable value ({type(exc).__name__}: {exc})") from None


def encode_rows(rows: Sequence[Any], *, framed: bool = False) -> list[bytes | Framed]:
    """Encode many tensors: the same bytes as ``encode`` on each, with the per-row work cut short.

    A put carries thousands of rows, and ``encode``'s checks cost more than the copy of a small row.
    Here a CPU tensor that numpy can view is joined straight to its cached prefix; anything else
    (non-contiguous, on a GPU, numpy, wrong type) falls back to ``encode``, which also names what is
    wrong. The join reads ``array.nbytes`` from the row's first element, so the row's storage must hold
    that many bytes from there (``.numpy()`` does not check; see ``_check_storage``). With ``framed``,
    a row of at least ``framing.LARGE`` bytes is not joined but ``Framed``: its prefix, then a view of
    the tensor's own storage, sent from there (see ``connection/framing.py``).
    """
    prefixes, join, views = header.ENCODED_PREFIXES, b"".join, _NUMPY_AS
    out: list[bytes | Framed] = []
    append = out.append
    for row in rows:  # each attribute read once: a tenth of a small row's cost went to reading them again
        try:
            dtype = row.dtype  # an AttributeError for what is not a tensor, as .numpy() below
            view = views.get(dtype)
            array = (row if view is None else row.view(view)).numpy()
            prefix = prefixes[dtype, array.shape]
            nbytes = array.nbytes
            if row.untyped_storage().nbytes() < row.storage_offset() * array.itemsize + nbytes:
                raise TypeError  # encode names it
            if framed and nbytes >= LARGE:  # cast: a TypeError if not contiguous, as join's
                append(Framed((prefix, memoryview(array).cast("B")), len(prefix) + nbytes))
            else:
                append(join((prefix, array)))
        except (AttributeError, KeyError, RuntimeError, TypeError):
            # TypeError also covers a non-contiguous array, which join refuses: encode makes it contiguous.
            try:
                append(encode_row(row))
            except InvalidExperienceError as exc:
                raise InvalidExperienceError(f"row {len(out)}: {exc}") from None
    return out


def encode_stacked(tensor: torch.Tensor, *, framed: bool = False) -> list[bytes | Framed]:
    """Encode each slice ``tensor[i]`` along dim 0, as ``encode`` would, without splitting the tensor;
    with ``framed``, rows of at least ``framing.LARGE`` bytes as views of the tensor (see ``encode_rows``)."""
    tensor = _dense_cpu(tensor)
    if tensor.dim() == 0:
        raise InvalidExperienceError("a stacked tensor needs a row dimension, got a 0-d tensor")
    try:
        view = _NUMPY_AS.get(tensor.dtype)
        array = (tensor if view is None else tensor.view(view)).numpy()
        flat = memoryview(array).cast("B")  # type: ignore[arg-type]  # (as in encode) refuses non-contiguous arrays
        prefix = header.ENCODED_PREFIXES[tensor.dtype, array.shape[1:]]
    except (KeyError, RuntimeError, TypeError):
        return encode_rows(tensor.unbind(0), framed=framed)  # caches the prefix; GPU and strided tensors land here
    size = flat.nbytes // len(array) if len(array) else 0
    if framed and size >= LARGE:
        total = len(prefix) + size
        return [Framed((prefix, flat[i * size : (i + 1) * size]), total) for i in range(len(array))]
    join = b"".join
    return [join((prefix, flat[i * size : (i + 1) * size])) for i in range(len(array))]


def as_tensor(value: Any) -> Any:
    """A numpy array becomes a tensor; anything else is left for ``encode`` to judge.

    Without a copy where torch can view the array; arrays in another byte order or with negative
    strides (``a[::-1]``), which torch cannot view, are copied into native, contiguous ones first, and
    read-only arrays are copied rather than viewed (torch warns about those).
    """
    if not isinstance(value, np.ndarray):
        return value
    dtype = value.dtype
    if dtype.kind not in "biufc" or dtype.type in _NO_TORCH_DTYPE:  # object, str, structured, datetime, ...
        raise InvalidExperienceError(f"a numpy array of dtype {dtype} cannot be stored; use one of {', '.join(DTYPES)}")
    if dtype.byteorder not in "=|":  # "|": byte order does not apply
        value = value.astype(dtype.newbyteorder("="))
    if any(stride < 0 for stride in value.strides):
        value = np.ascontiguousarray(value)
    if not value.flags.writeable:  # torch would warn (once per process, for the user's calls too)
        value = value.copy()
    try:
        return torch.from_numpy(value)
    except (TypeError, ValueError, RuntimeError):  # a numeric dtype torch has no match for
        raise InvalidExperienceError(
            f"a numpy array of dtype {dtype} cannot be stored; use one of {', '.join(DTYPES)}"
        ) from None


#: numpy's numeric types that torch.from_numpy refuses (extended precision, whatever its size here).
_NO_TORCH_DTYPE = frozenset({np.longdouble, np.clongdouble})


_is_bytes = functools.partial(operator.is_, bytes)


def decode_rows(values: Sequence[Any], *, where: str, fields: Sequence[str]) -> list[Any]:
    """Decode many rows, as ``decode`` on each; ``where`` is their key and ``fields`` their fields.

    What the caller gets: one CPU tensor per value, writable, owning its memory. The values (``bytes``,
    as a Redis client returns them) are first copied, in one pass, into one fresh writable buffer, and
    each tensor views its own disjoint slice of it: one copy per column per read. Writing into a
    returned tensor changes no other row, not ``values``, nothing in Redis, nothing another call
    returned. Keeping one row alive keeps that whole buffer alive. Within a column whose rows share a
    dtype, each row's data is aligned to its element size (not to 16 bytes, as in the stored layout).
    Values that are not all ``bytes`` are decoded one by one by ``decode`` (which views a bytearray).

    A value whose first bytes equal the full prefix of one already decoded (magic, version, header and
    padding, all checked then) needs only its payload size checked. Rows of a column share a few
    prefixes, so nearly every row takes this path; the rest, and every error, go through ``decode``.
    """
    if not all(map(_is_bytes, map(type, values))):  # per row in C: a read decodes thousands
        return [decode(v, where=where, field=f) for v, f in zip(values, fields)]  # names the bad value
    buffer = bytearray().join(values)
    view = memoryview(buffer)
    known, frombuffer = header.DECODED_PREFIXES, torch.frombuffer
    out: list[Any] = []
    start = 32  # prefix length of the last row; the common one for 1-d tensors
    at = 0
    for value, field in zip(values, fields):
        size = len(value)
        hit = known.get(value[:start])
        if hit is None or size != hit[0]:
            out.append(decode(view[at : at + size], where=where, field=field))
            if value[2] == VERSION or value[3] == KIND_TENSOR:  # a tensor: remember its prefix
                start = header.remember_prefix(value)
        else:
            shape = hit[2]
            # A view of the payload, not count= and offset=: torch parses fewer keywords (a tenth of a row's cost).
            tensor = frombuffer(view[at + start : at + size], dtype=hit[1])
            out.append(tensor if len(shape) == 1 else tensor.reshape(shape))
        at += size
    return out


def decode(data: bytes | bytearray | memoryview, *, where: str = "value", field: str | None = None) -> Any:
    """Decode one row, a tensor or a value; ``where`` (a key) and ``field`` name its place in errors.

    What the caller gets: a writable CPU tensor. Given ``bytes`` (or a read-only memoryview), it owns
    its memory, a fresh copy of ``data``: writing into it changes nothing else. Given a writable buffer
    (a bytearray, a writable memoryview), it is a view on that buffer, with no copy: writing into one
    writes into the other. A memoryview of any format, shape or strides is read as its bytes in C order.
    """
    if field is not None:  # formatted here, not by the caller: a batch decodes thousands of rows
        where = header.Place(where, field)  # type: ignore[assignment]
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"{where}: expected bytes, got {type(data).__name__}")
    if isinstance(data, memoryview) and (data.format != "B" or data.ndim != 1 or not data.c_contiguous):
        # Slicing and struct would count items or rows, not bytes, or refuse a strided view outright.
        data = data.cast("B") if data.c_contiguous else bytearray(data)
    size = len(data) if not isinstance(data, memoryview) else data.nbytes
    checked = header.checked(data, size, where)
    if isinstance(checked, int):
        return _decode_value(data, checked, size, where)
    dtype, shape, start, expected = checked
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    if isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly):
        data = bytearray(data)
    out = torch.frombuffer(data, dtype=dtype, offset=start)
    return out if len(shape) == 1 else out.reshape(shape)


def encode_column(column: str, value: Any, count: int, *, framed: bool = False) -> list[bytes | Framed]:
    """The ``count`` rows of one column of a put, encoded; errors name the column. With ``framed``, large
    tensor rows come as ``Framed`` views of the tensors (for a client that sends them uncopied: ``frames``).

    ``value`` is a stacked tensor or numeric numpy array (split along dim 0), a numpy array of objects
    or strings (verl's ``non_tensor_batch``: one value per element along dim 0), or a list of rows, each
    a tensor or a plain value (see the module docstring).
    """
    if isinstance(value, np.ndarray) and value.dtype.kind in "OUS":
        if value.ndim == 0:
            raise InvalidExperienceError(f"column {column!r}: a 0-d numpy array has no rows; wrap it in a list")
        value = list(value)
    try:
        value = as_tensor(value)
    except InvalidExperienceError as exc:
        raise InvalidExperienceError(f"column {column!r}: {exc}") from None
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise InvalidExperienceError(f"column {column!r}: a stacked tensor needs a row dimension, got a 0-d tensor")
        encode: Callable[..., list[bytes | Framed]] = encode_stacked
    elif not isinstance(value, (list, tuple)):
        raise InvalidExperienceError(
            f"column {column!r}: expected a tensor, a numpy array or a list of rows, got {type(value).__name__}"
        )
    else:
        encode = encode_rows
    wrong = row_count_error(column, value, count)
    if wrong is not None:
        raise wrong
    try:
        return encode(value, framed=framed)
    except InvalidExperienceError as exc:
        raise InvalidExperienceError(f"column {column!r}, {exc}") from None
