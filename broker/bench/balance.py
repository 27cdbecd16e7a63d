"""DP balancing on the benchmark's lengths: each call's batch cut into dp_size chunks, balanced and naive.

Through the dock, as a trainer would call it: ``get_experience(..., dp_size=4, balance=True)`` on a
dock holding the workload's prompt and response lengths. The naive figure is the same rows cut in
the order sampling picked them (lowest groups first).
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from broker.api.balance import imbalance
from broker.api.dock import TransferDock
from broker.bench.broker_dock import delete_dock
from broker.bench.docks import dock_target
from broker.bench.workload import Workload

LENGTHS = ["prompt_length", "response_length"]


def dp_balance(url: str, name: str, workload: Workload, dp_size: int = 4) -> dict[str, Any]:
    """max/mean chunk load per call, balanced and naive (mean and worst over the batch's calls)."""
    dock = TransferDock(dock_target(url), name, workload.prompts, workload.n, LENGTHS, ["trainer"],
                        length_columns=LENGTHS)
    try:
        prompts = workload.prompt_rows(range(workload.capacity))["prompt_length"]
        cost = {r: int(prompts[r]) + workload.response_length(r) for r in range(workload.capacity)}
        dock.put_experience({"prompt_length": prompts,
                             "response_length": [torch.tensor([workload.response_length(r)]) for r in cost]},
                            list(range(workload.capacity)))
        balanced, naive = [], []
        while not dock.all_consumed("trainer"):
            _, rows = dock.get_experience("trainer", LENGTHS, workload.call_rows, dp_size=dp_size, balance=True)
            assert rows is not None
            balanced.append(imbalance([cost[r] for r in rows], dp_size))
            naive.append(imbalance([cost[r] for r in sorted(rows)], dp_size))
    finally:
        delete_dock(dock)
    return {"dp_size": dp_size, "rows_per_call": workload.call_rows, "calls": len(balanced),
            "balanced_mean": statistics.mean(balanced), "balanced_max": max(balanced),
            "naive_mean": statistics.mean(naive), "naive_max": max(naive)}
