"""The sequential pipeline: load the prompts, then each stage in order, timing every dock call."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from broker.bench.docks import BenchDock
from broker.bench.workload import Checksums, Stage, Workload


@dataclass
class StageTime:
    """Seconds a stage spent in the dock (get, put) and in its own code (compute), over its calls."""

    get: float = 0.0
    compute: float = 0.0
    put: float = 0.0
    calls: int = 0

    @property
    def total(self) -> float:
        return self.get + self.compute + self.put


@dataclass
class RunResult:
    """One system's pass over the global batch."""

    system: str
    stages: dict[str, StageTime] = field(default_factory=dict)
    checksums: Checksums = field(default_factory=Checksums)

    @property
    def seconds(self) -> float:
        """End to end: every dock call and every stage's compute."""
        return sum(s.total for s in self.stages.values())

    @property
    def dock_seconds(self) -> float:
        """Only the dock's share: gets and puts."""
        return sum(s.get + s.put for s in self.stages.values())


def calls(workload: Workload, count: int) -> list[int]:
    """Row counts of the calls that cover the batch ``count`` rows at a time (the last may be smaller)."""
    cap = workload.capacity
    return [min(count, cap - start) for start in range(0, cap, count)]


def run_pipeline(system: str, dock: BenchDock, workload: Workload, stages: Sequence[Stage] | None = None) -> RunResult:
    """Run the batch through ``dock``; ``stages`` replaces the workload's (the tests corrupt one)."""
    result = RunResult(system)
    gc.collect()  # a collection left over from the previous system must not land in this one's timing
    load = result.stages["load"] = StageTime()
    for start in range(0, workload.capacity, workload.call_rows):
        rows = list(range(start, min(start + workload.call_rows, workload.capacity)))
        data = workload.prompt_rows(rows)
        t0 = time.perf_counter()
        dock.put(data, rows)
        load.put += time.perf_counter() - t0
        load.calls += 1
        result.checksums.add("load", data, rows)
    for stage in stages or workload.stages:
        timing = result.stages[stage.name] = StageTime()
        for count in calls(workload, stage.count):
            t0 = time.perf_counter()
            batch, rows = dock.get(stage.name, stage.reads, count)
            t1 = time.perf_counter()
            out = stage.fn(batch, rows)
            t2 = time.perf_counter()
            if stage.writes:
                dock.put(out, rows)
            t3 = time.perf_counter()
            timing.get += t1 - t0
            timing.compute += t2 - t1
            timing.put += t3 - t2
            timing.calls += 1
            result.checksums.add(stage.name, out, rows)  # outside the timed span: the checksum is ours, not the work's
    return result
