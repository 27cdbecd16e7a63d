"""Reshape experience between per-row tensor lists and padded batches, with MindSpeed-RL's semantics.

The dock stores one 1-D tensor per (column, row). Workers, however, hand over and expect whole
batches: padded ``(rows, width)`` matrices, or "packed" 1-D tensors plus per-row lengths for cheap
broadcasting. The helpers here convert between those layouts (the checks of what they are handed, and the
kernels that pad and pack, are in ``padding.py``). They mirror the functions of the same
names in MindSpeed-RL (``mindspeed_rl/trainer/utils/transfer_dock.py`` and
``mindspeed_rl/utils/pad_process.py``) so that worker code can be ported unchanged. Those of MindSpeed's
own padded batches (``original_length``), which its dock's API takes and gives, are its adapter's:
``padding_dict_to_tensor_dict``, ``remove_padding_tensor_dict_to_dict`` and ``trans_input_to_experience``
in ``broker.adapters.mindspeed.padding``. Here, as there, except that:

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

import torch
from torch import Tensor

from broker.api import padding
from broker.errors import InvalidExperienceError

__all__ = [
    "LENGTH_COLUMNS",
    "ORIGINAL_LENGTH_KEY",
    "pack_experience_columns",
    "pad_experience",
    "put_prompts_experience",
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

    return {column: _padded(column, flat, lengths, pad_id, multiple) for column, (flat, lengths) in flattened.items()}


def _padded(column: str, flat: Tensor, lengths: Tensor, pad_id: float | int, multiple: int) -> Tensor:
    """One packed 1-D column as a padded matrix: a length column as its values, one per row (never padded
    with ``pad_id``), any other padded with ``pad_id`` to a multiple of ``multiple``."""
    if column in LENGTH_COLUMNS:
        return padding.length_column(column, flat, lengths)
    return padding.pad_flat(flat, lengths, padding.pad_value_of(flat, pad_id), multiple)


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
        else:
            padded[column] = _padded(column, data, lengths, pad_id, multiple)
    return padded


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
