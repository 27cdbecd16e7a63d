"""Reshape experience between per-row tensor lists and padded batches, with MindSpeed-RL's semantics.

The dock stores one 1-D tensor per (column, row). Workers, however, hand over and expect whole
batches: padded ``(rows, width)`` matrices, or "packed" 1-D tensors plus per-row lengths for cheap
broadcasting. The helpers here convert between those layouts (the checks of what they are handed, and the
kernels that pad and pack, are in ``padding.py``). They mirror the functions of the same
names in MindSpeed-RL (``mindspeed_rl/trainer/utils/transfer_dock.py`` and
``mindspeed_rl/utils/pad_process.py``) so that worker code can be ported unchanged, except that:

* every padded batch is a plain ``dict[str, torch.Tensor]`` (no TensorDict dependency; the
  ``broker.adapters.mindspeed`` adapter wraps it in a TensorDict where tensordict is installed);
* dtypes are preserved (MindSpeed narrows int64 to int32 in ``trans_input_to_experience``);
* rows of 2 and more dimensions: ``padding_dict_to_tensor_dict`` pads them along their first
  dimension (which ``original_length`` records, as in MindSpeed) into ``(rows, longest, *rest)``;
  ``pack_experience_columns`` / ``unpack_pad_experience`` pack 2-D rows ``(C, L_i)`` along their last
  dimension into ``(C, sum L_i)``, as MindSpeed does for multimodal ``position_ids``;
* columns of plain values (labels: strings, dicts) pass through the padding helpers as lists and
  are left out of ``original_length``;
* malformed input raises :class:`~broker.errors.InvalidExperienceError` naming the problem, where
  MindSpeed would fail later with an unrelated error or silently produce a wrong batch.

Three layouts appear below, shown for the column ``"prompts"`` with rows ``[1, 1, 1]`` and ``[2, 2]``:

* rows:   ``{"prompts": [tensor([1, 1, 1]), tensor([2, 2])]}``
* padded: ``{"prompts": tensor([[1, 1, 1], [2, 2, 0]])}``
* packed: ``{"prompts": tensor([1, 1, 1, 2, 2])}`` with lengths ``{"prompts": tensor([3, 2])}``
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from broker.api import padding
from broker.errors import InvalidExperienceError

__all__ = [
    "LENGTH_COLUMNS",
    "ORIGINAL_LENGTH_KEY",
    "pack_experience_columns",
    "pad_experience",
    "padding_dict_to_tensor_dict",
    "put_prompts_experience",
    "remove_padding_tensor_dict_to_dict",
    "trans_input_to_experience",
    "unpack_pad_experience",
]

#: Key under which :func:`padding_dict_to_tensor_dict` stores every row's unpadded length.
ORIGINAL_LENGTH_KEY = "original_length"

#: Columns whose rows hold one number each; they become ``(rows, 1)`` and are never padded to
#: ``multiple``, because models read them as per-sample scalars rather than as sequences.
#: ``age`` is MindSpeed's partial-rollout column, kept so that ported column names behave the same.
LENGTH_COLUMNS = frozenset({"prompt_length", "response_length", "age"})

#: One column as callers hand it over: a list of 1-D rows, or an already padded 2-D tensor.
ColumnValue = Tensor | Sequence[Tensor]


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def pad_experience(
    experience_batch: Mapping[str, ColumnValue],
    pad_id: float | int,
    multiple: int = 1,
) -> dict[str, Tensor]:
    """Pad every column's rows into one ``(rows, width)`` tensor, ready to feed a model.

    ``width`` is the column's longest row rounded up to a multiple of ``multiple`` (the TP/CP size).
    Integer and bool columns are padded with ``pad_id`` cast to their dtype, floating and complex columns
    with ``0.0``. Columns in :data:`LENGTH_COLUMNS` must have one value per row and become ``(rows, 1)``.
    All columns must have the same number of rows.

    Dropped from MindSpeed: the special case for 2-D ``position_ids`` rows (rows must be 1-D here).

    >>> pad_experience({"attention_mask": [torch.tensor([1]), torch.tensor([2, 2])]}, pad_id=0)
    {'attention_mask': tensor([[1, 0],
            [2, 2]])}
    """
    padding.require_non_empty("experience_batch", experience_batch)
    multiple = padding.positive_int("multiple", multiple)
    flattened = {column: padding.flatten(column, value) for column, value in experience_batch.items()}
    padding.same_row_count({column: lengths.numel() for column, (_, lengths) in flattened.items()})

    batch: dict[str, Tensor] = {}
    for column, (flat, lengths) in flattened.items():
        if column in LENGTH_COLUMNS:
            batch[column] = padding.length_column(column, flat, lengths)
        else:
            batch[column] = padding.pad_flat(flat, lengths, padding.pad_value_of(flat, pad_id), multiple)
    return batch


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
    padding.require_non_empty("experience_dict", experience_dict)
    columns: list[str] = []
    experience: list[list[Tensor]] = []
    for column, value in experience_dict.items():
        if value is None:
            continue
        if isinstance(value, Tensor):
            rows = list(padding.check_matrix(column, value).unbind(0))
        else:
            rows = padding.check_rows(column, value)
        columns.append(column)
        experience.append(rows)
    if not columns:
        raise InvalidExperienceError("experience_dict has no columns: every value is None")
    padding.same_row_count({column: len(rows) for column, rows in zip(columns, experience, strict=True)})
    return columns, experience


def pack_experience_columns(
    experience_dict: Mapping[str, ColumnValue],
    experience_count: int,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Concatenate each column's rows into one 1-D tensor and record every row's length.

    Packing makes a batch two flat tensors per column, which is much cheaper to broadcast than many
    small ones. Every column must have exactly ``experience_count`` rows. Data keep their dtype;
    lengths are int32, as in MindSpeed. :func:`unpack_pad_experience` is the inverse.

    Dropped from MindSpeed: ``experience_consumer_stage`` and ``enable_partial_rollout`` (partial
    rollout is not supported), and 2-D ``position_ids`` rows. This is MindSpeed's own older signature.

    >>> data, lengths = pack_experience_columns({"prompts": [torch.tensor([1, 1]), torch.tensor([2])]}, 2)
    >>> data, lengths
    ({'prompts': tensor([1, 1, 2])}, {'prompts': tensor([2, 1], dtype=torch.int32)})
    """
    padding.require_non_empty("experience_dict", experience_dict)
    experience_count = padding.positive_int("experience_count", experience_count)
    batch_data: dict[str, Tensor] = {}
    batch_data_length: dict[str, Tensor] = {}
    for column, value in experience_dict.items():
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], Tensor) and value[0].dim() == 2:
            flat, lengths = padding.pack_2d(column, value)
        else:
            flat, lengths = padding.flatten(column, value)
        if lengths.numel() != experience_count:
            raise InvalidExperienceError(
                f"column {column!r} has {lengths.numel()} rows but experience_count is {experience_count}"
            )
        batch_data[column] = flat
        batch_data_length[column] = lengths.to(torch.int32)
    return batch_data, batch_data_length


def unpack_pad_experience(
    batch_data: Mapping[str, Tensor],
    batch_data_length: Mapping[str, Tensor],
    pad_id: float | int,
    multiple: int,
) -> dict[str, Tensor]:
    """Inverse of :func:`pack_experience_columns` followed by :func:`pad_experience`.

    Each packed column is cut at ``batch_data_length[column]`` and padded to ``(rows, width)`` with
    ``width = ceil(max(lengths) / multiple) * multiple`` -- MindSpeed's rule: the longest row of that
    column rounded up to the next multiple of ``multiple`` (the TP*CP size), never more. Integer and
    bool columns are padded with ``pad_id`` cast to their dtype, floating and complex ones with ``0.0``.
    Columns in :data:`LENGTH_COLUMNS` become ``(rows, 1)``. The result equals ``pad_experience`` on the rows.

    >>> unpack_pad_experience({"prompts": torch.tensor([1, 1, 1, 2])},
    ...                       {"prompts": torch.tensor([3, 1])}, pad_id=-1, multiple=2)
    {'prompts': tensor([[ 1,  1,  1, -1],
            [ 2, -1, -1, -1]])}
    """
    padding.require_non_empty("batch_data", batch_data)
    if not isinstance(batch_data_length, Mapping):
        raise InvalidExperienceError(
            f"batch_data_length must be a dict of columns, got {type(batch_data_length).__name__}"
        )
    multiple = padding.positive_int("multiple", multiple)
    checked = padding.checked_packed(batch_data, batch_data_length)

    padded: dict[str, Tensor] = {}
    for column, (data, lengths) in checked.items():
        if data.dim() == 2:
            padded[column] = padding.pad_packed_2d(data, lengths, pad_id, multiple)
        elif column in LENGTH_COLUMNS:
            padded[column] = padding.length_column(column, data, lengths)
        else:
            padded[column] = padding.pad_flat(data, lengths, padding.pad_value_of(data, pad_id), multiple)
    return padded


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
    padding.require_non_empty("experience_data", experience_data)
    if ORIGINAL_LENGTH_KEY in experience_data:
        raise InvalidExperienceError(
            f"experience_data already has a column named {ORIGINAL_LENGTH_KEY!r}; that key is reserved"
        )
    flattened: dict[str, tuple[Tensor, Tensor]] = {}
    values: dict[str, list[Any]] = {}
    for column, value in experience_data.items():
        if padding.is_value_column(value):
            values[column] = list(value)
        elif isinstance(value, Tensor) and value.dim() > 2:
            # Already padded rows of 2+ dimensions: every row counts as full length.
            flattened[column] = (value, torch.full((value.shape[0],), value.shape[1], dtype=torch.int64))
        elif isinstance(value, Tensor):
            # Already padded: keep the matrix itself, every row counts as full width.
            matrix = padding.check_matrix(column, value)
            full = torch.full((matrix.shape[0],), matrix.shape[1], dtype=torch.int64)
            flattened[column] = (matrix, full)
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], Tensor) and value[0].dim() > 1:
            flattened[column] = padding.pad_nd(column, value)
        else:
            flattened[column] = padding.pad_rows(column, value)
    counts = {column: lengths.numel() for column, (_, lengths) in flattened.items()}
    padding.same_row_count({**counts, **{column: len(v) for column, v in values.items()}})

    batch: dict[str, Any] = {}
    for column, (data, lengths) in flattened.items():
        batch[column] = data if data.dim() >= 2 else padding.pad_flat(data, lengths, 0, 1)
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
    passed: dict[str, Any] = {c: list(v) for c, v in data_dict.items() if padding.is_value_column(v)}
    columns = {column: value for column, value in data_dict.items()
               if column != ORIGINAL_LENGTH_KEY and column not in passed}
    for column, value in columns.items():
        if not isinstance(value, Tensor) or value.dim() < 2:
            raise InvalidExperienceError(f"column {column!r} must be a padded tensor of 2 or more dimensions")
    rows = padding.same_row_count({column: value.shape[0] for column, value in columns.items()}) if columns else 0
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
        array = padding.numpy_view(padded)
        if array is None:
            result[column] = [padded[i, :n] for i, n in enumerate(lengths.tolist())]
        else:
            result[column] = [torch.from_numpy(row[:n]) for row, n in zip(array, lengths.tolist())]
    result.update(passed)
    return result


def put_prompts_experience(
    batch: Mapping[str, ColumnValue],
    n_samples_per_prompt: int,
    dataset_additional_keys: Sequence[str] | None = None,
    indexes: Sequence[int] | None = None,
    add_another_batch: bool = False,
) -> tuple[dict[str, Tensor], list[int]]:
    """Turn a dataloader batch into the dock's first columns, each prompt repeated per sample.

    Every prompt (and every ``dataset_additional_keys`` value present in ``batch``; absent keys are
    skipped, as in MindSpeed) is repeated ``n_samples_per_prompt`` times consecutively, and a
    ``prompt_length`` column (one int64 value per row) is added in front. The result is what
    :func:`padding_dict_to_tensor_dict` gives for ``{"prompt_length", "prompts", *additional}``.

    The returned row indexes are ``indexes`` if given (one per output row), else ``0..rows-1``; with
    ``add_another_batch`` they are ``rows..2*rows-1`` (the second half of a dock twice the batch size),
    overriding ``indexes`` exactly as MindSpeed does.

    >>> data, idx = put_prompts_experience({"prompts": [torch.tensor([7, 7]), torch.tensor([8])]}, 2)
    >>> data["prompts"], data["prompt_length"].flatten(), idx
    (tensor([[7, 7],
            [7, 7],
            [8, 0],
            [8, 0]]), tensor([2, 2, 1, 1]), [0, 1, 2, 3])
    """
    padding.require_non_empty("batch", batch)
    n_samples_per_prompt = padding.positive_int("n_samples_per_prompt", n_samples_per_prompt)
    if "prompts" not in batch:
        raise InvalidExperienceError(f"batch has no 'prompts' column (columns: {sorted(batch)})")
    additional = [] if dataset_additional_keys is None else list(dataset_additional_keys)
    reserved = {"prompts", "prompt_length", ORIGINAL_LENGTH_KEY}
    clashing = sorted(reserved.intersection(additional))
    if clashing:
        raise InvalidExperienceError(f"dataset_additional_keys may not contain {clashing}")

    # Pad once per prompt, then repeat whole rows: identical to padding the repeated rows.
    sources = {"prompts": batch["prompts"]}
    sources.update({key: batch[key] for key in additional if key in batch})
    flattened = {column: padding.flatten(column, value) for column, value in sources.items()}
    prompt_count = padding.same_row_count({column: lengths.numel() for column, (_, lengths) in flattened.items()})
    rows = prompt_count * n_samples_per_prompt

    prompt_lengths = flattened["prompts"][1].repeat_interleave(n_samples_per_prompt)
    data: dict[str, Tensor] = {"prompt_length": prompt_lengths.unsqueeze(1)}
    original_length = [torch.ones(rows, dtype=torch.int64)]
    for column, (flat, lengths) in flattened.items():
        data[column] = padding.pad_flat(flat, lengths, 0, 1).repeat_interleave(n_samples_per_prompt, dim=0)
        original_length.append(lengths.repeat_interleave(n_samples_per_prompt))
    data[ORIGINAL_LENGTH_KEY] = torch.cat(original_length)

    if add_another_batch:
        out_indexes = list(range(rows, 2 * rows))
    elif indexes is None:
        out_indexes = list(range(rows))
    else:
        out_indexes = [int(i) for i in indexes]
        if len(out_indexes) != rows:
            raise InvalidExperienceError(
                f"got {len(out_indexes)} indexes for {prompt_count} prompts x {n_samples_per_prompt} "
                f"samples = {rows} rows"
            )
    return data, out_indexes
