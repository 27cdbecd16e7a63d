"""broker.ops.local_cluster: a local Redis Cluster on Redis 7 and 6.2, stopped whatever happens, failing over."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from redis.cluster import RedisCluster

from broker.ops.local_cluster import LocalCluster
from broker.ops.local_redis import RedisServer
from tests.helpers import redis_server_binary

needs_redis = pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")


def running(pid: int, port: int) -> bool:
    """Whether process ``pid`` is still a redis-server on ``port`` (a reaped PID may be reused by another)."""
    try:
        # redis-server rewrites its command line as its title: "redis-server 127.0.0.1:PORT [cluster]".
        title = Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False
    return re.search(rb"redis-server .*:%d\b" % port, title) is not None


@pytest.fixture
def started(monkeypatch):
    """``(pid, port, folder)`` of every redis-server started during the test."""
    seen: list[tuple[int, int, Path]] = []
    start = RedisServer.start

    def spy(self: RedisServer, *args, **kwargs):
        try:
            return start(self, *args, **kwargs)
        finally:
            if self.proc is not None:
                seen.append((self.proc.pid, self.port, self.folder))
            elif self.folder.is_dir():  # a start that failed: its process is reaped, its folder is ours to check
                seen.append((0, self.port, self.folder))

    monkeypatch.setattr(RedisServer, "start", spy)
    return seen


@pytest.mark.parametrize("fixture", ["cluster_url", "cluster62_url"])
def test_a_cluster_serves_keys_in_every_shard(fixture, request):
    url = request.getfixturevalue(fixture)
    client = RedisCluster.from_url(url)
    try:
        version = client.get_default_node().redis_connection.info("server")["redis_version"]
        assert version.startswith("6.2" if fixture == "cluster62_url" else "7")
        keys = [f"{fixture}-key-{i}" for i in range(300)]
        for i, key in enumerate(keys):
            client.set(key, i)
        assert [int(client.get(key)) for key in keys] == list(range(300))
        assert len({client.keyslot(key) for key in keys}) > 250
        assert len({client.get_node_from_key(key).port for key in keys}) == 3  # every primary holds some
        assert len(client.get_primaries()) == 3
        client.delete(*keys)
    finally:
        client.close()


@needs_redis
def test_stop_leaves_no_server_and_no_folder(started):
    cluster = LocalCluster(3, replicas=1).start()
    assert len(cluster.nodes) == len(cluster.urls) == len(started) == 6
    assert cluster.url == cluster.urls[0] == cluster.nodes[0].url
    pids = [node.proc.pid for node in cluster.nodes]
    assert [pid for pid, _, _ in started] == pids
    assert all(running(pid, port) for pid, port, _ in started)
    cluster.stop()
    assert not any(running(pid, port) for pid, port, _ in started)
    assert not any(folder.exists() for _, _, folder in started)
    cluster.stop()  # idempotent


@needs_redis
def test_a_bogus_argument_fails_the_start_and_leaves_nothing(started):
    with pytest.raises(RuntimeError, match="did not start"):
        LocalCluster(3, args=["--no-such-option", "yes"]).start()
    assert started  # the first node was tried, and failed
    assert not any(running(pid, port) for pid, port, _ in started)
    assert not any(folder.exists() for _, _, folder in started)


@needs_redis
def test_a_start_failing_after_the_servers_are_up_stops_them(started):
    # Redis holds cluster_state at fail for 2 s after a start, so no cluster is ready in half a second.
    with pytest.raises(TimeoutError, match="waiting until"):
        LocalCluster(3).start(timeout=0.5)
    assert len(started) == 3 and all(pid for pid, _, _ in started)
    assert not any(running(pid, port) for pid, port, _ in started)
    assert not any(folder.exists() for _, _, folder in started)


@needs_redis
@pytest.mark.slow
def test_a_killed_primary_is_replaced_by_its_replica_which_serves_its_keys():
    # A node timeout of 1 s: failed over in about 2 s, against about 4 s with the default 2 s.
    with LocalCluster(3, replicas=1, node_timeout_ms=1000) as cluster:
        client = RedisCluster.from_url(cluster.url)
        try:
            client.set("failover-key", "written before the crash")
            slot = client.keyslot("failover-key")
            primary = cluster.primary_of_slot(slot)
            assert primary in cluster.nodes[:3]
            with primary.client() as c:
                assert c.wait(1, 1000) == 1  # the replica has the key before the crash
            cluster.kill(primary)
            assert primary not in cluster.live_nodes()
            new = cluster.wait_for_failover(primary, timeout=30)
            assert new in cluster.nodes[3:]
            assert cluster.primary_of_slot(slot) is new
            with new.client() as c:  # a plain client: a node not serving the slot would answer MOVED
                assert c.get("failover-key") == b"written before the crash"
            with RedisCluster.from_url(new.url) as fresh:
                assert fresh.get("failover-key") == b"written before the crash"
        finally:
            client.close()
    assert os.path.isdir(primary.folder) is False
