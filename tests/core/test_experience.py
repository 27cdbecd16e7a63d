"""Tests for broker.api.batches and MindSpeed's padded batches (broker.adapters.mindspeed.padding): the seed
document's examples, round trips, and bad input.

No Redis needed. Every comparison is exact (values, dtype and shape), so a wrong pad value, width
or dtype fails.
"""

from __future__ import annotations

import doctest

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import broker.adapters.mindspeed.padding as padding_module
import broker.api.batches as experience_module
from broker.adapters.mindspeed.padding import (
    padding_dict_to_tensor_dict,
    remove_padding_tensor_dict_to_dict,
    trans_input_to_experience,
)
from broker.api.batches import (
    ORIGINAL_LENGTH_KEY,
    pack_experience_columns,
    pad_experience,
    put_prompts_experience,
    unpack_pad_experience,
)
from broker.errors import InvalidExperienceError

t = torch.tensor


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert isinstance(actual, torch.Tensor)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual, expected), (actual, expected)


def assert_dict_same(actual: dict, expected: dict) -> None:
    assert type(actual) is dict
    assert list(actual) == list(expected)
    for key, value in expected.items():
        if isinstance(value, list):
            assert isinstance(actual[key], list) and len(actual[key]) == len(value), key
            for got, want in zip(actual[key], value, strict=True):
                assert_same(got, want)
        else:
            assert_same(actual[key], value)


# --------------------------------------------------------------------------------------------------
# The seed document's examples, one test each
# --------------------------------------------------------------------------------------------------


def test_seed_pad_experience():
    experience_batch = {
        "prompts": [t([1, 1, 1, 1]), t([2, 2, 2, 2]), t([3, 3, 3, 3]), t([4, 4, 4, 4])],
        "attention_mask": [t([1]), t([2, 2]), t([3, 3, 3]), t([4, 4, 4, 4])],
    }
    out = pad_experience(experience_batch, pad_id=0.0, multiple=1)
    assert_dict_same(
        out,
        {
            "prompts": t([[1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3], [4, 4, 4, 4]]),
            "attention_mask": t([[1, 0, 0, 0], [2, 2, 0, 0], [3, 3, 3, 0], [4, 4, 4, 4]]),
        },
    )


def seed_pack_input() -> dict[str, list[torch.Tensor]]:
    return {
        "prompts": [t([1, 1, 1]), t([2, 2, 2, 2]), t([3, 3, 3]), t([4, 4, 4, 4])],
        "attention_mask": [t([1]), t([2, 2]), t([3, 3, 3]), t([4, 4, 4, 4])],
    }


def test_seed_pack_experience_columns():
    batch_data, batch_data_length = pack_experience_columns(seed_pack_input(), 4)
    assert_dict_same(
        batch_data,
        {
            "prompts": t([1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 4, 4, 4, 4]),
            "attention_mask": t([1, 2, 2, 3, 3, 3, 4, 4, 4, 4]),
        },
    )
    assert_dict_same(
        batch_data_length,
        {
            "prompts": t([3, 4, 3, 4], dtype=torch.int32),
            "attention_mask": t([1, 2, 3, 4], dtype=torch.int32),
        },
    )


def seed_packed() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return (
        {
            "prompts": t([1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 4, 4, 4, 4]),
            "attention_mask": t([1, 2, 2, 3, 3, 3, 4, 4, 4, 4]),
        },
        {"prompts": t([3, 4, 3, 4]), "attention_mask": t([1, 2, 3, 4])},
    )


def test_seed_unpack_pad_experience_multiple_2_follows_mindspeed_code():
    # The seed (and MindSpeed's docstring) print 8 columns for multiple=2, but MindSpeed's code rounds
    # the longest row (4) up to a multiple of 2, which is 4. We follow the code.
    batch_data, batch_data_length = seed_packed()
    out = unpack_pad_experience(batch_data, batch_data_length, pad_id=-1, multiple=2)
    assert_dict_same(
        out,
        {
            "prompts": t([[1, 1, 1, -1], [2, 2, 2, 2], [3, 3, 3, -1], [4, 4, 4, 4]]),
            "attention_mask": t([[1, -1, -1, -1], [2, 2, -1, -1], [3, 3, 3, -1], [4, 4, 4, 4]]),
        },
    )


def test_seed_unpack_pad_experience_printed_matrices_need_multiple_8():
    # The 8-wide matrices the seed prints are what the rule gives when the multiple is 8.
    batch_data, batch_data_length = seed_packed()
    out = unpack_pad_experience(batch_data, batch_data_length, pad_id=-1, multiple=8)
    assert_dict_same(
        out,
        {
            "prompts": t(
                [
                    [1, 1, 1, -1, -1, -1, -1, -1],
                    [2, 2, 2, 2, -1, -1, -1, -1],
                    [3, 3, 3, -1, -1, -1, -1, -1],
                    [4, 4, 4, 4, -1, -1, -1, -1],
                ]
            ),
            "attention_mask": t(
                [
                    [1, -1, -1, -1, -1, -1, -1, -1],
                    [2, 2, -1, -1, -1, -1, -1, -1],
                    [3, 3, 3, -1, -1, -1, -1, -1],
                    [4, 4, 4, 4, -1, -1, -1, -1],
                ]
            ),
        },
    )


def test_seed_trans_input_to_experience():
    experience_dict = {
        "prompts": t([[1, 1, 1, 1], [2, 2, 2, 2], [3, 3, 3, 3], [4, 4, 4, 4]]),
        "attention_mask": [t([1]), t([2, 2]), t([3, 3, 3]), t([4, 4, 4, 4])],
    }
    columns, data = trans_input_to_experience(experience_dict)
    assert columns == ["prompts", "attention_mask"]
    expected = [
        [t([1, 1, 1, 1]), t([2, 2, 2, 2]), t([3, 3, 3, 3]), t([4, 4, 4, 4])],
        [t([1]), t([2, 2]), t([3, 3, 3]), t([4, 4, 4, 4])],
    ]
    assert len(data) == 2
    for got_column, want_column in zip(data, expected, strict=True):
        assert len(got_column) == len(want_column)
        for got, want in zip(got_column, want_column, strict=True):
            assert_same(got, want)  # int64 stays int64 (MindSpeed would narrow to int32)


def test_seed_put_prompts_experience():
    # The seed only describes it: repeat each prompt n_samples_per_prompt times before the dock.
    batch = {"prompts": [t([1, 1, 1]), t([2, 2])]}
    data, indexes = put_prompts_experience(batch, n_samples_per_prompt=2)
    assert_dict_same(
        data,
        {
            "prompt_length": t([[3], [3], [2], [2]]),
            "prompts": t([[1, 1, 1], [1, 1, 1], [2, 2, 0], [2, 2, 0]]),
            ORIGINAL_LENGTH_KEY: t([1, 1, 1, 1, 3, 3, 2, 2]),
        },
    )
    assert indexes == [0, 1, 2, 3]


def test_seed_remove_padding_tensor_dict_to_dict_as_printed():
    data = {"prompt": t([[1, 1, 1, 0], [2, 2, 2, 2]]), "original_length": t([3, 4])}
    assert_dict_same(remove_padding_tensor_dict_to_dict(data), {"prompt": [t([1, 1, 1]), t([2, 2, 2, 2])]})


def test_seed_remove_padding_tensor_dict_to_dict_with_attention_mask():
    # The seed's output also lists attention_mask, so its input must have carried it (abbreviated).
    data = {
        "prompt": t([[1, 1, 1, 0], [2, 2, 2, 2]]),
        "attention_mask": t([[1, 0], [2, 2]]),
        "original_length": t([3, 4, 1, 2]),
    }
    assert_dict_same(
        remove_padding_tensor_dict_to_dict(data),
        {"prompt": [t([1, 1, 1]), t([2, 2, 2, 2])], "attention_mask": [t([1]), t([2, 2])]},
    )


def test_seed_padding_dict_to_tensor_dict():
    # The seed prints only "prompt" and a misspelled "origtinal_length" of [3, 4]; MindSpeed's code
    # names it original_length and appends every column's lengths.
    data = {"prompt": [t([1, 1, 1]), t([2, 2, 2, 2])], "attention_mask": [t([1]), t([2, 2])]}
    assert_dict_same(
        padding_dict_to_tensor_dict(data),
        {
            "prompt": t([[1, 1, 1, 0], [2, 2, 2, 2]]),
            "attention_mask": t([[1, 0], [2, 2]]),
            "original_length": t([3, 4, 1, 2]),
        },
    )


# --------------------------------------------------------------------------------------------------
# Further behaviour
# --------------------------------------------------------------------------------------------------


def test_docstring_examples():
    results = [doctest.testmod(module) for module in (experience_module, padding_module)]
    assert sum(r.attempted for r in results) >= 7
    assert not any(r.failed for r in results)


def test_pad_experience_float_columns_pad_with_zero_and_round_to_multiple():
    batch = {
        "old_log_prob": [t([-0.5, -1.5, -2.0]), t([-0.25])],
        "responses": [t([5, 6, 7], dtype=torch.int32), t([8], dtype=torch.int32)],
    }
    out = pad_experience(batch, pad_id=99, multiple=4)
    assert_dict_same(
        out,
        {
            "old_log_prob": t([[-0.5, -1.5, -2.0, 0.0], [-0.25, 0.0, 0.0, 0.0]]),
            "responses": t([[5, 6, 7, 99], [8, 99, 99, 99]], dtype=torch.int32),
        },
    )


def test_pad_experience_casts_pad_to_column_dtype():
    out = pad_experience(
        {
            "mask": [t([True]), t([], dtype=torch.bool)],
            "bytes": [t([1], dtype=torch.uint8), t([], dtype=torch.uint8)],
        },
        pad_id=-1,
    )
    assert_same(out["mask"], t([[True], [True]]))
    assert_same(out["bytes"], t([[1], [255]], dtype=torch.uint8))


def test_pad_experience_length_columns_become_column_vectors():
    out = pad_experience(
        {"response_length": [t([3]), t([5])], "prompt_length": t([[2], [4]], dtype=torch.int32)},
        pad_id=0,
        multiple=8,
    )
    assert_same(out["response_length"], t([[3], [5]]))
    assert_same(out["prompt_length"], t([[2], [4]], dtype=torch.int32))


def test_zero_length_rows():
    empty = t([], dtype=torch.int64)
    rows = {"responses": [empty, t([4, 5]), empty]}
    assert_same(pad_experience(rows, pad_id=-1)["responses"], t([[-1, -1], [4, 5], [-1, -1]]))

    packed, lengths = pack_experience_columns(rows, 3)
    assert_same(lengths["responses"], t([0, 2, 0], dtype=torch.int32))
    assert_same(
        unpack_pad_experience(packed, lengths, -1, 4)["responses"], t([[-1] * 4, [4, 5, -1, -1], [-1] * 4])
    )

    padded = padding_dict_to_tensor_dict(rows)
    assert_same(padded[ORIGINAL_LENGTH_KEY], t([0, 2, 0]))
    assert_dict_same(remove_padding_tensor_dict_to_dict(padded), {"responses": [empty, t([4, 5]), empty]})


def test_all_rows_empty_gives_zero_width():
    rows = {"x": [t([], dtype=torch.float32), t([], dtype=torch.float32)]}
    assert_same(pad_experience(rows, pad_id=0, multiple=4)["x"], torch.empty((2, 0), dtype=torch.float32))
    padded = padding_dict_to_tensor_dict(rows)
    assert_same(padded["x"], torch.empty((2, 0), dtype=torch.float32))
    assert_dict_same(remove_padding_tensor_dict_to_dict(padded), rows)


def test_unpack_length_columns_and_pad_experience_agree():
    rows = {
        "prompt_length": [t([3]), t([1])],
        "prompts": [t([1, 2, 3]), t([4])],
        "advantages": [t([0.5, 0.5, 0.5], dtype=torch.bfloat16), t([1.0], dtype=torch.bfloat16)],
    }
    packed, lengths = pack_experience_columns(rows, 2)
    out = unpack_pad_experience(packed, lengths, pad_id=7, multiple=2)
    assert_dict_same(
        out,
        {
            "prompt_length": t([[3], [1]]),
            "prompts": t([[1, 2, 3, 7], [4, 7, 7, 7]]),
            "advantages": t([[0.5, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16),
        },
    )
    assert_dict_same(out, pad_experience(rows, pad_id=7, multiple=2))


def test_padding_dict_to_tensor_dict_accepts_padded_matrix():
    scores = t([[0.5], [1.5]])
    out = padding_dict_to_tensor_dict({"rm_scores": scores, "responses": [t([1, 2]), t([3])]})
    assert out["rm_scores"] is scores
    assert_same(out["responses"], t([[1, 2], [3, 0]]))
    assert_same(out[ORIGINAL_LENGTH_KEY], t([1, 1, 2, 1]))
    assert list(out)[-1] == ORIGINAL_LENGTH_KEY


def test_remove_padding_passthrough_cases():
    assert remove_padding_tensor_dict_to_dict(None) == {}
    unpadded = {"prompts": t([[1, 2]])}
    out = remove_padding_tensor_dict_to_dict(unpadded)
    assert out == unpadded and out is not unpadded


def test_trans_input_to_experience_skips_none_and_keeps_dtype():
    columns, data = trans_input_to_experience(
        {"rm_scores": None, "ids": t([[1, 2], [3, 4]], dtype=torch.int64), "m": [t([True]), t([False])]}
    )
    assert columns == ["ids", "m"]
    assert_same(data[0][1], t([3, 4]))
    assert_same(data[1][0], t([True]))


def naive_put_prompts(batch, n, keys):
    """MindSpeed's literal algorithm: repeat row by row, then padding_dict_to_tensor_dict."""
    repeated = {
        "prompt_length": [t([len(p)]) for p in batch["prompts"] for _ in range(n)],
        "prompts": [p.clone() for p in batch["prompts"] for _ in range(n)],
    }
    for key in keys:
        if key in batch:
            repeated[key] = [v for v in batch[key] for _ in range(n)]
    return padding_dict_to_tensor_dict(repeated)


def test_put_prompts_experience_additional_keys_and_indexes():
    batch = {
        "prompts": [t([1, 1, 1], dtype=torch.int32), t([2], dtype=torch.int32)],
        "labels": [t([9.0]), t([8.0, 8.5])],
        "ignored": [t([0]), t([0])],
    }
    keys = ["labels", "not_in_batch"]
    data, indexes = put_prompts_experience(batch, 3, keys)
    assert_dict_same(data, naive_put_prompts(batch, 3, keys))
    assert list(data) == ["prompt_length", "prompts", "labels", ORIGINAL_LENGTH_KEY]
    assert_same(data["prompts"][3], t([2, 0, 0], dtype=torch.int32))
    assert_same(data["labels"][0], t([9.0, 0.0]))
    assert indexes == list(range(6))

    _, indexes = put_prompts_experience(batch, 3, keys, indexes=range(10, 16))
    assert indexes == [10, 11, 12, 13, 14, 15]
    _, indexes = put_prompts_experience(batch, 3, keys, indexes=[0] * 6, add_another_batch=True)
    assert indexes == [6, 7, 8, 9, 10, 11]


def test_put_prompts_experience_accepts_padded_prompts():
    data, _ = put_prompts_experience({"prompts": t([[5, 6], [7, 8]])}, 1)
    assert_same(data["prompts"], t([[5, 6], [7, 8]]))
    assert_same(data["prompt_length"], t([[2], [2]]))
    assert_same(data[ORIGINAL_LENGTH_KEY], t([1, 1, 2, 2]))


# --------------------------------------------------------------------------------------------------
# Round trips over random rows
# --------------------------------------------------------------------------------------------------

DTYPES = [torch.int32, torch.float32, torch.bfloat16, torch.bool]


def make_row(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return t([v % 2 == 1 for v in values], dtype=torch.bool)
    if dtype.is_floating_point:
        # quarters of small ints are exact in bfloat16 too, so equality is exact
        return (t(values, dtype=torch.float32) / 4).to(dtype)
    return t(values, dtype=dtype)


@st.composite
def experiences(draw) -> dict[str, list[torch.Tensor]]:
    n_rows = draw(st.integers(1, 6))
    n_columns = draw(st.integers(1, 3))
    batch = {}
    for c in range(n_columns):
        dtype = draw(st.sampled_from(DTYPES))
        batch[f"col{c}"] = [
            make_row(draw(st.lists(st.integers(-64, 64), max_size=9)), dtype) for _ in range(n_rows)
        ]
    return batch


@settings(max_examples=200, deadline=None)
@given(batch=experiences(), pad_id=st.integers(-5, 5), multiple=st.integers(1, 4))
def test_pack_unpack_round_trip(batch, pad_id, multiple):
    n_rows = len(next(iter(batch.values())))
    packed, lengths = pack_experience_columns(batch, n_rows)
    out = unpack_pad_experience(packed, lengths, pad_id, multiple)
    assert list(out) == list(batch)
    for column, rows in batch.items():
        dtype = rows[0].dtype
        longest = max(len(r) for r in rows)
        width = -(-longest // multiple) * multiple
        matrix = out[column]
        assert matrix.dtype == dtype and matrix.shape == (n_rows, width)
        pad = t(0.0 if dtype.is_floating_point else pad_id).to(dtype)
        for i, row in enumerate(rows):
            assert torch.equal(matrix[i, : len(row)], row)
            assert torch.equal(matrix[i, len(row) :], pad.expand(width - len(row)))
        assert_same(lengths[column], t([len(r) for r in rows], dtype=torch.int32))
    assert_dict_same(out, pad_experience(batch, pad_id, multiple))


@settings(max_examples=200, deadline=None)
@given(batch=experiences())
def test_padding_dict_round_trip(batch):
    padded = padding_dict_to_tensor_dict(batch)
    assert list(padded) == [*batch, ORIGINAL_LENGTH_KEY]
    assert_same(padded[ORIGINAL_LENGTH_KEY], t([len(r) for rows in batch.values() for r in rows]))
    for column, rows in batch.items():
        assert padded[column].shape == (len(rows), max(len(r) for r in rows))
    restored = remove_padding_tensor_dict_to_dict(padded)
    assert_dict_same(restored, batch)
    columns, data = trans_input_to_experience(restored)
    assert columns == list(batch)
    for got_rows, want_rows in zip(data, batch.values(), strict=True):
        for got, want in zip(got_rows, want_rows, strict=True):
            assert_same(got, want)


# --------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------

ROWS = [t([1, 2]), t([3])]

BAD_CALLS = [
    # pad_experience
    (lambda: pad_experience({}, 0), "empty"),
    (lambda: pad_experience({"a": [t([[1, 2]])]}, 0), r"row 0 has shape \(1, 2\); rows must be 1-D"),
    (lambda: pad_experience({"a": ROWS, "b": [t([1])]}, 0), "mismatched row counts"),
    (lambda: pad_experience({"a": []}, 0), "'a' has no rows"),
    (lambda: pad_experience({"a": [t([1]), t([1.0])]}, 0), "mixes dtypes"),
    (lambda: pad_experience({"a": [t([1]), [2]]}, 0), "row 1 is a list, not a tensor"),
    (lambda: pad_experience({"a": ROWS}, 0, multiple=0), "multiple must be a positive int"),
    (lambda: pad_experience({"response_length": [t([1, 2]), t([3])]}, 0), "exactly one value per row"),
    (lambda: pad_experience({"a": t([1, 2])}, 0), r"shape \(2,\); a tensor column must be 2-D"),
    # pack_experience_columns
    (lambda: pack_experience_columns({}, 2), "empty"),
    (lambda: pack_experience_columns({"a": ROWS}, 3), "'a' has 2 rows but experience_count is 3"),
    (lambda: pack_experience_columns({"a": ROWS}, 0), "experience_count must be a positive int"),
    (lambda: pack_experience_columns({"a": [t(1), t(2)]}, 2), "rows must be 1-D"),
    # unpack_pad_experience
    (lambda: unpack_pad_experience({}, {}, 0, 1), "empty"),
    (lambda: unpack_pad_experience({"a": t([1])}, {"b": t([1])}, 0, 1), "different columns"),
    (lambda: unpack_pad_experience({"a": t([1, 2])}, {"a": t([1, 2])}, 0, 1), "sum to 3 but .* 2 values"),
    (lambda: unpack_pad_experience({"a": t([[[1, 2]]])}, {"a": t([2])}, 0, 1), r"packed 1-D \(or 2-D\) tensor"),
    (lambda: pack_experience_columns({"a": [t([[1, 2]]), t([[1], [2]])]}, 2), "must share their first dimension"),
    (lambda: unpack_pad_experience({"a": t([1])}, {"a": t([1.0])}, 0, 1), "1-D integer tensor"),
    (lambda: unpack_pad_experience({"a": t([1])}, {"a": t([2, -1])}, 0, 1), "negative row lengths"),
    (lambda: unpack_pad_experience({"a": t([1])}, {"a": t([1])}, 0, 0), "multiple must be a positive int"),
    (
        lambda: unpack_pad_experience({"a": t([1]), "b": t([1, 2])}, {"a": t([1]), "b": t([1, 1])}, 0, 1),
        "mismatched row counts",
    ),
    # padding_dict_to_tensor_dict
    (lambda: padding_dict_to_tensor_dict({}), "empty"),
    (lambda: padding_dict_to_tensor_dict({"a": ROWS, "b": [t([1])]}), "mismatched row counts"),
    (lambda: padding_dict_to_tensor_dict({"a": ROWS, "original_length": ROWS}), "reserved"),
    (lambda: padding_dict_to_tensor_dict({"a": t([1.0, 2.0])}), "must be 2-D"),
    (lambda: padding_dict_to_tensor_dict({"a": [t([[1, 2]]), t([[1]])]}), "must agree past their first dimension"),
    (lambda: padding_dict_to_tensor_dict({"a": "text"}), "list of 1-D tensors or a 2-D tensor, got str"),
    # remove_padding_tensor_dict_to_dict
    (
        lambda: remove_padding_tensor_dict_to_dict({"a": t([[1, 2]]), "original_length": t([1, 1])}),
        "has 2 entries but 1 columns of 1 rows need 1",
    ),
    (
        lambda: remove_padding_tensor_dict_to_dict({"a": t([[1, 2]]), "original_length": t([3])}),
        r"width 2 .* row lengths \[3\]",
    ),
    (lambda: remove_padding_tensor_dict_to_dict({"a": t([1, 2]), "original_length": t([2])}),
     "padded tensor of 2 or more"),
    (lambda: remove_padding_tensor_dict_to_dict([1]), "must be a dict"),
    # trans_input_to_experience
    (lambda: trans_input_to_experience({}), "empty"),
    (lambda: trans_input_to_experience({"a": None}), "every value is None"),
    (lambda: trans_input_to_experience({"a": 3}), "got int"),
    (lambda: trans_input_to_experience({"a": t([1, 2])}), "must be 2-D"),
    (lambda: trans_input_to_experience({"a": ROWS, "b": [t([1])]}), "mismatched row counts"),
    # put_prompts_experience
    (lambda: put_prompts_experience({}, 2), "empty"),
    (lambda: put_prompts_experience({"labels": ROWS}, 2), "no 'prompts' column"),
    (lambda: put_prompts_experience({"prompts": ROWS}, 0), "n_samples_per_prompt must be a positive int"),
    (lambda: put_prompts_experience({"prompts": ROWS}, 2, indexes=[0, 1]), "got 2 indexes for .* = 4 rows"),
    (lambda: put_prompts_experience({"prompts": ROWS, "x": [t([1])]}, 2, ["x"]), "mismatched row counts"),
    (lambda: put_prompts_experience({"prompts": ROWS}, 2, ["prompt_length"]), "may not contain"),
    (lambda: put_prompts_experience({"prompts": []}, 2), "'prompts' has no rows"),
]


@pytest.mark.parametrize(("call", "message"), BAD_CALLS)
def test_bad_input_raises(call, message):
    with pytest.raises(InvalidExperienceError, match=message):
        call()


def test_invalid_experience_error_is_a_value_error():
    with pytest.raises(ValueError):
        pad_experience({}, 0)


def test_rows_of_two_and_more_dimensions_pad_along_their_first_and_come_back():
    pixels = [torch.rand(2, 3), torch.rand(4, 3)]  # patches x features, as multimodal pixel_values
    same = [torch.rand(1, 8), torch.rand(1, 8)]     # MindSpeed's own test rows
    padded = padding_dict_to_tensor_dict({"pixel_values": pixels, "prompts": same, "labels": ["a", "b"]})
    assert padded["pixel_values"].shape == (2, 4, 3) and padded["prompts"].shape == (2, 1, 8)
    assert padded["original_length"].tolist() == [2, 4, 1, 1]  # first dimensions, as MindSpeed records
    back = remove_padding_tensor_dict_to_dict(padded)
    assert all(torch.equal(a, b) for a, b in zip(back["pixel_values"], pixels))
    assert all(torch.equal(a, b) for a, b in zip(back["prompts"], same))
    assert back["labels"] == ["a", "b"]


def test_two_dimensional_position_ids_pack_along_their_last_dimension_as_mindspeed():
    rows = [torch.arange(6).reshape(3, 2), torch.arange(9).reshape(3, 3)]  # mrope: 3 x length
    data, lengths = pack_experience_columns({"position_ids": rows}, 2)
    assert data["position_ids"].shape == (3, 5) and lengths["position_ids"].tolist() == [2, 3]
    out = unpack_pad_experience(data, lengths, pad_id=-1, multiple=2)["position_ids"]
    assert out.shape == (2, 3, 4)
    assert torch.equal(out[0, :, :2], rows[0]) and torch.equal(out[1, :, :3], rows[1])
    assert bool((out[0, :, 2:] == -1).all()) and bool((out[1, :, 3:] == -1).all())


# --------------------------------------------------------------------------------------------------
# The fast paths (numpy copies, one concatenation for one-value rows) keep the semantics
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", [
    [t([1, 2, 3], dtype=torch.int32), t([4], dtype=torch.int32), t([], dtype=torch.int32)],  # numpy copies
    [t([0.5]), t([1.5]), t([2.5])],                                                          # one value per row
    [t([1, 2], dtype=torch.bfloat16), t([3], dtype=torch.bfloat16)],                         # numpy has no bfloat16
    [t([1.0, 2.0], requires_grad=True), t([3.0])],                                           # autograd
    [t([True, False]), t([True])],
])
def test_padding_matches_pad_sequence_whichever_way_it_is_made(rows):
    padded = padding_dict_to_tensor_dict({"a": rows})
    want = torch.nn.utils.rnn.pad_sequence([r.detach() for r in rows], batch_first=True)
    assert_same(padded["a"].detach(), want)
    assert padded[ORIGINAL_LENGTH_KEY].tolist() == [len(r) for r in rows]


@pytest.mark.parametrize("rows", [[t([1]), t([2.0])], [t([1, 2]), t([2.0])]])
def test_padding_refuses_a_column_of_mixed_dtypes_on_every_path(rows):
    with pytest.raises(InvalidExperienceError, match="mixes dtypes"):
        padding_dict_to_tensor_dict({"a": rows})


@pytest.mark.parametrize("padded", [
    t([[1, 2, 3], [4, 0, 0]], dtype=torch.int32),        # ragged: numpy views
    t([[1], [4]], dtype=torch.int32),                    # every row full: unbind
    t([[1, 2, 3], [4, 0, 0]], dtype=torch.bfloat16),     # numpy cannot view it: indexing
])
def test_unpadded_rows_are_views_of_the_batch(padded):
    lengths = [3, 1] if padded.shape[1] == 3 else [1, 1]
    rows = remove_padding_tensor_dict_to_dict({"a": padded, ORIGINAL_LENGTH_KEY: t(lengths)})["a"]
    assert [r.tolist() for r in rows] == [padded[i, :n].tolist() for i, n in enumerate(lengths)]
    rows[1][0] = 9  # as MindSpeed's: writing into a row writes into the batch
    assert padded[1, 0].item() == 9


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2,
                                   torch.complex64, torch.complex128], ids=str)
def test_padding_helpers_take_every_dtype_the_dock_stores(dtype):
    """torch has no masked_scatter_ for uint16 and wider nor for float8; complex columns pad with 0 as floats do."""
    def bits(x: torch.Tensor) -> bytes:  # float8 has no torch.equal
        return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    rows = [t([1, 2, 3]).to(dtype), t([4]).to(dtype)]
    pad = 0 if dtype.is_floating_point or dtype.is_complex else -1  # -1 wraps, as for uint8
    want = t([[1, 2, 3, pad], [4, pad, pad, pad]]).to(dtype)
    for padded in (pad_experience({"a": rows}, pad_id=-1, multiple=2)["a"],
                   unpack_pad_experience(*pack_experience_columns({"a": rows}, 2), pad_id=-1, multiple=2)["a"]):
        assert padded.dtype == dtype and bits(padded) == bits(want)
    padded = padding_dict_to_tensor_dict({"a": rows, "b": [t([[1, 2]]).to(dtype), t([[3, 4], [5, 6]]).to(dtype)]})
    assert padded["a"].dtype == padded["b"].dtype == dtype
    back = remove_padding_tensor_dict_to_dict(padded)
    for got, want_row in zip(back["a"] + back["b"], rows + [t([[1, 2]]).to(dtype), t([[3, 4], [5, 6]]).to(dtype)]):
        assert got.dtype == dtype and got.shape == want_row.shape and bits(got) == bits(want_row)
