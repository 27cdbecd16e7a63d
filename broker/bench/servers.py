"""The servers behind a benchmark URL, for its admin reads: one Redis, or every primary of a Redis Cluster.

A URL naming a cluster node opens a ``RedisCluster`` (``broker.ops.clients.connect``); the figures the
benchmark reads from the server (``used_memory``, key counts, ``INFO commandstats``) are then summed
over the primaries, since each holds only its slots' keys and runs only their commands.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import redis
from redis.cluster import RedisCluster

from broker.ops.clients import Client, connect, disconnect


@contextlib.contextmanager
def admin(url: str) -> Iterator[Client]:
    """A client of ``url``'s server or cluster for the block (the one docks of that URL share)."""
    client, _ = connect(url)
    try:
        yield client
    finally:
        disconnect(url)


def primaries(client: Client) -> list[tuple[str, redis.Redis]]:
    """``(host:port, client of that node)`` of every primary; one entry for a plain server."""
    if isinstance(client, RedisCluster):
        nodes = sorted(client.get_primaries(), key=lambda n: n.name)
        return [(n.name, client.get_redis_connection(n)) for n in nodes]
    kwargs = client.connection_pool.connection_kwargs
    where = f"{kwargs['host']}:{kwargs.get('port', 6379)}" if "host" in kwargs else str(kwargs.get("path", "server"))
    return [(where, client)]


def is_cluster(client: Client) -> bool:
    return isinstance(client, RedisCluster)


def used_memory(client: Client) -> int:
    """``used_memory`` summed over the primaries."""
    return sum(int(node.info("memory")["used_memory"]) for _, node in primaries(client))


def key_count(client: Client) -> int:
    """Keys in the database, summed over the primaries."""
    return sum(int(node.dbsize()) for _, node in primaries(client))


def server_version(client: Client) -> str:
    return str(primaries(client)[0][1].info("server")["redis_version"])


def command_stats(client: Client, commands: Iterable[str]) -> dict[str, tuple[int, int]]:
    """``command -> (calls, usec)`` from ``INFO commandstats``, summed over the primaries."""
    wanted = list(commands)
    out = {name: (0, 0) for name in wanted}
    for _, node in primaries(client):
        stats = node.info("commandstats")
        for name in wanted:
            s: dict[str, Any] = stats.get(f"cmdstat_{name}", {})
            calls, usec = out[name]
            out[name] = (calls + int(s.get("calls", 0)), usec + int(s.get("usec", 0)))
    return out


def delete_matching(client: Client, pattern: str, chunk: int = 1000) -> int:
    """Delete every key matching ``pattern`` (on every primary of a cluster); how many there were."""
    keys = list(client.scan_iter(match=pattern, count=1000))
    for first in range(0, len(keys), chunk):
        client.delete(*keys[first : first + chunk])  # a cluster client splits a DEL over the keys' slots
    return len(keys)
