"""Concurrent mode: every stage at once, ``per_stage`` processes each, pipelined through one shared dock.

Run for every system that processes can share: the broker, the MindSpeed adapter (one object per
process), the adapter as one Ray actor, and MindSpeed's own single actor. (The floors keep their
status in one process and are left out.) Broker stage processes wait for rows with
``get_experience(..., timeout=)`` (woken by the dock's pub/sub); the MindSpeed-style systems have no
wait and poll, as MindSpeed's workers do. The wall time runs from a barrier that every process has
reached (interpreter start-up and Ray connection are not counted) to the end of the last call that
did work: a process idling after its partner took the last rows does not count.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import queue
import time
from typing import Any

import torch

from broker.api.dock import TransferDock
from broker.bench.broker_dock import delete_dock
from broker.bench.docks import ActorCalls, MindSpeedCalls, dock_target
from broker.bench.workload import COLUMNS, Checksums, Rows, Workload

#: Systems the concurrent mode runs, in order.
CONCURRENT_SYSTEMS = ("broker", "adapter", "adapter-ray", "ray")

#: Longest a stage process waits in one call before checking whether its consumer is done.
_WAIT = 0.25

#: Ray namespace of the actors the stage processes look up by name.
_NAMESPACE = "broker-bench"

#: Pause of a polling stage process after a sampling call found nothing (MindSpeed's workers poll).
_POLL = 0.002


def context() -> Any:
    """A forkserver with the heavy imports done once: a new process costs a fork, not a torch import."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([
        "torch", "broker.bench.concurrent", "broker.bench.soak", "broker.bench.pipeline_soak",
        "broker.bench.adapter",  # the MindSpeed adapter and tensordict: seconds of imports per adapter process
    ])
    return ctx


class _Client:
    """What a stage process calls, the same for every system: get (None if nothing), put, all_consumed."""

    def __init__(self, system: str, url: str, name: str, workload: Workload, ray_address: str | None,
                 ray_env: dict[str, str]):
        self.workload = workload
        self.dock: TransferDock | None = None
        self.calls: MindSpeedCalls
        if system == "broker":
            self.dock = TransferDock.attach(dock_target(url), name)
        elif system == "adapter":
            from broker.bench.adapter import AdapterDock

            self.calls = AdapterDock(url, name, workload)
        else:
            # Before Ray is imported: how to join the driver's Ray (its token auth mode) is read from the
            # environment, which a process forked from the forkserver did not inherit from the driver.
            os.environ.update(ray_env)
            import ray

            ray.init(address=ray_address, log_to_driver=False, logging_level=logging.ERROR,
                     _node_ip_address="127.0.0.1")
            self.calls = ActorCalls(ray, ray.get_actor(name, namespace=_NAMESPACE))

    def get(self, consumer: str, columns: list[str], count: int) -> tuple[Rows, list[int]] | None:
        if self.dock is not None:
            batch, rows = self.dock.get_experience(consumer, columns, count, timeout=_WAIT)
            return None if batch is None or rows is None else (batch, rows)
        got = self.calls.try_get(consumer, columns, count)
        if got is None:
            time.sleep(_POLL)
        return got

    def put(self, data: Rows, rows: list[int]) -> None:
        if self.dock is not None:
            self.dock.put_experience(data, indexes=rows)
        else:
            self.calls.put(data, rows)

    def all_consumed(self, consumer: str) -> bool:
        return self.dock.all_consumed(consumer) if self.dock is not None else self.calls.all_consumed(consumer)

    def left(self, consumer: str) -> int:
        """Rows not yet handed to ``consumer`` (the broker's status; the others' calls divide the batch)."""
        if self.dock is not None:
            return self.workload.capacity - int(self.dock.status()["consumers"][consumer]["consumed"])
        return self.workload.capacity


def _stage_process(system: str, url: str, name: str, params: dict[str, Any], stage_name: str, barrier: Any,
                   out: Any, ray_address: str | None, ray_env: dict[str, str]) -> None:
    torch.set_num_threads(1)  # a dozen processes on a few cores: intra-op threads would only fight
    workload = Workload(**params)
    stage = workload.stage(stage_name)
    workload.response_length(0)  # draw the batch before the clock starts
    dock = _Client(system, url, name, workload, ray_address, ray_env)
    results, busy, calls = [], 0.0, 0
    barrier.wait()
    last = time.monotonic()
    count = stage.count
    while not dock.all_consumed(stage.name):
        got = dock.get(stage.name, list(stage.reads), count)
        if got is None:
            # The batch may end in a smaller call, when its rows are not a multiple of the call size.
            left = dock.left(stage.name)
            count = min(stage.count, left) if left > 0 else stage.count
            continue
        batch, rows = got
        t0 = time.perf_counter()  # busy = compute and put; the get includes waiting for upstream stages
        result = stage.fn(batch, rows)
        if stage.writes:
            dock.put(result, rows)
        busy += time.perf_counter() - t0
        calls += 1
        results.append((result, rows))
        last = time.monotonic()
    checks = Checksums()
    for result, rows in results:
        checks.add(stage.name, result, rows)
    out.put({"stage": stage_name, "end": last, "rows": checks.rows, "calls": calls, "busy": busy})


class _Driver:
    """The system's dock for one concurrent run: made before the stage processes, removed after."""

    def __init__(self, system: str, url: str, name: str, workload: Workload):
        self.system, self.url, self.name, self.ray_address = system, url, name, None
        self.dock: TransferDock | None = None
        self.calls: Any
        if system == "broker":
            self.dock = TransferDock(dock_target(url), name, prompts_num=workload.prompts,
                                     n_samples_per_prompt=workload.n, columns=list(COLUMNS),
                                     consumers=list(workload.consumers))
            self.dock.clear()
            return
        if system == "adapter":
            from broker.bench.adapter import AdapterDock

            self.calls = AdapterDock(url, name, workload)
            return
        import ray

        from broker.adapters.mindspeed import GRPOTransferDock
        from broker.bench.adapter import adapter_arguments
        from broker.bench.mindspeed import MindSpeedGRPOTransferDock
        from broker.bench.ray_dock import ACTOR_OPTIONS, start_ray

        started = start_ray()
        # Joined on the loopback address: Ray reports the node's detected IP, which may not route here.
        self.ray_address = "127.0.0.1:" + ray.get_runtime_context().gcs_address.rsplit(":", 1)[1]
        named = {"name": name, "namespace": _NAMESPACE, **ACTOR_OPTIONS}
        actor: Any
        if system == "adapter-ray":
            actor = ray.remote(GRPOTransferDock).options(**named).remote(
                **adapter_arguments(workload), url=url, name=name)
        else:
            actor = ray.remote(MindSpeedGRPOTransferDock).options(**named).remote(
                workload.prompts, workload.n, list(COLUMNS), list(workload.consumers), workload.seed)
        self.calls = ActorCalls(ray, actor, started)
        self.calls.reset()

    def put(self, data: Rows, rows: list[int]) -> None:
        if self.dock is not None:
            self.dock.put_experience(data, indexes=rows)
        else:
            self.calls.put(data, rows)

    def close(self) -> None:
        if self.dock is not None:
            delete_dock(self.dock)
        elif self.system == "adapter":
            self.calls.close()
        else:
            self.calls.stop()
            if self.system == "adapter-ray":
                delete_dock(TransferDock.attach(dock_target(self.url), self.name))


def run_concurrent(
    url: str, name: str, workload: Workload, per_stage: int = 2, timeout: float = 600.0, system: str = "broker",
) -> dict[str, Any]:
    """Run the batch with all stages at once; returns wall seconds, per-stage figures and checksums."""
    driver = _Driver(system, url, name, workload)
    # Every stage process is forked from the forkserver, the Ray systems' too: a forkserver started before
    # Ray lacks what Ray put in the driver's environment to join its cluster (its auth mode), so they are
    # handed the driver's RAY_ variables, as a spawned process would inherit them, without each importing
    # torch again. Start-up is not timed either way.
    ctx = context()
    ray_env = {k: v for k, v in os.environ.items() if k.startswith("RAY_")} if driver.ray_address else {}
    out = ctx.Queue()
    barrier = ctx.Barrier(1 + per_stage * len(workload.stages))
    params = dataclasses.asdict(workload)
    procs = [ctx.Process(target=_stage_process, daemon=True,
                         args=(system, url, name, params, s.name, barrier, out, driver.ray_address, ray_env))
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
            driver.put(data, rows)
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
        driver.close()
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
