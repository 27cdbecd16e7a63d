"""Cost of one exporter scrape against many docks: client time, server time, round trips.

``docks`` docks (16 prompts x 4 samples, 3 columns, 2 consumers, half written, a batch handed out)
are scraped ``scrapes`` times by the exporter's collector, after one scrape that scans the server and
reads the schemas. The server's time is the sum of what ``INFO commandstats`` charges the status
script and ``MEMORY USAGE`` (differences, so a shared server's counters are left alone); round trips
are counted as writes to the socket. Beside it, the same scrape reading every dock's counts without
the memory samples, to show what those cost.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import redis
import torch

from ..dock import TransferDock
from ..exporter import DockCollector
from ..keys import scan_pattern
from .docks import dock_target


class _CountingConnection(redis.Connection):
    """Counts writes to the socket: one per round trip of a pipeline."""

    sends = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).sends += 1
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]


def _server_usec(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name: int(stats.get(f"cmdstat_{name}", {}).get("usec", 0)) for name in ("evalsha", "memory|usage")}


def scrape_cost(url: str, prefix: str, docks: int = 1000, scrapes: int = 30) -> dict[str, Any]:
    """Per-scrape figures of the collector with and without memory sampling."""
    admin = redis.Redis.from_url(url)
    names = [f"{prefix}-{i:05d}" for i in range(docks)]
    try:
        for name in names:
            with TransferDock(dock_target(url), name, prompts_num=16, n_samples_per_prompt=4,
                              columns=["prompts", "responses", "scores"], consumers=["actor", "ref"]) as dock:
                dock.put_experience({"prompts": torch.zeros(32, 16, dtype=torch.int32)}, list(range(32)))
                dock.get_experience("actor", ["prompts"], 8)
        out: dict[str, Any] = {"docks": docks, "scrapes": scrapes, "keys": admin.dbsize()}
        for label, memory_keys in (("with_memory", 256), ("counts_only", 0)):
            client = redis.Redis.from_url(url, connection_class=_CountingConnection)
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
    finally:
        keys = list(admin.scan_iter(match=scan_pattern(f"{prefix}-*"), count=1000))
        for first in range(0, len(keys), 1000):
            admin.delete(*keys[first : first + 1000])
        admin.close()
