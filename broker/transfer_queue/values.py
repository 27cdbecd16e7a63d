"""How the TransferQueue slice keeps values in Redis: tags and field schemas as msgpack (never a pickle),
dtypes by name, and Redis bitmaps read as bool arrays.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
import torch

from broker.errors import InvalidExperienceError, SchemaError


def bitmap_bits(raw: bytes | None) -> np.ndarray:
    """A Redis bitmap as a bool array (bit 0 is the most significant bit of byte 0, as SETBIT numbers them)."""
    if not raw:
        return np.zeros(0, dtype=bool)
    return np.unpackbits(np.frombuffer(raw, dtype=np.uint8)).astype(bool)


def schema_out(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A field's schema as plain values: the dtype by name, the shape a list. Shapes of single rows
    (``per_sample_shapes``) belong to one put, not to the partition's field: they are not kept."""
    out = {k: v for k, v in schema.items() if k != "per_sample_shapes"}
    dtype = out.get("dtype")
    if dtype is not None:
        out["dtype"] = str(dtype)
    if out.get("shape") is not None:
        out["shape"] = [int(d) for d in out["shape"]]
    return out


def schema_in(stored: Any) -> dict[str, Any]:
    """The inverse of ``_schema_out``: torch dtypes and sizes again."""
    if not isinstance(stored, dict):
        raise SchemaError(f"stored field schema is not a map: {stored!r:.80}")
    out = dict(stored)
    dtype = out.get("dtype")
    if isinstance(dtype, str):
        found = getattr(torch, dtype.removeprefix("torch."), None)
        out["dtype"] = found if isinstance(found, torch.dtype) else dtype
    if isinstance(out.get("shape"), list):
        out["shape"] = torch.Size(out["shape"])
    return out


def pack(value: Any, what: str) -> bytes:
    try:
        packed: bytes = msgpack.packb(value, use_bin_type=True)
        return packed
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidExperienceError(
            f"{what} must hold plain values (str, int, float, bool, None, bytes, lists and dicts of them): {exc}; "
            "the broker never pickles what it stores") from exc


def unpack(raw: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise SchemaError(f"stored {what} is not msgpack: {exc}") from exc
