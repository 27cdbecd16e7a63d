"""``wait_replicas`` keeps its word on every call that writes, whatever the socket timeout.

A Redis 7 primary with one replica, of this module's own. The replication stream is cut with ``CLIENT
PAUSE WRITE`` on the replica: it stays attached and online, and neither applies nor acknowledges what the
primary sends until the pause ends (promoted while paused, it drops what it had not applied: a primary
lost at that moment). Each case checks what a user relies on:

- every call that writes raises ReplicationError after it was applied, carrying its result, while the
  replica acknowledges nothing; every call that hands something out logs it and returns what it handed
  out (raising would lose it);
- a call that returned is on the replica: promoted at once, it shows a clear's cleared marks and a new
  version (before, both were lost: the stage looked done and a version-7 batch passed a version-8 bound);
- a WAIT longer than the socket timeout is neither cut nor sent again: a put raises ReplicationError
  after ``wait_timeout``, a hand-out returns its rows (before, with a client passed in, both raised
  BrokerConnectionError and the hand-out's rows were marked consumed and never delivered);
- a replica the primary reports ``online`` while it still loads the snapshot is not waited on.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
import torch
from redis.cluster import RedisCluster

from broker import ReplicationError, Rollout, TransferDock
from broker.adapters.mindspeed import GRPOTransferDock, TransferQueueClient
from broker.ops.local_cluster import LocalCluster
from broker.ops.local_redis import RedisServer
from tests.helpers import redis_server_binary, required

WAIT = 0.2  # wait_timeout of the cases: a shortfall is reported within it
CONSUMERS = ["gen", "train"]
COLUMNS = ["prompts", "responses"]
ROLLOUT = Rollout(consumer="gen", response_columns=("responses",), max_age=2, gbs_train=1)


def sync(primary: RedisServer, replica: RedisServer) -> None:
    """Make ``replica`` a replica of ``primary`` (again, after a promotion) and wait until it is in sync:
    online, and an offset acknowledged (the broker counts no replica before: see broker/connection/replication.py)."""
    admin, other = primary.client(), replica.client()
    try:
        if other.info("replication")["role"] != "slave":
            other.execute_command("REPLICAOF", "127.0.0.1", primary.port)
        admin.set("sync", 1)
        admin.delete("sync")  # a write for the replica to acknowledge
        deadline = time.monotonic() + 30
        while not (int(admin.execute_command("WAIT", 1, 100)) == 1
                   and int(admin.info("replication").get("slave0", {}).get("offset", 0)) > 0):
            assert time.monotonic() < deadline, "the replica did not get in sync"
    finally:
        admin.close()
        other.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[RedisServer, RedisServer]]:
    binary = required(redis_server_binary(), "redis-server", "the replication tests")
    # No diskless-sync delay: a replica is in sync at once, not after Redis's default 5 s.
    with RedisServer("--repl-diskless-sync-delay", "0", binary=binary) as primary, \
            RedisServer(binary=binary) as replica:
        yield primary, replica


@pytest.fixture
def pair(servers: tuple[RedisServer, RedisServer]) -> Iterator[tuple[RedisServer, RedisServer]]:
    """The module's primary, emptied, and its replica in sync."""
    primary, replica = servers
    with primary.client() as admin:
        admin.flushall()
    sync(primary, replica)
    yield primary, replica
    with replica.client() as other:
        other.execute_command("CLIENT", "UNPAUSE")


@contextmanager
def cut(replica: RedisServer, seconds: float = 30.0) -> Iterator[None]:
    """The replica applies and acknowledges nothing from the primary for ``seconds`` (or the block)."""
    with replica.client() as other:
        other.execute_command("CLIENT", "PAUSE", int(seconds * 1000), "WRITE")
        try:
            yield
        finally:
            other.execute_command("CLIENT", "UNPAUSE")


def open_dock(url: str | redis.Redis, name: str = "repl", **kwargs: Any) -> TransferDock:
    kwargs.setdefault("wait_timeout", WAIT)
    kwargs.setdefault("wait_replicas", 1)
    return TransferDock(url, name, 2, 2, COLUMNS, CONSUMERS, rollout=ROLLOUT, **kwargs)


def prompts(rows: list[int]) -> dict[str, list[torch.Tensor]]:
    return {"prompts": [torch.tensor([r]) for r in rows]}


def finished(dock: TransferDock) -> None:
    """Every group holds its prompt and a finished response, so ``train`` may take them."""
    dock.put_experience(prompts([0, 1, 2, 3]), [0, 1, 2, 3], is_prompt=True)
    dock.put_experience({"responses": [torch.tensor([1, 2])] * 4}, [0, 1, 2, 3], rollout_completed=[1] * 4)


# -- every call that writes, with the replica cut off
#
# Per call: what to do first (with the replica in sync), the call, what it returns, and what a repeat is.

def _leased(dock: TransferDock) -> Any:
    finished(dock)
    return dock.get_experience("train", ["prompts"], 2, lease=30)[1]


WRITES: dict[str, tuple[Callable[[TransferDock], Any], Callable[[TransferDock, Any], Any], Any, str]] = {
    "put": (lambda d: None, lambda d, _: d.put_experience(prompts([0, 1]), [0, 1], is_prompt=True), None, "safe"),
    "clear": (finished, lambda d, _: d.clear(), None, "safe"),
    "clear rows": (finished, lambda d, _: d.clear([0, 1]), None, "safe"),
    "clear consumer": (finished, lambda d, _: d.clear(consumer="train"), None, "do not repeat"),
    "age_groups": (finished, lambda d, _: d.age_groups(), None, "do not repeat"),
    "set_version": (lambda d: d.set_version(7), lambda d, _: d.set_version(8), None, "safe"),
    "drop_groups": (finished, lambda d, _: d.drop_groups("train", [0]), 1, "do not repeat"),
    "ack": (_leased, lambda d, rows: d.ack("train", rows), 2, "safe"),
    "update_metrics": (lambda d: None, lambda d, _: d.update_metrics("loss", 1.5), None, "safe"),
    "update_metrics cumulate": (lambda d: None, lambda d, _: d.update_metrics("loss", [1.5], cumulate=True), None,
                                "do not repeat"),
    "reset_consumer": (_leased, lambda d, _: d.reset_consumer("train"), 2, "safe"),
    "grow": (lambda d: None, lambda d, _: d.grow(consumers=["extra"]), "the grown schema", "safe"),
    "unready": (finished, lambda d, _: d.unready(["responses"], [0, 1]), 2, "safe"),
    "register_consumer_columns": (lambda d: None, lambda d, _: d.register_consumer_columns({"train": ["prompts"]}),
                                  None, "safe"),
    "all_consumed": (_leased, lambda d, _: d.all_consumed("train"), False, "safe"),
    "delete": (finished, lambda d, _: d.delete(), None, "safe"),
    "creating a dock": (lambda d: None, lambda d, _: open_dock(d.client, "repl-other").created, None, "safe"),
}


@pytest.mark.parametrize("call", list(WRITES))
def test_a_write_the_replica_did_not_acknowledge_raises_after_it_was_applied(pair, call):
    primary, replica = pair
    setup, write, result, repeat = WRITES[call]
    with open_dock(primary.url) as dock:
        before = setup(dock)
        with cut(replica):
            started = time.monotonic()
            with pytest.raises(ReplicationError) as info:
                write(dock, before)
            seconds = time.monotonic() - started
        message = str(info.value)
        assert "applied on the primaries" in message and info.value.applied, message
        assert ("repeating it is safe" in message) == (repeat == "safe"), message
        assert ("do not repeat it" in message) == (repeat != "safe"), message
        assert info.value.repeat_safe == (repeat == "safe")
        assert pickle.loads(pickle.dumps(info.value)).repeat_safe == info.value.repeat_safe  # as Ray hands it on
        if result == "the grown schema":
            assert info.value.result.consumers == (*CONSUMERS, "extra")
        else:
            assert info.value.result == result
        assert seconds < WAIT + 2, f"{call} raised after {seconds:.2f} s"


def test_what_a_shortfall_leaves_behind_is_what_the_call_did(pair):
    """Applied means applied, once: the version set, the metric appended once, the cleared rows gone."""
    primary, replica = pair
    with open_dock(primary.url) as dock:
        finished(dock)
        with cut(replica):
            for call in (lambda: dock.set_version(8), lambda: dock.update_metrics("loss", [1.0], cumulate=True),
                         lambda: dock.clear([0, 1])):
                with pytest.raises(ReplicationError):
                    call()
        assert dock.version() == 8
        assert dock.get_metrics() == {"loss": [1.0]}
        assert dock.status()["columns"]["prompts"]["ready"] == 2


def test_a_dock_deleted_with_wait_replicas_leaves_no_key(pair):
    """The wait of ``delete`` writes its counter and deletes it again: nothing of the dock stays but the
    replies sampling calls keep for resends, which expire by themselves."""
    primary, _ = pair
    with open_dock(primary.url) as dock:
        finished(dock)
        dock.delete()
    with primary.client() as admin:
        assert [k for k in admin.keys("td:*") if b":reply:" not in k] == []


HANDOUTS: dict[str, tuple[Callable[[TransferDock], Any], Callable[[TransferDock], Any], Any]] = {
    "get_experience": (finished, lambda d: sorted(d.get_experience("train", ["prompts"], 2)[1]), [0, 1]),
    "prefetch_request_index": (lambda d: None, lambda d: d.prefetch_request_index(2), [0, 1]),
}


@pytest.mark.parametrize("call", list(HANDOUTS))
def test_a_handout_the_replica_did_not_acknowledge_logs_and_returns_what_it_handed_out(pair, call, caplog):
    primary, replica = pair
    setup, handout, expected = HANDOUTS[call]
    with open_dock(primary.url) as dock:
        setup(dock)
        with cut(replica), caplog.at_level(logging.WARNING, logger="broker"):
            assert handout(dock) == expected
    assert any(f"{call}: fewer replicas than attached acknowledged within" in r.getMessage() for r in caplog.records)


def test_a_reservation_the_replica_did_not_acknowledge_is_given_back(pair, caplog):
    """Unlike rows handed out, groups a reserve claimed can be given back: a failover could undo the claim,
    and with it the drop or clear that freed the groups, and prompts put there would overwrite a live group
    (the failover soak saw a prompt skipped so). The call returns None, as when none is free; the group is
    free again after."""
    primary, replica = pair
    with open_dock(primary.url) as dock:
        with cut(replica), caplog.at_level(logging.WARNING, logger="broker"):
            assert dock.reserve_groups(1, "prompts") is None
        assert any("reserve_groups: fewer replicas than attached acknowledged within" in r.getMessage()
                   and "gave it back" in r.getMessage() for r in caplog.records)
        assert dock.reserve_groups(2, "prompts") == [0, 1]


def test_the_mindspeed_adapter_waits_too(pair):
    """Its docks wait as native ones do, and its own write (a topic's timeout) goes through the dock."""
    primary, replica = pair
    td = GRPOTransferDock(2, 2, url=primary.url, name="repl-grpo", wait_replicas=1, wait_timeout=WAIT)
    queue = TransferQueueClient(primary.url, wait_replicas=1, wait_timeout=WAIT)
    try:
        with cut(replica):
            with pytest.raises(ReplicationError):
                td.clear()
            with pytest.raises(ReplicationError):
                queue.add_topic(2, 2, COLUMNS, CONSUMERS, topic="repl")
            with pytest.raises(ReplicationError):
                td.update_metrics("loss", 1.0)
    finally:
        td.dock.close()
        for dock in queue._docks.values():
            dock.close()


def replica_of(node: RedisServer) -> int | None:
    """The port of the primary ``node`` replicates, None for a primary."""
    with node.client() as admin:
        info = admin.info("replication")
    return int(info["master_port"]) if info["role"] == "slave" else None


@pytest.mark.slow
def test_a_clear_on_a_sharded_dock_waits_for_the_shards_it_deleted_bytes_from():
    """A cluster of 3 primaries with a replica each; the replica of one data shard's primary (not the
    control slot's) is cut off. A clear of a group on that shard deleted its bytes there: it raises,
    naming the node. A clear of a group on a shard whose replica is fine goes through."""
    binary = required(redis_server_binary(), "redis-server", "the replication tests")
    cluster = LocalCluster(3, replicas=1, binary=binary)
    try:
        cluster.start(timeout=60)

        def open_sharded() -> TransferDock:
            return TransferDock(cluster.url, "repl-sharded", 6, 2, ["prompts"], ["train"], wait_replicas=1,
                                wait_timeout=WAIT)

        with open_sharded() as first:
            first.put_experience(prompts(list(range(12))), list(range(12)))
        for node in cluster.nodes:  # every replica acknowledged an offset: it counts (connection/replication.py)
            with node.client() as admin:
                deadline = time.monotonic() + 10
                while admin.info("replication")["role"] == "master" and \
                        int(admin.info("replication").get("slave0", {}).get("offset", 0)) <= 0:
                    assert time.monotonic() < deadline, f"port {node.port}: the replica acknowledged nothing"
                    time.sleep(0.05)
        with open_sharded() as dock:
            slot = lambda key: RedisCluster.keyslot(dock.client, key)  # noqa: E731
            control = cluster.primary_of_slot(slot(dock.keys.meta))
            tags = dock.schema.shards
            node_of = [cluster.primary_of_slot(slot("{" + tags[g % len(tags)] + "}")) for g in range(6)]
            cut_group = next(g for g in range(6) if node_of[g] is not control)
            fine_group = next(g for g in range(6) if node_of[g] is not node_of[cut_group])
            shard_replica = next(node for node in cluster.nodes if replica_of(node) == node_of[cut_group].port)
            with cut(shard_replica):
                with pytest.raises(ReplicationError, match=f":{node_of[cut_group].port} "):
                    dock.clear([2 * cut_group, 2 * cut_group + 1])
                dock.clear([2 * fine_group, 2 * fine_group + 1])
            assert dock.status()["columns"]["prompts"]["ready"] == 8
    finally:
        for node in cluster.nodes:
            if node.proc is not None:
                with node.client() as admin:
                    try:
                        admin.execute_command("CLIENT", "UNPAUSE")
                    except redis.RedisError:
                        pass
        cluster.stop()


# -- a call that returned survives a failover


def test_a_clear_and_a_version_that_returned_are_on_a_replica_promoted_at_once(pair):
    """The replica lags (its stream paused for 0.5 s) and is promoted the moment each call returns:
    promoted while paused, it drops what it had not applied, as a replica does whose primary died. Each
    call waited for it, so it shows the cleared batch (not the consumed marks of the last one, which
    made all_consumed say the stage was done) and the version the trainer set."""
    primary, replica = pair
    with open_dock(primary.url, wait_timeout=5.0) as dock:
        finished(dock)
        dock.set_version(7)
        assert dock.get_experience("train", ["prompts"], 2)[1] is not None
        assert dock.all_consumed("train")  # gbs_train=1: the iteration's group was handed out
        with cut(replica, seconds=0.5):
            dock.clear()  # returns once the pause is over and the replica acknowledged it
        with cut(replica, seconds=0.5):
            dock.set_version(8)
            with replica.client() as other:
                other.execute_command("REPLICAOF", "NO", "ONE")  # still paused: what it did not apply is lost
    with TransferDock.attach(replica.url, "repl") as promoted:
        assert promoted.version() == 8
        assert promoted.status()["consumers"]["train"]["consumed"] == 0
        assert not promoted.all_consumed("train")


# -- a wait longer than the socket timeout


@pytest.mark.parametrize("kind", ["url", "client"])
def test_a_wait_longer_than_the_socket_timeout_is_a_shortfall_not_a_lost_connection(pair, kind, caplog):
    """socket_timeout 0.3 s, wait_timeout 1 s. The put raises ReplicationError after the wait (not a
    connection error), the hand-out returns its rows; each sent one WAIT (a resend would wait again)."""
    primary, replica = pair
    admin = primary.client()
    target: str | redis.Redis = primary.url + "?socket_timeout=0.3"
    if kind == "client":
        target = redis.Redis(port=primary.port, socket_timeout=0.3)
    try:
        with open_dock(target, wait_timeout=1.0) as dock:
            finished(dock)
            waits = int(admin.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))
            with cut(replica):
                started = time.monotonic()
                with pytest.raises(ReplicationError):
                    dock.put_experience(prompts([0, 1]), [0, 1], is_prompt=True)
                put_seconds = time.monotonic() - started
                with caplog.at_level(logging.WARNING, logger="broker"):
                    got = dock.get_experience("train", ["prompts"], 2)
            assert got[1] is not None and sorted(got[1]) == [0, 1]
            assert int(admin.info("commandstats")["cmdstat_wait"]["calls"]) - waits == 2
        assert 0.9 < put_seconds < 1.0 + 2
        assert any("get_experience: fewer replicas" in r.getMessage() for r in caplog.records)
    finally:
        admin.close()
        if isinstance(target, redis.Redis):
            target.close()


def test_a_wait_that_fails_never_loses_a_handout_and_reports_a_write_applied(pair, caplog):
    """Any error of the wait itself (here WAIT denied to the user after the dock opened, which checks it):
    the hand-out returns its rows (they are marked handed out already; before, it raised and they were
    never delivered), a write raises ReplicationError saying it was applied (before, a command error that
    hid it)."""
    primary, _ = pair
    with primary.client() as admin:
        admin.execute_command("ACL", "SETUSER", "nowait", "on", ">pw", "~*", "&*", "+@all")
    url = primary.url.replace("redis://", "redis://nowait:pw@")
    with open_dock(primary.url, wait_replicas=0) as maker:  # made here: attaching writes nothing to wait for
        finished(maker)
    with open_dock(url) as dock, primary.client() as admin:
        admin.execute_command("ACL", "SETUSER", "nowait", "-wait")  # holds for its open connections at once
        with caplog.at_level(logging.WARNING, logger="broker"):
            got = dock.get_experience("train", ["prompts"], 2)
        assert got[1] is not None and sorted(got[1]) == [0, 1]
        assert any("the wait failed: NoPermissionError" in r.getMessage() for r in caplog.records)
        with pytest.raises(ReplicationError, match="the wait failed: NoPermissionError.*applied on the primaries"):
            dock.set_version(3)
        assert dock.version() == 3


# -- a replica still loading the snapshot


@contextmanager
def replica_loading(keys: int) -> Iterator[tuple[RedisServer, Callable[[], bool]]]:
    """A primary holding ``keys`` keys and a replica joining it that loads them slowly (key-load-delay: 2 ms a
    key), reported online with offset 0 until it is done; yields the primary and whether the replica still loads."""
    binary = required(redis_server_binary(), "redis-server", "the replication tests")
    with RedisServer("--repl-diskless-sync-delay", "0", binary=binary) as primary, \
            RedisServer("--key-load-delay", "2000", binary=binary) as replica, primary.client() as admin:
        pipe = admin.pipeline(transaction=False)
        for i in range(keys):
            pipe.set(f"k{i}", "x")
        pipe.execute()
        with replica.client() as other:
            other.execute_command("REPLICAOF", "127.0.0.1", primary.port)

        def loading() -> bool:
            entry = admin.info("replication").get("slave0", {})
            return entry.get("state") == "online" and int(entry.get("offset", -1)) == 0

        deadline = time.monotonic() + 20
        while not loading():
            assert time.monotonic() < deadline, admin.info("replication")
            time.sleep(0.01)
        yield primary, loading


def test_a_replica_reported_online_while_it_loads_the_snapshot_is_not_waited_on(caplog, monkeypatch):
    """A put while the replica loads is waited on for the replicas in sync (none), instead of raising
    ReplicationError; the dock says it runs degraded once that lasts past the grace (shortened here)."""
    from broker.connection import replication

    monkeypatch.setattr(replication, "_SILENT_GRACE_SECONDS", 1.0)
    monkeypatch.setattr(replication, "_REPLICAS_TTL_SECONDS", 0.2)
    with replica_loading(1500) as (primary, loading), caplog.at_level(logging.WARNING, logger="broker"), \
            open_dock(primary.url) as dock:  # 3 s of loading
        dock.put_experience(prompts([0, 1]), [0, 1], is_prompt=True)
        assert not [r for r in caplog.records if "replicas wait_replicas asks for" in r.getMessage()]
        time.sleep(1.2)
        dock.put_experience(prompts([2, 3]), [2, 3], is_prompt=True)
        assert loading(), "the replica was done loading before the puts: the case proves nothing"
    assert len([r for r in caplog.records if "0 of the 1 replicas" in r.getMessage()]) == 1


def test_replicas_that_catch_up_within_the_grace_are_not_called_missing(caplog):
    """A freshly formed cluster's replicas acknowledge nothing for about a second: every process opening a dock
    in that second logged each node as degraded, then whole again. A shortfall of replicas online that ends
    within the grace is said nowhere; the put is waited on for the replicas in sync meanwhile."""
    with replica_loading(300) as (primary, loading), caplog.at_level(logging.WARNING, logger="broker"), \
            open_dock(primary.url) as dock:  # 0.6 s of loading
        began = time.monotonic()
        dock.put_experience(prompts([0, 1]), [0, 1], is_prompt=True)
        deadline = began + 20
        while loading():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(max(0.0, began + 2.2 - time.monotonic()))  # past the count's time to live: read again, whole
        dock.put_experience(prompts([2, 3]), [2, 3], is_prompt=True)
    said = [r.getMessage() for r in caplog.records if "replicas" in r.getMessage()]
    assert not said, said


def test_a_partitioned_dock_waits_on_every_partition_and_raises_once_all_applied(pair, caplog):
    """Each partition is a dock with its own waits; a shortfall in one partition does not stop the others: the
    put, the clear and the version reach every partition, then the ReplicationError says it was applied."""
    primary, replica = pair
    dock = TransferDock(primary.url, "repl-parts", 4, 2, ["prompts"], ["train"], wait_replicas=1,
                        wait_timeout=WAIT, partitions=2)
    with cut(replica):
        with pytest.raises(ReplicationError, match="repeating it is safe") as raised:
            dock.put_experience(prompts(list(range(8))), list(range(8)))
        assert raised.value.applied
        assert dock.status()["columns"]["prompts"]["ready"] == 8  # both partitions have it
        with caplog.at_level(logging.WARNING, logger="broker"):
            _, rows = dock.get_experience("train", ["prompts"], 8)
        assert sorted(rows) == list(range(8))  # handed out across both partitions; the shortfall is logged
        with pytest.raises(ReplicationError):
            dock.set_version(3)
        assert [p.version() for p in dock.partitions] == [3, 3]
        with pytest.raises(ReplicationError):
            dock.clear()
        assert dock.status()["columns"]["prompts"]["ready"] == 0
    dock.delete()
