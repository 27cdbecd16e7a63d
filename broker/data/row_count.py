"""The check that a column of a put gives one row per index: said once, for the codec (``encode_column``) and for
a partitioned dock, which must check it before it cuts a put by partition (``api/partitioned_moves.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from broker.errors import InvalidExperienceError


def row_count_error(column: str, value: Any, count: int) -> InvalidExperienceError | None:
    """The error of ``value``, a column of a put, giving other than ``count`` rows (a stacked tensor or numeric
    array along dim 0, a list, an array of objects), or None: also where the value is malformed otherwise,
    which ``encode_column`` names."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim > 0 and value.shape[0] != count:
        if isinstance(value, np.ndarray) and value.dtype.kind in "OUS":  # one value per element, as a list
            return InvalidExperienceError(f"column {column!r}: {value.shape[0]} rows for {count} indexes")
        return InvalidExperienceError(f"column {column!r}: stacked tensor of shape {tuple(value.shape)} has "
                                      f"{value.shape[0]} rows for {count} indexes")
    if isinstance(value, (list, tuple)) and len(value) != count:
        return InvalidExperienceError(f"column {column!r}: {len(value)} rows for {count} indexes")
    return None
