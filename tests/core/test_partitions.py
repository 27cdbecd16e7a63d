"""What a partitioned dock adds to the dock's contract (the contract itself: the suites that take ``partitions``).

Its record and its partitions' places, attach and pickling, a get taking from several partitions and giving
back what it took when they fall short, a clear racing gets that span partitions, and ``broker status``'s view.
"""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import torch

from broker import BrokerError, FencedError, SchemaError, TransferDock
from broker.control.status import Survey
from broker.errors import InvalidExperienceError
from tests.helpers import fill


def _dock(client, name="pd", prompts=6, n=2, partitions=3, **kwargs):
    return TransferDock(client, name, prompts, n, ["prompts", "responses"], ["train", "reward"],
                        partitions=partitions, **kwargs)


def test_a_partitioned_dock_is_its_partitions_and_a_record(client):
    dock = _dock(client)
    on_cluster = client.__class__.__name__ == "RedisCluster"  # where the names are chosen by their slots
    assert [p.name for p in dock.partitions] == ["pd~p0", "pd~p1", "pd~p2"] or on_cluster
    assert [p.prompts_num for p in dock.partitions] == [2, 2, 2] and dock.capacity == 12
    again = TransferDock.attach(client, "pd")
    assert [p.name for p in again.partitions] == [p.name for p in dock.partitions]
    with pytest.raises(SchemaError, match="exists with partitions"):
        TransferDock(client, "pd", 6, 2, ["prompts", "responses"], ["train", "reward"])
    with pytest.raises(SchemaError, match="partitions: stored 3, requested 2"):
        _dock(client, partitions=2)
    TransferDock(client, "plain", 4, 2, ["prompts"], ["train"])
    with pytest.raises(SchemaError, match="exists with one partition"):
        TransferDock(client, "plain", 4, 2, ["prompts"], ["train"], partitions=2)
    with pytest.raises(SchemaError, match="exceeds prompts_num"):
        _dock(client, name="small", prompts=2, partitions=3)


def test_on_a_cluster_the_partitions_land_on_different_primaries(client):
    if client.__class__.__name__ != "RedisCluster":
        pytest.skip("one server has one primary")
    dock = _dock(client)
    nodes = {client.nodes_manager.get_node_from_slot(client.keyslot(p.keys.meta)).name for p in dock.partitions}
    assert len(nodes) == 3


def test_rows_round_trip_through_partitions_in_the_callers_order(client):
    dock = _dock(client)
    rows = [11, 0, 5, 2, 7]
    dock.put_experience({"prompts": torch.tensor(rows).view(-1, 1)}, rows)
    assert dock.read_rows(["prompts"], rows, stack=True)["prompts"].flatten().tolist() == rows
    ready = dock.ready_rows(["prompts"])["prompts"]
    assert ready.nonzero().flatten().tolist() == sorted(rows)


def test_a_get_spanning_partitions_takes_from_each_and_gives_back_when_short(client):
    dock = _dock(client)
    fill(dock, columns=["prompts"], rows=list(range(12)))
    batch, rows = dock.get_experience("train", ["prompts"], 10, lease=30)
    assert len(set(rows)) == 10 and all(r // 2 * 2 in rows for r in rows)  # whole groups, from 3 partitions
    assert [int(v[0]) for v in batch["prompts"]] == list(rows)
    # One group left: a get of two groups takes it, finds nothing more, and gives it back.
    assert dock.get_experience("train", ["prompts"], 4) == (None, None)
    assert dock.status()["consumers"]["train"]["consumed"] == 10
    assert dock.ack("train", rows[:4]) == 4
    assert dock.ack("train", list(rows), token=rows.token) == 6  # a plain list and the token, as workers ack
    with pytest.raises(InvalidExperienceError, match="not a partitioned dock's lease token"):
        dock.ack("train", list(rows), token="g1234")
    _, last = dock.get_experience("train", ["prompts"], 2)
    assert sorted(set(range(12)) - set(rows)) == sorted(last)


def test_a_bad_put_writes_nothing_in_any_partition(client):
    dock = _dock(client)
    values = [torch.ones(1)] * 5 + [{1, 2}]  # the last row, in another partition than the first, cannot be stored
    with pytest.raises(InvalidExperienceError, match="a set cannot be stored"):
        dock.put_experience({"prompts": values}, [0, 1, 2, 3, 4, 5])
    assert dock.status()["columns"]["prompts"]["ready"] == 0


def test_a_delivery_fences_each_partitions_part_and_gives_back_only_leased_rows(client):
    dock = _dock(client)
    fill(dock, columns=["prompts"], rows=list(range(12)))
    _, rows = dock.get_experience("train", ["prompts"], 12, lease=30)
    dock.put_experience({"responses": [torch.ones(1)] * 4}, rows[:4])  # acks those four
    assert dock.give_back("train", rows) == 8
    with pytest.raises(InvalidExperienceError, match="lease"):
        dock.give_back("train", list(rows))
    dock.clear()
    with pytest.raises(Exception, match="clear|fenced|Fenced"):
        dock.put_experience({"responses": [torch.ones(1)] * 8}, rows[4:])


def test_a_clear_racing_gets_that_span_partitions_never_mixes_batches(client):
    """The worst case of a clear reaching the partitions one by one: readers taking batches that span them while a
    driver clears and refills. Every row a reader gets holds the value of the batch it was put in, never one of
    another batch, and no row is handed out twice within a batch."""
    dock = _dock(client, prompts=6, n=2)
    stop = threading.Event()
    seen: list[tuple[int, int, int]] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not stop.is_set():
                batch, rows = dock.get_experience("train", ["prompts"], 8, timeout=0.2)
                if rows is not None:
                    seen.extend((r, int(v[0]), int(v[1])) for r, v in zip(rows, batch["prompts"]))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for batch_no in range(15):
        dock.put_experience({"prompts": [torch.tensor([batch_no, r]) for r in range(12)]}, list(range(12)))
        dock.clear()
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert all(r == row for r, _, row in seen)  # each row's own bytes
    per_batch: dict[int, list[int]] = {}
    for r, batch_no, _ in seen:
        per_batch.setdefault(batch_no, []).append(r)
    assert all(len(rs) == len(set(rs)) for rs in per_batch.values())  # none handed out twice


def test_a_partitioned_dock_pickles_and_shows_in_status_as_one(client, backend, request):
    dock = _dock(client)
    fill(dock, columns=["prompts"], rows=[0, 1, 2, 3, 4, 5])
    found = dict(Survey(client).read().docks)
    assert found["pd"]["columns"]["prompts"]["ready"] == 6 and found["pd"]["partitions"] == 3
    assert found["pd"]["n_samples_per_prompt"] == 2 and found["pd"]["prompts_num"] == 6  # a shape, not a count
    assert found["pd"] == dock.status()
    assert not any("~" in name for name in found)
    assert dict(Survey(client, ["pd"]).read().docks)["pd"]["capacity"] == 12
    if backend == "fake":
        return  # a fakeredis client has no URL to pickle with
    url = request.getfixturevalue("cluster_url" if backend == "cluster" else
                                  "redis62_url" if backend == "redis62" else "real_url")
    with TransferDock.attach(url, "pd") as opened:
        again = pickle.loads(pickle.dumps(opened))
        assert again.status()["columns"]["prompts"]["ready"] == 6
        again.close()


def test_a_checkpoint_saves_and_restores_every_partition(client, backend, tmp_path):
    if backend == "cluster":
        pytest.skip("a dock with data shards is not restored into (broker/api/snapshot.py); on a cluster each "
                    "partition shards its bytes")
    from broker.api.snapshot import DockSnapshot

    dock = _dock(client)
    fill(dock, columns=["prompts"], rows=list(range(12)))
    _, taken = dock.get_experience("train", ["prompts"], 4)
    info = DockSnapshot(dock).save(tmp_path / "dock")
    assert len(info["partitions"]) == 3 and info["keys"] > 0
    dock.clear()
    DockSnapshot(dock).restore(tmp_path / "dock", info)
    status = dock.status()
    assert status["columns"]["prompts"]["ready"] == 12 and status["consumers"]["train"]["consumed"] == 4
    assert dock.read_rows(["prompts"], [7])["prompts"][0].tolist() == [7, 7]
    (tmp_path / "dock.p2").write_bytes(b"not a checkpoint")
    dock.clear()
    with pytest.raises(Exception, match="dock.p2"):
        DockSnapshot(dock).restore(tmp_path / "dock", info)
    assert dock.status()["columns"]["prompts"]["ready"] == 0  # a bad file restores no partition


def test_an_error_in_a_partition_names_the_docks_rows(client):
    dock = _dock(client)
    fill(dock, columns=["prompts"], rows=list(range(12)))
    _, rows = dock.get_experience("train", ["prompts"], 12)
    dock.clear([11])
    with pytest.raises(FencedError, match=r"partition 2 of dock 'pd', whose rows \[3\] are the dock's rows \[11\]"):
        dock.put_experience({"responses": [torch.ones(1)]}, rows[rows.index(11):rows.index(11) + 1])


def test_groups_are_dealt_in_blocks_and_every_row_maps_back():
    from broker.api.partition_map import PartitionMap, default_block

    assert default_block(24, 256) == 4 and default_block(3, 256) == 16 and default_block(3, 6) == 1
    for count, prompts, n, block in [(3, 16, 2, 1), (3, 16, 2, 2), (2, 9, 3, 4), (5, 33, 1, 2)]:
        pmap = PartitionMap(count, prompts, n, block)
        seen = {(pmap.partition_of(r), pmap.local(r)) for r in range(prompts * n)}
        assert len(seen) == prompts * n
        assert all(pmap.global_row(p, local) == r for r in range(prompts * n)
                   for p, local in [(pmap.partition_of(r), pmap.local(r))])
        assert all(local < pmap.prompts_of(p) * n for p, local in seen)  # each partition's rows from 0, no gap
        assert sum(pmap.prompts_of(p) for p in range(count)) == prompts
    pmap = PartitionMap(2, 16, 1, 4)
    assert [pmap.partition_of(g) for g in range(16)] == [0] * 4 + [1] * 4 + [0] * 4 + [1] * 4


def test_a_call_of_one_block_is_one_partitions_take(client):
    dock = TransferDock(client, "blocks", 16, 2, ["prompts"], ["train"], partitions=2)  # blocks of 4 groups
    assert dock.partition_map.block == 4
    fill(dock, rows=list(range(32)))
    _, rows = dock.get_experience("train", ["prompts"], 8)  # 4 groups: one block, one partition
    assert len({dock.partition_map.partition_of(r) for r in rows}) == 1
    again = TransferDock.attach(client, "blocks")
    assert again.partition_map == dock.partition_map
    assert again.read_rows(["prompts"], [31, 0])["prompts"][0].tolist() == [31, 7]


def test_a_partitioned_docks_fingerprint_names_its_partitions_schemas(client):
    """What a run's checkpoint records to know its dock again (``broker demo --partitions P`` failed on it)."""
    dock = _dock(client)
    again = TransferDock.attach(client, "pd")
    assert isinstance(dock.fingerprint, str) and dock.fingerprint == again.fingerprint
    assert all(p.name in dock.fingerprint and p.fingerprint in dock.fingerprint for p in dock.partitions)
    assert _dock(client, name="other").fingerprint != dock.fingerprint
    with pytest.raises(BrokerError, match="each with its own session"):
        _ = dock.binding


def _count_takes(monkeypatch, dock):
    """Each partition's sampling script calls, and those that handed nothing out: a spy around the real script
    (which still runs on the backend)."""
    seen = {"calls": 0, "empty": 0}
    for part in dock.partitions:
        scripts = part.session.scripts

        def spy(*args, real=scripts.sample, **kwargs):
            got = real(*args, **kwargs)
            seen["calls"] += 1
            seen["empty"] += got.handout is None
            return got

        monkeypatch.setattr(scripts, "sample", spy)
    return seen


def test_a_pipeline_draining_partitions_makes_no_take_that_finds_nothing(client, monkeypatch):
    # 12 partitions of 4 groups (blocks of 2), drained by gets of 6 groups as a pipeline stage does, each stage
    # putting its results into the rows it got: a take of a drained partition found nothing and was still a
    # script call (without the marks, 24 of the 56 takes here); the sampling script's count of what is left
    # there now has the gets ask such a partition last (32 takes, 2 a get: 6 groups from partitions of 4).
    dock = TransferDock(client, "drain", 48, 2, ["prompts", "responses"], ["train", "reward"], partitions=12)
    fill(dock, columns=["prompts"])
    seen = _count_takes(monkeypatch, dock)
    for consumer, reads, writes in (("train", "prompts", "responses"), ("reward", "responses", None)):
        got = []
        for _ in range(8):
            batch, rows = dock.get_experience(consumer, [reads], 12)
            assert rows is not None and len(rows) == 12
            if writes:
                dock.put_experience({writes: batch[reads]}, rows)
            got += rows
        assert sorted(got) == list(range(96))
    assert seen["empty"] == 0, seen
    assert seen["calls"] <= 2 * 16 + 4, seen
    seen["calls"] = 0
    assert dock.get_experience("train", ["prompts"], 2) == (None, None)  # nothing left: every partition asked
    assert seen["calls"] == 12


def test_a_partition_found_drained_is_still_asked_before_a_get_comes_back_short(client):
    dock = _dock(client, prompts=6, partitions=3)
    other = TransferDock.attach(client, "pd")  # another process: this object is not told of its puts
    fill(dock, columns=["prompts"])
    _, rows = dock.get_experience("train", ["prompts"], 12)
    assert sorted(rows) == list(range(12))  # every partition drained for "train", and marked so
    other.clear([4, 5])
    fill(other, columns=["prompts"], rows=[4, 5])  # group 2 ready again, in a partition marked drained
    assert dock.get_experience("train", ["prompts"], 4) == (None, None)  # two groups asked, one there: given back
    _, again = dock.get_experience("train", ["prompts"], 2)  # the marks did not hide it
    assert sorted(again) == [4, 5]


def test_a_drained_mark_reorders_and_ends():
    from broker.api.drained import Drained

    drained = Drained(0.2)
    key = Drained.key("train", True, ["b", "a"])
    drained.saw(key, 1, 0)
    drained.saw(key, 2, 3)
    assert drained.order(key, [1, 2, 3]) == [2, 3, 1]  # asked last, still asked
    assert drained.order(Drained.key("reward", True, ["a", "b"]), [1, 2, 3]) == [1, 2, 3]  # per consumer
    drained.refilled([1], ["c"])  # a put of a column "train" does not read: nothing qualifies anew
    assert drained.marked(key) == {1}
    drained.refilled([1], ["a"])
    assert drained.marked(key) == set()
    drained.saw(key, 1, 0)
    drained.saw(key, 1, 2)  # a take there found rows after all
    assert drained.marked(key) == set()
    drained.saw(key, 1, 0)
    time.sleep(0.25)  # refilled by someone this object does not hear from: asked in its turn again
    assert drained.order(key, [1, 2, 3]) == [1, 2, 3]


def test_a_take_failing_in_a_later_partition_gives_back_the_earlier_ones(client):
    dock = _dock(client)  # groups g in partition g % 3
    dock.partitions[0].grow(columns=["x"])  # a growth half way round the partitions
    dock.put_experience({"x": [torch.tensor([1])] * 2}, [0, 1])  # group 0, in partition 0: it knows "x"
    dock._turn = 0  # this get asks partition 0 first, then partition 1, which does not know "x"
    with pytest.raises(BrokerError, match="x"):
        dock.get_experience("train", ["x"], 4)
    assert dock.status()["consumers"]["train"]["consumed"] == 0  # group 0's take was given back
    dock.grow(columns=["x"])
    dock.put_experience({"x": [torch.tensor([2])] * 2}, [2, 3])
    _, rows = dock.get_experience("train", ["x"], 4)
    assert sorted(rows) == [0, 1, 2, 3]
