"""Redis memory per stored payload byte, for the broker and for the raw-bytes floor.

Each system holds the whole global batch (every column written) while ``INFO memory`` is read;
the difference to before it was written, over the tensors' own bytes, is the figure. ``MEMORY
USAGE`` summed over the system's keys is given too: it excludes allocator and client-buffer noise.
On a Redis Cluster both are summed over the primaries (a sharded dock's bytes are on every one).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from broker.bench.docks import BenchDock
from broker.bench.pipeline import run_pipeline
from broker.bench.servers import admin, used_memory
from broker.bench.workload import Workload
from broker.ops.clients import Client


def _key_usage(client: Client, patterns: tuple[str, ...]) -> int:
    """MEMORY USAGE summed over the keys matching ``patterns`` (a cluster client scans every primary)."""
    return sum(int(client.memory_usage(k, samples=0) or 0)
               for pattern in patterns for k in client.scan_iter(match=pattern, count=1000))


def measure(url: str, workload: Workload,
            systems: dict[str, tuple[Callable[[], BenchDock], tuple[str, ...]]]) -> dict[str, Any]:
    """``systems``: name -> (open the system, SCAN patterns of its keys). Runs the batch once in each."""
    payload = workload.payload_bytes()
    out: dict[str, Any] = {"payload_bytes": payload, "systems": {}}
    with admin(url) as client:
        for name, (open_dock, patterns) in systems.items():
            gc.collect()
            before = used_memory(client)
            dock = open_dock()
            try:
                run_pipeline(name, dock, workload)
                time.sleep(0.2)  # let the server release the big query buffers of the last calls
                used, keys = used_memory(client) - before, _key_usage(client, patterns)
            finally:
                dock.close()
            out["systems"][name] = {"used_memory_delta": used, "key_bytes": keys, "per_payload_byte": used / payload,
                                    "keys_per_payload_byte": keys / payload}
    return out
