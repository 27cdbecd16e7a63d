"""Where a partitioned dock's bytes land on a cluster: consecutive groups should spread over the primaries.

Found by ``broker bench --cluster --primaries 24 --partitions 24``: with 256 groups, 13 of the 24 primaries held
no bytes at all. Every partition's data shards are chosen by ``spread_tags`` starting at the same (first sorted)
primary, and partition k keeps its group j on its shard j % S; the dock's groups k + jP of every partition k then
all land on the primary of shard j. So P consecutive groups (one batch) are all on one primary, and with fewer
groups per partition than primaries the last primaries hold nothing.
"""

from __future__ import annotations

import pytest
import torch
from redis.cluster import RedisCluster

from tests.helpers import small_dock

pytestmark = pytest.mark.real



def test_consecutive_groups_of_a_partitioned_dock_put_their_bytes_on_different_primaries(cluster_url, cluster_admin):
    dock = small_dock(cluster_url, "placement", prompts=3, n=1, columns=("prompts",), partitions=3)
    try:
        dock.put_experience({"prompts": [torch.tensor([g]) for g in range(3)]}, [0, 1, 2])  # groups 0, 1, 2
        client = dock.client
        assert isinstance(client, RedisCluster)
        mine = "td:{placement~*}:data:*"  # this dock's partitions' data: other tests' docks share the cluster
        fields = {node.name: sum(client.get_redis_connection(node).hlen(key)
                                 for key in client.get_redis_connection(node).scan_iter(match=mine))
                  for node in client.get_primaries()}
        assert sum(fields.values()) == 3
        assert sorted(fields.values()) == [1, 1, 1], fields  # one group on each primary, as its control slot is
    finally:
        dock.delete()
        dock.close()
