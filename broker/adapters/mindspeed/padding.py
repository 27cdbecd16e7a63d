"""MindSpeed-RL's padded batches, which its dock's API takes and gives: each column padded into one tensor, every
row's true length under ``original_length`` (``ORIGINAL_LENGTH_KEY``).

The functions of the same names in MindSpeed-RL (``mindspeed_rl/trainer/utils/transfer_dock.py`` and
``mindspeed_rl/utils/pad_process.py``), with the differences ``broker.api.batches`` lists (plain dicts, dtypes
kept, rows of 2 and more dimensions, label columns, errors naming the problem):

- ``padding_dict_to_tensor_dict``: rows -> a padded batch with ``original_length``;
- ``remove_padding_tensor_dict_to_dict``: its inverse, rows as views of the padded tensors;
- ``trans_input_to_experience``: a data dict -> its column names and each column's rows, as a put stores them.

``GRPOTransferDock`` returns its batches in this format (a TensorDict where tensordict is installed). The
native dock's batch helpers (``pad_experience``, ``pack_experience_columns``, ``unpack_pad_experience``,
``put_prompts_experience``) are in ``broker.api.batches``, whose checks and padding these share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

# The checks of a column and the padding of packed rows are the batch helpers' own: one rule for both.
from broker.api.batches import ORIGINAL_LENGTH_KEY, ColumnValue
from broker.api.padding import check_matrix, check_rows, one_dtype, pad_flat, require_non_empty, same_row_count
from broker.errors import InvalidExperienceError

__all__ = ["ORIGINAL_LENGTH_KEY", "padding_dict_to_tensor_dict", "remove_padding_tensor_dict_to_dict",
           "trans_input_to_experience"]


def trans_input_to_experience(
    experience_dict: Mapping[str, ColumnValue | None],
) -> tuple[list[str], list[list[Tensor]]]:
    """Split a data dict into its column names and, per column, the list of 1-D rows to store.

    A 2-D tensor is split into its rows (views, not copies); a list of 1-D tensors is kept as is.
    Columns whose value is ``None`` are skipped, as in MindSpeed. All kept columns must have the same
    number of rows, since they are written to the same dock rows.

    Differences from MindSpeed: int64 is *not* narrowed to int32 (dtypes are preserved); the
    ``num_responses`` argument of old MindSpeed versions is gone there too, so rows are never grouped.

    >>> trans_input_to_experience({"prompts": torch.tensor([[1, 1], [2, 2]])})
    (['prompts'], [[tensor([1, 1]), tensor([2, 2])]])
    """
    require_non_empty("experience_dict", experience_dict)
    columns: list[str] = []
    experience: list[list[Tensor]] = []
    for column, value in experience_dict.items():
        if value is None:
            continue
        if isinstance(value, Tensor):
            rows = list(check_matrix(column, value).unbind(0))
        else:
            rows = check_rows(column, value)
        columns.append(column)
        experience.append(rows)
    if not columns:
        raise InvalidExperienceError("experience_dict has no columns: every value is None")
    same_row_count({column: len(rows) for column, rows in zip(columns, experience, strict=True)})
    return columns, experience


def _is_value_column(value: object) -> bool:
    """A list of plain values (labels, metadata): not padded, not in ``original_length``."""
    return isinstance(value, (list, tuple)) and bool(value) and not any(isinstance(v, Tensor) for v in value)


def _pad_nd(column: str, rows: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Rows of 2+ dimensions -> ``(rows, longest, *rest)`` padded with 0 along dim 0, and their lengths."""
    first = rows[0]
    for i, row in enumerate(rows):
        if not isinstance(row, Tensor) or row.dim() != first.dim() or row.shape[1:] != first.shape[1:]:
            shape = tuple(row.shape) if isinstance(row, Tensor) else type(row).__name__
            raise InvalidExperienceError(
                f"column {column!r} row {i} is {shape}; rows of 2+ dimensions must agree past their first "
                f"dimension ({tuple(first.shape)} for row 0)"
            )
    one_dtype(column, rows)
    lengths = torch.tensor([row.shape[0] for row in rows], dtype=torch.int64)
    out = first.new_zeros((len(rows), int(lengths.max()), *first.shape[1:]))
    for i, row in enumerate(rows):
        out[i, : row.shape[0]] = row
    return out, lengths


def _numpy_view(tensor: Tensor) -> np.ndarray | None:
    """A numpy view of a CPU tensor; None where numpy cannot view it (GPU, bfloat16, autograd)."""
    try:
        return tensor.numpy()
    except (RuntimeError, TypeError):
        return None


def _pad_rows(column: str, value: object) -> tuple[Tensor, Tensor]:
    """A list of 1-D rows -> ``(rows, longest)`` padded with 0, and the rows' lengths.

    Copied row by row into a numpy array where numpy can view every row (CPU tensors of one dtype):
    a third faster than ``pad_sequence`` on one thread, and, unlike torch's copies, never split over
    threads, which on a loaded machine made each batch several times slower. Anything else takes
    ``pad_sequence``, after ``check_rows`` names what is wrong.
    """
    arrays: list[np.ndarray | None] = []
    if isinstance(value, (list, tuple)) and value and all(isinstance(row, Tensor) for row in value):
        dtype = value[0].dtype
        if all(row.shape == (1,) and row.dtype is dtype and row.is_cpu for row in value):
            # One value per row (prompt_length, a score): one concatenation instead of a copy per row.
            return torch.cat(value).unsqueeze(1), torch.ones(len(value), dtype=torch.int64)
        arrays = [_numpy_view(row) for row in value]
    first = arrays[0] if arrays else None
    if first is None or any(a is None or a.ndim != 1 or a.dtype != first.dtype for a in arrays):
        rows = check_rows(column, value)
        lengths = torch.tensor([row.shape[0] for row in rows], dtype=torch.int64)
        return pad_sequence(rows, batch_first=True), lengths
    views = cast("list[np.ndarray]", arrays)
    counts = [a.shape[0] for a in views]
    out = np.zeros((len(views), max(counts)), dtype=views[0].dtype)
    for row, array, n in zip(out, views, counts):
        row[:n] = array
    return torch.from_numpy(out), torch.tensor(counts, dtype=torch.int64)


def padding_dict_to_tensor_dict(experience_data: Mapping[str, ColumnValue]) -> dict[str, Tensor]:
    """Pad each column's rows with 0 into ``(rows, width)`` and record the unpadded lengths.

    ``width`` is the column's longest row (no rounding). The lengths of all columns are concatenated,
    in column order, into one 1-D int64 tensor under :data:`ORIGINAL_LENGTH_KEY`, which is always the
    last key: ``[lengths of column 0..., lengths of column 1..., ...]``. An already padded 2-D tensor
    column is taken as is (not copied); every row then counts as full width. All columns must have the
    same number of rows. :func:`remove_padding_tensor_dict_to_dict` is the inverse.

    MindSpeed returns a TensorDict; this returns a plain dict.

    >>> out = padding_dict_to_tensor_dict({"prompt": [torch.tensor([1, 1, 1]), torch.tensor([2, 2, 2, 2])],
    ...                                    "attention_mask": [torch.tensor([1]), torch.tensor([2, 2])]})
    >>> out["prompt"], out["original_length"]
    (tensor([[1, 1, 1, 0],
            [2, 2, 2, 2]]), tensor([3, 4, 1, 2]))
    """
    require_non_empty("experience_data", experience_data)
    if ORIGINAL_LENGTH_KEY in experience_data:
        raise InvalidExperienceError(
            f"experience_data already has a column named {ORIGINAL_LENGTH_KEY!r}; that key is reserved"
        )
    flattened: dict[str, tuple[Tensor, Tensor]] = {}
    values: dict[str, list[Any]] = {}
    for column, value in experience_data.items():
        if _is_value_column(value):
            values[column] = list(value)
        elif isinstance(value, Tensor) and value.dim() > 2:
            # Already padded rows of 2+ dimensions: every row counts as full length.
            flattened[column] = (value, torch.full((value.shape[0],), value.shape[1], dtype=torch.int64))
        elif isinstance(value, Tensor):
            # Already padded: keep the matrix itself, every row counts as full width.
            matrix = check_matrix(column, value)
            full = torch.full((matrix.shape[0],), matrix.shape[1], dtype=torch.int64)
            flattened[column] = (matrix, full)
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], Tensor) and value[0].dim() > 1:
            flattened[column] = _pad_nd(column, value)
        else:
            flattened[column] = _pad_rows(column, value)
    counts = {column: lengths.numel() for column, (_, lengths) in flattened.items()}
    same_row_count({**counts, **{column: len(v) for column, v in values.items()}})

    batch: dict[str, Any] = {}
    for column, (data, lengths) in flattened.items():
        batch[column] = data if data.dim() >= 2 else pad_flat(data, lengths, 0, 1)
    batch.update(values)
    if flattened:
        batch[ORIGINAL_LENGTH_KEY] = torch.cat([lengths for _, lengths in flattened.values()])
    return batch


def remove_padding_tensor_dict_to_dict(
    data_dict: Mapping[str, Any] | None,
) -> dict[str, list[Any]] | dict[str, Any]:
    """Inverse of :func:`padding_dict_to_tensor_dict`: cut every padded row back to its true length.

    Row ``i`` of the ``k``-th column (counting only data columns, in order) is cut to
    ``original_length[k * rows + i]``. The rows returned are views of the padded tensors, as
    MindSpeed's (writing into one writes into the batch), and stay on the input's device (MindSpeed
    moves them to CPU). As in MindSpeed, ``None`` gives
    ``{}`` and a dict without :data:`ORIGINAL_LENGTH_KEY` is returned unchanged (as a new plain dict),
    so already unpadded data passes through.

    >>> remove_padding_tensor_dict_to_dict({"prompt": torch.tensor([[1, 1, 1, 0], [2, 2, 2, 2]]),
    ...                                     "original_length": torch.tensor([3, 4])})
    {'prompt': [tensor([1, 1, 1]), tensor([2, 2, 2, 2])]}
    """
    if data_dict is None:
        return {}
    if not isinstance(data_dict, Mapping):
        raise InvalidExperienceError(f"data_dict must be a dict of columns, got {type(data_dict).__name__}")
    if ORIGINAL_LENGTH_KEY not in data_dict:
        return dict(data_dict)

    original_length = data_dict[ORIGINAL_LENGTH_KEY]
    if not isinstance(original_length, Tensor) or original_length.dim() != 1:
        raise InvalidExperienceError(f"{ORIGINAL_LENGTH_KEY!r} must be a 1-D integer tensor")
    passed: dict[str, Any] = {c: list(v) for c, v in data_dict.items() if _is_value_column(v)}
    columns = {column: value for column, value in data_dict.items()
               if column != ORIGINAL_LENGTH_KEY and column not in passed}
    for column, value in columns.items():
        if not isinstance(value, Tensor) or value.dim() < 2:
            raise InvalidExperienceError(f"column {column!r} must be a padded tensor of 2 or more dimensions")
    rows = same_row_count({column: value.shape[0] for column, value in columns.items()}) if columns else 0
    if original_length.numel() != rows * len(columns):
        raise InvalidExperienceError(
            f"{ORIGINAL_LENGTH_KEY!r} has {original_length.numel()} entries but {len(columns)} columns "
            f"of {rows} rows need {rows * len(columns)}"
        )

    result: dict[str, list[Any]] = {}
    for k, (column, padded) in enumerate(columns.items()):
        lengths = original_length[k * rows : (k + 1) * rows].to(padded.device)
        if bool((lengths < 0).any()) or bool((lengths > padded.shape[1]).any()):
            raise InvalidExperienceError(
                f"column {column!r} has width {padded.shape[1]} but {ORIGINAL_LENGTH_KEY!r} gives "
                f"row lengths {lengths.tolist()}"
            )
        # Views, as MindSpeed's truncate_rows makes: no copy (a row is a prefix of a contiguous row of
        # the matrix, so it is contiguous, and a put encodes it without copying it first). Made through
        # numpy where it can view the matrix: a third of the cost of indexing the tensor, row by row.
        if bool((lengths == padded.shape[1]).all()):  # every row full (one value per row): one call makes them
            result[column] = list(padded.unbind(0))
            continue
        array = _numpy_view(padded)
        if array is None:
            result[column] = [padded[i, :n] for i, n in enumerate(lengths.tolist())]
        else:
            result[column] = [torch.from_numpy(row[:n]) for row, n in zip(array, lengths.tolist())]
    result.update(passed)
    return result
