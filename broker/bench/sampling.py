"""Sampling latency: p50/p99 of one ``get_experience`` on docks of growing size, all 16 columns ready.

Each call asks, like a stage would, for ``read_columns`` of the columns and one whole group, with
the fifo and the random policy. Cells hold one int32 each, so the figure is the cost of choosing
and marking rows plus one small read, not of moving payload. The server's own time per sampling
script comes from ``INFO commandstats`` (differences, so a shared server's counters are left alone).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import redis
import torch

from ..dock import TransferDock
from ..validation import POLICIES as ALL_POLICIES
from .broker_dock import delete_dock
from .docks import dock_target

#: The benchmark's dock has no length columns, so "seqlen" would be the random policy again.
POLICIES = tuple(p for p in ALL_POLICIES if p != "seqlen")


def percentiles(seconds: list[float]) -> dict[str, float]:
    """p50, p99 and max in milliseconds."""
    a = np.asarray(seconds) * 1000.0
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "max_ms": float(a.max())}


def _evalsha(client: redis.Redis) -> tuple[int, int]:
    stats = client.info("commandstats").get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


def _fill(dock: TransferDock, columns: list[str], chunk: int = 8192) -> None:
    for col in columns:
        for start in range(0, dock.capacity, chunk):
            stop = min(start + chunk, dock.capacity)
            dock.put_experience({col: torch.arange(start, stop, dtype=torch.int32).reshape(-1, 1)},
                                indexes=list(range(start, stop)))


def sampling_latency(url: str, name: str, sizes: tuple[int, ...] = (4096, 16384, 65536), n: int = 8,
                     columns: int = 16, read_columns: int = 4, calls: int = 300) -> dict[str, Any]:
    """Latency per dock size (rows) and policy, with the growth from the smallest to the largest size."""
    cols = [f"c{i:02d}" for i in range(columns)]
    client = redis.Redis.from_url(url)
    out: dict[str, Any] = {"columns": columns, "read_columns": read_columns, "rows_per_call": n, "calls": calls,
                           "sizes": {}}
    try:
        for rows in sizes:
            dock = TransferDock(dock_target(url), f"{name}-{rows}", prompts_num=rows // n, n_samples_per_prompt=n,
                                columns=cols, consumers=list(POLICIES))
            try:
                dock.clear()
                t0 = time.perf_counter()
                _fill(dock, cols)
                fill = time.perf_counter() - t0
                per_size: dict[str, Any] = {"fill_seconds": fill}
                for policy in POLICIES:
                    times = []
                    dock.get_experience(policy, cols[:read_columns], n, policy=policy)  # warm: script load, connection
                    count = min(calls, rows // n - 1)
                    before = _evalsha(client)
                    for _ in range(count):
                        t0 = time.perf_counter()
                        _, got = dock.get_experience(policy, cols[:read_columns], n, policy=policy)
                        times.append(time.perf_counter() - t0)
                        if got is None:
                            raise RuntimeError(f"sampling from a full dock of {rows} rows returned nothing")
                    after = _evalsha(client)
                    script_us = (after[1] - before[1]) / max(after[0] - before[0], 1)
                    per_size[policy] = {**percentiles(times), "server_script_us": script_us}
                out["sizes"][str(rows)] = per_size
            finally:
                delete_dock(dock)
    finally:
        client.close()
    small, large = out["sizes"][str(sizes[0])], out["sizes"][str(sizes[-1])]
    out["growth"] = {
        "rows_factor": sizes[-1] / sizes[0],
        **{f"{p}_p50_factor": large[p]["p50_ms"] / small[p]["p50_ms"] for p in POLICIES},
        **{f"{p}_script_factor": large[p]["server_script_us"] / max(small[p]["server_script_us"], 1e-9)
           for p in POLICIES},
    }
    return out
