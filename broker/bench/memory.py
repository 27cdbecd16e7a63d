"""Redis memory per stored payload byte, for the broker and for the raw-bytes floor.

Each system holds the whole global batch (every column written) while ``INFO memory`` is read;
the difference to before it was written, over the tensors' own bytes, is the figure. ``MEMORY
USAGE`` summed over the system's keys is given too: it excludes allocator and client-buffer noise.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import redis

from .docks import BenchDock
from .pipeline import run_pipeline
from .workload import Workload


def _used(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def _key_usage(client: redis.Redis, pattern: str) -> int:
    return sum(int(client.memory_usage(k, samples=0) or 0) for k in client.scan_iter(match=pattern, count=1000))


def measure(url: str, workload: Workload, systems: dict[str, tuple[Callable[[], BenchDock], str]]) -> dict[str, Any]:
    """``systems``: name -> (open the system, SCAN pattern of its keys). Runs the batch once in each."""
    client = redis.Redis.from_url(url)
    payload = workload.payload_bytes()
    out: dict[str, Any] = {"payload_bytes": payload, "systems": {}}
    try:
        for name, (open_dock, pattern) in systems.items():
            gc.collect()
            before = _used(client)
            dock = open_dock()
            try:
                run_pipeline(name, dock, workload)
                time.sleep(0.2)  # let the server release the big query buffers of the last calls
                used, keys = _used(client) - before, _key_usage(client, pattern)
            finally:
                dock.close()
            out["systems"][name] = {"used_memory_delta": used, "key_bytes": keys, "per_payload_byte": used / payload,
                                    "keys_per_payload_byte": keys / payload}
    finally:
        client.close()
    return out
