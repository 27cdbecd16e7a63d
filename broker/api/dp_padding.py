"""DP padding rows: the rows MindSpeed repeats to fill a batch up to a multiple of dp_size, which puts skip."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from broker.api.checks import is_int

__all__ = ["PAD_INDEX", "drop_padding"]

#: Index of a row repeated only to fill a batch up to a multiple of dp_size (MindSpeed's -2): puts skip it.
PAD_INDEX = -2


def drop_padding(data_dict: Any, indexes: Any, every_negative: bool = False) -> tuple[Any, Any]:
    """``data_dict`` and ``indexes`` without the rows of index ``PAD_INDEX`` (or, with
    ``every_negative``, of any negative index, as MindSpeed's puts skip them); anything malformed is
    passed through untouched for the usual checks to name."""
    if isinstance(indexes, (torch.Tensor, np.ndarray)):
        indexes = indexes.tolist()
    if not isinstance(indexes, Sequence) or isinstance(indexes, (str, bytes)) or not isinstance(data_dict, Mapping):
        return data_dict, indexes
    try:  # the common case, no padding, costs one C-level pass: puts carry thousands of rows
        if (min(indexes, default=0) >= 0) if every_negative else (PAD_INDEX not in indexes):
            return data_dict, indexes
    except TypeError:
        return data_dict, indexes
    keep = [i for i, r in enumerate(indexes) if not (is_int(r) and (r < 0 if every_negative else r == PAD_INDEX))]
    out: dict[Any, Any] = {}
    for column, value in data_dict.items():
        if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim and len(value) == len(indexes):
            out[column] = value[keep]
        elif isinstance(value, (list, tuple)) and len(value) == len(indexes):
            out[column] = [value[i] for i in keep]
        else:
            out[column] = value  # the wrong number of rows: the row-count check names it
    return out, [indexes[i] for i in keep]
