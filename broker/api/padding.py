"""The tensor work under ``batches.py``: checking a column's rows, flattening, padding and packing them.

``batches.py`` holds MindSpeed's helpers as users call them (their documentation and examples, and which
layout becomes which); the checks of what they are handed, and the kernels that move the values, are here,
shared by several of them. Every failure is an InvalidExperienceError naming the column and the row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from broker.errors import InvalidExperienceError


def positive_int(name: str, value: object) -> int:
    """``value`` as a positive int (a size, a multiple), or InvalidExperienceError naming ``name``."""
    # bool is an int subclass; True as a multiple is certainly a mistake
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidExperienceError(f"{name} must be a positive int, got {value!r}")
    return value


def require_non_empty(name: str, mapping: object) -> Mapping[Any, Any]:
    """``mapping`` as a dict of at least one column, or InvalidExperienceError naming ``name``."""
    if not isinstance(mapping, Mapping):
        raise InvalidExperienceError(f"{name} must be a dict of columns, got {type(mapping).__name__}")
    if not mapping:
        raise InvalidExperienceError(f"{name} is empty: there are no columns")
    return mapping


def check_rows(column: str, value: object) -> list[Tensor]:
    """Validate a list of 1-D rows sharing one dtype; return it as a list."""
    if not isinstance(value, (list, tuple)):
        raise InvalidExperienceError(
            f"column {column!r} must be a list of 1-D tensors or a 2-D tensor, got {type(value).__name__}"
        )
    if not value:
        raise InvalidExperienceError(f"column {column!r} has no rows")
    dtype = None
    for i, row in enumerate(value):
        if not isinstance(row, Tensor):
            raise InvalidExperienceError(f"column {column!r} row {i} is a {type(row).__name__}, not a tensor")
        if row.dim() != 1:
            raise InvalidExperienceError(
                f"column {column!r} row {i} has shape {tuple(row.shape)}; rows must be 1-D"
            )
        if dtype is None:
            dtype = row.dtype
        elif row.dtype != dtype:
            # torch.cat would silently promote; a column has exactly one dtype
            raise InvalidExperienceError(
                f"column {column!r} mixes dtypes: row 0 is {dtype}, row {i} is {row.dtype}"
            )
    return list(value)


def check_matrix(column: str, value: Tensor) -> Tensor:
    """A column given as an already padded tensor: 2-D, with at least one row."""
    if value.dim() != 2:
        raise InvalidExperienceError(
            f"column {column!r} is a tensor of shape {tuple(value.shape)}; "
            "a tensor column must be 2-D (rows, width)"
        )
    if value.shape[0] == 0:
        raise InvalidExperienceError(f"column {column!r} has no rows")
    return value


def flatten(column: str, value: object) -> tuple[Tensor, Tensor]:
    """Any column -> (packed 1-D data, int64 per-row lengths)."""
    if isinstance(value, Tensor):
        matrix = check_matrix(column, value)
        lengths = torch.full((matrix.shape[0],), matrix.shape[1], dtype=torch.int64)
        return matrix.reshape(-1), lengths
    rows = check_rows(column, value)
    lengths = torch.tensor([row.shape[0] for row in rows], dtype=torch.int64)
    return torch.cat(rows), lengths


def pad_flat(flat: Tensor, lengths: Tensor, pad_value: float | int | bool, multiple: int) -> Tensor:
    """Packed rows -> ``(rows, width)``, width = max length rounded up to a multiple of ``multiple``.

    One ``masked_scatter_`` instead of a per-row copy loop: the mask is row-major, exactly the order
    in which the rows were concatenated.
    """
    longest = int(lengths.max()) if lengths.numel() else 0
    width = -(-longest // multiple) * multiple
    # Cast through a tensor so that e.g. -1 wraps for uint8 and 0.5 truncates for ints, like torch does.
    fill = torch.tensor(pad_value).to(flat.dtype).item()
    out = torch.full((lengths.numel(), width), fill, dtype=flat.dtype, device=flat.device)
    mask = torch.arange(width, device=flat.device) < lengths.to(flat.device).unsqueeze(1)
    bits = _SCATTER_AS.get(flat.dtype)
    if bits is not None:  # a move of bits: the same through an integer view
        out.view(bits).masked_scatter_(mask, flat.view(bits))
        return out
    return out.masked_scatter_(mask, flat)


#: Dtypes ``masked_scatter_`` has no kernel for, and the integer dtype of the same size it moves them as.
_SCATTER_AS: dict[torch.dtype, torch.dtype] = {
    dtype: as_int
    for name, as_int in (("uint16", torch.int16), ("uint32", torch.int32), ("uint64", torch.int64),
                         ("float8_e4m3fn", torch.int8), ("float8_e5m2", torch.int8))
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)  # uint16 and wider: torch 2.3 and later
}


def pad_value_of(flat: Tensor, pad_id: float | int) -> float | int:
    """What a column of ``flat``'s dtype is padded with."""
    # MindSpeed pads floating columns (log-probs, advantages, ...) with 0.0 whatever pad_id is:
    # pad_id is a token id and means nothing in a float column (nor in a complex one).
    return 0.0 if flat.is_floating_point() or flat.is_complex() else pad_id


def length_column(column: str, flat: Tensor, lengths: Tensor) -> Tensor:
    """A column of one value per row (see ``batches.LENGTH_COLUMNS``) as ``(rows, 1)``."""
    if not bool((lengths == 1).all()):
        raise InvalidExperienceError(
            f"length column {column!r} must hold exactly one value per row, "
            f"got row lengths {lengths.tolist()}"
        )
    return flat.reshape(-1, 1)


def same_row_count(counts: Mapping[str, int]) -> int:
    """The one row count of every column (column -> rows), or InvalidExperienceError naming them."""
    distinct = set(counts.values())
    if len(distinct) > 1:
        raise InvalidExperienceError(f"columns have mismatched row counts: {dict(counts)}")
    return distinct.pop()


def one_dtype(column: str, rows: Sequence[Tensor]) -> None:
    """A column has exactly one dtype (torch.cat would silently promote)."""
    for i, row in enumerate(rows):
        if row.dtype != rows[0].dtype:
            raise InvalidExperienceError(
                f"column {column!r} mixes dtypes: row 0 is {rows[0].dtype}, row {i} is {row.dtype}"
            )


def pack_2d(column: str, rows: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """2-D rows ``(C, L_i)`` (multimodal ``position_ids``) -> ``(C, sum L_i)`` and the lengths ``L_i``."""
    first = rows[0]
    for i, row in enumerate(rows):
        if not isinstance(row, Tensor) or row.dim() != 2 or row.shape[0] != first.shape[0]:
            shape = tuple(row.shape) if isinstance(row, Tensor) else type(row).__name__
            raise InvalidExperienceError(
                f"column {column!r} row {i} is {shape}: 2-D rows must share their first dimension "
                f"({first.shape[0]} in row 0)"
            )
    one_dtype(column, rows)
    return torch.cat(list(rows), dim=1), torch.tensor([row.shape[1] for row in rows], dtype=torch.int64)










def checked_packed(
    batch_data: Mapping[str, Tensor], batch_data_length: Mapping[str, Any],
) -> dict[str, tuple[Tensor, Tensor]]:
    """Per column, the packed data and its row lengths, checked: the same columns in both, a 1-D (or 2-D) data
    tensor, 1-D integer lengths, none negative, summing to the data's last dimension, and one row count."""
    if set(batch_data) != set(batch_data_length):
        raise InvalidExperienceError(
            "batch_data and batch_data_length have different columns: "
            f"only in batch_data {sorted(set(batch_data) - set(batch_data_length))}, "
            f"only in batch_data_length {sorted(set(batch_data_length) - set(batch_data))}"
        )

    checked: dict[str, tuple[Tensor, Tensor]] = {}
    # MindSpeed iterates the lengths dict; keep its column order.
    for column, lengths in batch_data_length.items():
        data = batch_data[column]
        if not isinstance(data, Tensor) or data.dim() not in (1, 2):
            raise InvalidExperienceError(f"batch_data[{column!r}] must be a packed 1-D (or 2-D) tensor")
        if (
            not isinstance(lengths, Tensor)
            or lengths.dim() != 1
            or lengths.dtype == torch.bool
            or lengths.is_floating_point()
            or lengths.is_complex()
        ):
            raise InvalidExperienceError(f"batch_data_length[{column!r}] must be a 1-D integer tensor")
        if lengths.numel() == 0:
            raise InvalidExperienceError(f"column {column!r} has no rows")
        if bool((lengths < 0).any()):
            raise InvalidExperienceError(f"column {column!r} has negative row lengths: {lengths.tolist()}")
        total = int(lengths.sum())
        if total != data.shape[-1]:
            raise InvalidExperienceError(
                f"column {column!r}: row lengths sum to {total} but the packed data has {data.shape[-1]} values"
            )
        checked[column] = (data, lengths)
    same_row_count({column: lengths.numel() for column, (_, lengths) in checked.items()})
    return checked


def pad_packed_2d(data: Tensor, lengths: Tensor, pad_id: float | int, multiple: int) -> Tensor:
    """Packed 2-D rows ``(C, sum L_i)`` -> ``(rows, C, width)``, width the longest rounded up to ``multiple``."""
    width = -(-int(lengths.max()) // multiple) * multiple
    fill = torch.tensor(pad_value_of(data, pad_id)).to(data.dtype).item()
    out = torch.full((lengths.numel(), data.shape[0], width), fill, dtype=data.dtype, device=data.device)
    for i, (start, n) in enumerate(zip((torch.cumsum(lengths, 0) - lengths).tolist(), lengths.tolist())):
        out[i, :, :n] = data[:, start : start + n]
    return out
