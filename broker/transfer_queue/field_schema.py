"""A batch's field schema as TransferQueue keeps it: per field, one sample's dtype and shape, and how it is held.

``{field: {"dtype": torch.dtype | None, "shape": torch.Size | tuple | None, "is_nested": bool,
"is_non_tensor": bool}}``, plus ``"per_sample_shapes": [tuple, ...]`` (one per sample, in the batch's
order) for a nested (jagged) tensor field. Plain data: it pickles with the ``BatchMeta`` that holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from broker.errors import InvalidExperienceError

logger = logging.getLogger(__name__)

FieldSchema = dict[str, dict[str, Any]]


class SchemaHolder(Protocol):
    """What ``concat_field_schema`` reads of a batch (a ``BatchMeta``): described here, so this module needs
    nothing of the one that holds the batches."""

    @property
    def field_schema(self) -> FieldSchema: ...

    @property
    def size(self) -> int: ...


def batch_rows(data: Any) -> int:
    """The size of a TensorDict's first batch dimension (TensorDict is not imported: it is optional)."""
    size = getattr(data, "batch_size", None)
    if size is None or not hasattr(data, "items"):
        raise InvalidExperienceError(f"expected a TensorDict, got {type(data).__name__}")
    if len(size) == 0:
        raise InvalidExperienceError("the TensorDict has no batch dimension (batch_size=[]): give it one per sample")
    return int(size[0])


def extract_field_schema(data: Any) -> FieldSchema:
    """The field schema of a TensorDict, as TransferQueue's ``extract_field_schema`` finds it.

    A tensor field's shape is one sample's (a 1-D field's samples are ``(1,)``, as TransferQueue
    unsqueezes it); a nested tensor's is its first sample's, with every sample's in
    ``per_sample_shapes``; a non-tensor field (strings, objects, sub-TensorDicts) has neither dtype nor
    shape. An empty batch gives ``{}``. A field whose first dimension is not the batch size raises
    ``InvalidExperienceError`` (a ``ValueError``, as TransferQueue's).
    """
    rows = batch_rows(data)
    if rows == 0:
        logger.warning("Trying to extract field schema for empty batch. No action is taken.")
        return {}
    schema: FieldSchema = {}
    for name, value in data.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            samples = value.unbind()
            if len(samples) != rows:
                raise _inconsistent(name, rows, f"a nested tensor of {len(samples)} tensors")
            schema[name] = {"dtype": value.dtype, "shape": samples[0].shape, "is_nested": True,
                            "is_non_tensor": False, "per_sample_shapes": [tuple(t.shape) for t in samples]}
        elif isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != rows:
                raise _inconsistent(name, rows, f"a tensor of shape {tuple(value.shape)}")
            shape = torch.Size([1]) if value.dim() == 1 else value.shape[1:]
            schema[name] = {"dtype": value.dtype, "shape": shape, "is_nested": False, "is_non_tensor": False}
        else:
            if len(value) != rows:
                raise _inconsistent(name, rows, f"{len(value)} values")
            schema[name] = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    return schema


def _inconsistent(name: str, rows: int, got: str) -> InvalidExperienceError:
    return InvalidExperienceError(
        f"Inconsistent batch dimension for field '{name}': expected batch_size[0]={rows}, got {got}"
    )


def concat_field_schema(batches: Sequence[SchemaHolder]) -> FieldSchema:
    """The schema of the batches' rows one after the other, on the first batch's fields.

    A field nested in any batch is nested in the result (its shape None); per-sample shapes are kept
    when the field is nested or any batch has them, a batch without them giving its uniform shape for
    each of its samples. Only the four schema keys and ``per_sample_shapes`` are kept, as in
    TransferQueue's ``BatchMeta.concat``.
    """
    merged: FieldSchema = {}
    for name, meta in batches[0].field_schema.items():
        metas = [b.field_schema.get(name, {}) for b in batches]
        nested = bool(meta.get("is_nested", False)) or any(m.get("is_nested", False) for m in metas)
        merged[name] = {"dtype": meta.get("dtype"), "shape": None if nested else meta.get("shape"),
                        "is_nested": nested, "is_non_tensor": meta.get("is_non_tensor", False)}
        if nested or any(m.get("per_sample_shapes") for m in metas):
            shapes: list[Any] = []
            for batch, m in zip(batches, metas):
                shapes.extend(m.get("per_sample_shapes") or [m.get("shape")] * batch.size)
            merged[name]["per_sample_shapes"] = shapes
    return merged
