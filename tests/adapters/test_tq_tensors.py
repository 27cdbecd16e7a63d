"""TensorDicts through a real dock as TransferQueue 0.1.11 puts and gets them (broker/transfer_queue/
tensors.py): every kind of field round-trips bit-exact into what TransferQueue's own get returns, bad input is
refused naming the field, and (slow, with the wheel) the same TensorDicts through TransferQueue itself give
the same TensorDicts."""

from __future__ import annotations

import itertools
import logging
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from broker import TransferDock
from broker.errors import BrokerError, DecodeError, InvalidExperienceError
from broker.transfer_queue import tensors
from broker.transfer_queue.tensors import assemble, batch_of_one, columns_of, field_schema

_names = itertools.count()


def jagged(*rows: torch.Tensor) -> torch.Tensor:
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def strided(*rows: torch.Tensor) -> torch.Tensor:
    return torch.nested.as_nested_tensor(list(rows), layout=torch.strided)


def through_dock(where: Any, td: TensorDict, order: Sequence[int] | None = None, **assemble_kw: Any) -> TensorDict:
    """``td`` put into a fresh dock at ``where`` (rows 0..B-1) and read back in ``order`` (default: all)."""
    return puts_through_dock(where, [td], order, **assemble_kw)


def puts_through_dock(where: Any, batches: Sequence[TensorDict], order: Sequence[int] | None = None,
                      **assemble_kw: Any) -> TensorDict:
    """Each batch put in turn into the next rows of a fresh dock at ``where``, as the drop-in's put does
    (``columns_of``, ``put_experience``); the rows read back in ``order`` (default: all) as its get does."""
    names = list(batches[0].keys())
    size = sum(b.batch_size[0] for b in batches)
    dock = TransferDock(where, f"tqt{next(_names)}", prompts_num=max(size, 1), n_samples_per_prompt=1,
                        columns=names, consumers=["reader"])
    try:
        start = 0
        for batch in batches:
            count = batch.batch_size[0]
            dock.put_experience(columns_of(batch, count), indexes=list(range(start, start + count)))
            start += count
        rows = list(range(size)) if order is None else list(order)
        return assemble(dock.read_rows(names, rows, stack=True), len(rows), field_schema(batches[0]), **assemble_kw)
    finally:
        dock.delete()
        dock.close()


# -- bit-exact comparison of what a get returns ---------------------------------------------------------------


def raw(t: torch.Tensor) -> bytes:
    """A dense tensor's bytes: equal bytes are equal values, NaN and -0.0 included."""
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""


def assert_same_tensor(ours: torch.Tensor, theirs: torch.Tensor, where: str) -> None:
    assert type(ours) is type(theirs), where
    assert (ours.is_nested, ours.layout, ours.dtype) == (theirs.is_nested, theirs.layout, theirs.dtype), where
    if ours.is_nested and ours.layout == torch.jagged:
        assert ours._ragged_idx == theirs._ragged_idx, where
        assert torch.equal(ours.offsets(), theirs.offsets()), where
    if ours.is_nested:
        a, b = ours.unbind(), theirs.unbind()
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert (x.dtype, x.shape, raw(x)) == (y.dtype, y.shape, raw(y)), f"{where} row {i}"
    else:
        assert (ours.shape, raw(ours)) == (theirs.shape, raw(theirs)), where


def assert_same_value(ours: Any, theirs: Any, where: str) -> None:
    """Equal values of equal types, recursively; floats, arrays and tensors bit for bit."""
    assert type(ours) is type(theirs), f"{where}: {type(ours).__name__} vs {type(theirs).__name__}"
    if isinstance(ours, torch.Tensor):
        assert_same_tensor(ours, theirs, where)
    elif isinstance(ours, np.ndarray):
        assert (ours.dtype, ours.shape, ours.tobytes()) == (theirs.dtype, theirs.shape, theirs.tobytes()), where
    elif isinstance(ours, np.generic):
        assert (ours.dtype, ours.tobytes()) == (theirs.dtype, theirs.tobytes()), where
    elif isinstance(ours, float):
        assert struct.pack("<d", ours) == struct.pack("<d", theirs), where
    elif isinstance(ours, (list, tuple)):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_value(a, b, f"{where}[{i}]")
    elif isinstance(ours, dict):
        assert list(ours) == list(theirs), where
        for k in ours:
            assert_same_value(ours[k], theirs[k], f"{where}[{k!r}]")
    else:
        assert ours == theirs, where


def assert_same(ours: TensorDict, theirs: TensorDict, where: str = "") -> None:
    """Two TensorDicts hold the same fields, of the same kinds, bit for bit."""
    assert type(ours) is type(theirs) and ours.batch_size == theirs.batch_size, where
    assert sorted(ours.keys()) == sorted(theirs.keys()), where
    for name in theirs.keys():
        a, b = ours.get(name), theirs.get(name)
        assert type(a) is type(b), f"{where} field {name}: {type(a).__name__} vs {type(b).__name__}"
        if isinstance(b, torch.Tensor):
            assert_same_tensor(a, b, f"{where} field {name}")
        else:
            assert_same_value(a.tolist(), b.tolist(), f"{where} field {name}")


def like_tq(*rows: Any) -> Any:
    """What TransferQueue's get makes of a field's rows (its ``_pack_field_values``), written out here: 0-d
    tensors stacked; tensors as one jagged nested tensor, else strided, else a stack; the rest a stack."""
    if rows and all(isinstance(r, torch.Tensor) for r in rows):
        if all(r.dim() == 0 for r in rows):
            return torch.stack(list(rows))
        for layout in (torch.jagged, torch.strided):
            try:
                return torch.nested.as_nested_tensor(list(rows), layout=layout)
            except RuntimeError:
                pass
    return NonTensorStack(*rows)


def expected(fields: dict[str, Any], size: int) -> TensorDict:
    return TensorDict(fields, batch_size=[size])


# -- round trips through a real dock ----------------------------------------------------------------------------


def test_regular_tensors_come_back_as_transfer_queue_returns_them(client):
    """A column of >= 2 dims comes back as a jagged nested tensor of its rows, as TransferQueue returns it;
    a 1-d column as it went. Every dtype bit-exact (NaN, -0.0, bfloat16, bool), rows in the order asked."""
    a = torch.tensor([[1.5, float("nan")], [-0.0, float("inf")], [3.0, -1e-30]], dtype=torch.float32)
    b = torch.tensor([7, -(2**62), 0])
    c = torch.arange(12, dtype=torch.bfloat16).reshape(3, 2, 2) / 3
    d = torch.tensor([[True, False], [False, False], [True, True]])
    e = torch.zeros(3, 0, dtype=torch.int16)
    f = torch.tensor([True, False, True])
    td = TensorDict({"a": a, "b": b, "c": c, "d": d, "e": e, "f": f}, batch_size=[3])
    out = through_dock(client, td, order=[2, 0])
    want = expected({"a": jagged(a[2], a[0]), "b": b[[2, 0]], "c": jagged(c[2], c[0]), "d": jagged(d[2], d[0]),
                     "e": jagged(e[2], e[0]), "f": f[[2, 0]]}, 2)
    assert_same(out, want)
    assert out.get("a").offsets().tolist() == [0, 2, 4]  # rows of 2, one ragged dim, as TQ's get builds them


def test_nested_tensors_come_back_jagged_where_torch_can_and_strided_where_not(client):
    """Like TransferQueue, the layout follows the rows, not how they were put: a strided nested tensor whose
    rows differ in one dim comes back jagged; rows differing in two dims come back strided."""
    j = jagged(torch.arange(2), torch.arange(0), torch.arange(3))  # an empty row among them
    s0 = strided(torch.ones(2, 3), torch.full((1, 3), 2.0), torch.zeros(4, 3))  # ragged in dim 0 only
    s2 = strided(torch.ones(2, 3), torch.full((3, 4), 2.0), torch.zeros(1, 1))  # ragged in both dims
    last = strided(torch.ones(2, 3), torch.full((2, 5), 2.0), torch.zeros(2, 1))  # ragged in the last dim only
    h = jagged(*(torch.randn(n, 2).to(torch.bfloat16) for n in (3, 1, 2)))
    td = TensorDict({"j": j, "s0": s0, "s2": s2, "last": last, "h": h}, batch_size=[3])
    out = through_dock(client, td)
    want = expected({name: like_tq(*td.get(name).unbind()) for name in td.keys()}, 3)
    assert_same(out, want)
    assert out.get("s0").layout == torch.jagged and out.get("s2").layout == torch.strided
    assert out.get("last").layout == torch.jagged and out.get("last")._ragged_idx == 2
    one = expected({name: like_tq(td.get(name).unbind()[1]) for name in td.keys()}, 1)
    assert_same(through_dock(client, td, order=[1]), one)


def test_non_tensor_fields_come_back_as_stacks_of_the_same_values(client):
    """Strings, numbers, dicts, lists, None, bytes, numpy arrays and scalars, tensors inside values: each row
    as it went (numpy of its dtype, byte order and shape; tuples as lists, as TransferQueue gives them)."""
    rows = {
        "text": ["a", "", "ünï\x00code"],
        "num": [1, 2.5, float("nan")],
        "flags": [True, None, -(2**63)],
        "meta": [{"score": 0.5, "tags": ["x"]}, {1: b"\xff", "nested": {"t": (1, 2)}}, {}],
        "lists": [[1, [2, [3]]], [], ("a", None)],
        "arrays": [np.arange(3, dtype=">i4"), np.array([["ab", "c"]]), np.float32(1.5)],
        "numpy_in": [{"a": np.arange(2.0)}, [np.int8(-3), np.bool_(True)], np.array(5, dtype=np.uint16)],
        "tensor_in": [{"t": torch.tensor([1.5, -0.0], dtype=torch.bfloat16)}, [torch.ones(2, 0)], None],
        # dtypes the row codec gained for TransferQueue: inside values too (they were refused there)
        "new_dtypes_in": [{"u": torch.tensor([65535, 1], dtype=torch.uint16)},
                          [torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn)], {"c": torch.tensor([1 + 2j])}],
    }
    td = TensorDict({k: NonTensorStack(*v) for k, v in rows.items()}, batch_size=[3])
    out = through_dock(client, td, order=[2, 1, 0])

    def tq_rows(values: list[Any]) -> list[Any]:  # tuples become lists in TransferQueue too
        def plain(v: Any) -> Any:
            if isinstance(v, (list, tuple)):
                return [plain(x) for x in v]
            return {k: plain(x) for k, x in v.items()} if isinstance(v, dict) else v
        return [plain(v) for v in values]

    for name, values in rows.items():
        got = out.get(name)
        assert isinstance(got, NonTensorStack), name
        assert_same_value(got.tolist(), tq_rows(values[::-1]), name)
    assert out["text"] == ["ünï\x00code", "", "a"]  # td[field]: the list of values


def test_rows_that_are_tensors_in_a_non_tensor_field_are_packed_as_transfer_queue_packs_them(client):
    """A NonTensorStack of tensors: TransferQueue's get packs tensor rows as tensors (stacked 0-d, nested,
    strided for mixed dtypes, a stack when no nested tensor holds them); mixed with a string, a stack."""
    fields = {
        "zero_d": [torch.tensor(1), torch.tensor(2)],
        "same": [torch.ones(2), torch.zeros(2)],
        "dtypes": [torch.ones(2), torch.ones(3, dtype=torch.int64)],
        "ranks": [torch.ones(2), torch.ones(3, 1)],
        "mixed": [torch.tensor(1), "a"],
        "arrays": [np.ones(2), np.zeros(2)],  # numpy stays numpy: a stack, not a tensor
    }
    td = TensorDict({k: NonTensorStack(*v) for k, v in fields.items()}, batch_size=[2])
    out = through_dock(client, td)
    assert_same(out, expected({k: like_tq(*v) for k, v in fields.items()}, 2))
    assert out.get("dtypes").layout == torch.strided and out.get("dtypes").dtype == torch.float32  # torch's cast


def test_non_tensor_data_is_one_value_for_every_row(client):
    td = TensorDict({"same": NonTensorData({"k": [1, 2]}), "x": torch.arange(3)}, batch_size=[3])
    out = through_dock(client, td, order=[1, 2])
    assert out.get("same").tolist() == [{"k": [1, 2]}, {"k": [1, 2]}]
    assert_same_tensor(out.get("x"), torch.tensor([1, 2]), "x")


def test_a_kv_put_sample_is_a_batch_of_one_as_transfer_queue_makes_it(client):
    """kv_put's dict: a tensor gains a batch dim (a 0-d one comes back as shape (1,)), any other value is the
    one row (a list is one value)."""
    sample = {"ids": torch.arange(4), "score": torch.tensor(0.25), "text": "hi", "l": [1, 2, 3],
              "arr": np.arange(3), "d": {"a": 1}, "none": None}
    one = batch_of_one(sample)
    assert one.batch_size == torch.Size([1])
    out = through_dock(client, one)
    want = expected({"ids": jagged(torch.arange(4)), "score": torch.tensor([0.25]), "text": NonTensorStack("hi"),
                     "l": NonTensorStack([1, 2, 3]), "arr": NonTensorStack(np.arange(3)),
                     "d": NonTensorStack({"a": 1}), "none": NonTensorStack(None)}, 1)
    assert_same(out, want)
    assert columns_of(sample, 1)["text"] == ["hi"] and columns_of(sample, 1)["score"].shape == (1,)


def test_stack_uniform_keeps_equal_rows_one_tensor_unless_they_were_put_nested(client):
    a = torch.randn(3, 4)
    j = jagged(torch.ones(2), torch.zeros(2), torch.ones(2))  # put nested, rows happen to be equal
    td = TensorDict({"a": a, "j": j, "s": NonTensorStack("x", "y", "z")}, batch_size=[3])
    out = through_dock(client, td, order=[1, 0], stack_uniform=True)
    assert_same_tensor(out.get("a"), a[[1, 0]], "a")
    assert_same_tensor(out.get("j"), jagged(torch.zeros(2), torch.ones(2)), "j")
    assert out["s"] == ["y", "x"]


# -- no copies where none is needed -------------------------------------------------------------------------------


def test_a_regular_column_is_passed_on_and_read_back_without_a_copy(client):
    a = torch.randn(4, 3, 2)
    td = TensorDict({"a": a, "j": jagged(torch.ones(1), torch.ones(2), torch.ones(3), torch.ones(4))}, batch_size=[4])
    columns = columns_of(td, 4)
    assert columns["a"] is a  # the put splits it along dim 0 itself
    storage = td.get("j").values().untyped_storage().data_ptr()
    assert all(row.untyped_storage().data_ptr() == storage for row in columns["j"])  # views of its values
    read = torch.arange(24.0).reshape(4, 3, 2)
    out = assemble({"a": read}, 4).get("a")
    assert out.values().data_ptr() == read.data_ptr() and out.values().shape == (12, 2)


def test_an_empty_batch_is_an_empty_tensordict():
    out = assemble({}, 0, {})
    assert isinstance(out, TensorDict) and out.batch_size == torch.Size([0]) and not list(out.keys())


# -- the field schema ---------------------------------------------------------------------------------------------


def schema_cases() -> list[TensorDict]:
    return [
        TensorDict({"a": torch.randn(3, 4, 2), "b": torch.arange(3), "bf": torch.ones(3, 1, dtype=torch.bfloat16),
                    "j": jagged(torch.ones(2, 5), torch.ones(0, 5), torch.ones(3, 5)),
                    "s": strided(torch.ones(2, 3), torch.ones(3, 4), torch.ones(1, 1)),
                    "t": NonTensorStack("x", "y", "z"), "n": NonTensorStack(1, None, {"k": 2})}, batch_size=[3]),
        TensorDict({"last": jagged(torch.ones(2, 3), torch.ones(2, 4))}, batch_size=[2]),
        TensorDict({"x": torch.ones(0, 2)}, batch_size=[0]),
    ]


def test_field_schema_is_transfer_queues_form():
    schema = field_schema(schema_cases()[0])
    assert schema["a"] == {"dtype": torch.float32, "shape": torch.Size([4, 2]), "is_nested": False,
                           "is_non_tensor": False}
    assert schema["b"]["shape"] == torch.Size([1])  # TQ's unsqueezed view of a 1-d column
    assert schema["j"] == {"dtype": torch.float32, "shape": torch.Size([2, 5]), "is_nested": True,
                           "is_non_tensor": False, "per_sample_shapes": [(2, 5), (0, 5), (3, 5)]}
    assert schema["s"]["per_sample_shapes"] == [(2, 3), (3, 4), (1, 1)]
    assert schema["t"] == schema["n"] == {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    assert field_schema(schema_cases()[2]) == {}
    assert field_schema({"ids": torch.arange(4), "s": "x"}) == field_schema(batch_of_one({"ids": torch.arange(4),
                                                                                          "s": "x"}))


def test_field_schema_equals_transfer_queues_own():
    metadata = pytest.importorskip("transfer_queue.metadata")  # the wheel's function, no Ray needed
    for td in schema_cases():
        assert field_schema(td) == metadata.extract_field_schema(td)


def test_a_puts_columns_and_schema_in_one_pass_equal_the_two_functions_apart():
    cases = [*schema_cases()[:2], *comparison_cases().values()]
    for td in cases:
        rows = td.batch_size[0]
        columns, schema = tensors.put_columns(td, rows)
        assert schema == {name: {k: v for k, v in s.items() if k != "per_sample_shapes"}
                          for name, s in field_schema(td).items()}
        apart = columns_of(td, rows)
        assert list(columns) == list(apart)
        for name, column in columns.items():
            if isinstance(column, torch.Tensor):
                assert column is apart[name]
            elif all(isinstance(r, torch.Tensor) for r in column) and column:  # a nested field's rows: views
                assert [(r.shape, r.data_ptr()) for r in column] == [(r.shape, r.data_ptr()) for r in apart[name]]
                assert all(torch.equal(a, b) for a, b in zip(column, apart[name]))
            else:
                assert column == apart[name]
    sample = {"ids": torch.arange(4), "s": "x"}
    columns, schema = tensors.put_columns(sample, 1)
    assert schema == {"ids": field_schema(sample)["ids"], "s": field_schema(sample)["s"]}
    assert torch.equal(columns["ids"], torch.arange(4).unsqueeze(0)) and columns["s"] == ["x"]
    with pytest.raises(InvalidExperienceError, match="batch size 3, for 4 keys"):
        tensors.put_columns(schema_cases()[0], 4)


def test_nested_rows_are_unbinds_views_with_or_without_holes():
    values = torch.arange(20.0)
    cases = [
        jagged(torch.ones(2, 5), torch.ones(0, 5), torch.arange(15.0).reshape(3, 5)),
        jagged(*(torch.arange(n, dtype=torch.int32) for n in (1, 4, 7, 10))),
        torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 5, 10, 15]), lengths=torch.tensor([2, 3, 4])),
        strided(torch.ones(2, 3), torch.ones(3, 4)),
    ]
    for nt in cases:
        ours, theirs = tensors.nested_rows(nt), nt.unbind()
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b) and a.data_ptr() == b.data_ptr()
    # Rows that start past the values' first element (a narrowed batch): split from there.
    later = torch.nested.nested_tensor_from_jagged(values, torch.tensor([2, 5, 9, 15]))
    assert [r.tolist() for r in tensors.nested_rows(later)] == [[2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0],
                                                                 [9.0, 10.0, 11.0, 12.0, 13.0, 14.0]]


# -- errors ---------------------------------------------------------------------------------------------------------


class Opaque:
    pass


@pytest.mark.parametrize(("value", "words"), [
    (Opaque(), ["'obj', row 1", "never pickles", "Opaque"]),
    ({1, 2}, ["'obj', row 1", "set", "pass a list"]),
    (2**64, ["'obj', row 1", "64-bit", "str"]),
    ({(1, 2): "v"}, ["'obj', row 1", "dict key", "tuple"]),
    ({"__broker_tq_numpy__": 1}, ["'obj', row 1", "reserved"]),
    (np.array([object()]), ["'obj', row 1", "never pickles"]),  # an object array's elements are refused one by one
    ([[[Opaque()]]], ["'obj', row 1", "never pickles"]),
    ({"t": torch.ones(2).to_sparse()}, ["'obj', row 1", "sparse", "dense"]),
])
def test_values_msgpack_cannot_hold_are_refused_naming_the_field_and_row(value, words):
    td = TensorDict({"obj": NonTensorStack("fine", value)}, batch_size=[2])
    with pytest.raises(InvalidExperienceError) as err:
        columns_of(td, 2)
    for word in words:
        assert word in str(err.value)


def test_a_value_that_contains_itself_is_refused():
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(InvalidExperienceError, match="deeper than"):
        columns_of(TensorDict({"x": NonTensorStack(loop)}, batch_size=[1]), 1)


@pytest.mark.parametrize(("fields", "rows", "words"), [
    (TensorDict({"a": torch.ones(3, 2)}, batch_size=[3]), 4, ["batch size 3", "4 keys"]),
    (TensorDict({"a": torch.ones(3, 2)}, batch_size=[]), 3, ["no batch dimension"]),
    ({"a": torch.ones(2)}, 2, ["one sample", "TensorDict of batch size 2"]),
    ({"j": jagged(torch.ones(1), torch.ones(2))}, 1, ["'j'", "kv_batch_put"]),
    (TensorDict({"x": TensorDict({"y": torch.ones(2)}, [2])}, batch_size=[2]), 2, ["'x'", "flatten_keys"]),
    ([torch.ones(2)], 1, ["TensorDict", "list"]),
])
def test_bad_puts_are_refused_saying_what_was_wrong(fields, rows, words):
    with pytest.raises(InvalidExperienceError) as err:
        columns_of(fields, rows)
    for word in words:
        assert word in str(err.value)


def test_assemble_refuses_columns_of_another_size():
    with pytest.raises(InvalidExperienceError, match="'a': a column of 2 rows, for 3 keys"):
        assemble({"a": torch.ones(2, 2)}, 3)
    with pytest.raises(InvalidExperienceError, match="'s': 1 rows, for 2 keys"):
        assemble({"s": ["x"]}, 2)
    with pytest.raises(InvalidExperienceError):
        tensors.batch_size_of({"a": torch.ones(1)})


@pytest.mark.parametrize("marker", [
    {"__broker_tq_numpy__": ["<f4", [2], b"abc"]},  # 3 bytes for 8
    {"__broker_tq_numpy__": ["|O", [1], b"\x00" * 8]},  # objects: never made from bytes
    {"__broker_tq_numpy__": ["no such dtype", None, b""]},
    {"__broker_tq_numpy__": ["<f4", [-1], b""]},
    {"__broker_tq_tensor__": ["complex32", [1], b"\x00" * 4]},  # not a dtype it writes
    {"__broker_tq_tensor__": ["bool", [2], b"\x00\x07"]},
    {"__broker_tq_tensor__": "garbage"},
])
def test_a_malformed_marker_read_from_redis_raises_decode_error_naming_the_field(client, marker):
    """Markers are plain msgpack that anyone with the server's password could write: read back, each is
    checked against its bytes (and nothing read is ever unpickled)."""
    dock = TransferDock(client, f"tqt{next(_names)}", prompts_num=1, n_samples_per_prompt=1, columns=["m"],
                        consumers=["reader"])
    try:
        dock.put_experience({"m": [{"wrapped": [marker]}]}, indexes=[0])  # written past columns_of's check
        with pytest.raises(DecodeError, match="field 'm'") as err:
            assemble(dock.read_rows(["m"], [0], stack=True), 1)
        assert isinstance(err.value, BrokerError)
    finally:
        dock.delete()
        dock.close()


# -- the same TensorDicts through TransferQueue itself ---------------------------------------------------------------


def comparison_cases() -> dict[str, TensorDict]:
    """Every kind of field, for the comparison with TransferQueue (whose get raises on NonTensorData of a
    batch, so that kind is left out here)."""
    return {
        "regular": TensorDict({
            "a": torch.tensor([[1.5, float("nan")], [-0.0, float("inf")], [3.0, -1e-30]]),
            "b": torch.tensor([7, -(2**62), 0]), "c": torch.arange(12, dtype=torch.bfloat16).reshape(3, 2, 2) / 3,
            "d": torch.tensor([[True, False], [False, False], [True, True]]), "e": torch.zeros(3, 0),
            "f": torch.tensor([True, False, True]), "g": torch.arange(3, dtype=torch.uint8).reshape(3, 1),
        }, batch_size=[3]),
        "nested": TensorDict({
            "j": jagged(torch.arange(2), torch.arange(0), torch.arange(3)),
            "s0": strided(torch.ones(2, 3), torch.full((1, 3), 2.0), torch.zeros(4, 3)),
            "s2": strided(torch.ones(2, 3), torch.full((3, 4), 2.0), torch.zeros(1, 1)),
            "last": strided(torch.ones(2, 3), torch.full((2, 5), 2.0), torch.zeros(2, 1)),
            "h": jagged(*(torch.arange(n * 2, dtype=torch.bfloat16).reshape(n, 2) for n in (3, 1, 2))),
        }, batch_size=[3]),
        "values": TensorDict({
            "text": NonTensorStack("a", "", "ünï\x00code"), "num": NonTensorStack(1, 2.5, float("nan")),
            "flags": NonTensorStack(True, None, -(2**63)),
            "meta": NonTensorStack({"score": 0.5, "tags": ["x"]}, {1: b"\xff", "t": (1, 2)}, {}),
            "lists": NonTensorStack([1, [2, [3]]], [], ("a", None)),
            "arrays": NonTensorStack(np.arange(3, dtype=">i4"), np.array([["ab", "c"]]), np.float32(1.5)),
            "numpy_in": NonTensorStack({"a": np.arange(2.0)}, [np.int8(-3), np.bool_(True)], np.array(5, np.uint16)),
            "tensor_in": NonTensorStack({"t": torch.tensor([1.5, -0.0])}, [torch.ones(2, 0)], None),
        }, batch_size=[3]),
        "tensor_rows": TensorDict({
            "zero_d": NonTensorStack(torch.tensor(1), torch.tensor(2), torch.tensor(3)),
            "same": NonTensorStack(torch.ones(2), torch.zeros(2), torch.ones(2)),
            "dtypes": NonTensorStack(torch.ones(2), torch.ones(3, dtype=torch.int64), torch.ones(1)),
            "ranks": NonTensorStack(torch.ones(2), torch.ones(3, 1), torch.ones(1)),
            "mixed": NonTensorStack(torch.tensor(1), "a", None),
            "arrays": NonTensorStack(np.ones(2), np.zeros(2), np.ones(2)),
        }, batch_size=[3]),
    }


def kv_samples() -> dict[str, dict[str, Any]]:
    return {
        "kv0": {"ids": torch.arange(4), "score": torch.tensor(0.25), "text": "hi", "l": [1, 2, 3],
                "arr": np.arange(3), "d": {"a": (1, 2)}, "none": None},
        "kv1": {"ids": torch.arange(2), "score": torch.tensor(0.5), "text": "", "l": [], "arr": np.ones(2),
                "d": {}, "none": None},
    }


@pytest.mark.slow
def test_the_same_tensordicts_come_back_as_transfer_queue_itself_returns_them(url, monkeypatch):
    """One Ray session: each case through TransferQueue's kv_batch_put / kv_batch_get (and kv_put), and
    through a dock with columns_of / read_rows(stack=True) / assemble; the two results bit-equal, rows read
    in another order than they were put."""
    tq = pytest.importorskip("transfer_queue")
    ray = pytest.importorskip("ray")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    # TransferQueue's controller and each of its 2 storage units claim a whole CPU: on num_cpus=2 its init
    # waits forever. Claims are bookkeeping only, so Ray is told of 4 (as broker/bench/large_tq.py does).
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR, _node_ip_address="127.0.0.1")
    try:
        tq.init()
        try:
            for name, td in comparison_cases().items():
                size = td.batch_size[0]
                keys = [f"{name}-{i}" for i in range(size)]
                order = [size - 1, *range(size - 1)]
                tq.kv_batch_put(keys=keys, partition_id="cmp", fields=td)
                theirs = tq.kv_batch_get(keys=[keys[i] for i in order], partition_id="cmp")
                assert_same(through_dock(url, td, order), theirs, name)
            samples = kv_samples()
            for key, sample in samples.items():
                tq.kv_put(key=key, partition_id="kv", fields=sample)
            theirs = tq.kv_batch_get(keys=list(samples), partition_id="kv")
            ours = puts_through_dock(url, [batch_of_one(s) for s in samples.values()])
            assert_same(ours, theirs, "kv_put")
        finally:
            tq.close()
    finally:
        ray.shutdown()


def test_nan_helper_compares_bits():
    """The comparison itself can fail: NaN equals NaN bit for bit, -0.0 differs from 0.0."""
    assert_same_value(float("nan"), float("nan"), "nan")
    with pytest.raises(AssertionError):
        assert_same_value(-0.0, 0.0, "zero")
    with pytest.raises(AssertionError):
        assert_same_tensor(jagged(torch.ones(2)), torch.ones(1, 2), "layout")
