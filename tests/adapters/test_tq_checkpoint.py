"""broker.transfer_queue's save_checkpoint / load_checkpoint on a real Redis and a Redis Cluster: a round trip of
the whole system, consistency while writers and clearers run, saves that die half way, the errors, leases and
other processes across a restore, and TransferQueue's verl-style loop killed and resumed with every row
consumed exactly once."""

from __future__ import annotations

import copy
import json
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import redis
import torch

tensordict = pytest.importorskip("tensordict")
from tensordict import NonTensorStack, TensorDict  # noqa: E402

import broker.transfer_queue as tq  # noqa: E402
from broker import BrokerError  # noqa: E402
from broker.api import snapshot  # noqa: E402
from broker.ops.acl import worker_rules  # noqa: E402
from broker.ops.local_redis import RedisServer  # noqa: E402
from broker.transfer_queue import checkpoint  # noqa: E402
from broker.transfer_queue.client import TransferQueueClient  # noqa: E402
from broker.transfer_queue.errors import (  # noqa: E402
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointRestoreError,
)
from broker.transfer_queue.sampler import RankAwareSampler, SequentialSampler  # noqa: E402
from broker.transfer_queue.system import System  # noqa: E402
from tests.helpers import dense, empty_cluster, raw_state, restored_from, server_keys, worker_processes  # noqa: E402


def conf(url: str, namespace: str, **broker: Any) -> dict[str, Any]:
    return {"broker": {"url": url, "namespace": namespace, "get_meta_timeout": 0.5, "capacity": 4096, **broker}}


@pytest.fixture(params=["real", "cluster"])
def store(request) -> str:
    """An empty store's URL: the real server's, or a node's of the local cluster."""
    if request.param == "real":
        return request.getfixturevalue("url")
    empty_cluster(request.getfixturevalue("cluster_admin"))
    return request.getfixturevalue("cluster_url")


@pytest.fixture
def system(store):
    tq.init(conf(store, "ck" + uuid.uuid4().hex[:8]))
    yield tq.get_client().system
    tq.close()


@pytest.fixture
def real_system(url):
    tq.init(conf(url, "ck" + uuid.uuid4().hex[:8]))
    yield tq.get_client().system
    tq.close()


def batch(keys: list[str], base: int = 0) -> TensorDict:
    n = len(keys)
    ids = torch.arange(base, base + 3 * n).reshape(n, 3)
    return TensorDict({"input_ids": ids, "text": NonTensorStack(*[f"t{k}" for k in keys])}, batch_size=n)


def staging_keys(system: System) -> list[bytes]:
    return server_keys(system.client, system.keys.base + "ckpt:*")


def bits(raw: bytes | None) -> set[int]:
    return set() if not raw else {int(r) for r in np.flatnonzero(np.unpackbits(np.frombuffer(raw, np.uint8)))}


# -- a round trip -------------------------------------------------------------------------------------------


def test_a_restore_brings_back_the_system_as_it_was_saved(system, tmp_path):
    tq.kv_batch_put(["a", "b", "c", "d"], "train", batch(["a", "b", "c", "d"]), [{"score": i} for i in range(4)])
    tq.kv_batch_put(["x"], "val", batch(["x"], 100), [{"kind": "val"}])
    client = tq.get_client()
    first = client.get_meta(["input_ids"], 2, "train", task_name="actor")
    before, listing = raw_state(system), tq.kv_list()
    ck = tmp_path / "ck"

    tq.save_checkpoint(ck, metadata={"step": 7, "progress": [1, 2]})

    assert sorted(os.listdir(ck)) == ["metadata.json", "redis_keys.msgpack", "sampler.msgpack"]
    document = json.loads((ck / "metadata.json").read_text())
    assert document["user_metadata"] == {"step": 7, "progress": [1, 2]} and document["storage_saved"] is True
    assert document["version"] == checkpoint.VERSION and document["namespace"] == system.namespace
    assert json.loads(document["schema"]["columns"]) == list(system.dock.columns)
    assert staging_keys(system) == [] and raw_state(system) == before  # the save changed nothing
    # Everything after the checkpoint is undone by the load: clears, a new partition with a new field,
    # more consumption, a new task.
    tq.kv_clear(["a", "c"], "train")
    tq.kv_batch_put(["z"], "extra", TensorDict({"z": torch.ones(1, 2)}, batch_size=1), [{}])
    tq.kv_put("b", "train", None, {"score": 99})
    client.get_meta(["input_ids"], 1, "train", task_name="actor")
    client.get_meta(["input_ids"], 1, "val", task_name="critic")

    assert tq.load_checkpoint(ck) == {"step": 7, "progress": [1, 2]}

    after, restored = raw_state(system), restored_from(before, system)
    meta = system.keys.meta
    assert {k: v for k, v in after.items() if k != meta} == {k: v for k, v in restored.items() if k != meta}
    # The meta is the checkpoint's grown by what the system has now: every process finds its schema in it.
    assert set(system.dock.columns) == {*json.loads(document["schema"]["columns"]), "z"}
    assert "critic" in system.dock.consumers
    assert tq.kv_list() == listing and staging_keys(system) == []
    got = tq.kv_batch_get(["a", "b", "c", "d"], "train")
    assert torch.equal(dense(got["input_ids"]), torch.arange(12).reshape(4, 3))
    assert list(got["text"]) == ["ta", "tb", "tc", "td"]
    rows, consumed = client.get_consumption_status("actor", "train")
    assert dict(zip(rows.tolist(), consumed.tolist())) == {r: int(r in first.global_indexes) for r in rows.tolist()}
    rest = client.get_meta(["input_ids"], 2, "train", task_name="actor")  # what was left at the checkpoint
    assert sorted(rest.global_indexes + first.global_indexes) == sorted(rows.tolist())
    assert client.get_meta(["input_ids"], 1, "val", task_name="critic").size == 1  # consumed after: offered again


def test_the_keys_a_checkpoint_names_are_every_key_the_system_has(system, tmp_path):
    """The snapshot names the system's keys from its schema, partitions and named takes (no SCAN): after
    every kind of call, a SCAN finds no key it would miss."""
    client = tq.get_client()
    tq.kv_batch_put([f"k{i}" for i in range(8)], "train", batch([f"k{i}" for i in range(8)]),
                    [{"i": i} for i in range(8)])
    tq.kv_batch_put(["v"], "val", batch(["v"]))
    leased = client.get_meta(["input_ids"], 2, "train", task_name="actor", lease=30)
    client.ack(leased)
    client.get_meta(["input_ids"], 2, "train", task_name="actor", lease=30)
    ranked = TransferQueueClient(system, RankAwareSampler(), get_meta_timeout=0.5)
    ranked.get_meta(["input_ids"], 2, "train", task_name="ref", sampling_config={"dp_rank": 0, "batch_index": 0})
    tq.kv_clear(["k0", "k5"], "train")
    tq.kv_batch_put(["n"], "train", batch(["n"]))  # a freed row reused
    client.clear_partition("val")

    c, k = system.client, system.keys
    records = [r.decode() for r in c.zrange(k.named_index, 0, -1)]
    assert records, "no named take was recorded: the test exercises too little"
    schema = system.dock.refresh()
    named = {*k.every_key(schema.columns, schema.consumers, schema.rollout.age_buckets), *records,
             *system.checkpoint_keys().keys}
    found = {raw.decode() for raw in server_keys(c, k.base + "*")} - {
        raw.decode() for raw in server_keys(c, k.base + "reply:*")}
    assert found - named == set()
    tq.save_checkpoint(tmp_path / "ck")
    document = json.loads((tmp_path / "ck" / "metadata.json").read_text())
    assert document["keys"] == len(found) - 1  # each but the meta, which metadata.json holds


@pytest.mark.real
def test_a_worker_confined_to_its_system_by_acl_saves_and_loads(tmp_path):
    """No SCAN, no server-wide command: ``broker acl``'s rules for the system's dock are enough (with the
    broker's functions loaded, as ``broker acl --apply`` does)."""
    from broker.control.scripts.functions import load_library

    with RedisServer() as server:
        server.client().execute_command("ACL", "SETUSER", "worker", "on", ">pw", *worker_rules("tq.confined"))
        load_library(server.client())
        tq.init(conf(f"redis://worker:pw@127.0.0.1:{server.port}/0", "confined"))
        try:
            tq.kv_batch_put(["a", "b"], "p", batch(["a", "b"]), [{"t": 1}, {"t": 2}])
            tq.save_checkpoint(tmp_path / "ck")
            tq.kv_clear(["a"], "p")
            tq.load_checkpoint(tmp_path / "ck")
            assert tq.kv_list() == {"p": {"a": {"t": 1}, "b": {"t": 2}}}
        finally:
            tq.close()


# -- consistency while the system changes ---------------------------------------------------------------------


def _check_consistent(system: System) -> int:
    """Every row of the restored system is whole or absent; returns how many rows are whole."""
    c, k = system.client, system.keys
    keys = {key.decode(): int(row) for key, row in c.hgetall(k.tq_keys("train")).items()}
    rkeys = {int(row): key.decode() for row, key in c.hgetall(k.tq_rkeys("train")).items()}
    assert rkeys == {row: key for key, row in keys.items()}
    members = bits(c.get(k.tq_rows("train")))
    assert members == set(rkeys)
    assert not {int(r) for r in c.lrange(k.tq_free, 0, -1)} & members
    ready = {col: bits(c.get(k.ready(col))) for col in ("a", "b")}
    for col in ("a", "b"):
        assert ready[col] <= {int(f) for f in c.hkeys(k.data(col))}, f"rows ready in {col} without their bytes"
    for row in members:
        assert (row in ready["a"]) == (row in ready["b"]), f"row {row} ({rkeys[row]}) is half put"
    tags = {int(r): msgpack.unpackb(v) for r, v in c.hgetall(k.tq_tags("train")).items()}
    assert set(tags) <= members
    for row, tag in tags.items():
        assert rkeys[row] == f"w{tag['n']}"
        # Tags are set after the data; a row with tags and no data is one a kv_clear is ending between its
        # two steps (the dock's clear, then the release of the key), as a concurrent kv_list sees it too.
        assert row in ready["a"] or tag["n"] % 3 == 0, f"row {row} ({rkeys[row]}) has tags but no data"
    whole = sorted((key for key, row in keys.items() if row in ready["a"]), key=lambda s: int(s[1:]))
    if whole:
        got = tq.kv_batch_get(whole, "train")
        n = torch.tensor([int(key[1:]) for key in whole])
        assert torch.equal(dense(got["a"]), n[:, None].repeat(1, 4))
        assert torch.equal(dense(got["b"]), (2 * n)[:, None].repeat(1, 3).float())
    return len(whole)


def test_checkpoints_taken_while_writers_and_clearers_run_restore_whole_rows(system, tmp_path):
    stop, failures = threading.Event(), []

    def writer() -> None:
        n = 0
        while not stop.is_set():
            keys = [f"w{n + j}" for j in range(4)]
            values = torch.arange(n, n + 4)
            fields = TensorDict({"a": values[:, None].repeat(1, 4), "b": (2 * values)[:, None].repeat(1, 3).float()},
                                batch_size=4)
            tq.kv_batch_put(keys, "train", fields, [{"n": int(v)} for v in values])
            n += 4

    def clearer() -> None:  # rows of every third sample end, and their rows go to new samples
        while not stop.is_set():
            listing = tq.kv_list("train").get("train", {})
            ended = [key for key, tag in listing.items() if tag.get("n", 1) % 3 == 0]
            if ended:
                tq.kv_clear(ended, "train")

    def guarded(work) -> Any:
        def run() -> None:
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 (reported by the test)
                failures.append(exc)
        return run

    threads = [threading.Thread(target=guarded(work)) for work in (writer, clearer)]
    for thread in threads:
        thread.start()
    try:
        saved = []
        while len(saved) < 4:
            if tq.kv_list("train").get("train"):
                tq.save_checkpoint(tmp_path / f"ck{len(saved)}")
                saved.append(tmp_path / f"ck{len(saved)}")
            time.sleep(0.05)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not failures, failures
    assert staging_keys(system) == []
    whole = []
    for ck in saved:
        tq.load_checkpoint(ck)
        whole.append(_check_consistent(system))
    assert max(whole) > 0


# -- saves that die ---------------------------------------------------------------------------------------------


class _Crash(Exception):
    pass


def test_a_save_that_fails_half_way_leaves_the_previous_checkpoint(system, tmp_path, monkeypatch):
    ck = tmp_path / "ck"
    tq.kv_batch_put(["a", "b"], "p", batch(["a", "b"]), [{"v": 1}, {"v": 1}])
    tq.save_checkpoint(ck, metadata={"v": 1})
    saved = raw_state(system)
    tq.kv_batch_put(["c", "d", "e"], "p", batch(["c", "d", "e"], 10), [{"v": 2}] * 3)
    tq.kv_batch_put(["f"], "q", batch(["f"]))
    written = []
    real_write = snapshot._Writer.write

    def write_then_crash(self, record):
        if len(written) == 3:
            assert (tmp_path / "ck.tmp" / checkpoint.KEYS_FILE).exists()  # part of the new files is there
            raise _Crash("the disk is gone")
        written.append(record["k"])
        real_write(self, record)

    monkeypatch.setattr(snapshot._Writer, "write", write_then_crash)
    with pytest.raises(_Crash):
        tq.save_checkpoint(ck, metadata={"v": 2})
    monkeypatch.undo()

    assert not (tmp_path / "ck.tmp").exists() and not (tmp_path / "ck.old").exists()
    assert staging_keys(system) == []  # the snapshot's copies went with it
    assert json.loads((ck / "metadata.json").read_text())["user_metadata"] == {"v": 1}
    assert tq.load_checkpoint(ck) == {"v": 1}
    assert {k: v for k, v in raw_state(system).items() if k != system.keys.meta} == \
        {k: v for k, v in restored_from(saved, system).items() if k != system.keys.meta}
    assert tq.kv_list() == {"p": {"a": {"v": 1}, "b": {"v": 1}}}


def _save_and_die(url: str, namespace: str, folder: str, records: int) -> None:
    """Save a checkpoint and be SIGKILLed after writing ``records`` records of it: no handler runs."""
    tq.init(conf(url, namespace))
    real_write = snapshot._Writer.write

    def write(self, record):
        real_write(self, record)
        if self.records >= records:
            self.out.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    snapshot._Writer.write = write  # type: ignore[method-assign]
    tq.save_checkpoint(Path(folder) / "ck", metadata={"v": 2})


def test_a_saver_killed_half_way_leaves_the_previous_checkpoint(system, tmp_path):
    ck = tmp_path / "ck"
    tq.kv_batch_put(["a", "b"], "p", batch(["a", "b"]), [{"v": 1}, {"v": 1}])
    tq.save_checkpoint(ck, metadata={"v": 1})
    tq.kv_batch_put(["c"], "p", batch(["c"]), [{"v": 2}])
    ctx = worker_processes()
    saver = ctx.Process(target=_save_and_die, args=(system.url, system.namespace, str(tmp_path), 3))
    saver.start()
    saver.join(120)
    assert saver.exitcode == -signal.SIGKILL

    partial = tmp_path / "ck.tmp" / checkpoint.KEYS_FILE
    assert partial.exists() and partial.stat().st_size > 0
    assert not (tmp_path / "ck.tmp" / checkpoint.METADATA_FILE).exists()
    left = staging_keys(system)  # the dead saver's copies: they expire by themselves
    assert left and all(0 < system.client.pttl(key) <= snapshot.STAGING_TTL_MS for key in left)
    system.client.unlink(*left)
    assert tq.load_checkpoint(ck) == {"v": 1}
    assert tq.kv_list() == {"p": {"a": {"v": 1}, "b": {"v": 1}}}
    tq.save_checkpoint(ck, metadata={"v": 3})  # the next save replaces the dead one's leftovers
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_a_save_killed_between_its_renames_leaves_the_previous_checkpoint_as_old(system, tmp_path):
    ck, old = tmp_path / "ck", tmp_path / "ck.old"
    tq.kv_batch_put(["a"], "p", batch(["a"]), [{"v": 1}])
    tq.save_checkpoint(ck, metadata={"v": 1})
    tq.kv_clear(["a"], "p")
    ck.rename(old)  # what a save that died after moving the previous checkpoint aside leaves
    assert tq.load_checkpoint(ck) == {"v": 1}
    assert ck.is_dir() and not old.exists()
    assert tq.kv_list() == {"p": {"a": {"v": 1}}}
    ck.rename(old)
    tq.save_checkpoint(ck, metadata={"v": 2})  # a save brings it back first, then replaces it
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert json.loads((ck / "metadata.json").read_text())["user_metadata"] == {"v": 2}


# -- errors -------------------------------------------------------------------------------------------------------


def test_missing_and_corrupt_checkpoints_are_clear_errors_and_change_nothing(real_system, tmp_path):
    system = real_system
    with pytest.raises(CheckpointNotFoundError, match="not found") as info:
        tq.load_checkpoint(tmp_path / "nowhere")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, BrokerError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="metadata.json"):
        tq.load_checkpoint(tmp_path / "empty")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "controller_state.pkl").write_bytes(b"\x80\x04")
    with pytest.raises(CheckpointMismatchError, match="never unpickles"):
        tq.load_checkpoint(tmp_path / "theirs")

    tq.kv_batch_put(["a", "b"], "p", batch(["a", "b"]), [{}, {}])
    ck = tmp_path / "ck"
    tq.save_checkpoint(ck)
    tq.kv_clear(["a"], "p")
    now = raw_state(system)
    keys_file = ck / checkpoint.KEYS_FILE
    data = bytearray(keys_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    keys_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="not the file the save wrote"):
        tq.load_checkpoint(ck)
    keys_file.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(CheckpointCorruptError):
        tq.load_checkpoint(ck)
    metadata = (ck / checkpoint.METADATA_FILE).read_text()
    (ck / checkpoint.METADATA_FILE).write_text(metadata[: len(metadata) // 2])
    with pytest.raises(CheckpointCorruptError, match="not JSON"):
        tq.load_checkpoint(ck)
    (ck / checkpoint.METADATA_FILE).write_text(metadata)
    (ck / checkpoint.SAMPLER_FILE).unlink()
    with pytest.raises(CheckpointNotFoundError, match=checkpoint.SAMPLER_FILE):
        tq.load_checkpoint(ck)
    assert raw_state(system) == now and staging_keys(system) == []


def test_a_checkpoint_of_another_namespace_or_schema_is_refused(url, tmp_path):
    tq.init(conf(url, "one"))
    tq.kv_batch_put(["a"], "p", batch(["a"]))
    tq.save_checkpoint(tmp_path / "one")
    tq.close()
    tq.init(conf(url, "two"))
    tq.kv_batch_put(["b"], "p", batch(["b"]))
    try:
        with pytest.raises(CheckpointMismatchError, match="system 'one'; this process is attached to 'two'"):
            tq.load_checkpoint(tmp_path / "one")
        assert tq.kv_list() == {"p": {"b": {}}}
    finally:
        tq.close()
    redis.Redis.from_url(url).flushdb()
    tq.init(conf(url, "one", capacity=128))  # the same namespace made anew, of another size
    try:
        with pytest.raises(CheckpointMismatchError, match="prompts_num: checkpoint 4096, system 128"):
            tq.load_checkpoint(tmp_path / "one")
    finally:
        tq.close()
    with pytest.raises(BrokerError, match="not initialized"):
        tq.load_checkpoint(tmp_path / "one")
    with pytest.raises(BrokerError, match="not initialized"):
        tq.save_checkpoint(tmp_path / "x")


def test_what_a_checkpoint_cannot_hold_is_refused_before_anything_is_written(real_system, tmp_path):
    with pytest.raises(CheckpointError, match="JSON values only"):
        tq.save_checkpoint(tmp_path / "ck", metadata={"when": object()})
    sampler = tq.get_client()._sampler
    sampler._states = {"p": {"t": {0: {0: ([1, 2], [1, 2])}}}, "rng": np.random.default_rng(0)}
    with pytest.raises(CheckpointError, match="holds a Generator.*never pickles"):
        tq.save_checkpoint(tmp_path / "ck")
    assert not tmp_path.joinpath("ck").exists() and not tmp_path.joinpath("ck.tmp").exists()


def test_an_older_server_that_cannot_read_the_payloads_says_so_and_keeps_its_system(url, redis62_url, tmp_path):
    namespace = "ck" + uuid.uuid4().hex[:8]
    tq.init(conf(url, namespace))
    tq.kv_batch_put(["a"], "p", batch(["a"]), [{"on": "7"}])
    tq.save_checkpoint(tmp_path / "ck")
    tq.close()
    redis.Redis.from_url(redis62_url).flushdb()
    tq.init(conf(redis62_url, namespace))
    try:
        tq.kv_batch_put(["b"], "p", batch(["b"]), [{"on": "6.2"}])
        system = tq.get_client().system
        before = raw_state(system)
        with pytest.raises(CheckpointRestoreError, match="RDB format 1[0-9]"):
            tq.load_checkpoint(tmp_path / "ck")
        assert raw_state(system) == before and staging_keys(system) == []
        assert tq.kv_list() == {"p": {"b": {"on": "6.2"}}}
    finally:
        tq.close()


# -- resuming ---------------------------------------------------------------------------------------------------


def test_rows_leased_at_the_checkpoint_come_back_when_their_lease_runs_out(system, tmp_path):
    client = tq.get_client()
    client.put(TensorDict({"x": torch.arange(6).reshape(6, 1)}, batch_size=6), partition_id="p")
    done = client.get_meta(["x"], 2, "p", task_name="t")  # consumed for good
    leased = client.get_meta(["x"], 2, "p", task_name="t", lease=3.0)
    tq.save_checkpoint(tmp_path / "ck")
    client.ack(leased)  # after the checkpoint: undone by the load
    later = client.get_meta(["x"], 2, "p", task_name="t")

    tq.load_checkpoint(tmp_path / "ck")

    again = client.get_meta(["x"], 2, "p", task_name="t")  # consumed after the checkpoint: offered again
    assert sorted(again.global_indexes) == sorted(later.global_indexes)
    with pytest.raises(BrokerError, match="0 ready"):  # the leased rows are still out
        client.get_meta(["x"], 1, "p", task_name="t")
    deadline = max(score for _, score in system.client.zrange(system.keys.leases("t"), 0, -1, withscores=True))
    while (lambda now: now[0] * 1000 + now[1] // 1000)(system.client.time()) <= deadline:  # server time
        time.sleep(0.05)
    back = client.get_meta(["x"], 2, "p", task_name="t")
    assert sorted(back.global_indexes) == sorted(leased.global_indexes)
    assert not set(back.global_indexes) & set(done.global_indexes)


def test_the_samplers_state_comes_back_with_its_tuples(system, tmp_path):
    sampler = tq.get_client()._sampler
    states = {"train": {"actor": {0: {0: ([1, 2], [1, 2]), 1: ([3], [3])}, 1: {None: [4, 5]}}}}
    sampler._states = copy.deepcopy(states)
    tq.save_checkpoint(tmp_path / "ck")
    sampler._states = {}
    tq.load_checkpoint(tmp_path / "ck")
    assert sampler._states == states
    assert sampler.cached("train", "actor", 0, 1) == ([3], [3])


def test_other_processes_go_on_after_a_restore(system, tmp_path):
    """Another process's dock knows fields and tasks added after the checkpoint: the restored schema holds
    them, so it adopts it at its next call."""
    other = TransferQueueClient(System(system.url, system.namespace, 4096, 30.0), SequentialSampler(),
                                get_meta_timeout=0.5)
    try:
        tq.kv_batch_put(["a", "b"], "p", batch(["a", "b"]))
        tq.save_checkpoint(tmp_path / "ck")
        other.put(TensorDict({"late": torch.ones(2, 1)}, batch_size=2), partition_id="q")
        other.get_meta(["late"], 1, "q", task_name="late_task")
        tq.load_checkpoint(tmp_path / "ck")
        assert other.get_partition_list() == ["p"]
        meta = other.put(TensorDict({"late": torch.zeros(1, 1)}, batch_size=1), partition_id="q")
        assert other.get_meta(["late"], 1, "q", task_name="late_task").global_indexes == meta.global_indexes
        got = other.get_meta(["input_ids"], 2, "p", task_name="reader")
        assert torch.equal(dense(other.get_data(got)["input_ids"]), torch.arange(6).reshape(2, 3))
    finally:
        other.system.close()


# -- TransferQueue's verl-style loop, killed and resumed ----------------------------------------------------------

PRODUCERS, PER_PRODUCER, BATCH = 3, 80, 4
#: The trainer's batch: at most this many finished rows per step.
TRAIN_BATCH = 8
#: Finished rows a producer lets wait for the trainer before it pauses (as verl's rollout waits for its trainer).
AHEAD = 8
#: The first run: the checkpoint once this many rows are consumed, the kill once this many more are. No
#: producer can be done by then (each is at most AHEAD + BATCH rows ahead of what was consumed of it).
SAVE_AT, MORE_AFTER = 30, 20


def _write_json(file: Path, value: Any) -> None:
    tmp = file.with_name(file.name + ".tmp")
    tmp.write_text(json.dumps(value))
    tmp.rename(file)


def _read_json(file: Path, default: Any = None) -> Any:
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        return default


def _progress(listing: dict[str, dict[str, Any]], producer: int) -> int:
    return int(listing.get(f"progress-{producer}", {}).get("next", 0))


def _producer(url: str, namespace: str, producer: int) -> None:
    """A rollout worker: kv_batch_put rows with tags, from where its progress says.

    Its progress is a row of the partition whose tag is set in the same kv_batch_put as the rows' tags (one
    write): whatever moment a checkpoint catches, the progress it holds says exactly which rows are in.
    """
    tq.init(conf(url, namespace))
    n = _progress(tq.kv_list("train").get("train", {}), producer)
    while n < PER_PRODUCER:
        listing = tq.kv_list("train").get("train", {})
        if sum(tag.get("status") == "done" and tag["producer"] == producer for tag in listing.values()) >= AHEAD:
            time.sleep(0.01)
            continue
        count = min(BATCH, PER_PRODUCER - n)
        keys = [f"p{producer}-{n + j}" for j in range(count)] + [f"progress-{producer}"]
        tokens = torch.tensor([[producer, n + j, (n + j) * 7] for j in range(count)] + [[producer, -1, 0]])
        fields = TensorDict({"tokens": tokens, "reward": tokens[:, 1].float() / 3}, batch_size=count + 1)
        tags = [{"producer": producer, "n": n + j, "status": "done"} for j in range(count)]
        n += count
        tq.kv_batch_put(keys, "train", fields, tags + [{"status": "progress", "next": n}])
    tq.close()


def _consumer(url: str, namespace: str, folder: str, ledger: list[str], save_at: int | None,
              stop_at: int | None) -> None:
    """The trainer: poll kv_list, kv_batch_get finished rows, kv_clear them; save a checkpoint once
    ``save_at`` rows are consumed, its ledger (its progress) in the metadata, and idle from ``stop_at`` on
    (till it is killed). It returns when every row is consumed, or when the producers are done and rows
    are missing (then ``missing.json`` says which)."""
    tq.init(conf(url, namespace))
    here = Path(folder)
    expected = {f"p{p}-{n}" for p in range(PRODUCERS) for n in range(PER_PRODUCER)}
    while len(ledger) < len(expected):
        if stop_at is not None and len(ledger) >= stop_at:
            time.sleep(0.01)
            continue
        listing = tq.kv_list("train").get("train", {})
        done = [key for key, tag in listing.items() if tag.get("status") == "done"][:TRAIN_BATCH]
        if not done:
            if all(_progress(listing, p) == PER_PRODUCER for p in range(PRODUCERS)):
                _write_json(here / "missing.json", sorted(expected - set(ledger)))
                break
            time.sleep(0.005)
            continue
        got = tq.kv_batch_get(done, "train")
        for key, (producer, n, seven) in zip(done, dense(got["tokens"]).tolist()):
            assert key == f"p{producer}-{n}" and seven == 7 * n, (key, producer, n, seven)
        ledger += done
        tq.kv_clear(done, "train")
        _write_json(here / "consumer.json", {"consumed": len(ledger)})
        if save_at is not None and len(ledger) >= save_at:
            tq.save_checkpoint(here / "ck", metadata={"consumed": ledger})
            _write_json(here / "saved.json", {"consumed": len(ledger)})
            save_at = None
    _write_json(here / "ledger.json", ledger)
    tq.close()


def _wait_for(what: str, check, processes, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        dead = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
        assert not dead, f"a process died ({dead}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.slow
def test_a_verl_style_run_killed_after_a_checkpoint_resumes_with_every_row_consumed_once(store, tmp_path):
    namespace = "verl" + uuid.uuid4().hex[:6]
    ctx = worker_processes()

    def start(target, *args) -> Any:
        process = ctx.Process(target=target, args=(store, namespace, *args))
        process.start()
        return process

    # The first run: producers and the trainer; the trainer saves a checkpoint mid-run and goes on.
    first = [start(_producer, p) for p in range(PRODUCERS)]
    first.append(start(_consumer, str(tmp_path), [], SAVE_AT, SAVE_AT + MORE_AFTER))
    try:
        _wait_for("the checkpoint", lambda: (tmp_path / "saved.json").exists(), first)
        saved_at = _read_json(tmp_path / "saved.json")["consumed"]
        _wait_for("more consumption after the checkpoint",
                  lambda: _read_json(tmp_path / "consumer.json")["consumed"] >= SAVE_AT + MORE_AFTER, first)
    finally:
        for process in first:  # every process of the run dies at once, mid-call or not
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
        for process in first:
            process.join(30)
    assert all(p.exitcode == -signal.SIGKILL for p in first), [p.exitcode for p in first]
    # Rows were consumed after the checkpoint: the restore must offer them again, and the trainer's ledger
    # goes back to the checkpoint's.
    assert _read_json(tmp_path / "consumer.json")["consumed"] > saved_at

    tq.init(conf(store, namespace))
    try:
        ledger = tq.load_checkpoint(tmp_path / "ck")["consumed"]
        assert len(ledger) == saved_at == len(set(ledger))
        listing = tq.kv_list("train").get("train", {})
        assert not set(listing) & set(ledger)
        for p in range(PRODUCERS):  # each producer's rows below its progress are in, or consumed
            below = {f"p{p}-{n}" for n in range(_progress(listing, p))}
            assert below <= set(ledger) | {k for k, tag in listing.items() if tag.get("status") == "done"}
        second = [start(_producer, p) for p in range(PRODUCERS)]
        second.append(start(_consumer, str(tmp_path), ledger, None, None))
        try:
            for process in second:
                process.join(120)
            assert [p.exitcode for p in second] == [0] * len(second)
        finally:
            for process in second:
                process.kill()
        assert _read_json(tmp_path / "missing.json", []) == []
        final = _read_json(tmp_path / "ledger.json")
        expected = [f"p{p}-{n}" for p in range(PRODUCERS) for n in range(PER_PRODUCER)]
        assert len(final) == len(expected) and sorted(final) == sorted(expected)  # each row exactly once
        assert set(tq.kv_list("train").get("train", {})) == {f"progress-{p}" for p in range(PRODUCERS)}
        tq.get_client().system.delete()
    finally:
        tq.close()
