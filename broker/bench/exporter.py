"""Cost of one exporter scrape against many docks: client time, server time, round trips.

``docks`` docks (16 prompts x 4 samples, 3 columns, 2 consumers, half written, a batch handed out)
are scraped ``scrapes`` times by the exporter's collector, after one scrape that scans the server and
reads the schemas. The server's time is the sum of what ``INFO commandstats`` charges the status
script and ``MEMORY USAGE`` (differences, so a shared server's counters are left alone); round trips
are counted as writes to the socket. Beside it, the same scrape reading every dock's counts without
the memory samples, to show what those cost. On a Redis Cluster the keys and the server's time are
summed over the primaries, and a round trip is a write to any node's socket (one pipeline per node).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import redis
import torch
from redis.cluster import RedisCluster

from broker.api.dock import TransferDock
from broker.bench.docks import dock_target
from broker.bench.servers import admin, command_stats, delete_matching, key_count
from broker.ops.clients import Client
from broker.ops.exporter import DockCollector
from broker.ops.keys import dock_patterns


class _CountingConnection(redis.Connection):
    """Counts writes to the socket: one per round trip of a pipeline."""

    sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).sends += 1
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]


def _server_usec(client: Client) -> dict[str, int]:
    """Server microseconds of the status script (EVALSHA, or FCALL_RO as a function) and of MEMORY USAGE."""
    stats = command_stats(client, ("evalsha", "fcall_ro", "memory|usage"))
    return {"evalsha": stats["evalsha"][1] + stats["fcall_ro"][1], "memory|usage": stats["memory|usage"][1]}


def _counting_client(url: str, cluster: bool) -> Client:
    """A client of ``url`` whose connections count their writes (a cluster client's nodes' too)."""
    if cluster:
        return RedisCluster.from_url(url, connection_class=_CountingConnection)
    return redis.Redis.from_url(url, connection_class=_CountingConnection)


def scrape_cost(url: str, prefix: str, docks: int = 1000, scrapes: int = 30) -> dict[str, Any]:
    """Per-scrape figures of the collector with and without memory sampling."""
    names = [f"{prefix}-{i:05d}" for i in range(docks)]
    with admin(url) as client:
        try:
            return _scrapes(url, client, names, scrapes)
        finally:
            for pattern in dock_patterns(f"{prefix}-*"):
                delete_matching(client, pattern)


def _scrapes(url: str, admin: Client, names: list[str], scrapes: int) -> dict[str, Any]:
    for name in names:
        with TransferDock(dock_target(url), name, prompts_num=16, n_samples_per_prompt=4,
                          columns=["prompts", "responses", "scores"], consumers=["actor", "ref"]) as dock:
            dock.put_experience({"prompts": torch.zeros(32, 16, dtype=torch.int32)}, list(range(32)))
            dock.get_experience("actor", ["prompts"], 8)
    out: dict[str, Any] = {"docks": len(names), "scrapes": scrapes, "keys": key_count(admin)}
    for label, memory_keys in (("with_memory", 256), ("counts_only", 0)):
        client = _counting_client(url, isinstance(admin, RedisCluster))
        collector = DockCollector(client, where=url, memory_keys=memory_keys)
        started = time.perf_counter()
        list(collector.collect())
        first = time.perf_counter() - started
        before, _CountingConnection.sends = _server_usec(admin), 0
        times = []
        for _ in range(scrapes):
            started = time.perf_counter()
            list(collector.collect())
            times.append(time.perf_counter() - started)
        after = _server_usec(admin)
        client.close()
        ordered = sorted(times)
        out[label] = {
            "first_ms": first * 1000,
            "p50_ms": statistics.median(times) * 1000,
            "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000,
            "server_ms": sum(after[k] - before[k] for k in after) / scrapes / 1000,
            "round_trips": _CountingConnection.sends / scrapes,
        }
    return out
