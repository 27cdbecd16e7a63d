"""``broker bench``: run the selected modes against one Redis and print the report."""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import secrets
import statistics
import sys
from collections.abc import Callable, Iterator
from typing import Any

from broker import __version__
from broker.bench.docks import BenchDock
from broker.bench.options import CLUSTER_REPEAT, MODES, REPEAT
from broker.bench.pipeline import RunResult, run_pipeline
from broker.bench.report import json_line, table
from broker.bench.server_work import ServerWork, Work, medians
from broker.bench.servers import admin, is_cluster, primaries, server_version
from broker.bench.targets import targets
from broker.bench.workload import Checksums, Workload
from broker.ops.clients import redact
from broker.ops.keys import dock_patterns


def _say(text: str) -> None:
    print(f"broker bench: {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def redis_target(url: str | None, unix: bool) -> Iterator[tuple[str, bool]]:
    """The URL to measure, and whether it is a private server started here."""
    if url:
        yield url, False
        return
    from broker.ops.local_redis import private_redis

    with private_redis(unix=unix) as target:
        _say(f"started a {target.description} (no persistence; --url to use your own)")
        yield target.url, True


def openers(url: str, prefix: str, workload: Workload) -> dict[str, Callable[[], BenchDock]]:
    """How to open each system on a fresh store; imports happen only for the systems used."""

    def broker() -> BenchDock:
        from broker.bench.broker_dock import BrokerDock
        return BrokerDock(url, f"{prefix}-broker", workload)

    def broker_random() -> BenchDock:
        from broker.bench.broker_dock import BrokerDock
        return BrokerDock(url, f"{prefix}-broker-random", workload, policy="random")

    def ray() -> BenchDock:
        from broker.bench.ray_dock import RayDock
        return RayDock(workload, seed=workload.seed)

    def floor() -> BenchDock:
        from broker.bench.redis_floor import RedisFloorDock
        return RedisFloorDock(url, f"{prefix}-floor", workload)

    def inprocess() -> BenchDock:
        from broker.bench.inprocess import InProcessDock
        return InProcessDock(workload)

    def adapter() -> BenchDock:
        from broker.bench.adapter import AdapterDock
        return AdapterDock(url, f"{prefix}-adapter", workload)

    def adapter_ray() -> BenchDock:
        from broker.bench.adapter import AdapterRayDock
        return AdapterRayDock(url, f"{prefix}-adapter-ray", workload)

    return {"broker": broker, "broker-random": broker_random, "adapter": adapter, "adapter-ray": adapter_ray,
            "ray": ray, "redis-floor": floor, "inprocess": inprocess}


def pipeline_mode(url: str, prefix: str, workload: Workload, systems: tuple[str, ...], repeat: int,
                  warmup: int) -> dict[str, Any]:
    """Every system over the same batch, passes interleaved so drift in machine load hits all alike."""
    if "ray" in systems or "adapter-ray" in systems:
        try:
            import ray  # noqa: F401
        except ImportError:
            _say("ray is not installed (pip install 'redis-transfer-dock[workers]'): skipping the ray systems")
            systems = tuple(s for s in systems if s not in ("ray", "adapter-ray"))
    opened = openers(url, prefix, workload)
    docks: dict[str, BenchDock] = {}
    runs: dict[str, list[RunResult]] = {s: [] for s in systems}
    server = ServerWork.of(url)  # the server's own work per pass, read outside the timing (server_work.py)
    works: dict[str, list[Work | None]] = {s: [] for s in systems}
    try:
        for s in systems:
            _say(f"opening {s}")
            docks[s] = opened[s]()
        for i in range(warmup + repeat):
            order = systems[i % len(systems):] + systems[: i % len(systems)]
            for s in order:
                docks[s].reset()
                before = server.reading()
                result = run_pipeline(s, docks[s], workload)
                work = ServerWork.between(before, server.reading())
                label = f"warm-up {i + 1}" if i < warmup else f"pass {i + 1 - warmup}"
                _say(f"{label}: {s} {result.seconds:.3f} s")
                if i >= warmup:
                    runs[s].append(result)
                    works[s].append(work)
    finally:
        for dock in reversed(list(docks.values())):  # the first Ray system started Ray: it stops it, last
            dock.close()
        server.close()
    out: dict[str, Any] = {"repeat": repeat, "warmup": warmup, "systems": {}}
    for s, results in runs.items():
        best = min(results, key=lambda r: r.seconds)
        out["systems"][s] = {
            "seconds": best.seconds,
            "median_seconds": statistics.median(r.seconds for r in results),
            "dock_seconds": min(r.dock_seconds for r in results),
            "median_dock_seconds": statistics.median(r.dock_seconds for r in results),
            "runs": [round(r.seconds, 4) for r in results],
            "stages": {k: {"get": v.get, "compute": v.compute, "put": v.put, "calls": v.calls}
                       for k, v in best.stages.items()},
            "checksum": best.checksums.total(),
            "stage_checksums": best.checksums.by_stage(),
            "server_per_pass": medians(works[s]),
        }
    base = out["systems"].get("broker")
    for s in out["systems"].values():
        s["ratio_to_broker"] = s["seconds"] / base["seconds"] if base else None
        s["dock_ratio_to_broker"] = s["dock_seconds"] / base["dock_seconds"] if base else None
    totals = {r.checksums.total() for results in runs.values() for r in results}
    out["checksums_equal"] = len(totals) == 1
    return out


def reference_checksums(workload: Workload) -> Checksums:
    """What every system must produce: the batch through the in-process floor."""
    from broker.bench.inprocess import InProcessDock

    return run_pipeline("inprocess", InProcessDock(workload), workload).checksums


def run(args: argparse.Namespace) -> int:
    """Run what ``args`` selects; 0 when every checksum agrees (and the soak passed), else 1."""
    if args.repeat is None:
        args.repeat = CLUSTER_REPEAT if args.cluster else REPEAT
    positive = {"--prompts": args.prompts, "--n": args.n, "--groups-per-call": args.groups_per_call,
                "--repeat": args.repeat, "--per-stage": args.per_stage, "--sampling-calls": args.sampling_calls,
                "--clients": args.clients, "--seconds": args.seconds, "--kill-every": args.kill_every,
                "--exporter-docks": args.exporter_docks, "--exporter-scrapes": args.exporter_scrapes,
                "--primaries": args.primaries, "--batch": args.batch, "--fields": args.fields,
                "--seq-len": args.seq_len, "--rounds": args.rounds}
    if args.lease_seconds is not None:  # None: each soak's own default
        positive["--lease-seconds"] = args.lease_seconds
    bad = [name for name, value in positive.items() if value <= 0] + (["--warmup"] if args.warmup < 0 else [])
    if bad:
        print(f"broker bench: {', '.join(bad)} must be positive", file=sys.stderr)
        return 2
    if args.soak and args.pipeline and (args.leases or args.churn):
        print("broker bench: the pipeline soak always takes rows with leases; --leases and --churn are the plain "
              "soak's", file=sys.stderr)
        return 2
    if (args.unfenced or args.slow is not None) and not (args.soak and args.pipeline):
        print("broker bench: --slow and --unfenced belong to the pipeline soak (--soak --pipeline)", file=sys.stderr)
        return 2
    if args.slow is not None and not 0 <= args.slow <= 1:
        print("broker bench: --slow is a probability, from 0 to 1", file=sys.stderr)
        return 2
    if args.tenants and (args.soak or args.cluster):
        print("broker bench: --tenants is a soak of its own; it takes no --soak or --cluster", file=sys.stderr)
        return 2
    if args.cluster and (args.url or args.soak or args.unix):
        print("broker bench: --cluster starts a redis-server and a Redis Cluster of its own; it takes no --url, "
              "--unix or --soak", file=sys.stderr)
        return 2
    if args.partitions != 1 and not (args.cluster and 1 <= args.partitions <= args.prompts):
        print("broker bench: --partitions belongs to --cluster, from 1 to --prompts (a group never spans partitions)",
              file=sys.stderr)
        return 2
    workload = Workload(prompts=args.prompts, n=args.n, seed=args.seed, groups_per_call=args.groups_per_call)
    named_alone = args.exporter or args.fencing or args.large or args.tq_perftest  # modes run only when named
    selected = [m for m in MODES if getattr(args, m)] or ([] if named_alone else list(MODES))
    prefix = f"bench-{secrets.token_hex(4)}"
    report: dict[str, Any] = {"bench": "broker", "version": __version__}
    if not (args.soak or args.tenants) and not ((args.large or args.tq_perftest) and not selected):
        report["workload"] = {"prompts": workload.prompts, "n": workload.n, "rows": workload.capacity,
                              "seed": workload.seed, "rows_per_call": workload.call_rows,
                              "payload_bytes": workload.payload_bytes()}
    report["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "loadavg_start": os.getloadavg()[0]}
    if args.cluster:
        from broker.bench.cluster import compare

        report["cluster"] = compare(prefix, workload, primaries_count=args.primaries, repeat=args.repeat,
                                    warmup=args.warmup, wait_replicas=args.wait_replicas, partitions=args.partitions)
        report["redis"] = {"version": report["cluster"]["version"], "private": True,
                           "where": f"a private redis-server and a private {args.primaries}-primary Redis Cluster"}
        ok = report["cluster"]["checksums_equal"]
    else:
        from broker.bench.tenants import Unsupported

        try:
            ok = _measure(args, selected, prefix, workload, report)
        except Unsupported as exc:
            print(f"broker bench: {exc}", file=sys.stderr)
            return 2
    report["machine"]["loadavg_end"] = os.getloadavg()[0]
    report["targets"] = targets(report)
    if not args.json:
        print(table(report))
    print(json_line(report), flush=True)
    return 0 if ok else 1


def _measure(args: argparse.Namespace, selected: list[str], prefix: str, workload: Workload,
             report: dict[str, Any]) -> bool:
    """The modes or the soak against the Redis of ``--url`` (or a private one); whether all went well."""
    with redis_target(args.url, args.unix) as (url, private):
        with admin(url) as client:
            report["redis"] = {"version": server_version(client), "where": redact(url), "private": private}
            if is_cluster(client):
                report["redis"]["cluster_primaries"] = len(primaries(client))
        if args.tenants:
            from broker.bench.tenants import TenantsConfig, run_tenants

            tenants = TenantsConfig(clients=args.clients, seconds=args.seconds, rounds=args.rounds,
                                    pause=args.hostile_pause, seed=args.seed)
            _say(f"tenants: {tenants.rounds} rounds of {tenants.clients} clients for {tenants.seconds:g} s, alone "
                 "and beside a hostile tenant")
            report["tenants"] = run_tenants(url, prefix, tenants)
            return bool(report["tenants"]["ok"])
        if args.soak and args.pipeline:
            from broker.bench.pipeline_soak import PipelineSoakConfig, run_pipeline_soak

            defaults = PipelineSoakConfig()
            pipe = PipelineSoakConfig(per_stage=args.per_stage, seconds=args.seconds,
                                      slow=defaults.slow if args.slow is None else args.slow,
                                      lease_seconds=args.lease_seconds or defaults.lease_seconds,
                                      kill=args.kill, kill_every=args.kill_every, unfenced=args.unfenced,
                                      seed=args.seed)
            _say(f"pipeline soak: {pipe.per_stage} rollout and {pipe.per_stage} filter processes for "
                 f"{pipe.seconds:g} s{' (unfenced control run)' if pipe.unfenced else ''}")
            report["soak"] = run_pipeline_soak(url, f"{prefix}-pipeline-soak", pipe)
            return bool(report["soak"]["ok"])
        if args.soak:
            from broker.bench.soak import SoakConfig, run_soak

            cfg = SoakConfig(clients=args.clients, seconds=args.seconds, leases=args.leases or args.kill,
                             kill=args.kill, lease_seconds=args.lease_seconds or SoakConfig().lease_seconds,
                             kill_every=args.kill_every, churn=args.churn, seed=args.seed)
            _say(f"soak: {cfg.clients} clients for {cfg.seconds:g} s")
            report["soak"] = run_soak(url, f"{prefix}-soak", cfg)
            return bool(report["soak"]["ok"])
        return _modes(args, selected, url, prefix, workload, report)


def _ray_needed(selected: list[str], systems: tuple[str, ...]) -> bool:
    """Whether the pipeline or the concurrent mode will run a Ray system (and Ray imports)."""
    if not {"pipeline", "concurrent"} & set(selected) or not {"ray", "adapter-ray"} & set(systems):
        return False
    try:
        import ray  # noqa: F401
    except ImportError:
        return False  # pipeline_mode says so and skips them
    return True


def _modes(args: argparse.Namespace, selected: list[str], url: str, prefix: str, workload: Workload,
           report: dict[str, Any]) -> bool:
    from broker.bench.ray_dock import ray_for_modes

    ok = True
    with ray_for_modes(_ray_needed(selected, args.systems)):
        if "pipeline" in selected:
            report["pipeline"] = pipeline_mode(url, prefix, workload, args.systems, args.repeat, args.warmup)
            ok = report["pipeline"]["checksums_equal"]
        if "concurrent" in selected:
            from broker.bench.concurrent import CONCURRENT_SYSTEMS, run_concurrent

            reference = reference_checksums(workload)
            systems = [s for s in CONCURRENT_SYSTEMS if s in args.systems]
            report["concurrent"] = {"per_stage": args.per_stage,
                                    "processes": args.per_stage * len(workload.stages), "systems": {}}
            for system in systems:
                _say(f"concurrent: {system}, {args.per_stage * len(workload.stages)} stage processes")
                conc = run_concurrent(url, f"{prefix}-concurrent-{system}", workload, per_stage=args.per_stage,
                                      system=system)
                checks = conc.pop("checksums")
                conc["checksum"] = checks.total()
                conc["checksums_equal"] = conc["checksum"] == reference.total()
                report["concurrent"]["systems"][system] = conc
                ok = ok and conc["checksums_equal"]
    if "sampling" in selected:
        from broker.bench.sampling import sampling_latency

        _say(f"sampling: docks of {', '.join(map(str, args.sampling_sizes))} rows x 16 columns, "
             "without and with ages in play")
        report["sampling"] = sampling_latency(url, f"{prefix}-sampling", sizes=args.sampling_sizes,
                                              calls=args.sampling_calls)
    if "balance" in selected:
        from broker.bench.balance import dp_balance

        _say("balance: each call's rows cut for 4 DP ranks, balanced and naive")
        report["balance"] = dp_balance(url, f"{prefix}-balance", workload)
    if "memory" in selected:
        from broker.bench.memory import measure

        _say("memory: the whole batch in the broker, then in the floor")
        opened = openers(url, prefix, workload)
        report["memory"] = measure(url, workload, {
            # A sharded dock's bytes are under its data shards' tags, {NAME~S}: the second pattern.
            "broker": (opened["broker"], dock_patterns(f"{prefix}-broker")),
            "redis-floor": (opened["redis-floor"], (f"bench:{{{prefix}-floor}}:*",)),
        })
    if args.fencing:
        from broker.bench.fencing import fencing_cost

        _say(f"fencing: the rollout's puts of {workload.capacity} rows, unfenced, fenced and leased, alternated")
        report["fencing"] = fencing_cost(url, f"{prefix}-fencing", workload, args.repeat, args.warmup)
    if args.large:
        from broker.bench.large_run import run_large
        from broker.bench.large_workload import LargeWorkload

        base = LargeWorkload(batch=args.batch, fields=args.fields, seq_len=args.seq_len, complex=args.complex,
                             seed=args.seed)
        report["large"] = run_large(url, prefix, base, args.large_sizes or (args.batch,), args.large_systems,
                                    args.tq_python, args.repeat, args.warmup)
        ok = ok and report["large"]["checks_equal"]
    if args.tq_perftest:
        from broker.bench.large_workload import LargeWorkload
        from broker.bench.tq_perftest import run_tq_perftest

        base = LargeWorkload(batch=args.batch, fields=args.fields, seq_len=args.seq_len, complex=args.complex,
                             seed=args.seed)
        perftest = run_tq_perftest(url, base, args.tq_python, args.repeat, args.warmup)
        if perftest is not None:
            report["tq_perftest"] = perftest
    if args.exporter:
        from broker.bench.exporter import scrape_cost

        _say(f"exporter: {args.exporter_docks} docks, {args.exporter_scrapes} scrapes")
        report["exporter"] = scrape_cost(url, f"{prefix}-exporter", args.exporter_docks, args.exporter_scrapes)
    return ok
