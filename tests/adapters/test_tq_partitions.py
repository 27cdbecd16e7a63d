"""broker.transfer_queue on a system cut into sub-systems (``broker.partitions``, broker/transfer_queue/systems.py),
beyond the API contract the client and KV suites run on it too: which sub-system holds a partition, the same in
every process; another partition count refused, also when two processes start the system at once; global
indexes unique over the system and routed back; the order of partitions over every sub-system; leases across
the translation of indexes; and checkpoints of several files. tests/cluster/test_tq_cluster.py checks that the
sub-systems' slots are on different primaries."""

from __future__ import annotations

import json
import uuid
import zlib
from pathlib import Path
from typing import Any

import pytest
import redis
import torch

tensordict = pytest.importorskip("tensordict")
from tensordict import TensorDict  # noqa: E402

import broker.transfer_queue as tq  # noqa: E402
from broker.errors import CheckpointCorruptError, CheckpointMismatchError, FencedError, SchemaError  # noqa: E402
from broker.transfer_queue.metadata import BatchMeta  # noqa: E402
from broker.transfer_queue.systems import index_of  # noqa: E402
from tests.helpers import dense, worker_processes  # noqa: E402

#: Partition ids and the sub-system of three holding each (CRC-32 of the id, modulo 3).
WHERE = {"train": 0, "val": 1, "p": 1, "q": 2, "b": 2}


def conf(url: str, namespace: str, partitions: int | None = 3, **broker: Any) -> dict[str, Any]:
    more = {} if partitions is None else {"partitions": partitions}
    return {"broker": {"url": url, "namespace": namespace, "get_meta_timeout": 0.5, "capacity": 64, **more,
                       **broker}}


@pytest.fixture
def namespace(url):
    name = "part" + uuid.uuid4().hex[:8]
    yield name
    tq.close()


def rows(n: int, start: int = 0) -> TensorDict:
    return TensorDict({"x": torch.arange(start, start + n)}, batch_size=n)


def test_the_hash_is_crc32_of_the_id_so_every_process_and_release_agrees():
    assert {p: index_of(p, 3) for p in WHERE} == WHERE
    assert all(index_of(p, 1) == 0 for p in WHERE)
    assert index_of("p é {x}:*", 5) == zlib.crc32("p é {x}:*".encode()) % 5


def _put_in_other_process(url: str, namespace: str, out: Any) -> None:
    tq.init({"broker": {"url": url, "namespace": namespace}})  # no partitions: the stored count
    tq.kv_batch_put(["k0", "k1"], "q", rows(2, 10), [{"by": "child"}, {"by": "child"}])
    client = tq.get_client()
    client.put(rows(3, 20), partition_id="val")
    out.put((client.systems.count, client.get_meta(["x"], 3, "val", task_name="t").global_indexes))
    tq.close()


def test_each_partition_lives_in_the_same_sub_system_for_every_process(url, namespace):
    tq.init(conf(url, namespace))
    client = tq.get_client()
    client.put(rows(2), partition_id="train")
    ctx = worker_processes()
    out = ctx.Queue()
    child = ctx.Process(target=_put_in_other_process, args=(url, namespace, out))
    child.start()
    count, fetched = out.get(timeout=120)
    child.join(timeout=60)
    assert count == 3
    assert dense(tq.kv_batch_get(["k1", "k0"], "q")["x"]).tolist() == [11, 10]
    assert tq.kv_list("q") == {"q": {"k0": {"by": "child"}, "k1": {"by": "child"}}}
    assert fetched == [64 * WHERE["val"] + r for r in range(3)]  # sub-system 1's rows 0..2
    raw = redis.Redis.from_url(url)
    for partition in ("train", "val", "q"):  # each partition's keys are in its sub-system's dock, nowhere else
        holders = [k for k in range(3) if raw.exists(f"td:{{tq.{namespace}~p{k}}}:tq:rows:{partition}")]
        assert holders == [WHERE[partition]], partition
    assert not raw.exists(f"td:{{tq.{namespace}}}:meta")  # no dock of the system's own name


def test_another_partition_count_is_refused_and_none_attaches_with_the_stored_one(url, namespace):
    tq.init(conf(url, namespace))
    tq.get_client().put(rows(2), partition_id="q")
    tq.close()
    for asked in (1, 2):
        with pytest.raises(SchemaError, match=f"exists with broker.partitions 3; this process asked for {asked}"):
            tq.init(conf(url, namespace, partitions=asked))
    returned = tq.init(conf(url, namespace, partitions=None))
    assert returned["broker"]["partitions"] == 3 and "broker_docks" not in json.dumps(dict(returned))
    assert tq.get_client().systems.count == 3 and tq.kv_list() == {"q": {}}
    tq.close()
    one = "one" + namespace
    tq.init(conf(url, one, partitions=None))  # a system of one dock, as before
    tq.close()
    with pytest.raises(SchemaError, match="exists with broker.partitions 1; this process asked for 3"):
        tq.init(conf(url, one, partitions=3))
    stored = json.loads(redis.Redis.from_url(url).get(f"td:{{tq.{one}}}:tq:conf"))
    assert stored["broker"]["partitions"] == 1 and "broker_docks" not in stored  # the same keys as ever


def _init_with(url: str, namespace: str, partitions: int, go: Any, out: Any) -> None:
    go.wait(60)
    try:
        tq.init(conf(url, namespace, partitions=partitions))
        client = tq.get_client()
        client.put(rows(1), partition_id="q")  # each process writes where the stored conf says "q" lives
        out.put((partitions, ("ok", [p.dock.name for p in client.systems.parts])))
        tq.close()
    except SchemaError as exc:
        out.put((partitions, (str(exc), [])))


@pytest.mark.parametrize("counts", [(2, 3), (3, 3)])
def test_two_processes_starting_the_system_at_once_follow_the_conf_stored_first_or_are_refused(
        url, namespace, counts):
    """Two processes init the system at once (neither finds a conf): with another count, one wins and the other
    is refused having made no dock; with the same one, both open the same docks and write into one system."""
    ctx = worker_processes()
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_init_with, args=(url, namespace, p, go, out)) for p in counts]
    for p in procs:
        p.start()
    go.set()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    raw = redis.Redis.from_url(url)
    stored = json.loads(raw.get(f"td:{{tq.{namespace}}}:tq:conf"))
    winner = stored["broker"]["partitions"]
    for asked, (outcome, docks) in results:
        if asked == winner:
            assert outcome == "ok" and docks == stored["broker_docks"]
        else:
            assert f"exists with broker.partitions {winner}; this process asked for {asked}" in outcome
    made = sorted(k.decode() for k in raw.scan_iter(match=f"td:{{tq.{namespace}~p*}}:meta"))
    assert made == sorted(f"td:{{{name}}}:meta" for name in stored["broker_docks"]) and len(made) == winner
    tq.init(conf(url, namespace, partitions=None))
    in_q = tq.get_client().get_consumption_status("t", "q")[0]
    assert in_q.numel() == sum(asked == winner for asked, _ in results)  # a row per process that wrote, one "q"


def test_global_indexes_are_unique_over_the_system_and_calls_carrying_them_reach_their_sub_system(url, namespace):
    tq.init(conf(url, namespace))
    client = tq.get_client()
    metas = {p: client.put(rows(4, 100 * i), partition_id=p) for i, p in enumerate(WHERE)}
    indexes = [g for m in metas.values() for g in m.global_indexes]
    assert len(set(indexes)) == len(indexes) == 4 * len(WHERE)
    assert metas["q"].global_indexes == [128, 129, 130, 131]  # sub-system 2 of capacity 64: 2 * 64 + rows
    assert metas["b"].global_indexes == [132, 133, 134, 135]  # "b" shares sub-system 2 with "q"
    for i, (p, meta) in enumerate(metas.items()):
        got = client.get_meta(["x"], 4, p, task_name="t")
        assert got.global_indexes == meta.global_indexes
        assert dense(client.get_data(got)["x"]).tolist() == list(range(100 * i, 100 * i + 4))
    assert client.kv_retrieve_keys(metas["q"].global_indexes[:1], "b") == [None]  # another partition's index
    ids, status = client.get_production_status(["x"], "val")
    assert ids.tolist() == metas["val"].global_indexes and status.flatten().tolist() == [1] * 4
    both = BatchMeta.concat([metas["q"], metas["b"]])  # two partitions of one sub-system read together
    assert dense(client.get_data(both)["x"]).tolist() == [300 + r for r in range(4)] + [400 + r for r in range(4)]
    apart = BatchMeta.concat([metas["q"], metas["train"]])  # two sub-systems: each read there, joined in order
    assert dense(client.get_data(apart)["x"]).tolist() == [300 + r for r in range(4)] + [0, 1, 2, 3]
    client.clear_samples(apart)  # each part cleared in its own sub-system
    assert client.get_partition_list() == list(WHERE)
    assert all(client.get_consumption_status("t", p)[0].tolist() == [] for p in ("q", "train"))
    assert client.get_consumption_status("t", "b")[0].tolist() == metas["b"].global_indexes
    wrong = BatchMeta(global_indexes=metas["val"].global_indexes, partition_ids=["q"] * 4, field_schema={})
    with pytest.raises(KeyError, match="partition 'q' holds no global index"):
        client.clear_samples(wrong)


def test_partitions_are_listed_in_creation_order_over_every_sub_system(url, namespace):
    tq.init(conf(url, namespace))
    client = tq.get_client()
    order = ["q", "train", "val", "b", "p"]
    for p in order:
        tq.kv_put("k", p, None, {"p": p})
    assert client.get_partition_list() == order and list(tq.kv_list()) == order
    client.clear_partition("train")
    tq.kv_put("k", "train", None, {})  # made again: last, as in TransferQueue
    assert client.get_partition_list() == ["q", "val", "b", "p", "train"]


def test_a_leased_batch_of_a_sub_system_is_put_and_acked_through_its_global_indexes(url, namespace):
    tq.init(conf(url, namespace))
    client = tq.get_client()
    client.put(rows(4), partition_id="q")
    meta = client.get_meta(["x"], 2, "q", task_name="t", lease=30)
    assert meta.global_indexes == [128, 129]
    client.put(TensorDict({"y": torch.tensor([1.0, 2.0])}, batch_size=2), meta)  # fenced by its lease, and acked
    assert client.ack(meta) == 0  # acked by the put already
    with pytest.raises(FencedError):
        client.put(TensorDict({"y": torch.tensor([3.0, 4.0])}, batch_size=2), meta)  # the lease is over
    second = client.get_meta(["x"], 2, "q", task_name="t", lease=30)
    assert second.global_indexes == [130, 131] and client.ack(second) == 2


def test_a_checkpoint_of_a_cut_system_round_trips_and_is_checked_whole_before_any_restore(url, namespace,
                                                                                         tmp_path: Path):
    tq.init(conf(url, namespace))
    client = tq.get_client()
    tq.kv_batch_put(["a", "b"], "train", rows(2), [{"s": 1}, {"s": 2}])
    tq.kv_batch_put(["c"], "q", rows(1, 7), [{"s": 3}])
    taken = client.get_meta(["x"], 1, "train", task_name="t")
    ck = tmp_path / "ck"
    tq.save_checkpoint(ck, metadata={"step": 3})
    files = sorted(p.name for p in ck.iterdir())
    assert files == ["metadata.json", *(f"redis_keys.p{k}.msgpack" for k in range(3)), "sampler.msgpack"]
    document = json.loads((ck / "metadata.json").read_text())
    assert document["partitions"] == 3 and [s["dock"] for s in document["systems"]] == \
        [p.dock.name for p in client.systems.parts]

    tq.kv_clear(["a"], "train")
    tq.kv_batch_put(["d"], "q", rows(1, 9), [{"s": 4}])
    client.clear_partition("val")
    assert tq.load_checkpoint(ck) == {"step": 3}
    assert tq.kv_list() == {"train": {"a": {"s": 1}, "b": {"s": 2}}, "q": {"c": {"s": 3}}}
    assert dense(tq.kv_batch_get(["b", "a"], "train")["x"]).tolist() == [1, 0]
    assert dense(tq.kv_batch_get(["c"], "q")["x"]).tolist() == [7]
    consumed = client.get_consumption_status("t", "train")
    assert consumed[1].tolist() == [1 if g in taken.global_indexes else 0 for g in consumed[0].tolist()]

    # A file of one sub-system corrupt: refused before any sub-system is restored.
    tq.kv_clear(["c"], "q")
    before = tq.kv_list()
    damaged = ck / "redis_keys.p2.msgpack"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\0")
    with pytest.raises(CheckpointCorruptError):
        tq.load_checkpoint(ck)
    assert tq.kv_list() == before
    tq.close()

    # Another partition count: refused, naming both.
    other = namespace + "x"
    tq.init(conf(url, namespace, partitions=None))
    tq.close()
    tq.init(conf(url, other, partitions=2))
    document["namespace"] = other
    (ck / "metadata.json").write_text(json.dumps(document))
    with pytest.raises(CheckpointMismatchError, match="3 partitions.*this one has 2"):
        tq.load_checkpoint(ck)


def test_a_process_that_loses_the_race_to_store_the_conf_opens_the_winners_docks_or_is_refused(url, namespace,
                                                                                                monkeypatch):
    """Both processes found no conf; the other stored its own between this one's look and its SET NX: this one
    follows the stored conf (same count) or is refused (another count), having made no dock of its own."""
    from broker.transfer_queue import interface

    chosen = interface._chosen_docks
    raw = redis.Redis.from_url(url)

    def other_first(url_: str, namespace_: str, conf_: dict[str, Any]) -> tuple[str, ...]:
        docks = (f"tq.{namespace_}~p7", f"tq.{namespace_}~p8")  # the docks the other process chose
        theirs = json.loads(interface._conf_json(conf_, docks))
        theirs["broker"]["partitions"] = 2
        raw.set(f"td:{{tq.{namespace_}}}:tq:conf", json.dumps(theirs), nx=True)
        return chosen(url_, namespace_, conf_)

    monkeypatch.setattr(interface, "_chosen_docks", other_first)
    with pytest.raises(SchemaError, match="exists with broker.partitions 2; this process asked for 3"):
        tq.init(conf(url, namespace))
    assert list(raw.scan_iter(match="td:{tq.*~p*}:meta")) == []  # no dock was made
    raw.delete(f"td:{{tq.{namespace}}}:tq:conf")
    tq.init(conf(url, namespace, partitions=None))  # the other's count, and the docks it named
    assert [p.dock.name for p in tq.get_client().systems.parts] == [f"tq.{namespace}~p7", f"tq.{namespace}~p8"]


def test_a_data_loader_whose_workers_open_the_cut_system_hands_each_row_once_and_acks_its_leases(url, namespace):
    """The loader's worker processes open the system from the stored conf (its docks), fetch "q"'s batches from
    sub-system 2 under a lease, and the consumer acks them through their global indexes."""
    tq.init({**conf(url, namespace), "controller": {"sampler": "RankAwareSampler", "polling_mode": True}})
    client = tq.get_client()
    meta = client.put(rows(12, 50), partition_id="q")
    loader = tq.StreamingDataLoader(tq.StreamingDataset(
        {"broker": {"url": url, "namespace": namespace}}, batch_size=4, micro_batch_size=2, data_fields=["x"],
        partition_id="q", task_name="actor", dp_rank=0, should_check_consumption_status=True, lease=60),
        num_workers=2)
    got = [(dense(td["x"]).tolist(), m.global_indexes) for td, m in loader]
    assert sorted(g for _, gs in got for g in gs) == meta.global_indexes == list(range(128, 140))
    assert all(x == [g - 128 + 50 for g in gs] for x, gs in got)  # each row its own sample
    part = client.systems.route("q").system
    assert part.dock.client.zcard(part.keys.leases("actor")) == 0  # every micro-batch acked
    assert client.check_consumption_status("actor", "q")


def test_the_tools_that_open_a_dock_by_name_see_the_cut_system_as_one_dock_of_global_indexes(url, namespace):
    """The core's record of a partitioned dock names the sub-systems' docks: ``broker status tq.NS`` sums them,
    and ``TransferDock.attach`` opens them as one dock whose row indexes are the system's global indexes."""
    from broker import TransferDock
    from broker.api.partitioned import PartitionedDock
    from tests.helpers import cli_output

    tq.init(conf(url, namespace))
    client = tq.get_client()
    meta = client.put(rows(3), partition_id="q")
    client.put(rows(2), partition_id="train")
    status = json.loads(cli_output(["status", f"tq.{namespace}", "--url", url, "--json"]))
    assert status["partitions"] == 3 and status["columns"]["x"]["ready"] == 5
    with TransferDock.attach(url, f"tq.{namespace}") as dock:
        assert isinstance(dock, PartitionedDock)
        assert [p.name for p in dock.partitions] == [p.dock.name for p in client.systems.parts]
        assert [dock.partition_map.partition_of(g) for g in meta.global_indexes] == [2, 2, 2]
        assert dense(torch.stack(dock.read_rows(["x"], meta.global_indexes)["x"])).tolist() == [0, 1, 2]
    client.systems.delete()
    left = [k for k in redis.Redis.from_url(url).keys("*") if b":reply:" not in k]  # kept replies expire
    assert left == []  # the record, the conf and the counter too


def test_a_meta_joining_partitions_of_several_sub_systems_reads_as_one_system_would(url, namespace):
    """get_data of a concat of metas of "q" (sub-system 2), "train" (0) and "b" (2 again): every kind of field
    comes back as a system of one dock gives it (the same layouts, in the meta's order)."""
    def data(start: int, n: int) -> TensorDict:
        ragged = torch.nested.as_nested_tensor([torch.arange(start + i % 3 + 1) for i in range(n)],
                                               layout=torch.jagged)
        return TensorDict({"x": torch.arange(start, start + n), "m": torch.ones(n, 2) * start, "r": ragged,
                           "s": tensordict.NonTensorStack(*[f"s{start + i}" for i in range(n)])}, batch_size=n)

    answers = {}
    for partitions in (1, 3):
        name = f"{namespace}{partitions}"
        tq.init(conf(url, name, partitions=partitions))
        client = tq.get_client()
        metas = [client.put(data(10 * i, 2), partition_id=p) for i, p in enumerate(("q", "train", "b"))]
        got = client.get_data(BatchMeta.concat(metas))
        answers[partitions] = got
        tq.close()
    one, cut = answers[1], answers[3]
    assert dense(cut["x"]).tolist() == dense(one["x"]).tolist() == [0, 1, 10, 11, 20, 21]
    for field in ("m", "r"):
        assert cut[field].is_nested and one[field].is_nested and cut[field].layout == one[field].layout
        assert [t.tolist() for t in cut[field].unbind()] == [t.tolist() for t in one[field].unbind()]
    assert list(cut["s"]) == list(one["s"]) == ["s0", "s1", "s10", "s11", "s20", "s21"]


def test_a_partition_another_process_cleared_and_made_again_is_listed_last(url, namespace):
    """A process that saw a partition made takes no place of the system's counter for its puts there; when
    another process cleared the partition since, its put makes it again with a new place: listed last."""
    from broker.transfer_queue.interface import _stored, open_systems

    tq.init(conf(url, namespace))
    client = tq.get_client()
    client.put(rows(1), partition_id="train")
    client.put(rows(1), partition_id="q")
    stored, docks = _stored(url, namespace) or ({}, ())
    other = open_systems(url, namespace, stored, docks)  # another process's attachment
    try:
        train = other.route("train").system
        train.release("train", None)  # clear_partition there
        other.route("val").system.new_rows("val", 1)
        assert client.get_partition_list() == ["q", "val"]
        seq = redis.Redis.from_url(url).get(f"td:{{tq.{namespace}}}:tq:seq")
        client.put(rows(1), partition_id="q")  # known to this process: no place taken
        assert redis.Redis.from_url(url).get(f"td:{{tq.{namespace}}}:tq:seq") == seq
        client.put(rows(2), partition_id="train")  # gone since this process saw it: made again, last
        assert client.get_partition_list() == ["q", "val", "train"]
        assert client.get_consumption_status("t", "train")[0].numel() == 2
    finally:
        other.close()
