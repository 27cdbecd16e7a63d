"""What the write fence costs a put: the rollout stage's puts, unfenced, fenced by generations, and leased.

A put naming its delivery (the rows ``get_experience`` returned) is checked against it on the server
(lua/include/delivery.lua): the rows' generations unchanged, and under a lease, the lease still this
delivery's. This mode puts the workload's rollout output (responses, response_length, input_ids: most
of a batch's bytes) into the rows it was handed, three ways, alternated pass by pass so the machine's
noise falls on each alike:

* ``unfenced``: the rows as a plain list (what a producer does: no check);
* ``fenced``: the delivery of a get without a lease (the generations are checked);
* ``leased``: the delivery of a get with a lease (generations and every row's lease token are checked),
  put with ``ack=False`` (and acked after, untimed): the fence alone, what the target compares with
  ``unfenced``;
* ``leased+ack``: the same put as a stage makes it by default, acking its rows in the same step (the
  work a separate ``ack`` call did before).

Only the puts are timed; the best pass of each counts. Every variant writes the same bytes.
"""

from __future__ import annotations

import time
from typing import Any

from broker.api.dock import TransferDock
from broker.bench.broker_dock import delete_dock
from broker.bench.docks import dock_target
from broker.bench.workload import COLUMNS, Rows, Workload

VARIANTS = ("unfenced", "fenced", "leased", "leased+ack")
CONSUMER = "actor_rollout"
LEASE_SECONDS = 300.0


def fencing_cost(url: str, name: str, workload: Workload, repeat: int, warmup: int) -> dict[str, Any]:
    """Seconds of the rollout's puts per variant (best of ``repeat`` passes after ``warmup``), and ratios."""
    dock = TransferDock(dock_target(url), name, prompts_num=workload.prompts, n_samples_per_prompt=workload.n,
                        columns=list(COLUMNS), consumers=list(workload.consumers))
    k = workload.call_rows
    chunks = [list(range(first, min(first + k, workload.capacity))) for first in range(0, workload.capacity, k)]
    outputs = [workload.stage(CONSUMER).fn(workload.prompt_rows(rows), rows) for rows in chunks]
    nbytes = sum(t.numel() * t.element_size() for out in outputs for col in out.values() for t in col)
    best: dict[str, float] = {}
    try:
        for attempt in range(warmup + repeat):
            for variant in VARIANTS:
                put_seconds = _pass(dock, workload, chunks, outputs, variant)
                if attempt >= warmup:
                    best[variant] = min(best.get(variant, put_seconds), put_seconds)
    finally:
        delete_dock(dock)
    return {
        "rows": workload.capacity, "rows_per_put": k, "bytes": nbytes, "repeat": repeat,
        "variants": {v: {"put_seconds": best[v], "gb_per_s": nbytes / best[v] / 1e9} for v in VARIANTS},
        "fenced_over_unfenced": best["fenced"] / best["unfenced"],
        "leased_over_unfenced": best["leased"] / best["unfenced"],
        "leased_ack_over_unfenced": best["leased+ack"] / best["unfenced"],
    }


def _pass(dock: TransferDock, workload: Workload, chunks: list[list[int]], outputs: list[Rows], variant: str) -> float:
    """One batch: load the prompts, then for each chunk get its rows and put the rollout's output there."""
    dock.clear()
    for rows in chunks:
        dock.put_experience(workload.prompt_rows(rows), rows)
    lease = LEASE_SECONDS if variant.startswith("leased") else None
    put_seconds = 0.0
    for rows, out in zip(chunks, outputs):
        _, handed = dock.get_experience(CONSUMER, ["prompts"], len(rows), lease=lease)
        if handed != rows:  # fifo hands out the lowest groups: the output computed for them
            raise RuntimeError(f"fencing bench: expected rows {rows[:4]}..., was handed {list(handed or [])[:4]}...")
        named = list(handed) if variant == "unfenced" else handed
        start = time.perf_counter()
        dock.put_experience(out, named, ack=variant != "leased")
        put_seconds += time.perf_counter() - start
        if variant == "leased":
            dock.ack(CONSUMER, handed)  # untimed: the next put meets the leases the other variants leave
    return put_seconds
