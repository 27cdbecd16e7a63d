"""Every Redis Cluster error reaches the caller as a ``broker.ClusterError`` that says what happened:
keys of several slots in one transaction (redis-py's RedisClusterException, not a RedisError), and a
cluster that is down (CLUSTERDOWN: a primary died with no replica to take over). MOVED to a plain
client is in test_cluster_cli.py, and failovers in test_failover.py."""

from __future__ import annotations

import time

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from broker import ClusterError, TransferDock
from broker.connection import redis_errors
from broker.ops.local_cluster import LocalCluster
from tests.helpers import redis_server_binary, required


def test_keys_of_several_slots_in_one_transaction_are_a_cluster_error(cluster_url):
    client = RedisCluster.from_url(cluster_url)
    try:
        pipe = client.pipeline(transaction=True)
        pipe.set("td:{a}:x", 1)
        pipe.set("td:{b}:x", 1)
        with pytest.raises(ClusterError, match="refused the call") as caught, redis_errors("the cluster"):
            pipe.execute()
        assert not isinstance(caught.value.__cause__, redis.RedisError)  # redis-py's own hierarchy, caught too
    finally:
        client.close()


@pytest.mark.slow
def test_a_cluster_that_is_down_is_a_cluster_error_naming_it():
    required(redis_server_binary(), "redis-server", "the cluster tests")
    with LocalCluster(3, node_timeout_ms=1000) as cluster:
        dock = TransferDock(cluster.url, "down", 6, 2, ["prompts"], ["actor_train"])
        dock.put_experience({"prompts": [torch.ones(1)] * 12}, list(range(12)))
        # A primary other than the one the impatient client asks first and the one serving the dock's
        # meta: those must answer, so that what they answer is the cluster's state, not a dead socket.
        meta_node = cluster.primary_of_slot(RedisCluster.keyslot(dock.client, "td:{down}:meta"))
        victim = next(n for n in cluster.nodes if n is not cluster.nodes[0] and n is not meta_node)
        cluster.kill(victim)
        admin = redis.Redis(host="127.0.0.1", port=cluster.nodes[0].port)
        deadline = time.monotonic() + 30
        while admin.cluster("info").get("cluster_state") != "fail":
            assert time.monotonic() < deadline, "the cluster never noticed its dead primary"
            time.sleep(0.1)
        admin.close()
        # A client of its own that does not ride it out for a minute: the error is the point here.
        impatient = RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port, retry=Retry(NoBackoff(), 1))
        # The surviving primaries refuse every command while the cluster is down (full coverage is lost), and
        # the dock says so within its call's bound (opening's server check used to ask again for 8.5 s regardless).
        started = time.monotonic()
        with pytest.raises(ClusterError, match="is down") as caught:
            TransferDock.attach(impatient, "down", call_timeout=1.5).status()
        took = time.monotonic() - started
        assert "CLUSTERDOWN" in str(caught.value) or "down" in str(caught.value.__cause__)
        assert took < 1.5 + 2.0, took  # 2 s of slack for a loaded machine
        impatient.close()
        dock.close()
