"""The benchmark's output: a table for people and one JSON line for machines. The targets it ends with are
judged in ``targets.py``."""

from __future__ import annotations

import json
from typing import Any

from broker.bench.targets import TARGETS

GIB_BYTES = 1 << 30

LABELS = {"broker": "broker", "broker-random": "broker, random", "adapter": "mindspeed adapter",
          "adapter-ray": "adapter as actor", "ray": "ray single actor", "redis-floor": "redis floor",
          "redis-floor-2conn": "floor, 2 conns", "inprocess": "in-process", "transferqueue": "transferqueue"}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:8.0f}"


def _perftest(p: dict[str, Any]) -> list[str]:
    native = p["native_server"]
    lines = ["", f"TransferQueue's perftest ({p['perftest']}), timed by itself around ray.get of its writer and "
                 f"reader actors; best of {p['repeat']} after {p['warmup']} (median in brackets); GB = 2^30 bytes",
             "  drop-in: the same script with " + "; ".join(p["edits"]),
             f"  native broker: the same script on the native API (broker/bench/tq_native.py: put_experience / "
             f"read_rows / clear), on Redis {native['version']} ({native['allocator']}, "
             f"{native.get('executable') or 'redis-server'})"]
    for run in p["runs"]:
        dropin = run["systems"].get("drop-in", {})
        srv = dropin.get("server") or {}
        lines += ["", f"  {run['variant']}: {run['batch']} rows x {run['fields']} columns x {run['seq_len']}, "
                      f"{run['payload_bytes'] / GIB_BYTES:.4f} GB; the drop-in on its embedded Redis "
                      f"{srv.get('version', '?')} ({srv.get('allocator', '?')}, {srv.get('executable') or '?'})",
                  f"  {'system':<16}{'first put s':>12}{'put s':>18}{'GB/s':>7}{'get s':>18}{'GB/s':>7}"
                  f"{'mem/byte':>10}"]
        for name, sy in run["systems"].items():
            mem = f"{sy['memory_per_payload_byte']:10.3f}" if "memory_per_payload_byte" in sy else f"{'-':>10}"
            label = {"drop-in": "drop-in", "broker": "broker (native)"}.get(name, LABELS.get(name, name))
            lines.append(f"  {label:<16}{sy['first_put_seconds']:12.3f}"
                         f"{sy['put_seconds']:9.3f} ({sy['median_put_seconds']:6.3f}){sy['put_gb_per_s']:7.2f}"
                         f"{sy['get_seconds']:9.3f} ({sy['median_get_seconds']:6.3f}){sy['get_gb_per_s']:7.2f}{mem}")
        native = run["systems"].get("broker", {})
        tq = run["systems"].get("transferqueue", {})
        clients = [f"{label} put {sy[put]:.2f}, get {sy[get]:.2f}"
                   for label, sy, put, get in (
                       ("transferqueue", tq, "caller_cpu_put_seconds", "caller_cpu_get_seconds"),
                       ("drop-in", dropin, "caller_cpu_put_seconds", "caller_cpu_get_seconds"),
                       ("native", native, "caller_cpu_put_seconds", "caller_cpu_get_seconds"))
                   if put in sy and get in sy]
        if clients:
            lines.append("  caller's CPU s (medians; perftest's writer in a put, its reader in a get): "
                         + "; ".join(clients))
        actors = [f"{label} put {sy['actor_cpu_put_seconds']:.2f}, get {sy['actor_cpu_get_seconds']:.2f}"
                  for label, sy in (("transferqueue", tq), ("drop-in", dropin), ("native", native))
                  if "actor_cpu_put_seconds" in sy and "actor_cpu_get_seconds" in sy]
        if actors:
            lines.append("  every Ray actor's CPU s (medians; TransferQueue's storage units and controller "
                         "included, and 2 s of idling): " + "; ".join(actors))
        cpu = [f"{label} put {sy['server_cpu_put_seconds']:.2f}, get {sy['server_cpu_get_seconds']:.2f}"
               for label, sy in (("drop-in", dropin), ("native", native))
               if "server_cpu_put_seconds" in sy and "server_cpu_get_seconds" in sy]
        if cpu:
            lines.append("  Redis server CPU s (medians): " + "; ".join(cpu))
        if run["ratios"]:
            lines.append("  speed ratios (above 1: the drop-in is faster): " + ", ".join(
                f"{k.replace('dropin_', '').replace('_speed_over_', ' over ').replace('_', ' ')} {v:.2f}"
                for k, v in run["ratios"].items()))
    return lines


def _large(large: dict[str, Any]) -> list[str]:
    srv = large["server"]
    lines = ["", f"large batches: a writer process puts, a reader process gets every row, timed from the driver; "
                 f"best of {large['repeat']} (median in brackets); GB = 2^30 bytes",
             f"  server: Redis {srv['version']}, allocator {srv['allocator']}, "
             f"io-threads {srv.get('io_threads', '?')}, client-query-buffer-limit "
             f"{srv.get('client_query_buffer_limit', '?')}, proto-max-bulk-len {srv.get('proto_max_bulk_len', '?')}"]
    for run in large["runs"]:
        stacked = run.get("stacked_reads")
        how = "" if stacked is None else (", broker reads stacked" if stacked else ", broker reads rows")
        lines += ["", f"  {run['variant']}: {run['batch']} rows x {run['fields']} columns x {run['seq_len']}, "
                      f"{run['payload_bytes'] / GIB_BYTES:.4f} GB{how}",
                  f"  {'system':<16}{'first put s':>12}{'put s':>18}{'GB/s':>7}{'get s':>18}{'GB/s':>7}"
                  f"{'mem/byte':>10}  checksums"]
        for name, sy in run["systems"].items():
            mem = f"{sy['memory_per_payload_byte']:10.3f}" if "memory_per_payload_byte" in sy else f"{'-':>10}"
            lines.append(f"  {LABELS.get(name, name):<16}{sy['first_put_seconds']:12.3f}"
                         f"{sy['put_seconds']:9.3f} ({sy['median_put_seconds']:6.3f}){sy['put_gb_per_s']:7.2f}"
                         f"{sy['get_seconds']:9.3f} ({sy['median_get_seconds']:6.3f}){sy['get_gb_per_s']:7.2f}"
                         f"{mem}  {'equal' if sy['checks_equal'] else 'DIFFER'}")
        cpu = [(LABELS.get(n, n), sy) for n, sy in run["systems"].items() if "client_cpu_put_seconds" in sy]
        if cpu:
            lines.append("  CPU s (medians), client / server: " + "; ".join(
                f"{name} put {sy['client_cpu_put_seconds']:.2f} / {sy['server_cpu_put_seconds']:.2f}, get "
                f"{sy['client_cpu_get_seconds']:.2f} / {sy['server_cpu_get_seconds']:.2f}" for name, sy in cpu))
        if run["ratios"]:
            lines.append("  " + ", ".join(f"{k.replace('_', ' ')} {v:.2f}" for k, v in run["ratios"].items()))
    return lines


def _header(report: dict[str, Any]) -> list[str]:
    r, m = report["redis"], report["machine"]
    where = f"Redis {r['version']} at {r['where']}; {m['cpus']} CPUs, load average {m['loadavg_start']:.1f}"
    w = report.get("workload")
    if not w:
        return [f"broker bench: {where}"]
    return [f"broker bench: {w['prompts']} prompts x {w['n']} = {w['rows']} rows, "
            f"{w['payload_bytes'] / 1e6:.1f} MB payload, seed {w['seed']}; {where}"]


def _pipeline(pipe: dict[str, Any]) -> list[str]:
    lines = ["", f"sequential pipeline, best of {pipe['repeat']} (median in brackets)",
             f"  {'system':<18}{'end-to-end s':>20}{'dock s (get+put)':>20}{'x broker':>10}  checksum"]
    for name, s in pipe["systems"].items():
        ratio = f"{s['ratio_to_broker']:.2f}" if s.get("ratio_to_broker") is not None else "-"
        lines.append(f"  {LABELS.get(name, name):<18}{s['seconds']:>9.3f} ({s['median_seconds']:6.3f})"
                     f"{s['dock_seconds']:>11.3f} ({s['median_dock_seconds']:6.3f}){ratio:>10}  {s['checksum']}")
    lines.append(f"  checksums {'all equal' if pipe['checksums_equal'] else 'DIFFER: data was damaged in transit'}")
    served = {name: s["server_per_pass"] for name, s in pipe["systems"].items() if s.get("server_per_pass")}
    if served:
        lines += ["", "  the Redis server's work per pass (medians; commands include those scripts and MULTIs run):",
                  f"  {'system':<18}{'commands':>12}{'scripts':>10}{'server CPU ms':>16}"]
        lines += [f"  {LABELS.get(name, name):<18}{w['commands']:>12.0f}{w['scripts']:>10.0f}"
                  f"{w['cpu_seconds'] * 1000:>16.1f}" for name, w in served.items()]
    lines += ["", "  ms per stage in the best run, get / compute / put:",
              "  " + f"{'stage':<18}" + "".join(f"{LABELS.get(n, n):>28}" for n in pipe["systems"])]
    for stage in next(iter(pipe["systems"].values()))["stages"]:
        cells = ["    " + "".join(_ms(s["stages"][stage][k]) for k in ("get", "compute", "put"))
                 for s in pipe["systems"].values()]
        lines.append(f"  {stage:<18}" + "".join(cells))
    return lines


def _concurrent(conc: dict[str, Any]) -> list[str]:
    lines = ["", f"concurrent: {conc['processes']} processes ({conc['per_stage']} per stage), all stages at once",
             f"  {'system':<18}{'wall s':>10}{'x broker':>10}  checksum"]
    base = conc["systems"].get("broker")
    for name, c in conc["systems"].items():
        ratio = f"{c['seconds'] / base['seconds']:.2f}" if base else "-"
        same = "equal to the sequential run" if c["checksums_equal"] else "DIFFERS from the sequential run"
        lines.append(f"  {LABELS.get(name, name):<18}{c['seconds']:>10.3f}{ratio:>10}  {c['checksum']} {same}")
    for name, c in conc["systems"].items():
        lines.append(f"  {LABELS.get(name, name)}:")
        for stage, s in c["stages"].items():
            lines.append(f"    {stage:<18} done at {s['done_at']:7.3f} s, {s['calls']:4d} calls, "
                         f"{s['busy_seconds']:7.3f} s compute+put")
    return lines


def _balance(bal: dict[str, Any]) -> list[str]:
    return ["", f"DP balance: {bal['calls']} calls of {bal['rows_per_call']} rows cut for {bal['dp_size']} ranks, "
                "max/mean chunk load (mean over calls / worst call)",
            f"  balanced (Karmarkar-Karp)  {bal['balanced_mean']:.4f} / {bal['balanced_max']:.4f}",
            f"  naive cut                  {bal['naive_mean']:.4f} / {bal['naive_max']:.4f}"]


def _sampling(samp: dict[str, Any]) -> list[str]:
    lines = ["", f"sampling latency of one get_experience ({samp['read_columns']} of {samp['columns']} columns, "
                 f"{samp['rows_per_call']} rows, {samp['calls']} calls)",
             f"  {'rows':>8}  {'fifo p50 / p99 ms':>20}  {'random p50 / p99 ms':>20}  {'script us fifo/random':>22}"]
    for rows, s in samp["sizes"].items():
        f, r = s["fifo"], s["random"]
        lines.append(f"  {int(rows):>8}  {f['p50_ms']:9.3f} / {f['p99_ms']:7.3f}  {r['p50_ms']:9.3f} / "
                     f"{r['p99_ms']:7.3f}  {f['server_script_us']:10.0f} / {r['server_script_us']:9.0f}")
    g = samp["growth"]
    lines.append(f"  rows x{g['rows_factor']:.0f}: p50 x{g['fifo_p50_factor']:.2f} fifo, "
                 f"x{g['random_p50_factor']:.2f} random")
    aged = samp.get("ages")
    if aged:
        lines += [f"  with ages in play (max_age {aged['max_age']}, oldest first): a trainer's group, the rollout's "
                  "rows; x = over fifo above",
                  f"  {'rows':>8}  {'trainer p50 / p99 ms':>20}  {'x p50 / p99':>12}  {'rollout p50 / p99 ms':>20}  "
                  f"{'x p50 / p99':>12}  {'server us per get t/r':>22}"]
        for rows, a in aged["sizes"].items():
            t, r, tx, rx = a["trainer"], a["rollout"], a["trainer_over_plain"], a["rollout_over_plain"]
            lines.append(f"  {int(rows):>8}  {t['p50_ms']:9.3f} / {t['p99_ms']:7.3f}  "
                         f"{tx['p50']:5.2f} / {tx['p99']:4.2f}  {r['p50_ms']:9.3f} / {r['p99_ms']:7.3f}  "
                         f"{rx['p50']:5.2f} / {rx['p99']:4.2f}"
                         f"  {t['server_us_per_get']:10.0f} / {r['server_us_per_get']:9.0f}")
        by_age = next(reversed(aged["sizes"].values()))["groups_by_age"]
        lines.append("  groups by age at the largest size: " + ", ".join(f"{k}: {v}" for k, v in by_age.items()))
    return lines


def _fencing(f: dict[str, Any]) -> list[str]:
    lines = ["", f"the rollout's puts of {f['rows']} rows ({f['bytes'] / 1e6:.1f} MB), {f['rows_per_put']} rows per "
                 f"put, best of {f['repeat']}"]
    for variant, v in f["variants"].items():
        ratio = v["put_seconds"] / f["variants"]["unfenced"]["put_seconds"]
        lines.append(f"  {variant:<12}{_ms(v['put_seconds'])} ms  {v['gb_per_s']:6.2f} GB/s  {ratio:6.3f} x unfenced")
    lines.append("  (leased: the fence alone, ack=False; leased+ack: a stage's put as it acks its rows by default)")
    return lines


def _exporter(exp: dict[str, Any]) -> list[str]:
    lines = ["", f"exporter scrape of {exp['docks']} docks ({exp['keys']} keys), {exp['scrapes']} scrapes",
             f"  {'':<14}{'first ms':>10}{'p50 ms':>10}{'p99 ms':>10}{'server ms':>11}{'round trips':>13}"]
    for label in ("with_memory", "counts_only"):
        e = exp[label]
        lines.append(f"  {label.replace('_', ' '):<14}{e['first_ms']:10.1f}{e['p50_ms']:10.1f}{e['p99_ms']:10.1f}"
                     f"{e['server_ms']:11.1f}{e['round_trips']:13.1f}")
    return lines


def _memory(mem: dict[str, Any]) -> list[str]:
    lines = ["", f"Redis memory for the whole batch ({mem['payload_bytes'] / 1e6:.1f} MB of tensor bytes)"]
    for name, s in mem["systems"].items():
        lines.append(f"  {LABELS.get(name, name):<18}{s['used_memory_delta'] / 1e6:8.1f} MB used_memory = "
                     f"{s['per_payload_byte']:.3f} per payload byte (keys alone {s['keys_per_payload_byte']:.3f})")
    return lines


def _role(n: dict[str, Any], partitions: int) -> str:
    if not n["control"]:
        return "data"
    if partitions == 1:
        return "control + data"
    return ",".join(f"p{p}" for p in n["controls"]) + " + data"


def _cluster(c: dict[str, Any]) -> list[str]:
    s, k = c["single"], c["cluster"]
    partitions = c.get("partitions", 1)
    layout = (f"{c['shards']} data shards" if partitions == 1 else
              f"a dock of {partitions} partitions, each of {c['shards']} data shards")
    lines = ["", f"one redis-server vs a {c['primaries']}-primary Redis Cluster ({layout}), "
                 f"one client, best of {c['repeat']} (median in brackets)",
             f"  {'':<22}{'end-to-end s':>20}{'dock s':>10}{'client CPU s':>14}  checksum"]
    for label, r in (("one server", s), (f"{c['primaries']}-primary cluster", k)):
        lines.append(f"  {label:<22}{r['seconds']:>9.3f} ({r['median_seconds']:6.3f}){r['dock_seconds']:>10.3f}"
                     f"{r['client_cpu_seconds']:>14.3f}  {r['checksum']}")
    same = ("checksums equal, and equal to the in-process reference" if c["checksums_equal"]
            else "checksums DIFFER: data was damaged in transit")
    lines.append(f"  cluster / one server {c['ratio']:.3f} (medians {c['median_ratio']:.3f}, "
                 f"dock {c['dock_ratio']:.3f}); {same}")
    if "durable" in c:
        d = c["durable"]
        label = f"wait_replicas={c['wait_replicas']}"
        lines.append(f"  {label:<22}{d['seconds']:>9.3f} ({d['median_seconds']:6.3f})"
                     f"{d['dock_seconds']:>10.3f}{d['client_cpu_seconds']:>14.3f}  {d['checksum']}")
        lines.append(f"  wait_replicas={c['wait_replicas']} / cluster {c['durable_ratio']:.3f} "
                     f"(medians {c['durable_median_ratio']:.3f}): what waiting for replicas costs")
    total = c["moved_bytes"] * c["repeat"]
    lines += ["", f"  server seconds per GB moved ({c['moved_bytes'] / 1e6:.1f} MB a pass: "
                  f"{c['written_bytes'] / 1e6:.1f} MB put, {c['read_bytes'] / 1e6:.1f} MB got; {c['repeat']} passes; "
                  "a primary's GB: those of the rows it holds)",
              f"  {'primary':<22}{'role':<16}{'share':>7}{'command s/GB':>14}{'= scripts':>11}{'+ data':>9}"
              f"{'process CPU s/GB':>18}{'script calls':>14}"]
    for label, nodes, clustered in (("one server", s["nodes"], False), ("cluster", k["nodes"], True)):
        for where, n in nodes.items():
            gb = n["payload_bytes"] / 1e9
            role = _role(n, partitions) if clustered else "everything"
            figures = (f"{n['command_seconds_per_gb']:>14.3f}{n['script_seconds'] / gb:>11.3f}"
                       f"{n['data_seconds'] / gb:>9.3f}{n['cpu_seconds_per_gb']:>18.3f}" if gb else
                       f"{'-':>14}{'-':>11}{'-':>9}{'-':>18}")
            calls = sum(v for name, v in n["calls"].items() if name.startswith(("eval", "fcall")))
            share = n["payload_bytes"] / total
            lines.append(f"  {(where if clustered else label):<22}{role:<16}{share:>7.0%}{figures}{calls:>14}")
    p = c["projection"]
    ratio = p.get("script_over_mean")
    lines += ["", f"  script time: busiest primary {p['busiest_script']} / mean of the primaries "
                  + (f"{ratio:.2f}" if ratio is not None else "-") + " (target <= 1.3); summed over the primaries, "
                  f"scripts {p['script_seconds_per_gb']:.3f} s and data {p['data_seconds_per_gb']:.3f} s per GB of "
                  f"the workload, {p['script_calls_per_gb']:.0f} script calls per GB",
              "  projected GB/s moved by S primaries" + ("" if partitions == 1 else " with P = S partitions")
              + ", if the servers, not the clients, are the bottleneck:",
              f"  {'':<46}" + "".join(f"{'S=' + str(n):>8}" for n in p["primaries"]) + f"{'limit':>8}"]
    for measure in ("command", "process"):
        m = p[measure]
        who = _role({"control": m["busiest_is_control"], "controls": m["busiest_controls"]}, partitions)
        linear = f"{measure}: S / {m['seconds_per_gb']:.3f} (busiest, {who})"
        lines.append(f"  {linear:<46}" + "".join(f"{v:>8.2f}" for v in m["linear_gb_per_second"].values())
                     + f"{'-':>8}")
        if "control_gb_per_second" in m:
            bound = f"{measure}: 1 / ({m['control_seconds_per_gb']:.3f} + {m['spread_seconds_per_gb']:.3f} / S)"
            ceiling = m["control_ceiling_gb_per_second"]
            lines.append(f"  {bound:<46}" + "".join(f"{v:>8.2f}" for v in m["control_gb_per_second"].values())
                         + (f"{ceiling:>8.2f}" if ceiling else f"{'-':>8}"))
    if "spread_gb_per_second" in p:
        spread = f"command: S / ({ratio:.2f} x {p['script_seconds_per_gb']:.3f} + {p['data_seconds_per_gb']:.3f})"
        lines.append(f"  {spread:<46}" + "".join(f"{v:>8.2f}" for v in p["spread_gb_per_second"].values())
                     + f"{'-':>8}")
    lines.append(f"  at S = {c['primaries']} as measured (busiest primary's scripts + data / S): "
                 f"{p['measured_gb_per_second']:.2f} GB/s")
    if partitions == 1:
        lines.append(f"  the control slot's primary {p['control_node']} runs every script; busiest by command time "
                     f"{p['command']['busiest']}, by process CPU {p['process']['busiest']}")
    else:
        lines.append(f"  {partitions} partitions' scripts on {len(p['control_nodes'])} of {c['primaries']} primaries; "
                     f"busiest by command time {p['command']['busiest']}, by process CPU {p['process']['busiest']}"
                     + ("" if partitions == c["primaries"] else
                        f"; measured with P = {partitions} on {c['primaries']} primaries, not P = S"))
    return lines


def _pipeline_soak(soak: dict[str, Any]) -> list[str]:
    c = soak["config"]
    how = "unfenced control run: plain rows, as before the fence" if c["unfenced"] else "writes fenced"
    killed = f", a worker SIGKILLed every {c['kill_every']:g} s on average" if c["kill"] else ""
    f, late, m, acks = soak["fenced"], soak["late_writes"], soak["mispaired"], soak["short_acks"]
    landed = "nothing checked them" if c["unfenced"] else "the lease had run out, but nobody had taken the rows yet"
    r = soak["redelivered_rows"]
    return ["", f"pipeline soak: {c['per_stage']} rollout + {c['per_stage']} filter processes for "
                f"{soak['load_seconds']:.1f} s, lease {c['lease_seconds']:g} s, {c['slow']:.0%} of batches sleeping "
                f"{c['slow_factor']:g} x the lease{killed} ({how}): {soak['kills']} kills -> "
                f"{'OK' if soak['ok'] else 'FAILED'}",
            f"  prompts put {soak['prompts_put']}: trained {soak['trained']} "
            f"({soak['prompts_trained_per_second']:.1f}/s), "
            f"dropped {soak['dropped']} (dock's discarded {soak['discarded']}), in the dock {soak['in_dock']}, "
            f"lost {soak['lost']}; trained twice {soak['trained_twice']}, rejected but trained "
            f"{soak['trained_rejected']}, unknown {soak['unknown']}",
            f"  mispaired rows {soak['mispaired_rows']} (response of another prompt {m['response_of_another_prompt']}, "
            f"reward of another response {m['reward_of_another_response']}, of which {m['reward_after_a_rewrite']} "
            "after the response was written again by a redo)",
            f"  slow batches {soak['slow_batches']}: late writes refused {late['refused']}, landed {late['landed']} "
            f"({landed})",
            f"  refused (FencedError): rollout puts {f['rollout_puts']}, filter puts {f['filter_puts']}, "
            f"drops {f['filter_drops']}; prompts whose responses landed twice {soak['rewritten']['responses']} "
            f"(rewards {soak['rewritten']['rewards']})",
            f"  rollout / filter / train: rows redelivered {r['rollout']} / {r['filter']} / {r['train']}, acks "
            f"releasing fewer rows than handed out {acks['rollout']} / {acks['filter']} / {acks['train']}",
            f"  drained {soak['drained']} in {soak['drain_seconds']:.1f} s, crashed workers {len(soak['crashed'])}"
            + (f"; failed checks: {', '.join(soak['failed'])}" if soak["failed"] else "")]


def _soak(soak: dict[str, Any]) -> list[str]:
    if soak.get("mode") == "pipeline":
        return _pipeline_soak(soak)
    c = soak["config"]
    mode = "leases, killing clients" if c["kill"] else "leases" if c["leases"] else "no leases"
    if c.get("churn"):
        mode += ", a driver clearing and refilling"
    lines = ["", f"soak: {c['clients']} clients for {soak['load_seconds']:.1f} s ({mode}): "
                 f"{soak['ops_per_second']:.0f} calls/s, {soak['items_per_second']:.0f} groups consumed/s, "
                 f"{soak['kills']} kills -> {'OK' if soak['ok'] else 'FAILED'}",
             f"  items put {soak['items_put']}, lost {soak['lost']}, repeats {soak['repeats']} (redelivered rows "
             f"{soak['redelivered_rows']}), unknown {soak['unknown']}, corrupt {soak['corrupt']}, "
             f"stranded groups {soak['stranded_groups']}, drained {soak['drained']}"]
    if soak.get("churn"):
        ch = soak["churn"]
        lines.append(f"  driver: {ch['generations']} generations, {ch['whole_clears']} whole and "
                     f"{ch['partial_clears']} partial clears; {soak['cleared_unread']} items cleared before anyone "
                     f"read them")
    for op, s in soak["latency"].items():
        lines.append(f"  {op:<10} {s['calls']:7d} calls  p50 {s['p50_ms']:7.2f} ms  p99 {s['p99_ms']:7.2f} ms")
    return lines


def _tenants(t: dict[str, Any]) -> list[str]:
    c = t["config"]
    lines = ["", f"tenants: {c['rounds']} rounds of {c['clients']} clients for {c['seconds']:g} s, alone and beside a "
                 f"hostile tenant (a misbehaviour every {c['pause']:g} s) -> {'OK' if t['ok'] else 'FAILED'}"]
    for label, key in (("alone", "alone"), ("beside hostile", "beside_hostile")):
        s = t[key]
        p99 = "  ".join(f"{op} {ms:.2f}" for op, ms in s["p99_ms"].items())
        lines.append(f"  {label:<15} {s['calls_per_second']:7.0f} calls/s  p99 ms: {p99}  lost {s['lost']}, "
                     f"repeats {s['repeats']}, corrupt {s['corrupt']}")
    lines.append("  slowdown beside the hostile tenant: "
                 + ", ".join(f"{k} {v:.2f}x" for k, v in t["slowdown"].items()))
    lines.append(f"  exporter: {t['scrapes']['total']} scrapes, failed {t['scrapes']['failed'] or 'none'}")
    lines.append("  the hostile tenant's attempts: "
                 + ", ".join(f"{k} {v}" for k, v in t["hostile_attempts"].items()))
    return lines


def table(report: dict[str, Any]) -> str:
    """The report as text for a terminal."""
    lines = _header(report)
    sections = {"pipeline": _pipeline, "concurrent": _concurrent, "balance": _balance, "sampling": _sampling,
                "memory": _memory, "exporter": _exporter, "fencing": _fencing, "soak": _soak, "cluster": _cluster,
                "large": _large, "tq_perftest": _perftest, "tenants": _tenants}
    for key, section in sections.items():
        if report.get(key):
            lines += section(report[key])
    judged = report.get("targets", {})
    if judged:
        lines += ["", "targets"]
        for key, t in judged.items():
            lines.append(f"  {'met ' if t['met'] else 'MISS'}  {TARGETS[key]}: {t['value']:.3f}")
    return "\n".join(lines)


def json_line(report: dict[str, Any]) -> str:
    return json.dumps(report, separators=(",", ":"), sort_keys=False)
