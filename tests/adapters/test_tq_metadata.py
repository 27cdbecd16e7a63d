"""TransferQueue's BatchMeta and KVBatchMeta on the broker (broker.transfer_queue.metadata).

Our own tests of the behaviour first; then, where the ``transferqueue`` wheel is installed, the same
inputs through TransferQueue's classes and ours, compared operation by operation (hypothesis).
Pure Python: no Redis.
"""

from __future__ import annotations

import copy
import functools
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensordict import NonTensorStack, TensorDict

from broker.errors import BrokerError, InvalidExperienceError, RowIndexError, UnknownColumnError
from broker.transfer_queue.errors import MetaIndexTypeError, MissingKeysError
from broker.transfer_queue.metadata import BatchMeta, KVBatchMeta, extract_field_schema

F32 = {"dtype": torch.float32, "shape": (2,), "is_nested": False, "is_non_tensor": False}
I64 = {"dtype": torch.int64, "shape": (4,), "is_nested": False, "is_non_tensor": False}


def batch(size: int = 3, fields: dict[str, dict[str, Any]] | None = None, **kwargs: Any) -> BatchMeta:
    return BatchMeta(global_indexes=list(range(10, 10 + size)), partition_ids=["p0"] * size,
                     field_schema={"a": F32} if fields is None else fields, **kwargs)


def nested(size: int, shapes: list[tuple[int, ...]]) -> dict[str, Any]:
    return {"dtype": torch.float32, "shape": None, "is_nested": True, "is_non_tensor": False,
            "per_sample_shapes": shapes}


# -- construction ---------------------------------------------------------------------------------

def test_a_new_batch_has_nothing_produced_and_copies_what_it_is_given():
    indexes, schema, info = [1, 2], {"a": dict(F32)}, {"k": "v"}
    b = BatchMeta(indexes, ["p", "p"], field_schema=schema, extra_info=info)
    indexes.append(3)
    schema["a"]["dtype"] = torch.int8
    info["k"] = "changed"
    assert b.global_indexes == [1, 2] and b.size == len(b) == 2
    assert b.field_schema["a"]["dtype"] == torch.float32 and b.extra_info == {"k": "v"}
    assert b.production_status.dtype == np.int8 and list(b.production_status) == [0, 0]
    assert b.custom_meta == [{}, {}] and b._custom_backend_meta == [{}, {}]
    assert not b.is_ready and b.field_names == ["a"]


@pytest.mark.parametrize("kwargs, message", [
    ({"partition_ids": ["p"]}, "Length mismatch: global_indexes has 2, partition_ids has 1"),
    ({"production_status": [1, 1, 1]}, "production_status length 3 != batch_size 2"),
    ({"production_status": [[1], [1]]}, r"shape \(2, 1\)"),
    ({"custom_meta": [{}]}, "custom_meta length 1 != batch_size 2"),
    ({"_custom_backend_meta": [{}, {}, {}]}, "_custom_backend_meta length 3"),
    ({"field_schema": {"n": nested(2, [(1,)])}}, "Field 'n' per_sample_shapes length 1 != batch_size 2"),
])
def test_inconsistent_columns_are_refused_as_value_errors(kwargs, message):
    args = {"global_indexes": [0, 1], "partition_ids": ["p", "p"], **kwargs}
    with pytest.raises(InvalidExperienceError, match=message) as info:
        BatchMeta(**args)
    assert isinstance(info.value, ValueError) and isinstance(info.value, BrokerError)


def test_an_empty_custom_meta_list_means_empty_dicts_as_in_transfer_queue():
    assert batch(2, custom_meta=[]).custom_meta == [{}, {}]


def test_readiness_is_read_from_production_status_each_time():
    b = batch(2, production_status=[1, 0])
    assert not b.is_ready
    b.production_status[1] = 1  # TransferQueue's cached flag would still say False here
    assert b.is_ready
    assert not BatchMeta.empty().is_ready  # no samples: never ready


def test_dtypes_and_shapes_per_sample_and_unknown_fields_are_key_errors():
    b = batch(2, fields={"a": F32, "n": nested(2, [(3,), (5,)])})
    assert b.get_dtypes("a") == [torch.float32] * 2
    assert b.get_shapes("a") == [(2,), (2,)] and b.get_shapes("n") == [(3,), (5,)]
    with pytest.raises(UnknownColumnError, match="Field 'zz' not found in field_schema") as info:
        b.get_shapes("zz")
    assert isinstance(info.value, KeyError)


# -- per-sample views -----------------------------------------------------------------------------

def test_a_sample_view_shows_its_own_shape_of_a_nested_field_and_cannot_be_written():
    b = batch(2, fields={"a": F32, "n": nested(2, [(3,), (5,)])}, production_status=[0, 1],
              custom_meta=[{"uid": "x"}, {"uid": "y"}])
    view = b.samples[1]
    assert (view.global_index, view.partition_id, view.production_status) == (11, "p0", 1)
    assert view.fields["n"]["shape"] == (5,) and "per_sample_shapes" not in view.fields["n"]
    assert view.fields["a"]["dtype"] == torch.float32 and view.custom_meta["uid"] == "y"
    with pytest.raises(TypeError):
        view.fields["a"]["dtype"] = torch.int8  # type: ignore[index]
    with pytest.raises(TypeError):
        view.custom_meta["uid"] = "z"  # type: ignore[index]
    assert b.samples[-1].global_index == 11 and len(b.samples) == 2
    assert [s.global_index for s in b.samples] == [10, 11]
    with pytest.raises(RowIndexError):
        b.samples[2]
    assert "global_index=11" in repr(view)


# -- extra_info and custom_meta -------------------------------------------------------------------

def test_extra_info_methods():
    b = batch(1, extra_info={"step": 1})
    b.set_extra_info("lr", {"v": 0.1})
    b.update_extra_info({"epoch": 2})
    every = b.get_all_extra_info()
    every["lr"]["v"] = 9  # a deep copy
    assert b.get_extra_info("lr") == {"v": 0.1} and b.get_extra_info("nope", 5) == 5
    assert b.has_extra_info("epoch") and b.remove_extra_info("epoch") == 2 and b.remove_extra_info("epoch") is None
    b.clear_extra_info()
    assert b.extra_info == {}


def test_custom_meta_updates_each_sample_and_refuses_a_wrong_length():
    b = batch(2, custom_meta=[{"a": 1}, {"a": 2}])
    b.update_custom_meta([{"b": 1}, {"a": 5}])
    b.update_custom_meta(None)
    assert b.custom_meta == [{"a": 1, "b": 1}, {"a": 5}]
    copied = b.get_all_custom_meta()
    copied[0]["a"] = 100
    assert b.custom_meta[0]["a"] == 1
    with pytest.raises(InvalidExperienceError, match="custom_meta list 1 must match the batch size: 2"):
        b.update_custom_meta([{}])
    b.clear_custom_meta()
    assert b.custom_meta == [{}, {}]


# -- add_fields and extract_field_schema ----------------------------------------------------------

def test_extract_field_schema_of_tensors_nested_tensors_and_non_tensors():
    jagged = torch.nested.as_nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged)
    td = TensorDict({"x": torch.zeros(2, 3, dtype=torch.bfloat16), "flat": torch.arange(2), "j": jagged,
                     "s": NonTensorStack("a", "b")}, batch_size=2)
    schema = extract_field_schema(td)
    assert schema["x"] == {"dtype": torch.bfloat16, "shape": (3,), "is_nested": False, "is_non_tensor": False}
    assert schema["flat"]["shape"] == (1,)  # a 1-D field's samples are (1,), as TransferQueue unsqueezes it
    assert schema["j"] == {"dtype": torch.float32, "shape": (2,), "is_nested": True, "is_non_tensor": False,
                           "per_sample_shapes": [(2,), (3,)]}
    assert schema["s"] == {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    assert extract_field_schema(TensorDict({}, batch_size=0)) == {}


def test_extract_field_schema_refuses_what_is_not_a_batched_tensordict():
    with pytest.raises(InvalidExperienceError, match="expected a TensorDict, got dict"):
        extract_field_schema({"x": torch.zeros(2)})
    with pytest.raises(InvalidExperienceError, match="no batch dimension"):
        extract_field_schema(TensorDict({"x": torch.zeros(2)}, batch_size=[]))


def test_add_fields_adds_the_schema_and_marks_every_sample_ready():
    b = batch(2, production_status=[0, 0])
    assert b.add_fields(TensorDict({"r": torch.ones(2, 5, dtype=torch.int32)}, batch_size=2)) is b
    assert b.field_names == ["a", "r"] and b.field_schema["r"]["shape"] == (5,) and b.is_ready
    b.production_status[:] = 0
    b.add_fields(TensorDict({"q": torch.ones(2, 1)}, batch_size=2), set_all_ready=False)
    assert not b.is_ready
    b.add_fields(TensorDict({}, batch_size=0))  # empty: nothing happens
    with pytest.raises(InvalidExperienceError, match="add_fields batch size mismatch: self.size=2 vs tensor_dict=3"):
        b.add_fields(TensorDict({"z": torch.ones(3)}, batch_size=3))


# -- selecting, chunking, reordering -------------------------------------------------------------

def test_select_samples_keeps_each_samples_columns_together():
    b = batch(4, fields={"n": nested(4, [(1,), (2,), (3,), (4,)])}, production_status=[1, 0, 1, 0],
              custom_meta=[{"i": i} for i in range(4)], _custom_backend_meta=[{"n": i} for i in range(4)])
    s = b.select_samples([3, 0, 3])
    assert s.global_indexes == [13, 10, 13] and list(s.production_status) == [0, 1, 0]
    assert s.field_schema["n"]["per_sample_shapes"] == [(4,), (1,), (4,)]
    assert s.custom_meta == [{"i": 3}, {"i": 0}, {"i": 3}] and s._custom_backend_meta[1] == {"n": 0}
    s.custom_meta[0]["i"] = 99
    assert b.custom_meta[3] == {"i": 3}
    with pytest.raises(InvalidExperienceError, match=r"Sample indices must be in range \[0, 4\)"):
        b.select_samples([4])
    with pytest.raises(InvalidExperienceError):
        b.select_samples([-1])


def test_select_fields_keeps_known_fields_and_backend_entries_of_its_own():
    b = batch(1, fields={"a": F32, "b": I64}, _custom_backend_meta=[{"a": 1, "b": 2, "_loc": 3}],
              extra_info={"k": [1]})
    s = b.select_fields(["b", "nope"])
    assert s.field_names == ["b"] and s._custom_backend_meta == [{"b": 2, "_loc": 3}]
    s.extra_info["k"].append(2)
    assert b.extra_info == {"k": [1]}


def test_indexing_slicing_and_iterating_give_batches():
    b = batch(5)
    assert b[1].global_indexes == [11] and b[-1].global_indexes == [14] and b[np.int64(2)].global_indexes == [12]
    assert b[1:4:2].global_indexes == [11, 13] and b[::-1].global_indexes == [14, 13, 12, 11, 10]
    assert [x.global_indexes for x in b] == [[10], [11], [12], [13], [14]]
    with pytest.raises(RowIndexError, match="out of range"):
        b[5]
    with pytest.raises(MetaIndexTypeError) as info:
        b["a"]  # type: ignore[index]
    assert isinstance(info.value, TypeError)


def test_chunk_gives_the_first_chunks_one_more_and_refuses_fewer_than_one():
    b = batch(10, custom_meta=[{"i": i} for i in range(10)])
    chunks = b.chunk(3)
    assert [c.global_indexes[0] for c in chunks] == [10, 14, 17] and [len(c) for c in chunks] == [4, 3, 3]
    assert chunks[1].custom_meta[0] == {"i": 4}
    assert [len(c) for c in batch(2).chunk(4)] == [1, 1, 0, 0]
    for bad in (0, -1):
        with pytest.raises(InvalidExperienceError, match="chunks must be at least 1"):
            b.chunk(bad)


def test_chunk_by_partition_in_order_of_first_appearance():
    b = BatchMeta([1, 2, 3, 4], ["B", "A", "B", "C"], field_schema={"a": F32})
    assert [(c.partition_ids[0], c.global_indexes) for c in b.chunk_by_partition()] == [
        ("B", [1, 3]), ("A", [2]), ("C", [4])]


def test_reorder_is_in_place_and_takes_only_a_permutation():
    b = batch(3, fields={"n": nested(3, [(1,), (2,), (3,)])}, production_status=[1, 0, 0],
              custom_meta=[{"i": 0}, {"i": 1}, {"i": 2}])
    b.reorder([2, 0, 1])
    assert b.global_indexes == [12, 10, 11] and list(b.production_status) == [0, 1, 0]
    assert b.field_schema["n"]["per_sample_shapes"] == [(3,), (1,), (2,)] and b.custom_meta[0] == {"i": 2}
    for bad, message in (([0, 1], "Indices length 2 mismatch batch size 3"), ([0, 0, 1], "duplicates"),
                         ([0, 1, 3], "must be in range"), ([-1, 0, 1], "must be in range")):
        with pytest.raises(InvalidExperienceError, match=message):
            b.reorder(bad)


# -- union and concat ----------------------------------------------------------------------------

def test_union_adds_other_fields_and_a_sample_is_ready_only_if_ready_on_both_sides():
    a = batch(2, fields={"a": F32, "shared": F32}, production_status=[1, 0], custom_meta=[{"x": 1}, {"x": 2}],
              extra_info={"k": 1, "only_a": 0})
    b = batch(2, fields={"b": I64, "shared": I64}, production_status=[1, 1], custom_meta=[{"x": 9}, {}],
              extra_info={"k": 2})
    u = a.union(b)
    assert list(u.field_schema) == ["a", "shared", "b"] and u.field_schema["shared"]["dtype"] == torch.int64
    assert list(u.production_status) == [1, 0] and not u.is_ready
    assert u.custom_meta == [{"x": 9}, {"x": 2}] and u.extra_info == {"k": 2, "only_a": 0}
    empty_side = a.union(BatchMeta.empty())
    assert empty_side is not a and empty_side.global_indexes == a.global_indexes
    assert BatchMeta.empty().union(a).field_names == a.field_names and a.union(None).size == 2
    with pytest.raises(InvalidExperienceError, match="global_indexes do not match"):
        a.union(BatchMeta([0, 1], ["p0", "p0"]))
    with pytest.raises(InvalidExperienceError, match="partition_ids do not match"):
        a.union(BatchMeta([10, 11], ["p0", "p1"]))


def test_concat_appends_rows_and_merges_nested_shapes_and_extra_info():
    a = batch(2, fields={"n": {**F32, "shape": (7,)}}, production_status=[1, 1], extra_info={"s": 1})
    b = BatchMeta([20], ["p1"], field_schema={"n": nested(1, [(3,)])}, production_status=[0],
                  extra_info={"s": 1, "t": torch.tensor([1.0])}, custom_meta=[{"c": 1}])
    c = BatchMeta.concat([BatchMeta.empty(), a, None, b])
    assert c.global_indexes == [10, 11, 20] and c.partition_ids == ["p0", "p0", "p1"]
    assert c.field_schema["n"] == {"dtype": torch.float32, "shape": None, "is_nested": True, "is_non_tensor": False,
                                   "per_sample_shapes": [(7,), (7,), (3,)]}
    assert list(c.production_status) == [1, 1, 0] and c.custom_meta == [{}, {}, {"c": 1}]
    assert c.extra_info["s"] == 1 and torch.equal(c.extra_info["t"], torch.tensor([1.0]))
    assert BatchMeta.concat([]).size == 0 and BatchMeta.concat([BatchMeta.empty()]).size == 0


@pytest.mark.parametrize("other, message", [
    (BatchMeta([5], ["p"], field_schema={"b": F32}), "field_names mismatch at chunk\\[1\\]"),
    (BatchMeta([5], ["p"], field_schema={"a": I64}), "Field 'a' dtype mismatch in concat"),
    (BatchMeta([5], ["p"], field_schema={"a": F32}, extra_info={"step": 2}), "extra_info key 'step' has conflicting"),
])
def test_concat_refuses_batches_that_do_not_fit(other, message):
    with pytest.raises(InvalidExperienceError, match=message):
        BatchMeta.concat([batch(1, extra_info={"step": 1}), other])


def test_concat_without_validation_takes_the_first_batchs_fields():
    c = BatchMeta.concat([batch(1), BatchMeta([5], ["p"], field_schema={"b": I64})], validate=False)
    assert c.field_names == ["a"] and c.size == 2


def test_chunk_then_concat_gives_the_batch_back():
    b = batch(6, fields={"n": nested(6, [(i,) for i in range(6)])}, production_status=[1, 0, 1, 1, 0, 1],
              extra_info={"metrics": {"loss": 0.5}}, custom_meta=[{"i": i} for i in range(6)])
    back = BatchMeta.concat(b.chunk(4))
    assert snapshot(back) == snapshot(b)


# -- pickling ------------------------------------------------------------------------------------

def test_a_batch_pickles_with_everything_and_comes_back_writable_from_read_only_buffers():
    b = batch(2, fields={"a": F32, "n": nested(2, [(1,), (2,)])}, production_status=[1, 0],
              extra_info={"step": 42}, custom_meta=[{"s": 0.9}, {"s": 0.8}])
    assert snapshot(pickle.loads(pickle.dumps(b))) == snapshot(b)
    # Ray passes numpy arrays out of band and hands them back read-only (zero copy)
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    restored = pickle.loads(data, buffers=[memoryview(x).toreadonly() for x in buffers])
    assert restored.production_status.flags.writeable and list(restored.production_status) == [1, 0]
    restored.add_fields(TensorDict({"new": torch.ones(2, 4)}, batch_size=2))
    assert restored.is_ready and list(b.production_status) == [1, 0]
    assert copy.deepcopy(b).field_schema == b.field_schema


def test_str_names_size_fields_readiness_indexes_and_info():
    assert str(batch(2, extra_info={"k": 1})) == (
        "BatchMeta(size=2, field_names=['a'], is_ready=False, global_indexes=[10, 11], extra_info={'k': 1})")


# -- KVBatchMeta ---------------------------------------------------------------------------------

def kv(n: int = 3, **kwargs: Any) -> KVBatchMeta:
    return KVBatchMeta(keys=[f"k{i}" for i in range(n)], tags=[{"i": i} for i in range(n)], **kwargs)


def test_kv_meta_defaults_and_validation():
    empty = KVBatchMeta()
    assert (empty.size, len(empty), empty.keys, empty.tags, empty.partition_id, empty.fields, empty.extra_info) == (
        0, 0, [], [], None, None, {})
    for kwargs, message in (({"keys": ["a", "b"], "tags": [{}]}, "keys and tags must have same length"),
                            ({"keys": ["a", "a"], "tags": [{}, {}]}, "Got duplicated keys: \\['a'\\]"),
                            ({"keys": ["a"], "tags": [{}], "fields": ["f", "f"]}, "Got duplicated fields")):
        with pytest.raises(InvalidExperienceError, match=message):
            KVBatchMeta(**kwargs)


def test_kv_meta_copies_tags_extra_info_and_lists():
    tags, info, keys = [{"d": [1]}], {"n": {"v": 1}}, ["a"]
    m = KVBatchMeta(keys=keys, tags=tags, extra_info=info)
    m.tags[0]["d"].append(2)
    m.extra_info["n"]["v"] = 2  # type: ignore[index]
    keys.append("b")
    assert tags == [{"d": [1]}] and info == {"n": {"v": 1}} and m.keys == ["a"]


def test_kv_select_keys():
    m = kv(3, partition_id="p", fields=["f"], extra_info={"t": 1})
    s = m.select_keys(["k2", "k0"])
    assert (s.keys, s.tags, s.partition_id, s.fields, s.extra_info) == (
        ["k2", "k0"], [{"i": 2}, {"i": 0}], "p", ["f"], {"t": 1})
    with pytest.raises(InvalidExperienceError, match="Contain duplicate keys"):
        m.select_keys(["k0", "k0"])
    with pytest.raises(MissingKeysError, match=r"Keys \['zz'\] not found in current batch") as info:
        m.select_keys(["k0", "zz"])
    assert isinstance(info.value, RuntimeError)


def test_kv_reorder_takes_a_permutation():
    m = kv(3)
    m.reorder([2, 0, 1])
    assert m.keys == ["k2", "k0", "k1"] and m.tags == [{"i": 2}, {"i": 0}, {"i": 1}]
    with pytest.raises(InvalidExperienceError, match="does not match the batch size 3"):
        m.reorder([0, 1])
    with pytest.raises(InvalidExperienceError, match="Contain duplicate indexes"):
        m.reorder([0, 0, 1])
    with pytest.raises(RowIndexError, match=r"\[-1\] are outside \[0, 3\)"):
        m.reorder([-1, 0, 1])  # TransferQueue would take it and might repeat a key


def test_kv_chunk_and_concat_round_trip():
    m = kv(10, partition_id="p", fields=["f"], extra_info={"t": "v"})
    chunks = m.chunk(3)
    assert [c.keys[0] for c in chunks] == ["k0", "k4", "k7"] and [len(c) for c in chunks] == [4, 3, 3]
    assert all(c.partition_id == "p" and c.fields == ["f"] and c.extra_info == {"t": "v"} for c in chunks)
    chunks[0].fields.append("g")  # type: ignore[union-attr]
    assert chunks[1].fields == ["f"]  # chunks do not share one list
    assert KVBatchMeta.concat(m.chunk(4)) == m
    assert [len(c) for c in kv(2).chunk(5)] == [1, 1, 0, 0, 0]
    with pytest.raises(InvalidExperienceError, match="chunks must be at least 1"):
        m.chunk(0)


def test_kv_concat_skips_empties_and_refuses_mismatches():
    assert KVBatchMeta.concat([]) == KVBatchMeta()
    joined = KVBatchMeta.concat([KVBatchMeta(), kv(1), None])
    assert joined.keys == ["k0"] and joined.extra_info is None  # as TransferQueue: no info is None
    other = KVBatchMeta(keys=["x"], tags=[{}], fields=["g"])
    with pytest.raises(InvalidExperienceError, match="Field names do not match"):
        KVBatchMeta.concat([kv(1, fields=["f"]), other])
    with pytest.raises(InvalidExperienceError, match="Partition do not match"):
        KVBatchMeta.concat([kv(1, partition_id="a"), KVBatchMeta(keys=["x"], tags=[{}], partition_id="b")])
    with pytest.raises(InvalidExperienceError, match="extra_info key 'step' has conflicting values"):
        KVBatchMeta.concat([kv(1, extra_info={"step": 1}), KVBatchMeta(keys=["x"], tags=[{}], extra_info={"step": 2})])


def test_kv_meta_pickles_and_prints_as_transfer_queues():
    m = kv(2, partition_id="p", fields=["f"])
    assert pickle.loads(pickle.dumps(m)) == m
    assert str(m) == "KVBatchMeta(size=2, field_names=['f'], extra_info={})"


# -- the same inputs through TransferQueue's classes and ours ---------------------------------------

def snapshot(b: Any) -> dict[str, Any]:
    """Everything a user can read of a BatchMeta, TransferQueue's or ours, as plain comparable data."""
    def plain(schema: dict[str, dict[str, Any]]) -> dict[str, Any]:
        return {f: {k: (tuple(v) if isinstance(v, torch.Size) else v) for k, v in m.items()} for f, m in schema.items()}

    return {
        "size": b.size, "len": len(b), "global_indexes": list(b.global_indexes), "partition_ids": list(b.partition_ids),
        "field_names": b.field_names, "field_schema": plain(b.field_schema), "is_ready": b.is_ready,
        "production_status": [int(x) for x in b.production_status], "extra_info": b.extra_info,
        "custom_meta": b.custom_meta, "backend": b._custom_backend_meta,
        # TransferQueue merges extra_info keys in a set's order, ours in the order first seen
        "str": str(b) if len(b.extra_info) < 2 else None,
        "samples": [(s.global_index, s.partition_id, s.production_status, dict(s.custom_meta),
                     {f: dict(m) for f, m in s.fields.items()}) for s in b.samples],
    }


FIELDS = ["a", "b", "n", "s"]


@st.composite
def batch_specs(draw: st.DrawFn, size: int | None = None, indexes: list[int] | None = None) -> dict[str, Any]:
    """The constructor arguments of a random batch: tensor, nested and non-tensor fields, some produced."""
    if indexes is None:
        size = draw(st.integers(0, 6)) if size is None else size
        indexes = draw(st.lists(st.integers(0, 50), min_size=size, max_size=size, unique=True))
    size = len(indexes)
    schema: dict[str, dict[str, Any]] = {}
    for name in draw(st.lists(st.sampled_from(FIELDS), unique=True)):
        if name == "n":
            schema[name] = nested(size, [(draw(st.integers(1, 4)),) for _ in range(size)])
        elif name == "s":
            schema[name] = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
        else:
            schema[name] = {**draw(st.sampled_from([F32, I64])), "shape": (draw(st.integers(1, 3)),)}
    return {
        "global_indexes": indexes,
        "partition_ids": draw(st.lists(st.sampled_from(["p0", "p1"]), min_size=size, max_size=size)),
        "field_schema": schema,
        "production_status": draw(st.lists(st.integers(0, 1), min_size=size, max_size=size)),
        "extra_info": draw(st.dictionaries(st.sampled_from(["step", "tag"]), st.integers(0, 2), max_size=2)),
        "custom_meta": draw(st.lists(st.dictionaries(st.sampled_from(["u", "v"]), st.integers(0, 3), max_size=2),
                                     min_size=size, max_size=size)),
        "_custom_backend_meta": [{"a": i, "_k": i} for i in range(size)],
    }


def same_outcome(theirs: Any, ours: Any, op: Any) -> tuple[Any, Any] | None:
    """Run ``op`` on both; both raise (ours a BrokerError that is also the built-in theirs raised), or
    both return."""
    try:
        expected = op(theirs)
    except Exception as exc:  # noqa: BLE001 - whatever TransferQueue raises, ours must raise the same kind
        with pytest.raises(Exception) as info:
            op(ours)
        assert isinstance(info.value, BrokerError) and isinstance(info.value, type(exc)), (exc, info.value)
        return None
    return expected, op(ours)


def assert_same(expected: Any, got: Any) -> None:
    if isinstance(expected, list):
        assert len(expected) == len(got)
        for e, g in zip(expected, got):
            assert_same(e, g)
    elif expected is None or isinstance(expected, (bool, int, dict, tuple)):
        assert expected == got
    else:
        assert snapshot(expected) == snapshot(got)


OPS = st.one_of(
    st.tuples(st.just("select_samples"), st.lists(st.integers(-1, 7), max_size=6)),
    st.tuples(st.just("select_fields"), st.lists(st.sampled_from([*FIELDS, "zz"]), max_size=3)),
    st.tuples(st.just("reorder"), st.tuples(st.permutations(range(7)), st.booleans())),
    st.tuples(st.just("chunk"), st.integers(1, 4)),
    st.tuples(st.just("chunk_by_partition"), st.none()),
    st.tuples(st.just("getitem"), st.one_of(st.integers(-8, 8), st.builds(slice, st.integers(-3, 7) | st.none(),
                                                                          st.integers(-3, 7) | st.none(),
                                                                          st.sampled_from([None, 1, 2, -1])))),
    st.tuples(st.just("union_self_fields"), st.lists(st.sampled_from(FIELDS), max_size=2)),
    st.tuples(st.just("concat_chunks"), st.integers(1, 4)),
    st.tuples(st.just("copy"), st.none()),
    st.tuples(st.just("update_custom_meta"), st.integers(0, 3)),
    st.tuples(st.just("get_shapes"), st.sampled_from([*FIELDS, "zz"])),
)


def apply(kind: str, arg: Any, b: Any) -> Any:
    """One operation; returns (what to compare, the batch to go on with)."""
    if kind == "select_samples":
        out = b.select_samples(arg)
        return out, out
    if kind == "select_fields":
        out = b.select_fields(arg)
        return out, out
    if kind == "reorder":
        order, valid = arg
        b.reorder([i for i in order if i < b.size] if valid else list(order[: b.size]))
        return b, b
    if kind == "chunk":
        out = b.chunk(arg)
        return out, out[0]
    if kind == "chunk_by_partition":
        out = b.chunk_by_partition()
        return out, out[0] if out else b
    if kind == "getitem":
        out = b[arg]
        return out, out
    if kind == "union_self_fields":
        out = b.select_fields(arg).union(b.select_fields(FIELDS[::-1]))
        return out, out
    if kind == "concat_chunks":
        out = type(b).concat(b.chunk(arg))
        return out, out
    if kind == "copy":
        return b.copy(), b
    if kind == "update_custom_meta":
        b.update_custom_meta([{"u": arg}] * b.size if arg else [{"u": 0}])
        return b, b
    return b.get_shapes(arg), b


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=batch_specs(), ops=st.lists(OPS, max_size=6))
def test_operations_give_what_transfer_queues_give(spec, ops):
    their = pytest.importorskip("transfer_queue.metadata")
    theirs, ours = their.BatchMeta(**copy.deepcopy(spec)), BatchMeta(**copy.deepcopy(spec))
    assert snapshot(theirs) == snapshot(ours)
    for kind, arg in ops:
        outcome = same_outcome(theirs, ours, functools.partial(apply, kind, arg))
        if outcome is None:
            continue
        (expected, theirs), (got, ours) = outcome
        assert_same(expected, got)
        assert snapshot(theirs) == snapshot(ours)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_concat_and_union_of_two_batches_give_what_transfer_queues_give(data):
    their = pytest.importorskip("transfer_queue.metadata")
    first = data.draw(batch_specs())
    second = data.draw(st.one_of(batch_specs(), batch_specs(indexes=first["global_indexes"])))
    if data.draw(st.booleans()):  # same fields, so that validation passes more often
        second["field_schema"] = {k: v for k, v in first["field_schema"].items() if k != "n"}
    validate = data.draw(st.booleans())
    pairs = [(their.BatchMeta(**copy.deepcopy(s)), BatchMeta(**copy.deepcopy(s))) for s in (first, second)]
    (t1, o1), (t2, o2) = pairs
    outcome = same_outcome((t1, t2), (o1, o2), lambda p: type(p[0]).concat(list(p), validate=validate))
    if outcome is not None:
        assert snapshot(outcome[0]) == snapshot(outcome[1])
    outcome = same_outcome((t1, t2), (o1, o2), lambda p: p[0].union(p[1]))
    if outcome is not None:
        assert snapshot(outcome[0]) == snapshot(outcome[1])


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@settings(max_examples=100, deadline=None)
@given(rows=st.integers(0, 4), shapes=st.lists(st.integers(1, 3), min_size=4, max_size=4),
       kinds=st.lists(st.sampled_from(["dense", "flat", "jagged", "strided", "strings"]), min_size=1, max_size=4,
                      unique=True))
def test_extract_field_schema_and_add_fields_give_what_transfer_queues_give(rows, shapes, kinds):
    their = pytest.importorskip("transfer_queue.metadata")
    fields: dict[str, Any] = {}
    for kind in kinds:
        if kind == "dense":
            fields[kind] = torch.zeros(rows, shapes[0], dtype=torch.float16)
        elif kind == "flat":
            fields[kind] = torch.arange(rows)
        elif kind == "strings" and rows:
            fields[kind] = NonTensorStack(*[str(i) for i in range(rows)])
        elif kind in ("jagged", "strided") and rows:
            tensors = [torch.ones(shapes[i % 4], 2) for i in range(rows)]
            layout = torch.jagged if kind == "jagged" else torch.strided
            fields[kind] = torch.nested.as_nested_tensor(tensors, layout=layout)
    td = TensorDict(fields, batch_size=rows)
    expected, got = their.extract_field_schema(td), extract_field_schema(td)
    assert {f: {k: (tuple(v) if isinstance(v, torch.Size) else v) for k, v in m.items()} for f, m in expected.items()} \
        == {f: {k: (tuple(v) if isinstance(v, torch.Size) else v) for k, v in m.items()} for f, m in got.items()}
    spec = {"global_indexes": list(range(rows)), "partition_ids": ["p"] * rows}
    theirs, ours = their.BatchMeta(**spec), BatchMeta(**spec)
    theirs.add_fields(td)
    ours.add_fields(td)
    assert snapshot(theirs) == snapshot(ours)


@st.composite
def kv_specs(draw: st.DrawFn) -> dict[str, Any]:
    keys = draw(st.lists(st.sampled_from("abcdefgh"), unique=True, max_size=6))
    return {"keys": keys, "tags": [{"t": draw(st.integers(0, 2))} for _ in keys],
            "partition_id": draw(st.sampled_from([None, "p"])),
            "fields": draw(st.sampled_from([None, ["f"], ["f", "g"]])),
            "extra_info": draw(st.sampled_from([None, {}, {"s": 1}, {"s": 2}]))}


@settings(max_examples=300, deadline=None)
@given(specs=st.lists(kv_specs(), min_size=1, max_size=3), chunks=st.integers(1, 4),
       pick=st.lists(st.sampled_from("abcdefghz"), max_size=4), order=st.permutations(range(6)))
def test_kv_operations_give_what_transfer_queues_give(specs, chunks, pick, order):
    their = pytest.importorskip("transfer_queue.metadata")

    def fields(m: Any) -> tuple[Any, ...]:
        return m.keys, m.tags, m.partition_id, m.fields, m.extra_info, m.size, len(m), str(m)

    theirs = [their.KVBatchMeta(**copy.deepcopy(s)) for s in specs]
    ours = [KVBatchMeta(**copy.deepcopy(s)) for s in specs]
    assert [fields(m) for m in theirs] == [fields(m) for m in ours]
    ops = [
        lambda ms: type(ms[0]).concat(ms),
        lambda ms: ms[0].chunk(chunks),
        lambda ms: ms[0].select_keys(pick),
        lambda ms: ms[0].reorder([i for i in order if i < ms[0].size]) or ms[0],
    ]
    for op in ops:
        outcome = same_outcome(theirs, ours, op)
        if outcome is not None:
            expected, got = outcome
            if isinstance(expected, list):
                assert [fields(m) for m in expected] == [fields(m) for m in got]
            else:
                assert fields(expected) == fields(got)
