"""``broker bench --large``: the driver. Each system's writer and reader in processes of their own, timed here.

For each variant (plain; complex with ``--complex``) and batch size (``--batch``, or each of
``--large-sizes``) it starts the writer and reader processes (``large.py``) and TransferQueue's child
(``large_tq.py``), then runs ``--warmup`` + ``--repeat`` passes, the systems in a rotated order each
pass so drift in machine load hits all alike. A pass of one system: clear it (untimed), put the batch
(timed), read ``used_memory``, get every row of every column (timed), compare checksums, clear it.
The first put of each system, on its fresh dock or empty server, is reported on its own.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from broker.bench.large import ProcessActor
from broker.bench.large_workload import GIB, LargeWorkload
from broker.bench.server_work import server_cpu
from broker.bench.servers import admin, is_cluster, used_memory
from broker.ops.clients import Client

REDIS_SYSTEMS = ("broker", "redis-floor", "redis-floor-2conn")


def _say(text: str) -> None:
    print(f"broker bench: {text}", file=sys.stderr, flush=True)


def server_facts(client: Client) -> dict[str, Any]:
    """What decides a large put's floor on this server: build, allocator, io-threads, size limits."""
    info = {**client.info("server"), **client.info("memory")}
    config: dict[str, str] = {}
    for name in ("io-threads", "client-query-buffer-limit", "proto-max-bulk-len", "maxmemory"):
        try:
            config.update({str(k): str(v) for k, v in client.config_get(name).items()})
        except Exception:  # noqa: BLE001 - CONFIG may be renamed or denied on a user's server
            pass
    return {"version": str(info.get("redis_version")), "allocator": str(info.get("mem_allocator")),
            "executable": str(info.get("executable", "")), **{k.replace("-", "_"): v for k, v in config.items()}}


def tq_interpreter(requested: str | None) -> tuple[str | None, str]:
    """The interpreter to run TransferQueue in, or None and why not."""
    python = requested or sys.executable
    probe = subprocess.run([python, "-c", "import transfer_queue, tensordict, ray, omegaconf"],
                           capture_output=True, text=True)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return None, (f"{python} cannot import transfer_queue ({last}): skipping the transferqueue system "
                      "(pip install 'redis-transfer-dock[tq]', or --tq-python PATH)")
    return python, ""


class TQSystem:
    """TransferQueue's writer and reader behind its child interpreter; each call is one JSON line."""

    def __init__(self, python: str, w: LargeWorkload):
        script = Path(__file__).with_name("large_tq.py")
        # Ray and TransferQueue log freely: to a file, whose tail a failure shows.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([python, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1)
        fields = {"batch": w.batch, "fields": w.fields, "seq_len": w.seq_len, "complex": w.complex, "seed": w.seed}
        self.version = str(self._call({"workload": fields})["version"])

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith("@@bench "):
                reply: dict[str, Any] = json.loads(line[len("@@bench "):])
                return reply
        status = self.proc.wait()
        self.log.seek(0)
        tail = self.log.read()[-3000:]
        raise RuntimeError(f"the TransferQueue child ended (exit status {status}) without replying:\n{tail}")

    def put(self) -> float:
        return float(self._call({"op": "put"})["seconds"])

    def get(self) -> float:
        return float(self._call({"op": "get"})["seconds"])

    def checks_equal(self) -> bool:
        r = self._call({"op": "check"})
        return bool(r["expected"] == r["got"])

    def reset(self) -> None:
        self._call({"op": "clear"})

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self._call({"op": "close"})
        finally:
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()


class RedisSystems:
    """The broker and the floor: one writer and one reader process hosting both."""

    def __init__(self, url: str, prefix: str, w: LargeWorkload, systems: list[str]):
        self.writer = ProcessActor("writer", url, prefix, w, systems)
        self.reader = ProcessActor("reader", url, prefix, w, systems)
        self.writer.ready()
        self.reader.ready()
        self.expected = self.writer.call("expected")
        self.stacked = bool(self.reader.call("reads_stacked"))

    def close(self) -> None:
        for actor in (self.reader, self.writer):
            actor.close()


def measure_one(url: str, prefix: str, w: LargeWorkload, systems: list[str], tq_python: str | None,
                repeat: int, warmup: int) -> dict[str, Any]:
    """Every system on one batch: passes interleaved; best, median and first put; memory; checksums."""
    payload = w.payload_bytes()
    redis_systems = [s for s in systems if s in REDIS_SYSTEMS]
    record: dict[str, dict[str, Any]] = {s: {"checks_equal": True} for s in systems}
    hosts: RedisSystems | None = None
    tq: TQSystem | None = None
    out: dict[str, Any] = {"variant": w.label(), "batch": w.batch, "fields": w.fields, "seq_len": w.seq_len,
                           "payload_bytes": payload, "systems": {}}
    try:
        if redis_systems:
            hosts = RedisSystems(url, prefix, w, redis_systems)
            out["stacked_reads"] = hosts.stacked
        if "transferqueue" in systems and tq_python:
            tq = TQSystem(tq_python, w)
            out["transferqueue_version"] = tq.version
        with admin(url) as client:
            for i in range(warmup + repeat):
                order = systems[i % len(systems):] + systems[: i % len(systems)]
                for s in order:
                    got = _pass(s, hosts, tq, client)
                    put_s, get_s = got["put"], got["get"]
                    r = record[s]
                    if i == 0:
                        r["first_put"] = put_s
                    if i >= warmup:
                        for key, value in got.items():
                            if key != "ok":
                                r.setdefault(key, []).append(value)
                    r["checks_equal"] = r["checks_equal"] and got["ok"]
                    label = f"warm-up {i + 1}" if i < warmup else f"pass {i + 1 - warmup}"
                    _say(f"large {w.label()} {w.batch} rows, {label}: {s} put {put_s:.3f} s, get {get_s:.3f} s")
    finally:
        if hosts is not None:
            hosts.close()
        if tq is not None:
            tq.close()
    for s, r in record.items():
        if not r.get("put"):
            continue
        best_put, best_get = min(r["put"]), min(r["get"])
        out["systems"][s] = {
            "first_put_seconds": r["first_put"], "put_seconds": best_put, "get_seconds": best_get,
            "median_put_seconds": statistics.median(r["put"]), "median_get_seconds": statistics.median(r["get"]),
            "put_gb_per_s": payload / GIB / best_put, "get_gb_per_s": payload / GIB / best_get,
            "puts": [round(v, 4) for v in r["put"]], "gets": [round(v, 4) for v in r["get"]],
            "checks_equal": r["checks_equal"],
        }
        # CPU seconds (medians): what a loaded machine's wall times hide, the work each side did.
        for key in ("client_cpu_put", "server_cpu_put", "client_cpu_get", "server_cpu_get"):
            if r.get(key):
                out["systems"][s][f"{key}_seconds"] = statistics.median(r[key])
        if r.get("memory"):
            out["systems"][s]["memory_per_payload_byte"] = statistics.median(r["memory"]) / payload
    out["ratios"] = ratios(out["systems"])
    return out


def _pass(system: str, hosts: RedisSystems | None, tq: TQSystem | None, client: Client) -> dict[str, Any]:
    """One system's pass: put and get seconds, checksums equal; for the Redis systems also the writer's and
    reader's CPU seconds, the server's CPU seconds in each call and ``used_memory`` of the stored batch."""
    if system == "transferqueue":
        assert tq is not None
        tq.reset()
        out = {"put": tq.put(), "get": tq.get(), "ok": tq.checks_equal()}
        tq.reset()
        return out
    assert hosts is not None
    hosts.writer.call("reset", system)
    time.sleep(0.2)  # let a lazy free of the last pass's values finish before the baseline
    before, cpu0 = used_memory(client), server_cpu(client)
    began = time.perf_counter()
    client_put = hosts.writer.call("put", system)
    put_s = time.perf_counter() - began
    cpu1 = server_cpu(client)
    time.sleep(0.2)  # let the server release the big query buffers of the put
    stored = used_memory(client) - before
    cpu2 = server_cpu(client)
    began = time.perf_counter()
    client_get = hosts.reader.call("get", system)
    get_s = time.perf_counter() - began
    cpu3 = server_cpu(client)
    ok = hosts.reader.call("got") == hosts.expected
    hosts.writer.call("reset", system)
    hosts.reader.call("forget")
    return {"put": put_s, "get": get_s, "ok": ok, "memory": stored, "client_cpu_put": client_put,
            "server_cpu_put": cpu1 - cpu0, "client_cpu_get": client_get, "server_cpu_get": cpu3 - cpu2}


def ratios(systems: dict[str, Any]) -> dict[str, float]:
    """The issue's ratios, on best times: broker put over each floor's (one and two connections), TransferQueue's
    get over the broker's."""
    out: dict[str, float] = {}
    b, f, t = systems.get("broker"), systems.get("redis-floor"), systems.get("transferqueue")
    f2 = systems.get("redis-floor-2conn")
    if b and f:
        out["broker_put_over_floor"] = b["put_seconds"] / f["put_seconds"]
        out["broker_get_over_floor"] = b["get_seconds"] / f["get_seconds"]
    if b and f2:  # the broker's put uses two connections too (PUT_LANES): the floor it is held to
        out["broker_put_over_floor_2conn"] = b["put_seconds"] / f2["put_seconds"]
        out["broker_get_over_floor_2conn"] = b["get_seconds"] / f2["get_seconds"]
    if b and t:
        out["tq_get_over_broker"] = t["get_seconds"] / b["get_seconds"]
        out["broker_put_over_tq"] = b["put_seconds"] / t["put_seconds"]
    if f and t:
        out["floor_put_over_tq"] = f["put_seconds"] / t["put_seconds"]
    return out


def run_large(url: str, prefix: str, base: LargeWorkload, sizes: tuple[int, ...], systems: tuple[str, ...],
              tq_python_requested: str | None, repeat: int, warmup: int) -> dict[str, Any]:
    """The large mode's report: the server, then one entry per variant and size."""
    chosen = list(systems)
    tq_python = None
    if "transferqueue" in chosen:
        tq_python, why = tq_interpreter(tq_python_requested)
        if tq_python is None:
            _say(why)
            chosen.remove("transferqueue")
    with admin(url) as client:
        if is_cluster(client):
            raise ValueError("--large measures one redis-server: the raw floor does not follow cluster redirects")
        server = server_facts(client)
    _say(f"large: Redis {server['version']} ({server['allocator']}, io-threads {server.get('io_threads', '?')}); "
         f"{', '.join(chosen)}; sizes {', '.join(map(str, sizes))}; {'plain and complex' if base.complex else 'plain'}")
    variants = [False, True] if base.complex else [False]
    runs = []
    for complex_ in variants:
        for batch in sizes:
            w = LargeWorkload(batch=batch, fields=base.fields, seq_len=base.seq_len, complex=complex_, seed=base.seed)
            runs.append(measure_one(url, prefix, w, chosen, tq_python, repeat, warmup))
    return {"server": server, "systems": chosen, "repeat": repeat, "warmup": warmup, "batch": base.batch,
            "runs": runs, "checks_equal": all(s["checks_equal"] for r in runs for s in r["systems"].values())}
