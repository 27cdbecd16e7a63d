"""``--cluster``: the same dock workload on one redis-server and on a Redis Cluster, in one run, side by side.

The run starts a private redis-server and a private cluster of ``primaries`` primaries (``LocalCluster``),
opens the broker's dock on each (on the cluster: one data shard per primary, the dock's control keys in
its own slot ``{NAME}``; with ``partitions`` P > 1 the cluster's dock is a partitioned dock, P docks
``NAME~pK`` whose slots fall on different primaries, each with a data shard per primary, while the one
server's stays a dock of one, the ratio's reference), and runs the sequential pipeline through both
with one client, passes interleaved as in the pipeline mode. It reports the time ratio cluster / one
server, that both runs' checksums equal the in-process reference, and what each server spent on the
bytes moved.

Server time, per primary, over the timed passes (each pass's stats are reset before it, read after it):

``command``  ``INFO commandstats`` usec of what the client sends: the scripts (EVALSHA & co., with the
             commands they call inside) and the data commands (HSET, HMGET, HDEL, UNLINK). EXEC and the
             commands scripts call are left out: commandstats counts them too, inside their EXEC or
             script, and again on their own. (The scripts' schema check is one small HMGET per script
             call, which stays in: a microsecond or so.) Command time leaves out reading requests from
             and writing replies to the sockets, which for a data plane is much of the work.
``process``  ``INFO cpu`` used_cpu_user + used_cpu_sys: everything the server process did, I/O included.

Bytes moved per pass: the tensor bytes every put writes and every get reads (counted on the in-process
floor, ``moved_bytes``); a primary's share is the bytes of the rows whose data shard it holds (group g
on shard g % S; all of them on one server; on a partitioned dock, a row is in the partition the dock's
map says (blocks of groups dealt round robin, ``broker/api/partition_map.py``), its group j there on that
partition's shard j % S). Script time is whatever commandstats says per primary:
a partition's scripts run on the primary holding its slot. Seconds per GB of a primary are its seconds over its share.
The bytes on its sockets (``INFO stats`` total_net_input_bytes + total_net_output_bytes) are reported
beside it: the encoded tensors, the protocol and the scripts' own traffic.

Projection, assuming the servers, not the clients, are the bottleneck (enough client machines; on a
small machine the clients fill the cores before any server does, so scaling cannot be measured here):

``linear``   S primaries move S / c GB/s, c the seconds per GB of the busiest primary: every primary is
             taken to cost what the busiest does per byte through it, with the bytes evenly spread.
             With P = 1 this ignores that the scripts do not spread (``control`` below does not); with
             P > 1 it is the model, read as P = S: each primary holds one partition's slot (its scripts)
             and a share of every partition's bytes, so adding primaries with partitions spreads both.
             It assumes what this run cannot show: that a primary's seconds per GB stay what they were
             here as S and P grow. Two things move them: a call's groups are cut by partition, so script
             calls per GB grow with P (one put of 16 groups is 16 scripts at P >= 16; reported as
             ``script_calls_per_gb``, to compare runs at several P), and a partition's reads fan out to
             more, smaller HMGETs as S grows. A run with the P and S it projects to measures them; the
             busiest primary's script seconds over the mean (``script_over_mean``) says how evenly the
             partitions shared the scripts here.
``spread``   (P > 1) the same with P = S, from the sums over the primaries instead of one primary's bytes:
             with K the script and D the data seconds per GB of the whole workload summed over the
             primaries, and r the busiest primary's script seconds over the mean, the busiest primary is
             busy (r K + D) / S seconds per GB moved: S / (r K + D) GB/s. Bytes are taken to spread
             evenly (they need not have here: a primary's share can be off when a partition holds fewer
             groups than there are primaries); K is this run's, with this P's script calls.
``measured`` at the S of the run: 1 / (k_b + D / S), k_b the busiest primary's script seconds per GB of the
             whole workload (the control primary's, for P = 1), the data even.
``control``  (P = 1 only) the scripts stay on the one primary holding the control slot however many
             primaries there are, while the data spreads: with k its script seconds per GB of the whole
             workload and d the data seconds per GB summed over the primaries, that primary is busy
             k + d / S seconds per GB moved, so S primaries move 1 / (k + d / S) GB/s, never more than
             1 / k. For process CPU, k is the control primary's excess over the mean of the others.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from redis.cluster import RedisCluster

from broker.api.partitioned import PartitionedDock
from broker.bench.broker_dock import BrokerDock
from broker.bench.inprocess import InProcessDock
from broker.bench.pipeline import RunResult, run_pipeline
from broker.bench.server_work import SCRIPT_COMMANDS, server_cpu
from broker.bench.servers import admin, primaries, server_version
from broker.bench.workload import Rows, Workload
from broker.ops.clients import Client

#: The data plane's commands (the scripts' are server_work.SCRIPT_COMMANDS).
DATA_COMMANDS = ("hset", "hmget", "hdel", "unlink")

#: Primaries the projection is given for.
PROJECTED_PRIMARIES = (3, 6, 12, 24)


def _say(text: str) -> None:
    print(f"broker bench: {text}", file=sys.stderr, flush=True)


class _Counting:
    """A dock passing calls through and adding up the tensor bytes put and got, per row."""

    def __init__(self, inner: InProcessDock, capacity: int):
        self.inner, self.written, self.read = inner, 0, 0
        self.per_row = [0] * capacity

    def _count(self, data: Rows, rows: list[int]) -> int:
        total = 0
        for values in data.values():
            for row, t in zip(rows, values):
                self.per_row[row] += t.nbytes
                total += t.nbytes
        return total

    def put(self, data: Rows, rows: list[int]) -> None:
        self.written += self._count(data, rows)
        self.inner.put(data, rows)

    def get(self, consumer: str, columns: tuple[str, ...], count: int) -> tuple[Rows, list[int]]:
        batch, rows = self.inner.get(consumer, columns, count)
        self.read += self._count(batch, rows)
        return batch, rows

    def reset(self) -> None:
        self.inner.reset()

    def close(self) -> None:
        self.inner.close()


@dataclass
class Moved:
    """The tensor bytes one pass moves: put, got, and both per row; and the pass's reference checksum."""

    written: int
    read: int
    per_row: list[int]
    checksum: str

    @property
    def total(self) -> int:
        return self.written + self.read


def moved_bytes(workload: Workload) -> Moved:
    """What one pass moves, counted on the in-process floor (whose checksum is every system's reference)."""
    dock = _Counting(InProcessDock(workload), workload.capacity)
    result = run_pipeline("inprocess", dock, workload)
    return Moved(dock.written, dock.read, dock.per_row, result.checksums.total())


@dataclass
class _Node:
    """One primary's figures summed over the timed passes; ``controls``: the partitions whose control slot
    (and so every script) it holds, ``[0]`` or ``[]`` for a dock of one partition."""

    controls: list[int]
    script_usec: int = 0
    data_usec: int = 0
    cpu_seconds: float = 0.0
    net_bytes: int = 0
    calls: dict[str, int] = field(default_factory=dict)


def _snapshot(node: Client) -> tuple[float, int]:
    stats = node.info("stats")
    return server_cpu(node), int(stats["total_net_input_bytes"]) + int(stats["total_net_output_bytes"])


class _Target:
    """One server or cluster, its dock, and what its primaries spent during the timed passes."""

    def __init__(self, label: str, url: str, name: str, workload: Workload, client: Client, moved: Moved,
                 wait_replicas: int = 0, partitions: int = 1):
        self.label, self.url = label, url
        self.dock = BrokerDock(url, name, workload, wait_replicas=wait_replicas, partitions=partitions)
        try:
            self._layout(name, workload, client, moved)
        except BaseException:
            self.dock.close()
            raise
        self.runs: list[RunResult] = []
        self.client_cpu: list[float] = []

    def _layout(self, name: str, workload: Workload, client: Client, moved: Moved) -> None:
        """The primaries, which hold control slots, and the bytes a pass moves through each."""
        self.nodes = primaries(client)
        node_of: Callable[[str], str] = (
            (lambda key: client.get_node_from_key(key).name) if isinstance(client, RedisCluster)
            else (lambda key: self.nodes[0][0])
        )
        dock = self.dock.dock
        parts = dock.partitions if isinstance(dock, PartitionedDock) else (dock,)
        controls = [node_of(part.keys.meta) for part in parts]
        self.stats = {where: _Node(controls=[p for p, c in enumerate(controls) if c == where])
                      for where, _ in self.nodes}
        #: Per primary, the tensor bytes a pass moves through it. Row r is in the partition and is the row there
        #: that the dock's map says (``PartitionedDock.partition_map``); a sharded partition keeps its group j on
        #: its data shard j % S (sharded_store.py), an unsharded one everything in its own slot.
        self.share = {where: 0 for where, _ in self.nodes}
        holders = [[node_of("{" + tag + "}") for tag in part.schema.shards] or [controls[p]]
                   for p, part in enumerate(parts)]
        pmap = dock.partition_map if isinstance(dock, PartitionedDock) else None
        for row, size in enumerate(moved.per_row):
            p, local = (pmap.partition_of(row), pmap.local(row)) if pmap is not None else (0, row)
            on = holders[p]
            self.share[on[(local // workload.n) % len(on)]] += size

    def timed(self, workload: Workload) -> RunResult:
        before: dict[str, tuple[float, int]] = {}
        for where, node in self.nodes:
            node.config_resetstat()
            before[where] = _snapshot(node)
        cpu = time.process_time()
        result = run_pipeline(self.label, self.dock, workload)
        self.client_cpu.append(time.process_time() - cpu)
        for where, node in self.nodes:
            cpu_now, net_now = _snapshot(node)
            s = self.stats[where]
            s.cpu_seconds += cpu_now - before[where][0]
            s.net_bytes += net_now - before[where][1]
            for key, value in node.info("commandstats").items():
                name = key.removeprefix("cmdstat_")
                usec = int(value.get("usec", 0))
                if name in SCRIPT_COMMANDS:
                    s.script_usec += usec
                elif name in DATA_COMMANDS:
                    s.data_usec += usec
                else:
                    continue
                s.calls[name] = s.calls.get(name, 0) + int(value.get("calls", 0))
        return result

    def report(self) -> dict[str, Any]:
        best = min(self.runs, key=lambda r: r.seconds)
        passes = len(self.runs)
        nodes: dict[str, Any] = {}
        for where, s in self.stats.items():
            share = self.share[where] * passes
            gb = share / 1e9
            command = (s.script_usec + s.data_usec) / 1e6
            nodes[where] = {
                "control": bool(s.controls), "controls": s.controls, "script_seconds": s.script_usec / 1e6,
                "data_seconds": s.data_usec / 1e6, "command_seconds": command, "cpu_seconds": s.cpu_seconds,
                "net_bytes": s.net_bytes,
                "payload_bytes": share,  # per GB: None for a primary holding no rows (fewer groups than shards)
                "command_seconds_per_gb": command / gb if gb else None,
                "script_seconds_per_gb": s.script_usec / 1e6 / gb if gb else None,
                "data_seconds_per_gb": s.data_usec / 1e6 / gb if gb else None,
                "cpu_seconds_per_gb": s.cpu_seconds / gb if gb else None, "calls": s.calls,
            }
        return {
            "seconds": best.seconds, "median_seconds": statistics.median(r.seconds for r in self.runs),
            "dock_seconds": min(r.dock_seconds for r in self.runs),
            "runs": [round(r.seconds, 4) for r in self.runs], "checksum": best.checksums.total(),
            "checksums": sorted({r.checksums.total() for r in self.runs}),
            "client_cpu_seconds": statistics.median(self.client_cpu), "passes": passes, "nodes": nodes,
            "stages": {k: {"get": v.get, "compute": v.compute, "put": v.put, "calls": v.calls}
                       for k, v in best.stages.items()},
        }


def _projection(nodes: dict[str, Any], gb: float, partitions: int) -> dict[str, Any]:
    """Throughput for S primaries from the cluster's per-primary figures (see the module docstring)."""
    scripts = {where: n["script_seconds"] for where, n in nodes.items()}
    mean_script = statistics.mean(scripts.values())
    busiest_script = max(scripts, key=lambda w: scripts[w])
    out: dict[str, Any] = {
        "assumption": "the servers, not the clients, are the bottleneck (enough client machines); the bytes spread "
                      "evenly over the primaries; " + (
                          "the scripts run on the control slot's primary alone" if partitions == 1 else
                          f"the dock has P = S partitions, and each primary costs per GB through it what the "
                          f"busiest did here with P = {partitions} (its scripts' per-call share included)"),
        "partitions": partitions, "primaries": list(PROJECTED_PRIMARIES),
        "control_nodes": [where for where, n in nodes.items() if n["control"]],
        # Per GB of the whole workload, summed over the primaries: what P = S would spread over S of them.
        "script_seconds_per_gb": sum(scripts.values()) / gb,
        "data_seconds_per_gb": sum(n["data_seconds"] for n in nodes.values()) / gb,
        "script_calls_per_gb": sum(sum(c for name, c in n["calls"].items() if name in SCRIPT_COMMANDS)
                                   for n in nodes.values()) / gb,
        "busiest_script": busiest_script,
        "script_over_mean": scripts[busiest_script] / mean_script if mean_script else None,
    }
    if partitions == 1:
        out["control_node"] = out["control_nodes"][0]
    # By command time, at the S measured: the busiest primary's scripts plus an even share of the data.
    size = len(nodes)
    out["measured_gb_per_second"] = 1 / (scripts[busiest_script] / gb + out["data_seconds_per_gb"] / size)
    if partitions > 1 and out["script_over_mean"] is not None:
        # With P = S, the scripts spread as unevenly as here and the data evenly: S / (r K + D).
        busy = out["script_over_mean"] * out["script_seconds_per_gb"] + out["data_seconds_per_gb"]
        out["spread_gb_per_second"] = {str(s): s / busy for s in PROJECTED_PRIMARIES}
    for measure, key in (("command", "command_seconds_per_gb"), ("process", "cpu_seconds_per_gb")):
        busiest = max((where for where in nodes if nodes[where][key] is not None), key=lambda w: nodes[w][key])
        c = nodes[busiest][key]
        m: dict[str, Any] = {
            "busiest": busiest, "busiest_is_control": nodes[busiest]["control"],
            "busiest_controls": nodes[busiest]["controls"], "seconds_per_gb": c,
            "linear_gb_per_second": {str(s): s / c for s in PROJECTED_PRIMARIES},
        }
        if partitions == 1:  # today's model: every script on one primary however many there are
            control = out["control_node"]
            others = [n for where, n in nodes.items() if where != control]
            if measure == "command":
                fixed = nodes[control]["script_seconds"] / gb
                spread = sum(n["data_seconds"] for n in nodes.values()) / gb
            else:
                mean_other = statistics.mean(n["cpu_seconds"] for n in others) if others else 0.0
                fixed = max(nodes[control]["cpu_seconds"] - mean_other, 0.0) / gb
                spread = mean_other * len(nodes) / gb if others else nodes[control]["cpu_seconds"] / gb - fixed
            m.update({
                "control_seconds_per_gb": fixed, "spread_seconds_per_gb": spread,
                "control_gb_per_second": {str(s): 1 / (fixed + spread / s) for s in PROJECTED_PRIMARIES},
                "control_ceiling_gb_per_second": 1 / fixed if fixed > 0 else None,
            })
        out[measure] = m
    return out


@contextlib.contextmanager
def _servers(primaries_count: int, replicas: int = 0) -> Iterator[tuple[str, str]]:
    """A private redis-server and a private cluster (``replicas`` per primary), their URLs; every server
    stopped after, on an error too."""
    from broker.ops.local_cluster import LocalCluster
    from broker.ops.local_redis import private_redis

    with private_redis() as single, LocalCluster(primaries_count, replicas=replicas) as cluster:
        _say(f"started a {single.description}, and a {primaries_count}-primary Redis Cluster "
             f"{cluster.version} with {replicas} replica(s) per primary on ports "
             f"{', '.join(str(n.port) for n in cluster.nodes)}, stopped at the end")
        yield single.url, cluster.url


def compare(prefix: str, workload: Workload, *, primaries_count: int = 3, repeat: int = 3,
            warmup: int = 1, wait_replicas: int = 0, partitions: int = 1) -> dict[str, Any]:
    """Run the comparison on private servers; every server is stopped before this returns or raises.

    ``partitions``: the cluster's docks (plain and durable) are made with that many partitions; the one
    server's stays a dock of one, the ratio's reference.

    With ``wait_replicas`` the cluster has that many replicas per primary, and a third dock on it, opened
    with ``wait_replicas``, is timed beside the plain one: the durability option's cost, in one run."""
    moved = moved_bytes(workload)
    with _servers(primaries_count, wait_replicas) as (single_url, cluster_url), contextlib.ExitStack() as stack:
        single_admin = stack.enter_context(admin(single_url))
        cluster_admin = stack.enter_context(admin(cluster_url))
        targets: dict[str, _Target] = {}
        systems = [("single", single_url, single_admin, 0), ("cluster", cluster_url, cluster_admin, 0)]
        if wait_replicas:
            systems.append(("durable", cluster_url, cluster_admin, wait_replicas))
        for label, url, client, wait in systems:
            parts = 1 if label == "single" else partitions
            _say(f"cluster: opening the dock on the {label}" + (f" ({parts} partitions)" if parts > 1 else ""))
            targets[label] = _Target(label, url, f"{prefix}-{label}", workload, client, moved, wait, parts)
            stack.callback(targets[label].dock.close)
        clustered = targets["cluster"].dock.dock
        shards = len((clustered.partitions[0] if isinstance(clustered, PartitionedDock) else clustered).schema.shards)
        version = server_version(single_admin)
        order = list(targets)
        for i in range(warmup + repeat):
            for label in order[i % len(order):] + order[: i % len(order)]:
                target = targets[label]
                target.dock.reset()
                if i < warmup:
                    result = run_pipeline(label, target.dock, workload)
                else:
                    result = target.timed(workload)
                    target.runs.append(result)
                name = f"warm-up {i + 1}" if i < warmup else f"pass {i + 1 - warmup}"
                _say(f"cluster: {name}: {label} {result.seconds:.3f} s")
        single, cluster = targets["single"].report(), targets["cluster"].report()
        durable = targets["durable"].report() if wait_replicas else None
    gb = moved.total * repeat / 1e9
    checks = {moved.checksum, *single["checksums"], *cluster["checksums"], *(durable or {}).get("checksums", [])}
    return {
        "version": version, "primaries": primaries_count, "partitions": partitions, "shards": shards,
        "repeat": repeat, "warmup": warmup,
        "written_bytes": moved.written, "read_bytes": moved.read, "moved_bytes": moved.total,
        "reference_checksum": moved.checksum,
        "single": single, "cluster": cluster,
        "ratio": cluster["seconds"] / single["seconds"],
        "median_ratio": cluster["median_seconds"] / single["median_seconds"],
        "dock_ratio": cluster["dock_seconds"] / single["dock_seconds"],
        "checksums_equal": len(checks) == 1,
        "projection": _projection(cluster["nodes"], gb, partitions),
        **({} if durable is None else {
            "wait_replicas": wait_replicas, "durable": durable,
            "durable_ratio": durable["seconds"] / cluster["seconds"],
            "durable_median_ratio": durable["median_seconds"] / cluster["median_seconds"],
        }),
    }
