"""What a run's figures say against the issue's targets: each target's value and whether it is met, judged from
the report's sections (``targets``), and the sentence each is read by (``TARGETS``, which the table prints)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The issue's targets: (key in "targets", how to read it).
TARGETS = {
    "broker_over_floor": "broker end-to-end <= 1.15 x the Redis floor",
    "ray_over_broker": "broker >= 5 x faster than the single-actor dock",
    "adapter_over_broker": "MindSpeed adapter, one object per process, end-to-end <= 1.2 x the broker",
    "adapter_over_native": "MindSpeed adapter <= 1.2 x the native calls it makes (the broker sampling at random)",
    "ray_over_adapter_ray": "the adapter as a Ray actor faster than MindSpeed's own single actor",
    "dp_balance_max_over_mean": "DP-balanced batches: max/mean chunk load <= 1.05 at dp_size=4",
    "concurrent_adapter_over_broker": "concurrent: the adapter per process <= 1.2 x the broker",
    "concurrent_ray_over_adapter_ray": "concurrent: the adapter as an actor faster than the single actor",
    "sampling_p99_ms": "sampling p99 <= 2 ms at 65,536 rows x 16 columns",
    "sampling_growth": "sampling p50 grows sub-linearly with rows",
    "sampling_p99_ages_ms": "sampling p99 at 65,536 rows x 16 columns with ages <= 2 ms",
    "memory_per_payload_byte": "Redis memory <= 1.15 x payload bytes",
    "cluster_over_single": "Redis Cluster, one client, end-to-end <= 1.15 x one redis-server",
    "fencing_cost": "a put fenced by its lease (ack=False) <= 1.05 x the same put unfenced",
    "large_put_over_floor": "large batch: the broker's put <= 1.2 x the Redis floor's (aim: at the floor)",
    "large_complex_put_over_floor": "large batch, complex: the broker's put <= 1.2 x the Redis floor's",
    "large_put_over_floor_2conn": "large batch: the broker's put <= 1.1 x the Redis floor's over two connections",
    "large_get_over_tq": "large batch: the broker's get >= 1 x as fast as TransferQueue's (aim: 1.5 x)",
    "large_complex_get_over_tq": "large batch, complex: the broker's get >= 1 x as fast as TransferQueue's",
    "large_memory_per_payload_byte": "large batch: Redis memory <= 1.15 x payload bytes (the embedded server)",
    "tq_perftest_get_over_tq": "perftest: the drop-in's get >= 1 x as fast as TransferQueue's",
    "tq_perftest_put_over_native": "perftest: the drop-in's put >= 0.9 x as fast as the native put",
    "tq_perftest_complex_put_over_tq": "perftest, complex: the drop-in's put >= 1 x as fast as TransferQueue's",
    "tq_perftest_complex_get_over_tq": "perftest, complex: the drop-in's get >= 1 x as fast as TransferQueue's",
    "tq_perftest_memory_per_payload_byte": "perftest: Redis memory <= 1.15 x payload bytes (the drop-in's embedded "
                                           "server)",
}


def targets(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target the run can judge: its value and whether it is met."""
    out: dict[str, dict[str, Any]] = {}
    #: (target, mode, numerator system, denominator system, met when the ratio is ...)
    ratios: list[tuple[str, str, str, str, Callable[[float], bool]]] = [
        ("broker_over_floor", "pipeline", "broker", "redis-floor", lambda v: v <= 1.15),
        ("ray_over_broker", "pipeline", "ray", "broker", lambda v: v >= 5.0),
        ("adapter_over_broker", "pipeline", "adapter", "broker", lambda v: v <= 1.2),
        ("adapter_over_native", "pipeline", "adapter", "broker-random", lambda v: v <= 1.2),
        ("ray_over_adapter_ray", "pipeline", "ray", "adapter-ray", lambda v: v > 1.0),
        ("concurrent_adapter_over_broker", "concurrent", "adapter", "broker", lambda v: v <= 1.2),
        ("concurrent_ray_over_adapter_ray", "concurrent", "ray", "adapter-ray", lambda v: v > 1.0),
    ]
    for key, mode, top, bottom, met in ratios:
        systems = report.get(mode, {}).get("systems", {})
        if top in systems and bottom in systems:
            value = systems[top]["seconds"] / systems[bottom]["seconds"]
            out[key] = {"value": value, "met": met(value)}
    bal = report.get("balance")
    if bal:
        out["dp_balance_max_over_mean"] = {"value": bal["balanced_max"], "naive": bal["naive_max"],
                                           "met": bal["balanced_max"] <= 1.05}
    sampling = report.get("sampling")
    if sampling:
        largest = sampling["sizes"][max(sampling["sizes"], key=int)]
        value = max(largest[p]["p99_ms"] for p in ("fifo", "random"))
        out["sampling_p99_ms"] = {"value": value, "rows": int(max(sampling["sizes"], key=int)), "met": value <= 2.0}
        g = sampling["growth"]
        value = max(g["fifo_p50_factor"], g["random_p50_factor"])
        out["sampling_growth"] = {"value": value, "rows_factor": g["rows_factor"], "met": value < g["rows_factor"]}
        aged = sampling.get("ages", {}).get("sizes")
        if aged:
            rows = max(aged, key=int)
            value = max(aged[rows][kind]["p99_ms"] for kind in ("trainer", "rollout"))
            out["sampling_p99_ages_ms"] = {"value": value, "rows": int(rows), "met": value <= 2.0}
    cluster = report.get("cluster")
    if cluster:
        out["cluster_over_single"] = {"value": cluster["ratio"], "primaries": cluster["primaries"],
                                      "met": cluster["ratio"] <= 1.15}
    fencing = report.get("fencing")
    if fencing:
        value = fencing["leased_over_unfenced"]
        out["fencing_cost"] = {"value": value, "met": value <= 1.05}
    out.update(large_targets(report.get("large")))
    out.update(perftest_targets(report.get("tq_perftest")))
    memory = report.get("memory", {}).get("systems", {})
    if "broker" in memory:
        value = memory["broker"]["per_payload_byte"]
        out["memory_per_payload_byte"] = {"value": value, "met": value <= 1.15}
    return out


def large_targets(large: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The large mode's targets, judged at ``--batch`` (or the largest size swept) for each variant."""
    out: dict[str, dict[str, Any]] = {}
    if not large:
        return out
    for variant, prefix in (("plain", "large_"), ("complex", "large_complex_")):
        runs = [r for r in large["runs"] if r["variant"] == variant]
        if not runs:
            continue
        run = next((r for r in runs if r["batch"] == large["batch"]), max(runs, key=lambda r: r["batch"]))
        ratio = run["ratios"]
        if "broker_put_over_floor" in ratio:
            value = ratio["broker_put_over_floor"]
            out[f"{prefix}put_over_floor"] = {"value": value, "rows": run["batch"], "met": value <= 1.2}
        if variant == "plain" and "broker_put_over_floor_2conn" in ratio:
            value = ratio["broker_put_over_floor_2conn"]
            out["large_put_over_floor_2conn"] = {"value": value, "rows": run["batch"], "met": value <= 1.1}
        if "tq_get_over_broker" in ratio:
            value = ratio["tq_get_over_broker"]
            out[f"{prefix}get_over_tq"] = {"value": value, "rows": run["batch"], "met": value >= 1.0}
        broker = run["systems"].get("broker", {})
        if variant == "plain" and "memory_per_payload_byte" in broker:
            value = broker["memory_per_payload_byte"]
            out["large_memory_per_payload_byte"] = {"value": value, "rows": run["batch"], "met": value <= 1.15}
    return out


def perftest_targets(perftest: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The drop-in's targets on TransferQueue's perftest (speeds: above 1, the drop-in is faster)."""
    out: dict[str, dict[str, Any]] = {}
    #: (target, variant, ratio, threshold)
    wanted = [("tq_perftest_get_over_tq", "plain", "dropin_get_speed_over_tq", 1.0),
              ("tq_perftest_put_over_native", "plain", "dropin_put_speed_over_native", 0.9),
              ("tq_perftest_complex_put_over_tq", "complex", "dropin_put_speed_over_tq", 1.0),
              ("tq_perftest_complex_get_over_tq", "complex", "dropin_get_speed_over_tq", 1.0)]
    runs = {r["variant"]: r for r in (perftest or {}).get("runs", [])}
    for key, variant, ratio, threshold in wanted:
        value = runs.get(variant, {}).get("ratios", {}).get(ratio)
        if value is not None:
            out[key] = {"value": value, "rows": runs[variant]["batch"], "met": value >= threshold}
    memory = runs.get("plain", {}).get("systems", {}).get("drop-in", {}).get("memory_per_payload_byte")
    if memory is not None:
        out["tq_perftest_memory_per_payload_byte"] = {"value": memory, "rows": runs["plain"]["batch"],
                                                      "met": memory <= 1.15}
    return out
