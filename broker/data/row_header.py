"""The header of one stored row: its layout, its checks, and the caches that make both one dict lookup a row.

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

Every field is checked against the bytes actually present before a payload is touched (``checked``): a
shared Redis is an attack surface. Turning tensors and values into rows and back is ``codec.py``.
"""

from __future__ import annotations

import math
import struct
import sys
from typing import Any

import msgpack
import numpy as np
import torch

from broker.errors import DecodeError, InvalidExperienceError

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for is little-endian
    raise ImportError("the broker's tensor format is little-endian; this host is big-endian")

MAGIC = b"TD"
VERSION = 1
#: Version of rows that carry a kind byte: the one every value is written with.
KIND_VERSION = 2
KIND_TENSOR, KIND_VALUE = 0, 1
PREFIX = struct.Struct("<2sBBI")
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
NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ITEMSIZE = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a torch dtype, or InvalidExperienceError if the broker does not store it."""
    try:
        return NAMES[dtype]
    except KeyError:
        raise InvalidExperienceError(
            f"dtype {dtype} is not supported; use one of {', '.join(DTYPES)}"
        ) from None


def checked(data: Any, size: int, where: Any) -> tuple[torch.dtype, tuple[int, ...], int, int] | int:
    """Every check ``decode`` makes of one row's ``size`` bytes: a tensor's (dtype, shape, payload offset,
    payload bytes), its bool payload included; for a value, its declared length (the msgpack is not read)."""
    if size < PREFIX.size:
        raise DecodeError(f"{where}: {size} bytes is too short for an encoded tensor")
    magic, version, kind, header_len = PREFIX.unpack_from(data, 0)
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
            f"{where}: shape {shape} of {NAMES[dtype]} needs {expected} payload bytes, found {max(size - start, 0)}"
        )
    if expected and dtype is torch.bool and np.frombuffer(data, dtype=np.uint8, offset=start).max() > 1:
        raise DecodeError(f"{where}: bool payload holds bytes other than 0 and 1")
    return known


def declared_length(data: bytes | bytearray | memoryview) -> int | None:
    """The length of the whole row whose first bytes ``data`` are, as its prefix declares it (a tensor's
    header and payload, a value's msgpack); None when those bytes declare nothing readable (too short,
    another magic or version, a bad header): ``decode`` then says what is wrong. Reads only the prefix."""
    if len(data) >= PREFIX.size and data[2] == KIND_VERSION and data[3] == KIND_VALUE and data[:2] == MAGIC:
        return 8 + int(PREFIX.unpack_from(data, 0)[3])
    layout = prefix_layout(data)
    return None if layout is None else layout[3]


def prefix_layout(data: bytes | bytearray | memoryview) -> tuple[int, torch.dtype, tuple[int, ...], int] | None:
    """(payload offset, dtype, shape, whole length) that the prefix of a tensor row declares, whatever follows
    it (a cut row's head: data/fit.py); None for a value or a prefix that is not readable. Checks the
    prefix as ``decode`` does, and nothing of the payload."""
    if len(data) < PREFIX.size:
        return None
    magic, version, kind, header_len = PREFIX.unpack_from(data, 0)
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
    hit = DECODED_PREFIXES.get(key if type(key) is bytes else bytes(key))
    if hit is not None and len(value) == hit[0]:
        return guess, hit[1], hit[2]
    found = checked(value, len(value), Place(where, field))
    if isinstance(found, int):
        return None
    return remember_prefix(value), found[0], found[1]


# A batch holds thousands of rows but few distinct (dtype, shape) pairs: prefixes and parsed headers are
# cached so that per-row work is a dict lookup. Both caches are bounded, since shapes vary with lengths.
_CACHE_LIMIT = 1 << 16
ENCODED_PREFIXES: dict[tuple[torch.dtype, tuple[int, ...]], bytes] = {}
_DECODED_HEADERS: dict[bytes, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
#: Whole prefixes (through the padding) of values ``decode`` accepted -> (length of the whole value,
#: dtype, shape, number of elements). Empty and bool tensors are not listed: they need ``decode``.
DECODED_PREFIXES: dict[bytes, tuple[int, torch.dtype, tuple[int, ...], int]] = {}


def encoded_prefix(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """Everything before the payload: fixed prefix, msgpack header and padding."""
    key = (dtype, shape)
    prefix = ENCODED_PREFIXES.get(key)
    if prefix is None:
        header = msgpack.packb([NAMES[dtype], list(shape)])
        start = _payload_offset(len(header))
        prefix = PREFIX.pack(MAGIC, VERSION, 0, len(header)) + header + bytes(start - 8 - len(header))
        if len(ENCODED_PREFIXES) >= _CACHE_LIMIT:
            ENCODED_PREFIXES.clear()
        ENCODED_PREFIXES[key] = prefix
    return prefix


def remember_prefix(value: bytes | bytearray) -> int:
    """Cache the prefix of a value ``decode`` just accepted; returns the prefix's length."""
    header = bytes(value[8 : 8 + PREFIX.unpack_from(value, 0)[3]])
    # Another thread may have emptied the cache since decode filled it.
    dtype, shape, start, expected = _DECODED_HEADERS.get(header) or _parse_header(header, "value")
    if expected == 0 or dtype is torch.bool:  # an empty view, or a payload to check for bytes other than 0/1
        return start
    if len(DECODED_PREFIXES) >= _CACHE_LIMIT:
        DECODED_PREFIXES.clear()
    DECODED_PREFIXES[bytes(value[:start])] = (start + expected, dtype, shape, math.prod(shape))
    return start


def _parse_header(header: bytes, where: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """Validated (dtype, shape, payload offset, payload bytes) of a header seen for the first time."""
    name, shape = _read_header(memoryview(header), where)
    parsed = (DTYPES[name], shape, _payload_offset(len(header)), math.prod(shape) * _ITEMSIZE[name])
    if len(_DECODED_HEADERS) >= _CACHE_LIMIT:
        _DECODED_HEADERS.clear()
    _DECODED_HEADERS[header] = parsed
    return parsed


class Place:
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
