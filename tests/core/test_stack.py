"""``get_experience(..., stack=True)`` and ``read_rows(..., stack=True)``: a column decoded straight into one
tensor (stacked, or jagged nested when the rows' first dims differ), or the list where its rows do not stack.

The decoding itself is checked here without Redis over every dtype (``broker/data/stacking.py``), then
through the dock on every backend: round trips, what stays a list, corrupt rows, and that the result
owns its memory.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from broker import DecodeError
from broker.data import codec, row_header, stacking
from tests.helpers import data_cell, fill

FIELDS = [str(i) for i in range(64)]


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, so that equality is bit-exact (NaNs, bfloat16 and bool included)."""
    return t.contiguous().view(-1).view(torch.uint8)


def random_rows(dtype: torch.dtype, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Rows of random bits (NaNs and all) of ``dtype``, 0/1 for bool."""
    rows = []
    for shape in shapes:
        raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * torch.empty((), dtype=dtype).element_size(),),
                            dtype=torch.uint8)
        rows.append((raw % 2).bool().reshape(shape) if dtype is torch.bool else raw.view(dtype).reshape(shape))
    return rows


def decode_stacked(rows: list[object]) -> torch.Tensor | list[object]:
    return stacking.decode_stacked([codec.encode_row(r) for r in rows], where="td:{d}:data:c", fields=FIELDS)


@pytest.mark.parametrize("dtype", list(row_header.DTYPES.values()), ids=list(row_header.DTYPES))
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (0, 4)])
def test_uniform_rows_stack_bit_exact(dtype, shape):
    rows = random_rows(dtype, [shape] * 6)
    out = decode_stacked(rows)
    assert isinstance(out, torch.Tensor) and not out.is_nested
    assert out.dtype == dtype and out.shape == (6, *shape)
    assert torch.equal(bits(out), bits(torch.stack(rows)))


@pytest.mark.parametrize("dtype", list(row_header.DTYPES.values()), ids=list(row_header.DTYPES))
def test_ragged_rows_become_a_jagged_nested_tensor(dtype):
    rows = random_rows(dtype, [(3, 2), (0, 2), (5, 2), (1, 2)])
    out = decode_stacked(rows)
    assert isinstance(out, torch.Tensor) and out.is_nested and out.layout == torch.jagged and out.dtype == dtype
    assert [tuple(r.shape) for r in out.unbind()] == [(3, 2), (0, 2), (5, 2), (1, 2)]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(out.unbind(), rows))


@pytest.mark.parametrize("rows", [
    pytest.param(["a", {"k": 1}], id="values"),
    pytest.param([torch.ones(2), "a"], id="a tensor and a value"),
    pytest.param([torch.ones(2), torch.ones(2, dtype=torch.float64)], id="mixed dtypes"),
    pytest.param([torch.ones(2), torch.ones(2, 1)], id="mixed ranks"),
    pytest.param([torch.tensor(1), torch.tensor([1])], id="0-d beside 1-d"),
    pytest.param([torch.ones(2, 3), torch.ones(2, 4)], id="trailing dims differ"),
])
def test_rows_that_do_not_stack_come_back_as_the_list(rows):
    out = decode_stacked(rows)
    assert isinstance(out, list)
    for got, want in zip(out, rows):
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want


def test_stacking_makes_no_tensor_per_row(monkeypatch):
    """One allocation and a copy per row: neither the list decoder nor torch.frombuffer is called."""
    def refuse(*args, **kwargs):
        raise AssertionError("a tensor per row")

    rows = [torch.arange(4.0) + i for i in range(5)]
    values = [codec.encode(r) for r in rows]
    monkeypatch.setattr(codec, "decode_rows", refuse)
    monkeypatch.setattr(torch, "frombuffer", refuse)
    assert torch.equal(stacking.decode_stacked(values, where="k", fields=FIELDS), torch.stack(rows))


@pytest.mark.parametrize("damage", ["garbage", "bool payload", "short payload"])
def test_a_corrupt_row_raises_decode_error_naming_it(damage):
    rows = [torch.tensor([True, False, True])] * 4
    values = [codec.encode(r) for r in rows]
    if damage == "garbage":
        values[2] = b"\x80\x04garbage"
    elif damage == "bool payload":
        values[2] = values[2][:-1] + b"\x02"
    else:
        values[2] = values[2][:-1]
    with pytest.raises(DecodeError, match="td:{d}:data:c field 2"):
        stacking.decode_stacked(values, where="td:{d}:data:c", fields=FIELDS)


def test_the_result_owns_its_memory():
    values = [codec.encode(torch.arange(3.0) + i) for i in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "The given buffer is not writable" among them
        out = stacking.decode_stacked(values, where="k", fields=FIELDS)
        out += 100
    assert torch.equal(stacking.decode_stacked(values, where="k", fields=FIELDS),
                       torch.stack([torch.arange(3.0) + i for i in range(4)]))


# -- through the dock, on every backend ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, shape", [
    (torch.float32, (5,)), (torch.float32, (2, 3)), (torch.bfloat16, (4,)), (torch.bool, (6,)), (torch.int64, (3,)),
])
def test_read_rows_and_get_stack_uniform_columns(make_dock, dtype, shape):
    dock = make_dock(prompts_num=2, n=2, columns=("x",))
    rows = random_rows(dtype, [shape] * 4)
    dock.put_experience({"x": rows}, indexes=[0, 1, 2, 3])
    read = dock.read_rows(["x"], [3, 1, 0, 2], stack=True)["x"]
    assert read.dtype == dtype and read.shape == (4, *shape)
    assert torch.equal(bits(read), bits(torch.stack([rows[i] for i in (3, 1, 0, 2)])))
    batch, got = dock.get_experience("actor_train", ["x"], 4, stack=True)
    assert batch["x"].shape == (4, *shape)
    assert torch.equal(bits(batch["x"]), bits(torch.stack([rows[i] for i in got])))


def test_ragged_rows_come_back_jagged(make_dock):
    dock = make_dock(prompts_num=2, n=2, columns=("responses",))
    rows = [torch.arange(n, dtype=torch.int32) for n in (3, 1, 4, 2)]
    dock.put_experience({"responses": rows}, indexes=[0, 1, 2, 3])
    out = dock.read_rows(["responses"], [0, 1, 2, 3], stack=True)["responses"]
    assert out.is_nested and out.layout == torch.jagged
    assert all(torch.equal(a, b) for a, b in zip(out.unbind(), rows))


def test_values_and_unwritten_rows_stay_lists(make_dock):
    dock = make_dock(prompts_num=2, n=2, columns=("labels", "meta", "prompts"))
    dock.put_experience({"labels": ["a", "b", "c", "d"], "meta": [{"i": i} for i in range(4)]}, indexes=[0, 1, 2, 3])
    dock.put_experience({"prompts": [torch.ones(2)] * 3}, indexes=[0, 1, 3])
    batch = dock.read_rows(["labels", "meta", "prompts"], [0, 1, 2, 3], stack=True)
    assert batch["labels"] == ["a", "b", "c", "d"] and batch["meta"] == [{"i": i} for i in range(4)]
    assert isinstance(batch["prompts"], list) and batch["prompts"][2] is None
    assert isinstance(dock.read_rows(["prompts"], [0, 1, 3], stack=True)["prompts"], torch.Tensor)


def test_get_stacks_whole_groups_as_the_list_form_gives_them(make_dock):
    dock = make_dock(prompts_num=3, n=2, columns=("prompts", "responses", "labels"),
                     consumers=("listed", "stacked"))
    fill(dock, ["prompts"])
    dock.put_experience({"responses": [torch.arange(r + 1.0) for r in range(6)], "labels": list("abcdef")},
                        indexes=list(range(6)))
    columns = ["prompts", "responses", "labels"]
    listed, rows = dock.get_experience("listed", columns, 4, policy="fifo")
    stacked, same = dock.get_experience("stacked", columns, 4, policy="fifo", stack=True)
    assert rows == same and len(rows) == 4 and rows[0] // 2 == rows[1] // 2 and rows[2] // 2 == rows[3] // 2
    assert torch.equal(stacked["prompts"], torch.stack(listed["prompts"]))
    assert all(torch.equal(a, b) for a, b in zip(stacked["responses"].unbind(), listed["responses"]))
    assert stacked["labels"] == listed["labels"]


def test_dp_padding_and_explicit_rows_are_stacked_in_the_order_returned(make_dock):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",), consumers=("listed", "stacked"))
    fill(dock)
    listed, rows = dock.get_experience("listed", ["prompts"], indexes=[3, 0, 2], dp_size=2, dp_padding=True)
    stacked, same = dock.get_experience("stacked", ["prompts"], indexes=[3, 0, 2], dp_size=2, dp_padding=True,
                                        stack=True)
    assert list(rows) == list(same) == [3, 0, 2, -2]
    assert torch.equal(stacked["prompts"], torch.stack(listed["prompts"]))


def test_a_stacked_read_owns_its_memory(make_dock):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",))
    fill(dock)
    first = dock.read_rows(["prompts"], [0, 1, 2, 3], stack=True)["prompts"]
    first.fill_(-1)
    batch, rows = dock.get_experience("actor_train", ["prompts"], 4, stack=True)
    batch["prompts"].fill_(-1)
    assert dock.read_rows(["prompts"], [0, 1, 2, 3], stack=True)["prompts"].tolist() == [[r, 7] for r in range(4)]


def test_read_rows_names_a_corrupt_row(make_dock, client):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",))
    fill(dock)
    client.hset(*data_cell(dock, "prompts", 2), b"\x80\x04garbage")
    with pytest.raises(DecodeError, match="field 2"):
        dock.read_rows(["prompts"], [0, 1, 2, 3], stack=True)


def test_stack_must_be_a_bool(make_dock):
    from broker import InvalidExperienceError

    dock = make_dock(prompts_num=2, n=2, columns=("prompts",))
    with pytest.raises(InvalidExperienceError, match="stack must be a bool"):
        dock.read_rows(["prompts"], [0], stack=1)
    with pytest.raises(InvalidExperienceError, match="stack must be a bool"):
        dock.get_experience("actor_train", ["prompts"], 2, stack="yes")


def test_a_get_gives_back_a_row_whose_bool_payload_is_corrupt(make_dock, client):
    """The prefix is sound, the payload is not: found before the stacked column is built, as in the list form."""
    dock = make_dock(prompts_num=2, n=2, columns=("mask",))
    dock.put_experience({"mask": [torch.tensor([True, False])] * 4}, indexes=[0, 1, 2, 3])
    key, field = data_cell(dock, "mask", 1)
    client.hset(key, field, client.hget(key, field)[:-1] + b"\x02")
    with pytest.raises(DecodeError, match="field 1: bool payload"):
        dock.get_experience("actor_train", ["mask"], 4, stack=True)
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 0  # given back


def test_the_rollout_consumers_age_column_is_stacked_too(make_dock):
    """On a partial-rollout dock the rollout consumer's batch is reordered oldest first, with an ``age``
    the broker makes: both hold with stack=True, the age a (rows, 1) int32 tensor."""
    from broker import Rollout

    dock = make_dock(2, 2, ("prompts", "responses"), ("actor_rollout", "actor_train"),
                     rollout=Rollout(response_columns=("responses",), max_age=3, gbs_train=2))
    rows = [0, 1, 2, 3]
    dock.put_experience({"prompts": [torch.tensor([r, r]) for r in rows]}, rows, is_prompt=True)
    batch, got = dock.get_experience("actor_rollout", ["prompts", "responses", "age"], 4, get_n_samples=False,
                                     stack=True)
    assert got == rows
    assert batch["prompts"].tolist() == [[r, r] for r in rows]
    assert batch["responses"].shape == (4, 1)  # the placeholders
    assert batch["age"].dtype == torch.int32 and batch["age"].tolist() == [[0]] * 4
