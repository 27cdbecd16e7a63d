"""Concurrent mode: every stage at once, ``per_stage`` processes each, pipelined through one broker dock.

Stage processes wait for rows with ``get_experience(..., timeout=)`` (woken by the dock's pub/sub),
so ref, actor and reward start on the first groups rollout writes. The wall time runs from a barrier
that every process has reached (interpreter start-up is not counted) to the end of the last call
that did work: a process idling in a wait after its partner took the last rows does not count.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue
import time
from typing import Any

import torch

from ..dock import TransferDock
from .broker_dock import delete_dock
from .docks import dock_target
from .workload import COLUMNS, Checksums, Workload

#: Longest a stage process waits in one call before checking whether its consumer is done.
_WAIT = 0.25


def context() -> Any:
    """A forkserver with the heavy imports done once: a new process costs a fork, not a torch import."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "broker.bench.concurrent", "broker.bench.soak"])
    return ctx


def _stage_process(url: str, name: str, params: dict[str, Any], stage_name: str, barrier: Any, out: Any) -> None:
    torch.set_num_threads(1)  # a dozen processes on a few cores: intra-op threads would only fight
    workload = Workload(**params)
    stage = workload.stage(stage_name)
    workload.response_length(0)  # draw the batch before the clock starts
    dock = TransferDock.attach(dock_target(url), name)
    results, busy, calls = [], 0.0, 0
    barrier.wait()
    last = time.monotonic()
    count = stage.count
    while not dock.all_consumed(stage.name):
        batch, rows = dock.get_experience(stage.name, list(stage.reads), count, timeout=_WAIT)
        if batch is None or rows is None:
            # The batch may end in a smaller call, when its rows are not a multiple of the call size.
            left = workload.capacity - dock.status()["consumers"][stage.name]["consumed"]
            count = min(stage.count, left) if left > 0 else stage.count
            continue
        t0 = time.perf_counter()  # busy = compute and put; the get includes waiting for upstream stages
        result = stage.fn(batch, rows)
        if stage.writes:
            dock.put_experience(result, rows)
        busy += time.perf_counter() - t0
        calls += 1
        results.append((result, rows))
        last = time.monotonic()
    checks = Checksums()
    for result, rows in results:
        checks.add(stage.name, result, rows)
    out.put({"stage": stage_name, "end": last, "rows": checks.rows, "calls": calls, "busy": busy})


def run_concurrent(
    url: str, name: str, workload: Workload, per_stage: int = 2, timeout: float = 600.0
) -> dict[str, Any]:
    """Run the batch with all stages at once; returns wall seconds, per-stage figures and checksums."""
    dock = TransferDock(dock_target(url), name, prompts_num=workload.prompts, n_samples_per_prompt=workload.n,
                        columns=list(COLUMNS), consumers=list(workload.consumers))
    dock.clear()
    ctx = context()
    out = ctx.Queue()
    barrier = ctx.Barrier(1 + per_stage * len(workload.stages))
    params = dataclasses.asdict(workload)
    procs = [ctx.Process(target=_stage_process, args=(url, name, params, s.name, barrier, out), daemon=True)
             for s in workload.stages for _ in range(per_stage)]
    for p in procs:
        p.start()
    checks = Checksums()
    try:
        barrier.wait(timeout=120)
        start = time.monotonic()
        for first in range(0, workload.capacity, workload.call_rows):
            rows = list(range(first, min(first + workload.call_rows, workload.capacity)))
            data = workload.prompt_rows(rows)
            dock.put_experience(data, indexes=rows)
            checks.add("load", data, rows)
        reports: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while len(reports) < len(procs):
            try:
                reports.append(out.get(timeout=1.0))
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"concurrent run failed: {len(reports)} of {len(procs)} stage processes "
                                       f"reported; exit codes {[p.exitcode for p in procs]}") from None
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        delete_dock(dock)
    stages: dict[str, dict[str, float]] = {}
    for r in reports:
        checks.merge(_as_checksums(r["rows"], r["stage"]))
        s = stages.setdefault(r["stage"], {"calls": 0, "busy_seconds": 0.0, "done_at": 0.0})
        s["calls"] += r["calls"]
        s["busy_seconds"] += r["busy"]
        s["done_at"] = max(s["done_at"], r["end"] - start)
    return {"seconds": max(r["end"] for r in reports) - start, "processes": len(procs),
            "per_stage": per_stage, "stages": stages, "checksums": checks}


def _as_checksums(rows: dict[str, dict[int, int]], stage: str) -> Checksums:
    c = Checksums()
    c.rows = {stage: rows.get(stage, {})}
    return c
