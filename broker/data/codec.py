"""Wire format of one row: a tensor (a small msgpack header, then its raw bytes) or a plain value (msgpack).

Layout of one encoded tensor::

    offset 0   b"TD"            magic
    offset 2   u8  version      (1, or 2)
    offset 3   u8  kind         0 = tensor (in version 1, a reserved 0)
    offset 4   u32 header_len   little-endian, length of the msgpack header
    offset 8   msgpack          [dtype name, [dim, ...]]
    ...        zero padding     so that the payload starts at a multiple of 16
    payload    prod(shape) * itemsize raw bytes, little-endian, C order

Layout of one encoded value (a row that is not a tensor: a label, a dict of metadata, ...)::

    offset 0   b"TD"            magic
    offset 2   u8  version      (2)
    offset 3   u8  kind         1 = value
    offset 4   u32 length       little-endian, length of the msgpack that follows
    offset 8   msgpack          the value

Tensors are still written as version 1, so brokers from before values existed read them; a value is
version 2, which such a broker refuses by name ("tensor format version 2") rather than misreading.
A value is ``None``, ``bool``, ``int`` (64-bit), ``float``, ``str``, ``bytes`` and lists and dicts
of those; what comes back equals what went in, except that tuples come back as lists, numpy scalars
as Python numbers, and numpy arrays nested inside a value as (nested) lists. Dict keys may be
strings, bytes or ints.

Nothing here ever unpickles: a shared Redis is an attack surface, so decoding accepts only this
layout and checks every field against the bytes actually present before touching the payload.

What a reader gets: plain CPU tensors that are writable and own their memory. The bytes a Redis client
returns are immutable, so each read copies them once, one column at a time, into a fresh buffer that
the column's tensors view (see ``decode_rows``); writing into a returned tensor corrupts nothing: no
other row, nothing in Redis, nothing another call returned. The decoder never hands torch a read-only
buffer, so torch's "The given buffer is not writable" warning, which it shows once per process, is
left to the user's own calls, and nothing here filters warnings. A column wanted as one tensor is
decoded straight into it by ``stacking.py``, with the checks here (``tensor_layout``).

What a writer may pass: torch tensors of a dtype in ``DTYPES`` (bool; uint8 to uint64, int8 to int64;
float8_e4m3fn, float8_e5m2, float16, bfloat16, float32, float64; complex64, complex128), on any device,
strided or not (lazy negation and conjugation are resolved), and numpy arrays of those dtypes numpy has
(all but bfloat16 and the float8s) in any byte order and memory layout (copied first where torch cannot
view them). Anything else (sparse, nested, meta, quantized, mkldnn, other dtypes such as complex32 or
the float8 "fnuz" variants, data-less subclasses such as FakeTensor, tensors whose storage was freed,
numpy object, string, structured, datetime or extended-precision arrays, scalars) raises
``InvalidExperienceError`` naming what is wrong; no torch or numpy error escapes. A value cannot hold
complex numbers (msgpack has none): a complex array is stored as a row of its own.
"""

from __future__ import annotations

import math
import struct
import sys
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import torch

from broker.connection.framing import LARGE, Framed
from broker.errors import DecodeError, InvalidExperienceError

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("the broker's tensor format is little-endian; this host is big-endian")

MAGIC = b"TD"
VERSION = 1
#: Version of rows that carry a kind byte: the one every value is written with.
KIND_VERSION = 2
KIND_TENSOR, KIND_VALUE = 0, 1
_PREFIX = struct.Struct("<2sBBI")
_ALIGN = 16
_MAX_NDIM = 64

#: Supported dtypes by wire name. Wire names are ours, so a torch rename never changes stored data.
#: uint16, uint32 and uint64 exist from torch 2.3 on: with an older torch they are left out.
DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in {
        "bool": torch.bool,
        "uint8": torch.uint8,
        "uint16": getattr(torch, "uint16", None),
        "uint32": getattr(torch, "uint32", None),
        "uint64": getattr(torch, "uint64", None),
        "int8": torch.int8,
        "int16": torch.int16,
        "int32": torch.int32,
        "int64": torch.int64,
        "float8_e4m3fn": torch.float8_e4m3fn,
        "float8_e5m2": torch.float8_e5m2,
        "float16": torch.float16,
        "bfloat16": torch.bfloat16,
        "float32": torch.float32,
        "float64": torch.float64,
        "complex64": torch.complex64,
        "complex128": torch.complex128,
    }.items()
    if isinstance(dtype, torch.dtype)
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ITEMSIZE = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in DTYPES.items()}


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


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype, or InvalidExperienceError if the broker does not store it."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise InvalidExperienceError(
            f"dtype {dtype} is not supported; use one of {', '.join(DTYPES)}"
        ) from None


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
    prefix = _encoded_prefix(tensor.dtype, tuple(tensor.shape))
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
    return _PREFIX.pack(MAGIC, KIND_VERSION, KIND_VALUE, len(packed)) + packed


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
    prefixes, join, views = _ENCODED_PREFIXES, b"".join, _NUMPY_AS
    out: list[bytes | Framed] = []
    for i, row in enumerate(rows):
        try:
            view = views.get(row.dtype)  # an AttributeError for what is not a tensor, as .numpy() below
            array = (row if view is None else row.view(view)).numpy()
            prefix = prefixes[row.dtype, array.shape]
            if row.untyped_storage().nbytes() < row.storage_offset() * array.itemsize + array.nbytes:
                raise TypeError  # encode names it
            if framed and array.nbytes >= LARGE:  # cast: a TypeError if not contiguous, as join's
                out.append(Framed((prefix, memoryview(array).cast("B")), len(prefix) + array.nbytes))
            else:
                out.append(join((prefix, array)))
        except (AttributeError, KeyError, RuntimeError, TypeError):
            # TypeError also covers a non-contiguous array, which join refuses: encode makes it contiguous.
            try:
                out.append(encode_row(row))
            except InvalidExperienceError as exc:
                raise InvalidExperienceError(f"row {i}: {exc}") from None
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
        prefix = _ENCODED_PREFIXES[tensor.dtype, array.shape[1:]]
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
    if not all(type(v) is bytes for v in values):
        return [decode(v, where=where, field=f) for v, f in zip(values, fields)]  # names the bad value
    buffer = bytearray().join(values)
    view = memoryview(buffer)
    known, frombuffer = _DECODED_PREFIXES, torch.frombuffer
    out: list[Any] = []
    start = 32  # prefix length of the last row; the common one for 1-d tensors
    at = 0
    for value, field in zip(values, fields):
        size = len(value)
        hit = known.get(value[:start])
        if hit is None or size != hit[0]:
            out.append(decode(view[at : at + size], where=where, field=field))
            if value[2] == VERSION or value[3] == KIND_TENSOR:  # a tensor: remember its prefix
                start = _remember_prefix(value)
        else:
            _, dtype, shape, count = hit
            tensor = frombuffer(buffer, dtype=dtype, count=count, offset=at + start)
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
        where = _Place(where, field)  # type: ignore[assignment]
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"{where}: expected bytes, got {type(data).__name__}")
    if isinstance(data, memoryview) and (data.format != "B" or data.ndim != 1 or not data.c_contiguous):
        # Slicing and struct would count items or rows, not bytes, or refuse a strided view outright.
        data = data.cast("B") if data.c_contiguous else bytearray(data)
    size = len(data) if not isinstance(data, memoryview) else data.nbytes
    checked = _checked(data, size, where)
    if isinstance(checked, int):
        return _decode_value(data, checked, size, where)
    dtype, shape, start, expected = checked
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    if isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly):
        data = bytearray(data)
    out = torch.frombuffer(data, dtype=dtype, offset=start)
    return out if len(shape) == 1 else out.reshape(shape)


def _checked(data: Any, size: int, where: Any) -> tuple[torch.dtype, tuple[int, ...], int, int] | int:
    """Every check ``decode`` makes of one row's ``size`` bytes: a tensor's (dtype, shape, payload offset,
    payload bytes), its bool payload included; for a value, its declared length (the msgpack is not read)."""
    if size < _PREFIX.size:
        raise DecodeError(f"{where}: {size} bytes is too short for an encoded tensor")
    magic, version, kind, header_len = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise DecodeError(f"{where}: not an encoded tensor (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version not in (VERSION, KIND_VERSION):
        raise DecodeError(f"{where}: tensor format version {version}, this broker reads {VERSION} and {KIND_VERSION}")
    if version == KIND_VERSION and kind != KIND_TENSOR:
        if kind != KIND_VALUE:
            raise DecodeError(f"{where}: unknown kind {kind} of row (0 is a tensor, 1 a value)")
        return int(header_len)
    if 8 + header_len > size:
        raise DecodeError(f"{where}: header length {header_len} runs past the {size} bytes stored")
    header = bytes(data[8 : 8 + header_len])
    known = _DECODED_HEADERS.get(header)
    if known is None:
        known = _parse_header(header, where)
    dtype, shape, start, expected = known
    if size - start != expected:
        raise DecodeError(
            f"{where}: shape {shape} of {_NAMES[dtype]} needs {expected} payload bytes, found {max(size - start, 0)}"
        )
    if expected and dtype is torch.bool and np.frombuffer(data, dtype=np.uint8, offset=start).max() > 1:
        raise DecodeError(f"{where}: bool payload holds bytes other than 0 and 1")
    return known


def declared_length(data: bytes | bytearray | memoryview) -> int | None:
    """The length of the whole row whose first bytes ``data`` are, as its prefix declares it (a tensor's
    header and payload, a value's msgpack); None when those bytes declare nothing readable (too short,
    another magic or version, a bad header): ``decode`` then says what is wrong. Reads only the prefix."""
    if len(data) >= _PREFIX.size and data[2] == KIND_VERSION and data[3] == KIND_VALUE and data[:2] == MAGIC:
        return 8 + int(_PREFIX.unpack_from(data, 0)[3])
    layout = prefix_layout(data)
    return None if layout is None else layout[3]


def prefix_layout(data: bytes | bytearray | memoryview) -> tuple[int, torch.dtype, tuple[int, ...], int] | None:
    """(payload offset, dtype, shape, whole length) that the prefix of a tensor row declares, whatever follows
    it (a cut row's head: data/fit.py); None for a value or a prefix that is not readable. Checks the
    prefix as ``decode`` does, and nothing of the payload."""
    if len(data) < _PREFIX.size:
        return None
    magic, version, kind, header_len = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC or version not in (VERSION, KIND_VERSION) or (version == KIND_VERSION and kind != KIND_TENSOR):
        return None
    if 8 + header_len > len(data):
        return None
    header = bytes(data[8 : 8 + header_len])
    try:
        dtype, shape, start, expected = _DECODED_HEADERS.get(header) or _parse_header(header, "value")
    except DecodeError:
        return None
    return start, dtype, shape, start + expected


def tensor_layout(
    value: bytes | bytearray, guess: int, where: str, field: str,
) -> tuple[int, torch.dtype, tuple[int, ...]] | None:
    """(payload offset, dtype, shape) of one encoded tensor, after every check ``decode`` makes (a bool
    payload's bytes too), or None for a value (a row that is not a tensor; its msgpack is not read here).
    ``guess`` is the prefix length to look up among the prefixes already accepted (the last row's)."""
    key = value[:guess]
    hit = _DECODED_PREFIXES.get(key if type(key) is bytes else bytes(key))
    if hit is not None and len(value) == hit[0]:
        return guess, hit[1], hit[2]
    checked = _checked(value, len(value), _Place(where, field))
    if isinstance(checked, int):
        return None
    return _remember_prefix(value), checked[0], checked[1]


# A batch holds thousands of rows but few distinct (dtype, shape) pairs: prefixes and parsed headers are
# cached so that per-row work is a dict lookup. Both caches are bounded, since shapes vary with lengths.
_CACHE_LIMIT = 1 << 16
_ENCODED_PREFIXES: dict[tuple[torch.dtype, tuple[int, ...]], bytes] = {}
_DECODED_HEADERS: dict[bytes, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
#: Whole prefixes (through the padding) of values ``decode`` accepted -> (length of the whole value,
#: dtype, shape, number of elements). Empty and bool tensors are not listed: they need ``decode``.
_DECODED_PREFIXES: dict[bytes, tuple[int, torch.dtype, tuple[int, ...], int]] = {}


def _encoded_prefix(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """Everything before the payload: fixed prefix, msgpack header and padding."""
    key = (dtype, shape)
    prefix = _ENCODED_PREFIXES.get(key)
    if prefix is None:
        header = msgpack.packb([_NAMES[dtype], list(shape)])
        start = _payload_offset(len(header))
        prefix = _PREFIX.pack(MAGIC, VERSION, 0, len(header)) + header + bytes(start - 8 - len(header))
        if len(_ENCODED_PREFIXES) >= _CACHE_LIMIT:
            _ENCODED_PREFIXES.clear()
        _ENCODED_PREFIXES[key] = prefix
    return prefix


def _remember_prefix(value: bytes | bytearray) -> int:
    """Cache the prefix of a value ``decode`` just accepted; returns the prefix's length."""
    header = bytes(value[8 : 8 + _PREFIX.unpack_from(value, 0)[3]])
    # Another thread may have emptied the cache since decode filled it.
    dtype, shape, start, expected = _DECODED_HEADERS.get(header) or _parse_header(header, "value")
    if expected == 0 or dtype is torch.bool:  # an empty view, or a payload to check for bytes other than 0/1
        return start
    if len(_DECODED_PREFIXES) >= _CACHE_LIMIT:
        _DECODED_PREFIXES.clear()
    _DECODED_PREFIXES[bytes(value[:start])] = (start + expected, dtype, shape, math.prod(shape))
    return start


def _parse_header(header: bytes, where: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """Validated (dtype, shape, payload offset, payload bytes) of a header seen for the first time."""
    name, shape = _read_header(memoryview(header), where)
    parsed = (DTYPES[name], shape, _payload_offset(len(header)), math.prod(shape) * _ITEMSIZE[name])
    if len(_DECODED_HEADERS) >= _CACHE_LIMIT:
        _DECODED_HEADERS.clear()
    _DECODED_HEADERS[header] = parsed
    return parsed


class _Place:
    """``KEY field FIELD``, formatted only if an error message needs it."""

    __slots__ = ("key", "field")

    def __init__(self, key: str, field: str):
        self.key, self.field = key, field

    def __str__(self) -> str:
        return f"{self.key} field {self.field}"


def _payload_offset(header_len: int) -> int:
    return -(-(8 + header_len) // _ALIGN) * _ALIGN


def _read_header(raw: memoryview, where: str) -> tuple[str, tuple[int, ...]]:
    try:
        header = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, max_str_len=64, max_bin_len=0,
            max_array_len=_MAX_NDIM + 2, max_map_len=0, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise DecodeError(f"{where}: unreadable tensor header ({exc})") from None
    if not (isinstance(header, list) and len(header) == 2 and isinstance(header[1], list)):
        raise DecodeError(f"{where}: tensor header must be [dtype, shape], got {header!r:.80}")
    name, shape = header
    if not isinstance(name, str) or name not in DTYPES:
        raise DecodeError(f"{where}: unknown dtype {name!r:.40}")
    if len(shape) > _MAX_NDIM or not all(type(d) is int and 0 <= d < 2**62 for d in shape):
        raise DecodeError(f"{where}: invalid shape {shape!r:.80}")
    return name, tuple(shape)
