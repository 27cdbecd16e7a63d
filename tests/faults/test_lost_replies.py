"""Connections cut at the worst moments: after Redis ran a command, before the reply arrived."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster

from broker import Rollout, TransferDock, connection
from broker.connection import replies, retries
from tests.helpers import empty_cluster, fill, lose_next_reply, lose_next_transaction_reply

pytestmark = pytest.mark.real


@contextlib.contextmanager
def cut_connections_as_the_pool_hands_them_out(url: str, times: int) -> Iterator[list[int]]:
    """Have the server close a connection just before the pool checks it, ``times`` times in a row.

    The pool's check sees a closed connection, reconnects and checks again: the second cut lands on
    the fresh connection, which redis-py does not retry by itself.
    """
    admin = redis.Redis.from_url(url)
    original = redis.connection.AbstractConnection.can_read
    cuts: list[int] = []
    cutting = threading.Lock()

    def can_read(self, timeout: float = 0) -> bool:
        # The lock keeps the admin's own connection checks out of the cutting.
        if len(cuts) < times and self._sock is not None and cutting.acquire(blocking=False):
            try:
                host, port = self._sock.getsockname()[:2]
                cuts.append(admin.client_kill_filter(addr=f"{host}:{port}"))
                time.sleep(0.05)  # let the close reach this socket
            finally:
                cutting.release()
        return original(self, timeout)

    redis.connection.AbstractConnection.can_read = can_read
    try:
        yield cuts
    finally:
        redis.connection.AbstractConnection.can_read = original
        admin.close()


@pytest.fixture
def dock(real_url) -> TransferDock:
    redis.Redis.from_url(real_url).flushdb()
    return TransferDock(real_url, "blip", prompts_num=4, n_samples_per_prompt=2,
                        columns=["prompts", "responses"], consumers=["actor_train"])


@pytest.fixture
def dock_anywhere(dock_url) -> TransferDock:
    """The dock on the real server, or on the cluster (whose client retries a lost reply on its own path)."""
    return TransferDock(dock_url, "blip", prompts_num=4, n_samples_per_prompt=2,
                        columns=["prompts", "responses"], consumers=["actor_train"])


def test_lost_sampling_reply_returns_the_same_rows_on_retry(dock_anywhere):
    dock = dock_anywhere
    fill(dock)
    with lose_next_reply("EVALSHA") as cuts:
        batch, rows = dock.get_experience("actor_train", ["prompts"], 4)
    assert cuts == [1]
    # Without the request id the retry would sample rows 4-7 and rows 0-3 would be lost for good.
    assert rows == [0, 1, 2, 3]
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 4
    assert dock.get_experience("actor_train", ["prompts"], 4)[1] == [4, 5, 6, 7]


def test_lost_put_reply_is_retried_harmlessly(dock):
    with lose_next_transaction_reply() as cuts:
        dock.put_experience({"prompts": [torch.tensor([i]) for i in range(4)]}, indexes=[0, 1, 2, 3])
    assert cuts == [1]
    assert dock.status()["columns"]["prompts"] == {"ready": 4, "groups_ready": 2}
    batch, _ = dock.get_experience("actor_train", ["prompts"], indexes=[0, 3])
    assert [t.item() for t in batch["prompts"]] == [0, 3]


def test_lost_ack_and_status_replies_are_retried(dock):
    fill(dock)
    _, rows = dock.get_experience("actor_train", ["prompts"], 2, lease=30)
    with lose_next_reply("EVALSHA"):
        dock.ack("actor_train", rows)
    with lose_next_transaction_reply():
        status = dock.status()
    assert status["consumers"]["actor_train"] == {"consumed": 2, "leased": 0, "redelivered": 0, "dead": 0}


def test_connection_cut_while_the_pool_hands_it_out_is_retried(dock, real_url):
    fill(dock)
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 0  # leaves a pooled, idle connection
    with cut_connections_as_the_pool_hands_them_out(real_url, times=2) as cuts:
        batch, rows = dock.get_experience("actor_train", ["prompts"], 4)
    assert cuts == [1, 1]
    assert rows == [0, 1, 2, 3]
    assert [t.tolist() for t in batch["prompts"]] == [t.tolist() for t in dock.get_experience(
        "actor_train", ["prompts"], indexes=rows)[0]["prompts"]]


@contextlib.contextmanager
def cut_a_reply_midway(after: int, times: int = 1) -> Iterator[list[int]]:
    """Close the connection of a read straight off the socket (``broker.connection.replies``, a stacked get's
    path) once ``after`` bytes of its replies have arrived, ``times`` times: what a dropped link does while a
    large batch streams in."""
    original = replies.RespReader._recv
    cuts: list[int] = []
    received = [0]

    def recv(self, into):
        if len(cuts) < times and received[0] >= after:
            cuts.append(1)
            received[0] = 0
            self._sock.shutdown(socket.SHUT_RDWR)
        got = original(self, into)
        received[0] += got
        return got

    replies.RespReader._recv = recv
    try:
        yield cuts
    finally:
        replies.RespReader._recv = original


@pytest.mark.parametrize("lease", [None, 30], ids=["unleased", "leased"])
def test_a_stacked_get_cut_midway_is_read_again_and_loses_no_row(real_url, lease):
    """Before: the stacked read raised BrokerConnectionError at once, its rows already marked handed out:
    without a lease they were never delivered (rows 2-7 of 0-7 came later, all_consumed was True). A read of
    rows handed out is repeatable: it is made again, as the list read's pipeline is; read_rows too."""
    redis.Redis.from_url(real_url).flushdb()
    dock = TransferDock(real_url, "cut", prompts_num=8, n_samples_per_prompt=1, columns=["x", "y"],
                        consumers=["c"])
    rows = torch.arange(8 * 4096, dtype=torch.float32).reshape(8, 4096)
    dock.put_experience({"x": rows, "y": rows + 1}, list(range(8)))
    with cut_a_reply_midway(after=40_000, times=2) as cuts:
        batch, got = dock.get_experience("c", ["x", "y"], 8, stack=True, lease=lease)
    assert cuts == [1, 1] and got == list(range(8))
    assert torch.equal(batch["x"], rows) and torch.equal(batch["y"], rows + 1)
    with cut_a_reply_midway(after=40_000) as cuts:
        again = dock.read_rows(["x", "y"], [7, 0, 3, 5], stack=True)
    picked = rows[[7, 0, 3, 5]]
    assert cuts == [1] and torch.equal(again["x"], picked) and torch.equal(again["y"], picked + 1)
    dock.delete()


def test_exactly_once_while_connections_are_killed_at_random(dock_url):
    """Readers race a killer that cuts every client connection every few milliseconds (on a cluster, on
    every primary: the dock's control slot and its data shards)."""
    dock = TransferDock(dock_url, "storm", prompts_num=64, n_samples_per_prompt=4, columns=["prompts"],
                        consumers=["actor_train"])
    fill(dock)
    if isinstance(dock.client, RedisCluster):
        admins = [redis.Redis(host=n.host, port=n.port) for n in dock.client.get_primaries()]
    else:
        admins = [redis.Redis.from_url(dock_url)]
    stop = threading.Event()
    kills = []

    def killer() -> None:
        while not stop.is_set():
            for admin in admins:
                kills.append(admin.client_kill_filter(_type="normal", skipme=True))
            time.sleep(0.003)

    got: list[list[int]] = []
    errors: list[Exception] = []

    def reader() -> None:
        try:
            while not dock.all_consumed("actor_train"):
                _, rows = dock.get_experience("actor_train", ["prompts"], 4)
                if rows:
                    got.append(rows)
        except Exception as exc:  # a reader that gives up is a failure, reported below
            errors.append(exc)

    threads = [threading.Thread(target=killer)] + [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(120)
    stop.set()
    threads[0].join()
    assert not errors, errors
    assert sum(kills) > 0
    flat = sorted(r for rows in got for r in rows)
    assert flat == list(range(256)), "rows lost or handed out twice while connections were cut"


# -- a cluster client's connections cut: its slot map reloads, its retries, its scripts, its pipelines --


def blip_on_cluster(cluster_url: str, **options) -> TransferDock:
    """Dock "blip" on the local cluster, emptied first."""
    with RedisCluster.from_url(cluster_url) as cluster:
        empty_cluster(cluster)
    return TransferDock(cluster_url, "blip", prompts_num=4, n_samples_per_prompt=2, columns=["prompts"],
                        consumers=["actor_train"], **options)


@pytest.fixture
def cluster_dock(cluster_url) -> TransferDock:
    return blip_on_cluster(cluster_url)


def test_a_slot_map_reload_cut_on_every_node_is_retried(cluster_dock):
    """A lost reply makes the cluster client reload its slot map before it resends, asking each node once.
    With that reload cut on every node too (what the storm above does now and then on a loaded machine),
    redis-py raised "Redis Cluster cannot be connected", which nothing retried: the reader gave up."""
    dock = cluster_dock
    fill(dock)
    nodes = len(dock.client.get_nodes())
    time.sleep(1.1)  # redis-py 8.2 reloads the slot map at most once a second (topology_refresh_min_interval)
    with lose_next_reply("EVALSHA") as cut, lose_next_reply("CLUSTER SLOTS", times=nodes) as reloads_cut:
        batch, rows = dock.get_experience("actor_train", ["prompts"], 4)
    assert (cut, len(reloads_cut)) == ([1], nodes)
    assert rows == [0, 1, 2, 3]
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 4


def test_a_cluster_call_is_resent_until_its_deadline_not_just_its_attempts(cluster_dock, monkeypatch):
    """A cluster call whose connection failures outlast ``CLUSTER_ATTEMPTS`` is sent again while its
    deadline allows (under the storm above, a SCRIPT LOAD to every primary failed 13 times within 13 s
    and the reader gave up far inside its 30 s bound)."""
    dock = cluster_dock
    fill(dock)
    # The pauses between attempts (seconds by the tenth) are not the point: none, to keep the test short.
    monkeypatch.setattr(retries._BACKOFF, "_backoff", NoBackoff())
    with lose_next_reply("EVALSHA", times=connection.CLUSTER_ATTEMPTS + 2) as cuts:
        batch, rows = dock.get_experience("actor_train", ["prompts"], 4)
    assert len(cuts) == connection.CLUSTER_ATTEMPTS + 2
    assert rows == [0, 1, 2, 3]
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 4


def test_a_script_is_loaded_on_every_primary_however_often_one_is_cut(cluster_url):
    """A script missing on the cluster (flushed, a new primary) is loaded on every primary. redis-py sends
    SCRIPT LOAD to all of them as one command, and to all again after any one's connection failed: under
    the storm above, no attempt got through all three within the call's bound. With every second reply
    lost, each of its attempts failed at the second primary, until the call's deadline."""
    from broker.control.scripts.functions import uses_functions

    dock = blip_on_cluster(cluster_url, call_timeout=5)
    fill(dock)
    if uses_functions(dock.client):  # Redis 7: the scripts are a function library, lost by FUNCTION FLUSH
        dock.client.execute_command("FUNCTION", "FLUSH")
        loads = "FUNCTION"
    else:
        dock.client.script_flush()
        loads = "SCRIPT LOAD"
    with lose_next_reply(loads, times=10**6, every=2) as cuts:  # every second one
        batch, rows = dock.get_experience("actor_train", ["prompts"], 4)
    assert cuts
    assert rows == [0, 1, 2, 3]


@contextlib.contextmanager
def cut_cluster_connections_as_handed_out(times: int) -> Iterator[list[int]]:
    """Have the next ``times`` connections a cluster client takes for a command or a pipeline (not for a
    reload of its slot map) found closed as the pool hands them out; yields a list that counts the cuts."""
    original = redis.cluster.get_connection
    cuts: list[int] = []

    def get_connection(redis_node, *args, **options):
        connection = original(redis_node, *args, **options)
        if len(cuts) < times:
            cuts.append(1)
            connection.disconnect()
            redis_node.connection_pool.release(connection)
            raise redis.ConnectionError("test: connection closed as the pool handed it out")
        return connection

    redis.cluster.get_connection = get_connection
    try:
        yield cuts
    finally:
        redis.cluster.get_connection = original


def test_a_cluster_pipeline_is_resent_until_its_deadline_when_no_connection_could_be_had(cluster_url):
    """redis-py resends a pipeline whose connection could not be had at once, ``CLUSTER_ATTEMPTS`` times
    within a fraction of a second: under the storm above, a reader's read of its rows failed them all."""
    dock = blip_on_cluster(cluster_url, shards=0)  # its rows are read in one pipeline, and nothing else
    fill(dock)
    with cut_cluster_connections_as_handed_out(connection.CLUSTER_ATTEMPTS + 3) as cuts:
        batch = dock.read_rows(["prompts"], [0, 5])
    assert len(cuts) == connection.CLUSTER_ATTEMPTS + 3
    assert [t.tolist() for t in batch["prompts"]] == [[0, len("prompts")], [5, len("prompts")]]


# -- every call that changes the dock applies once, however often it is resent ---------------------
# The reply of each call below is cut after Redis ran it; the client resends the same call (the same
# request id). Before the request ids, each of these applied twice (seen: reserve_groups returned [2, 3]
# and left groups 0 and 1 claimed for good; prefetch skipped rows 0 and 1; a metric was appended twice;
# a dropped group was counted twice; a resent clear cleared the next batch's rows).


def lose_exec_reply(dock: TransferDock, between=lambda: None):
    """Cut the reply of the next MULTI/EXEC of ``dock``'s client (plain or cluster)."""
    if isinstance(dock.client, RedisCluster):
        return lose_next_reply("EXEC", between)
    return lose_next_transaction_reply(between)


def test_a_resent_reserve_claims_its_groups_once(dock_anywhere):
    dock = dock_anywhere
    with lose_next_reply("EVALSHA") as cuts:
        assert dock.reserve_groups(2, "prompts") == [0, 1]
    assert cuts == [1]
    assert dock.reserve_groups(2, "prompts") == [2, 3]
    assert dock.reserve_groups(1, "prompts") is None


def test_a_resent_prefetch_moves_the_cursor_once(dock_anywhere):
    dock = dock_anywhere
    with lose_next_reply("EVALSHA") as cuts:
        assert dock.prefetch_request_index(2) == [0, 1]
    assert cuts == [1]
    assert dock.prefetch_request_index(2) == [2, 3]


def test_a_resent_cumulated_metric_is_appended_once(dock_anywhere):
    dock = dock_anywhere
    dock.update_metrics("reward", [1.0], cumulate=True)
    with lose_next_reply("EVALSHA") as cuts:
        dock.update_metrics("reward", [2.0], cumulate=True)
    assert cuts == [1]
    assert dock.get_metrics() == {"reward": [1.0, 2.0]}


def test_a_resent_drop_is_counted_once(dock_anywhere):
    dock = dock_anywhere
    fill(dock)
    with lose_next_reply("EVALSHA") as cuts:
        assert dock.drop_groups("actor_train", [1]) == 1
    assert cuts == [1]
    assert dock.status()["discarded"] == {"actor_train": 1}


def test_a_resent_clear_does_not_clear_the_next_batch(dock_anywhere):
    dock = dock_anywhere
    fill(dock)
    with lose_next_reply("EVALSHA", between=lambda: fill(dock)) as cuts:  # the driver refills at once
        dock.clear()
    assert cuts == [1]
    assert dock.status()["columns"]["prompts"] == {"ready": 8, "groups_ready": 4}


def test_a_resent_ack_says_how_many_it_released(dock_anywhere):
    dock = dock_anywhere
    fill(dock)
    _, rows = dock.get_experience("actor_train", ["prompts"], 2, lease=30)
    with lose_next_reply("EVALSHA") as cuts:
        assert dock.ack("actor_train", rows) == 2
    assert cuts == [1]


def test_a_resent_rollout_put_gives_its_unfinished_rows_back_once(dock_url):
    """The rollout's put gives unfinished rows back to be continued; another worker takes them before
    the resend. The resend must not give them back again (they would be generated twice at once) nor
    write its bytes over what that worker writes."""
    rollout = Rollout(response_columns=("responses",), max_age=2, gbs_train=1)
    dock = TransferDock(dock_url, "resent-rollout", 2, 2, ["prompts", "responses"], ["actor_rollout", "actor_train"],
                        rollout=rollout)
    dock.put_experience({"prompts": [torch.tensor([1])] * 2}, [0, 1], is_prompt=True)
    _, rows = dock.get_experience("actor_rollout", ["prompts", "responses"], 2, get_n_samples=False, lease=30)
    taken = []
    with lose_exec_reply(dock, between=lambda: taken.append(dock.get_experience(
            "actor_rollout", ["prompts", "responses"], 2, get_n_samples=False, lease=30)[1])) as cuts:
        dock.put_experience({"responses": [torch.tensor([1, 2])] * 2}, rows, rollout_completed=[0, 0])
    assert cuts == [1] and taken == [rows]
    assert dock.get_experience("actor_rollout", ["prompts"], 2, get_n_samples=False) == (None, None)
    assert dock.status()["consumers"]["actor_rollout"]["leased"] == 2  # the other worker's lease stands
    dock.delete()


def test_a_resent_create_still_says_it_created_the_dock(dock_url):
    with lose_next_reply("EVALSHA") as cuts:
        dock = TransferDock(dock_url, "resent-create", 2, 2, ["prompts"], ["actor_train"])
    assert cuts == [1] and dock.created
    dock.delete()
