"""The type of what the broker talks to (``Client``), which every module of the connection layer takes or gives."""

from __future__ import annotations

import redis
from redis.cluster import RedisCluster

#: What the broker talks to: one Redis server, or a Redis Cluster (any of whose nodes a URL may name).
Client = redis.Redis | RedisCluster
