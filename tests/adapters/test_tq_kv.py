"""broker.transfer_queue's KV interface (TransferQueue's kv_put / kv_batch_put / kv_batch_get / kv_list /
kv_clear) on a real Redis 7, Redis 6.2 and a Redis Cluster: keys, tags, partitions, new fields for existing
keys, bit-exact TensorDicts, clear errors, and rows reused after clears."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
import torch

tensordict = pytest.importorskip("tensordict")
from tensordict import TensorDict  # noqa: E402

import broker.transfer_queue as tq  # noqa: E402
from broker import BrokerError  # noqa: E402
from broker.control.scripts import runs_of  # noqa: E402
from tests.helpers import dense, empty_cluster  # noqa: E402


@pytest.fixture(params=[1, 3])
def partitions(request) -> int:
    """Every test of the KV interface also on a system cut into three sub-systems (``broker.partitions``): the
    partitions these tests use ("train" and "val", "p" and "q") live in different ones."""
    return int(request.param)


@pytest.fixture(params=["real", "redis62", "cluster"])
def system(request, partitions):
    if request.param == "real":
        url = request.getfixturevalue("url")
    elif request.param == "redis62":
        url = request.getfixturevalue("redis62_url")
        redis.Redis.from_url(url).flushdb()
    else:
        empty_cluster(request.getfixturevalue("cluster_admin"))
        url = request.getfixturevalue("cluster_url")
    tq.init({"broker": {"url": url, "namespace": "kv" + uuid.uuid4().hex[:8], "get_meta_timeout": 0.5,
                        "partitions": partitions}})
    yield tq
    tq.get_client().systems.delete()
    tq.close()


def batch(n: int, start: int = 0) -> TensorDict:
    return TensorDict({"input_ids": torch.arange(start, start + 3 * n).reshape(n, 3),
                       "mask": torch.ones(n, 3, dtype=torch.bool)}, batch_size=n)


def test_put_list_get_clear_round_trip(system):
    meta = tq.kv_batch_put(["a", "b"], "train", batch(2), [{"score": 1.5}, {"score": 2}])
    assert meta.keys == ["a", "b"] and meta.partition_id == "train"
    assert sorted(meta.fields) == ["input_ids", "mask"]
    tq.kv_put("c", "train", {"input_ids": torch.tensor([7, 8, 9]), "mask": torch.zeros(3, dtype=torch.bool)},
              {"score": 3})
    assert tq.kv_list() == {"train": {"a": {"score": 1.5}, "b": {"score": 2}, "c": {"score": 3}}}
    got = tq.kv_batch_get(["c", "a"], "train")
    assert torch.equal(dense(got["input_ids"]), torch.tensor([[7, 8, 9], [0, 1, 2]]))
    assert got["mask"].dtype == torch.bool and got.batch_size == torch.Size([2])
    only = tq.kv_batch_get("b", "train", select_fields="input_ids")
    assert list(only.keys()) == ["input_ids"]
    tq.kv_clear(["a", "c"], "train")
    assert tq.kv_list("train") == {"train": {"b": {"score": 2}}}
    with pytest.raises(KeyError, match="'a'"):
        tq.kv_batch_get(["a"], "train")


def test_new_fields_for_existing_keys_add_columns_and_tags_merge(system):
    tq.kv_batch_put(["k0", "k1"], "p", batch(2), [{"stage": "rollout"}, {"stage": "rollout"}])
    meta = tq.kv_batch_put(["k0", "k1"], "p", TensorDict({"reward": torch.tensor([0.5, -1.0])}, batch_size=2),
                           [{"stage": "reward"}, {"stage": "reward", "extra": True}])
    assert sorted(meta.fields) == ["input_ids", "mask", "reward"]
    assert meta.tags == [{"stage": "reward"}, {"stage": "reward", "extra": True}]
    tq.kv_put("k0", "p", None, {"done": 1})  # tags only
    assert tq.kv_list("p")["p"]["k0"] == {"stage": "reward", "done": 1}
    got = tq.kv_batch_get_by_meta(meta)
    assert torch.equal(got["reward"], torch.tensor([0.5, -1.0]))


def test_partitions_are_separate_and_keys_may_repeat_across_them(system):
    tq.kv_batch_put(["x"], "train", batch(1, 0))
    tq.kv_batch_put(["x"], "val", batch(1, 100))
    assert tq.get_client().get_partition_list() == ["train", "val"]
    assert dense(tq.kv_batch_get("x", "val")["input_ids"]).tolist() == [[100, 101, 102]]
    assert dense(tq.kv_batch_get("x", "train")["input_ids"]).tolist() == [[0, 1, 2]]


def test_gets_give_the_fields_every_key_has_and_leave_out_missing_keys_as_transfer_queue_does(system):
    """TransferQueue's kv_batch_get reads the fields every one of the keys has (of select_fields, those: an
    empty TensorDict when there is none; a ValueError when the keys share no field at all), and leaves out
    keys the partition does not hold, raising a ValueError only when it holds none; a key asked for twice
    comes twice. The drop-in raised for each."""
    tq.kv_batch_put(["a"], "p", batch(1))
    tq.kv_batch_put(["b"], "p", None, [{"only": "tags"}])
    assert tq.kv_batch_get(["a", "b"], "p", select_fields="input_ids").batch_size == torch.Size([0])
    with pytest.raises(ValueError, match="Some fields are not ready"):  # no field shared, none selected
        tq.kv_batch_get(["a", "b"], "p")
    assert tq.kv_batch_get(["a"], "p", select_fields=["nope"]).batch_size == torch.Size([0])
    got = tq.kv_batch_get(["zz", "a", "a"], "p", select_fields=["input_ids", "nope"])
    assert list(got.keys()) == ["input_ids"] and dense(got["input_ids"]).tolist() == [[0, 1, 2]] * 2
    with pytest.raises(ValueError, match="keys or partition were not found"):
        tq.kv_batch_get(["zz"], "p")
    with pytest.raises(ValueError, match="keys or partition were not found"):
        tq.kv_batch_get(["a"], "no-such-partition")
    assert tq.get_client().kv_retrieve_meta(["zz", "a"], "p").size == 1


def test_bad_calls_name_what_is_wrong_and_write_nothing(system):
    with pytest.raises(BrokerError, match="2 keys but fields hold 3 rows"):
        tq.kv_batch_put(["a", "b"], "p", batch(3))
    with pytest.raises(BrokerError, match="fields, tags, or both"):
        tq.kv_batch_put(["a"], "p")
    with pytest.raises(BrokerError, match="tags must be a list"):
        tq.kv_batch_put(["a"], "p", batch(1), tags=[{}, {}])
    with pytest.raises(TypeError, match="partition_id must be a str"):
        tq.kv_batch_put(["a"], 7, batch(1))
    assert tq.kv_list() == {}


def test_cleared_rows_go_to_new_samples_and_look_unproduced(system):
    tq.kv_batch_put([f"k{i}" for i in range(4)], "p", batch(4))
    tq.kv_clear(["k1", "k2"], "p")
    tq.kv_batch_put(["n1", "n2"], "p", None, [{}, {}])  # rows reused, no fields yet
    client = tq.get_client()
    rows, status = client.get_production_status(["input_ids"], "p")
    produced = dict(zip(rows.tolist(), status[:, 0].tolist()))  # one column per field asked for
    assert sorted(produced.values()) == [0, 0, 1, 1]
    assert len(produced) == 4  # the two cleared rows were reused, not new ones


def test_kv_list_gives_keys_in_first_put_order_and_partitions_in_creation_order(system):
    """As TransferQueue lists them (verl's replay buffers batch in this order), whatever rows the keys got: here
    rows freed last first, so the row order is not the put order."""
    tq.kv_batch_put(["f", "g", "h"], "p", batch(3))
    tq.kv_clear(["h"], "p")
    tq.kv_clear(["g"], "p")
    tq.kv_batch_put(["z", "y"], "p", batch(2))  # y gets a lower row than z
    tq.kv_put("f", "p", None, {"again": True})  # an existing key keeps its place
    tq.kv_batch_put(["x", "f"], "p", None, [{}, {}])
    assert list(tq.kv_list("p")["p"]) == ["f", "z", "y", "x"]
    tq.kv_clear(["f"], "p")
    tq.kv_put("f", "p", None, {})  # cleared, then put again: last
    assert list(tq.kv_list("p")["p"]) == ["z", "y", "x", "f"]
    for partition in ("q2", "q1"):
        tq.kv_put("a", partition, None, {})
    tq.get_client().clear_partition("p")
    tq.kv_put("a", "p", None, {})  # made again: after the others
    assert list(tq.kv_list()) == ["q2", "q1", "p"] == tq.get_client().get_partition_list()


def test_the_async_twins_do_the_same(system):
    async def run():
        await tq.async_kv_batch_put(["a"], "p", batch(1), [{"t": 1}])
        got = await tq.async_kv_batch_get(["a"], "p")
        listed = await tq.async_kv_list("p")
        await tq.async_kv_clear("a", "p")
        return got, listed, await tq.async_kv_list("p")

    got, listed, after = asyncio.run(run())
    assert dense(got["input_ids"]).tolist() == [[0, 1, 2]] and listed == {"p": {"a": {"t": 1}}} and after == {"p": {}}


def test_a_get_sees_fields_another_process_added_after_it_attached(system):
    from broker.transfer_queue.client import TransferQueueClient
    from broker.transfer_queue.sampler import SequentialSampler
    from broker.transfer_queue.system import System

    tq.kv_batch_put(["a", "b"], "p", batch(2), [{"t": 1}, None])
    mine = tq.get_client().systems.route("p").system  # the system, or the sub-system holding "p"
    # another process's attachment, opened before the field
    other = System(mine.url, mine.namespace, 1 << 10, 5.0, dock=mine.dock.name)
    try:
        tq.kv_batch_put(["b"], "p", TensorDict({"late": torch.tensor([4.0])}, batch_size=1))
        assert "late" not in other.dock.columns
        state = other.snapshot("p", keys=["b", "a"], tag_rows=mine.rows_of_keys("p", ["a", "b"]))
        assert state.tags == [{"t": 1}, {}]
        rows = state.rows_of_keys()
        assert state.common_fields(rows) == ["input_ids", "mask"]  # "late" is b's alone
        assert state.common_fields(rows[:1]) == ["input_ids", "late", "mask"]
        got = TransferQueueClient(other, SequentialSampler()).read("p", rows[:1], ["late"], state)
        assert dense(got["late"]).tolist() == [4.0]
        with pytest.raises(KeyError, match="'nope'"):
            other.snapshot("p", keys=["a", "nope"]).rows_of_keys()
    finally:
        other.close()


def test_rows_for_keys_in_chunks_keep_one_row_per_key(system):
    """tq_rows.lua looks keys up and records new ones a thousand at a time: 2,500 keys, some twice, some
    known already, each get one row, and each row maps back to its key. A new key asked twice in one call
    gets its row both times (the second used to get -1)."""
    route = tq.get_client().systems.route("p")  # the sub-system's rows; global indexes are route.glob(rows)

    def rows_of(partition: str, keys: list[str]) -> list[int]:
        return route.system.rows_for_keys(partition, keys).rows

    first = rows_of("p", [f"k{i}" for i in range(700)])
    keys = [f"k{i}" for i in range(2500)] + ["k5", "k1500", "k2499"]
    rows = rows_of("p", keys)
    assert rows[:700] == first and len(set(rows[:2500])) == 2500
    assert rows[2500:] == [rows[5], rows[1500], rows[2499]]
    assert tq.get_client().kv_retrieve_keys(route.glob(rows[:2500]), "p") == keys[:2500]
    assert rows_of("p", ["k2499", "new", "new"]) == [rows[2499], max(rows) + 1, max(rows) + 1]
    given = route.system.rows_for_keys("p", ["k7", "newer", "k8"])  # which keys this call made
    assert given.fresh == [False, True, False] and given.handout.runs == tuple(runs_of(given.rows))


def test_tensor_fields_come_back_jagged_as_transfer_queue_returns_them(system):
    """verl's v1 trainer calls ``.offsets()`` on the prompts and responses kv_batch_get returns: TransferQueue
    0.1.11 gives every field of tensor rows as a jagged nested tensor, rows of one shape included (scalars
    stacked), from kv_batch_get and get_data alike. The drop-in stacked equal rows into one tensor, and verl
    failed with "'Tensor' object has no attribute 'offsets'" whenever a batch's rows were of one length."""
    tq.kv_batch_put(["a", "b"], "p", TensorDict({"reg": torch.ones(2, 4), "score": torch.tensor([1.0, 2.0])},
                                                batch_size=2))
    tq.kv_put("c", "q", {"r": torch.arange(4)})  # verl's agent loop puts one sample at a time
    tq.kv_put("d", "q", {"r": torch.arange(4) + 1})
    got = tq.kv_batch_get(["a", "b"], "p")
    assert got["reg"].is_nested and got["reg"].layout == torch.jagged and got["reg"].offsets().tolist() == [0, 4, 8]
    assert not got["score"].is_nested and got["score"].tolist() == [1.0, 2.0]
    r = tq.kv_batch_get(["c", "d"], "q")["r"]
    assert r.is_nested and r.offsets().tolist() == [0, 4, 8] and dense(r).tolist() == [[0, 1, 2, 3], [1, 2, 3, 4]]
    client = tq.get_client()
    meta = client.get_meta(["reg"], 2, "p", task_name="t")
    assert client.get_data(meta)["reg"].is_nested


def test_stack_uniform_gives_equal_rows_as_one_tensor(url):
    """``broker.stack_uniform: true`` (beyond TransferQueue, off by default): a field whose rows share one shape
    comes back as one stacked tensor; rows put nested stay jagged."""
    tq.init({"broker": {"url": url, "namespace": "dense" + uuid.uuid4().hex[:8], "stack_uniform": True}})
    try:
        nested = torch.nested.nested_tensor([torch.arange(2), torch.arange(2)], layout=torch.jagged)
        tq.kv_batch_put(["a", "b"], "p", TensorDict({"reg": torch.ones(2, 4), "nested": nested}, batch_size=2))
        got = tq.kv_batch_get(["a", "b"], "p")
        assert not got["reg"].is_nested and got["reg"].shape == (2, 4)
        assert got["nested"].is_nested
    finally:
        tq.get_client().system.delete()
        tq.close()


def test_any_str_names_a_field_a_task_or_a_partition(system):
    """TransferQueue takes any str as a name; the dock's names are 1-128 of [A-Za-z0-9_.-], so other names
    (and names in the adapter's reserved ``tq.``) are kept under a digest: each round-trips, two names never
    share a column, and a plain name is still the column ``redis-cli`` shows."""
    import numpy as np

    from broker.transfer_queue.names import dock_name_of

    odd = ["", "my field é", "a:b{c}*", "f" * 300, "tq.sample", "responses"]
    fields = {name: torch.full((2,), float(i)) for i, name in enumerate(odd)}
    for partition in ["", "p é {x}:*"]:
        tq.kv_put("k", partition, fields, {"t": 1})
        got = tq.kv_batch_get(["k"], partition)
        assert sorted(got.keys()) == sorted(odd)
        for i, name in enumerate(odd):
            assert dense(got[name]).tolist() == [[float(i)] * 2], name
        assert tq.kv_list(partition) == {partition: {"k": {"t": 1}}}
    assert dock_name_of("responses") == "responses" and dock_name_of("tq.sample") != "tq.sample"
    assert len({dock_name_of(n) for n in odd}) == len(odd)
    system_ = tq.get_client().systems.route("").system  # the sub-system of partition ""
    assert "responses" in system_.dock.columns
    task = "critic é {x}"
    meta = tq.get_client().get_meta(["responses", ""], 1, "", task_name=task)
    assert meta.size == 1 and tq.get_client().check_consumption_status(task, "")
    rows, status = tq.get_client().get_production_status(["my field é", "responses"], "")
    assert status.tolist() == [[1, 1]] and len(rows) == 1
    assert np.array_equal(tq.get_client().get_consumption_status(task, "")[1].numpy(), [1])


def test_numpy_arrays_of_objects_and_str_give_each_row_its_element(system):
    """A numpy array of str or of dtype object in a TensorDict is one value to tensordict; TransferQueue's put
    indexes it, a row an element (the drop-in gave every row the whole array, or refused dtype object). The
    elements are stored as plain values (msgpack), never pickled: an arbitrary object is refused."""
    import fractions

    import numpy as np

    from broker import InvalidExperienceError

    values = np.array(["x", {"k": [1, 2]}, None, b"b", 2.5, np.array([[1, 2]], dtype=object)], dtype=object)
    tq.kv_batch_put([f"k{i}" for i in range(6)], "p", TensorDict({"o": values, "s": np.array(list("abcdef"))},
                                                                batch_size=6))
    got = tq.kv_batch_get([f"k{i}" for i in range(6)], "p")
    assert got["s"] == list("abcdef")
    out = got["o"]
    assert out[:5] == ["x", {"k": [1, 2]}, None, b"b", 2.5]
    assert isinstance(out[5], np.ndarray) and out[5].dtype == object and out[5].tolist() == [[1, 2]]
    with pytest.raises(InvalidExperienceError, match=r"field 'q', row 1: a fractions.Fraction cannot be stored"):
        tq.kv_batch_put(["q0", "q1"], "p", TensorDict({"q": np.array([1, fractions.Fraction(1, 3)], dtype=object)},
                                                    batch_size=2))
    assert "q0" not in tq.kv_list("p")["p"]
