"""Where a TransferQueue system cut into sub-systems (``broker.partitions``) lands on a cluster: each sub-system's
dock in its own slot, on its own primary, so one system's control plane spreads over the cluster; and its
partitions work there, each in its sub-system (broker/transfer_queue/systems.py)."""

from __future__ import annotations

import uuid

import pytest
import torch
from redis.cluster import RedisCluster

from tests.helpers import dense, empty_cluster

tensordict = pytest.importorskip("tensordict")
from tensordict import TensorDict  # noqa: E402

import broker.transfer_queue as tq  # noqa: E402

pytestmark = pytest.mark.real


def test_the_sub_systems_of_a_transfer_queue_system_are_on_different_primaries(cluster_url, cluster_admin):
    empty_cluster(cluster_admin)
    tq.init({"broker": {"url": cluster_url, "namespace": "spread" + uuid.uuid4().hex[:6], "partitions": 3,
                        "get_meta_timeout": 0.5}})
    try:
        client = tq.get_client()
        parts = client.systems.parts
        cluster = parts[0].client
        assert isinstance(cluster, RedisCluster)
        primaries = [cluster.nodes_manager.get_node_from_slot(cluster.keyslot(p.keys.meta)).name for p in parts]
        assert len(set(primaries)) == 3, primaries  # one sub-system per primary
        for i, partition in enumerate(("train", "val", "q")):  # sub-systems 0, 1 and 2
            client.put(TensorDict({"x": torch.arange(3) + 10 * i}, batch_size=3), partition_id=partition)
        for i, partition in enumerate(("train", "val", "q")):
            meta = client.get_meta(["x"], 3, partition, task_name="t")
            assert dense(client.get_data(meta)["x"]).tolist() == [10 * i, 10 * i + 1, 10 * i + 2]
        held = {node.name: cluster.get_redis_connection(node).keys("td:{tq.*}:tq:rows:*")
                for node in cluster.get_primaries()}
        assert sorted(len(keys) for keys in held.values()) == [1, 1, 1], held  # a partition on each primary
    finally:
        tq.get_client().systems.delete()
        tq.close()
