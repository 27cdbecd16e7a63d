"""``broker bench --tq-perftest``: TransferQueue's own benchmark, run through the drop-in unchanged but for the
package name, beside TransferQueue itself and the broker's native API, in one run.

The benchmark is ``scripts/performance_test/perftest.py`` of the ``transferqueue`` wheel: a writer and a
reader Ray actor, each calling ``tq.init``; the writer ``kv_batch_put``s a TensorDict of ``--fields`` float32
columns of ``--batch`` x ``--seq-len`` (its ``--use_complex_case``: a third ragged, a third strings), the
reader ``kv_list``s and ``kv_batch_get``s all of it, the writer ``kv_clear``s it; put and get are timed by
perftest around ``ray.get`` in its driver. Per variant (plain; complex with ``--complex``):

``transferqueue``  the wheel's perftest as it is (SimpleStorage, the wheel's ``config.yaml``), in the
                   interpreter of ``--tq-python`` (default: this one)
``drop-in``        a copy of it whose only edit is ``import transfer_queue as tq`` ->
                   ``import broker.transfer_queue as tq`` (``renamed``), with the same ``config.yaml``, in
                   this interpreter: the drop-in finds no Redis URL, so the writer's ``init`` starts its
                   embedded redis-server and the reader attaches to it, as a user's run would
``broker``         the broker's native API in perftest itself: a copy whose only edit makes ``tq`` the module
                   ``broker.bench.tq_native`` (``put_experience`` / ``read_rows(..., stack=True)`` / ``clear``
                   on the benchmark's Redis, the same conversion of the TensorDict into columns), so that
                   it runs in the same actors, on the same batch, timed the same way as the drop-in: the
                   difference is the adapter's (in a Ray actor the same put took 1.5 times what it takes in
                   a plain process, so a baseline measured elsewhere said more of Ray than of the adapter)

Each perftest run makes ``--warmup`` + ``--repeat`` iterations (perftest's ``--num_test_iterations``); the
first ``--warmup`` are not counted. perftest's own CSV gives the times. Every perftest run is hosted by
``tq_perftest_launch.py``, which starts Ray with enough CPUs for TransferQueue's actors and reads, at
perftest's "Starting ..." log lines (outside its timings), the CPU seconds of the run's actors and, for
the broker's runs, the server's ``used_memory`` and CPU seconds: a loaded machine moves the wall times,
not the work. Memory per payload byte with the batch stored is the reading after the put (perftest sleeps
2 s after it) less the one before, over the batch's bytes.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from broker.bench import tq_native
from broker.bench.large_run import server_facts
from broker.bench.large_workload import GIB, LargeWorkload
from broker.bench.servers import admin, is_cluster

#: The systems of the mode, in the order they run within a variant.
PERFTEST_SYSTEMS = ("transferqueue", "drop-in", "broker")

#: Where the benchmark is inside the wheel's site-packages, and the conf it is run with.
PERFTEST = Path("scripts/performance_test/perftest.py")
CONFIG = Path("transfer_queue/config.yaml")

#: The only edits that make a TransferQueue script use the broker: the package name in its imports (the
#: same edits as tests/adapters/test_tq_tutorials.py makes to the tutorials).
EDITS = [
    (re.compile(r"^import transfer_queue as tq\b", re.M), "import broker.transfer_queue as tq"),
    (re.compile(r"^import transfer_queue$", re.M), "import broker.transfer_queue as transfer_queue"),
    (re.compile(r"^(\s*)from transfer_queue(\.[\w.]+)? import", re.M), r"\1from broker.transfer_queue\2 import"),
]

#: perftest's writer and reader actors' class.
CALLER = "TQClientActor"

#: Seconds perftest sleeps per iteration (2 s after the put, the list and the get; 10 s after each).
SLEEPS_PER_ITERATION = 16


def _say(text: str) -> None:
    print(f"broker bench: {text}", file=sys.stderr, flush=True)


def renamed(text: str) -> str:
    """A TransferQueue script's text with ``transfer_queue`` imports made ``broker.transfer_queue`` ones."""
    for pattern, repl in EDITS:
        text = pattern.sub(repl, text)
    return text


def on_native_api(text: str) -> str:
    """perftest's text with ``tq`` the module of its calls on the native API (``broker.bench.tq_native``)."""
    out = re.sub(r"^import transfer_queue as tq\b", "import broker.bench.tq_native as tq", text, flags=re.M)
    if out == text:
        raise ValueError("perftest.py no longer says `import transfer_queue as tq`: cannot run it on the native API")
    return out


def find_wheel(python: str) -> tuple[Path | None, str]:
    """The site-packages folder holding the wheel's perftest and conf, as ``python`` imports it, or None and
    why not."""
    probe = subprocess.run(
        [python, "-c", "import pathlib, transfer_queue, ray, tensordict, omegaconf; "
                       "print(pathlib.Path(transfer_queue.__file__).resolve().parent.parent)"],
        capture_output=True, text=True)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return None, (f"{python} cannot import transfer_queue ({last}): skipping --tq-perftest, which runs the "
                      "wheel's own perftest.py (pip install 'redis-transfer-dock[tq]', or --tq-python PATH)")
    site = Path(probe.stdout.strip().splitlines()[-1])
    missing = [str(site / p) for p in (PERFTEST, CONFIG) if not (site / p).is_file()]
    if missing:
        return None, f"the transferqueue wheel at {site} has no {', '.join(missing)}: skipping --tq-perftest"
    return site, ""


def _broker_root() -> str:
    """The folder the ``broker`` package is in: on the path of the drop-in's Ray workers."""
    import broker

    return str(Path(broker.__file__).resolve().parent.parent)


def run_perftest(python: str, script: Path, config: Path, w: LargeWorkload, iterations: int, folder: Path,
                 measure: bool, url: str | None = None) -> dict[str, Any]:
    """One perftest run: its iterations' put and get seconds (from its CSV) and, with ``measure``, the
    server readings of ``tq_perftest_launch.py`` (of the server at ``url``, given for the native API's run;
    else of the one the drop-in started)."""
    csv_path = folder / f"{script.stem}-{w.label()}.csv"
    launcher = Path(__file__).with_name("tq_perftest_launch.py")
    cmd = [python, str(launcher), *(["--measure"] if measure else []), str(script),
           "--backend_config", str(config), "--global_batch_size", str(w.batch), "--field_num", str(w.fields),
           "--seq_len", str(w.seq_len), "--num_test_iterations", str(iterations), "--output_csv", str(csv_path),
           *(["--use_complex_case"] if w.complex else [])]
    # No REDIS_URL: the drop-in starts its embedded server; no RAY_ADDRESS: the launcher starts a Ray of its own.
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RAY_ADDRESS")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_UV_RUN_RUNTIME_ENV="0", BROKER_TQ_DIR=str(folder))
    if url is not None:
        env[tq_native.URL_ENV] = url  # Ray's workers inherit it: the launcher starts Ray
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_broker_root(), env.get("PYTHONPATH", "")) if p)
    # perftest sleeps 16 s per iteration; Ray starts in seconds; a GiB moves in well under a minute here.
    timeout = 180 + iterations * (SLEEPS_PER_ITERATION + 60 * (1 + w.payload_bytes() / GIB))
    log_path = folder / f"{script.stem}-{w.label()}.log"
    with open(log_path, "w+") as log:
        try:
            done = subprocess.run(cmd, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                                  timeout=timeout)
            status: int | str = done.returncode
            stdout = done.stdout
        except subprocess.TimeoutExpired as exc:
            status, stdout = f"timed out after {timeout:.0f} s", (exc.stdout or b"").decode(errors="replace")
        log.seek(0)
        tail = log.read()[-4000:]
    if status != 0 or not csv_path.is_file():
        raise RuntimeError(f"{script.name} ({w.label()}) failed (exit status {status}):\n{tail}")
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    readings = [json.loads(line[len("@@perftest "):]) for line in stdout.splitlines()
                if line.startswith("@@perftest ")]
    return {"put": [float(r["put_time"]) for r in rows], "get": [float(r["get_time"]) for r in rows],
            "gb": float(rows[0]["total_data_size_gb"]) if rows else 0.0, "readings": readings}


def _server_figures(readings: list[dict[str, Any]]) -> dict[str, Any]:
    """Per iteration, from the launcher's readings: the actors' CPU seconds in put and get (by class, and
    summed) and, where the Redis server was read, memory with the batch stored and its CPU in put and get."""
    server = next((r["server"] for r in readings if "server" in r), None)
    errors = [r["error"] for r in readings if "error" in r]
    steps = [r for r in readings if "step" in r and "error" not in r]
    out: dict[str, Any] = {"server": server, "errors": errors, "memory": [], "server_cpu_put": [],
                           "server_cpu_get": [], "actor_cpu_put": [], "actor_cpu_get": [], "caller_cpu_put": [],
                           "caller_cpu_get": [], "actor_roles": {}}
    for i in range(len(steps) - 3):
        a, b, c, d = steps[i : i + 4]
        if [a["step"], b["step"], c["step"], d["step"]] != ["put", "list", "get", "delete"]:
            continue
        for label, (start, end) in (("put", (a, b)), ("get", (c, d))):
            spent = [(role, seconds - start["actors"].get(pid, (role, 0.0))[1])
                     for pid, (role, seconds) in end["actors"].items()]
            out[f"actor_cpu_{label}"].append(sum(s for _, s in spent))
            # The caller: perftest's writer in a put, its reader in a get, the busier of its two actors
            # (the other idles through the call).
            out[f"caller_cpu_{label}"].append(max((s for role, s in spent if role == CALLER), default=0.0))
            roles: dict[str, float] = {}
            for role, seconds in spent:
                roles[role] = roles.get(role, 0.0) + seconds
            for role, seconds in roles.items():
                out["actor_roles"].setdefault(f"{role} {label}", []).append(seconds)
        if "used_memory" in a:
            out["memory"].append(b["used_memory"] - a["used_memory"])
            out["server_cpu_put"].append(b["cpu"] - a["cpu"])
            out["server_cpu_get"].append(d["cpu"] - c["cpu"])
    return out


def _summary(times: dict[str, list[float]], warmup: int, payload: int) -> dict[str, Any]:
    """Best, median and first of a perftest run's iterations (the first ``warmup`` not counted)."""
    put, get = times["put"][warmup:], times["get"][warmup:]
    best_put, best_get = min(put), min(get)
    return {"first_put_seconds": times["put"][0], "put_seconds": best_put, "get_seconds": best_get,
            "median_put_seconds": statistics.median(put), "median_get_seconds": statistics.median(get),
            "put_gb_per_s": payload / GIB / best_put, "get_gb_per_s": payload / GIB / best_get,
            "puts": [round(v, 4) for v in put], "gets": [round(v, 4) for v in get]}


def ratios(systems: dict[str, Any]) -> dict[str, float]:
    """The issue's ratios on best times, each as speed (above 1: the drop-in is faster)."""
    out: dict[str, float] = {}
    d, t, b = systems.get("drop-in"), systems.get("transferqueue"), systems.get("broker")
    if d and t:
        out["dropin_get_speed_over_tq"] = t["get_seconds"] / d["get_seconds"]
        out["dropin_put_speed_over_tq"] = t["put_seconds"] / d["put_seconds"]
    if d and b:
        out["dropin_put_speed_over_native"] = b["put_seconds"] / d["put_seconds"]
        out["dropin_get_speed_over_native"] = b["get_seconds"] / d["get_seconds"]
    return out


def measure_variant(url: str, w: LargeWorkload, site: Path, tq_python: str, repeat: int,
                    warmup: int, folder: Path) -> dict[str, Any]:
    """TransferQueue's perftest, the drop-in's, then the native broker, on one batch shape."""
    payload = w.payload_bytes()
    out: dict[str, Any] = {"variant": w.label(), "batch": w.batch, "fields": w.fields, "seq_len": w.seq_len,
                           "payload_bytes": payload, "systems": {}}
    iterations = warmup + repeat
    for system, python, script, native in (("transferqueue", tq_python, folder / "perftest.py", False),
                                           ("drop-in", sys.executable, folder / "perftest_broker.py", False),
                                           ("broker", sys.executable, folder / "perftest_native.py", True)):
        _say(f"tq-perftest {w.label()}: {system}, {iterations} iterations of {script.name} "
             f"(perftest sleeps {SLEEPS_PER_ITERATION} s in each)")
        got = run_perftest(python, script, site / CONFIG, w, iterations, folder, system != "transferqueue",
                           url if native else None)
        entry = _summary(got, warmup, payload)
        entry["perftest_gb"] = got["gb"]
        figures = _server_figures(got["readings"])
        if figures["server"]:
            entry["server"] = figures["server"]
        if figures["errors"]:
            entry["reading_errors"] = figures["errors"]
        # Medians of the counted iterations (all, if the readings of some were lost).
        timed = ("server_cpu_put", "server_cpu_get", "actor_cpu_put", "actor_cpu_get", "caller_cpu_put",
                 "caller_cpu_get")
        counted = {k: figures[k][warmup:] or figures[k] for k in ("memory", *timed)}
        if counted["memory"]:
            entry["memory_per_payload_byte"] = statistics.median(counted["memory"]) / payload
        for key in timed:
            if counted[key]:
                entry[f"{key}_seconds"] = statistics.median(counted[key])
        entry["actor_cpu_seconds"] = {role: round(statistics.median(v[warmup:] or v), 4)
                                      for role, v in figures["actor_roles"].items()}
        out["systems"][system] = entry
        _say(f"tq-perftest {w.label()}: {system} put {entry['put_seconds']:.3f} s, get {entry['get_seconds']:.3f} s "
             f"(best of {repeat})")
    out["ratios"] = ratios(out["systems"])
    return out


def run_tq_perftest(url: str, base: LargeWorkload, tq_python_requested: str | None, repeat: int,
                    warmup: int) -> dict[str, Any] | None:
    """The mode's report (None, said on stderr, when the wheel is not there to give its perftest)."""
    tq_python = tq_python_requested or sys.executable
    site, why = find_wheel(tq_python)
    if site is None:
        _say(why)
        return None
    with admin(url) as client:
        if is_cluster(client):
            raise ValueError("--tq-perftest measures the native broker on one redis-server, as the drop-in's "
                             "embedded server is one")
        native_server = server_facts(client)
    folder = Path(tempfile.mkdtemp(prefix="broker-tq-perftest-"))
    try:
        original = (site / PERFTEST).read_text()
        edited = renamed(original)
        (folder / "perftest.py").write_text(original)
        (folder / "perftest_broker.py").write_text(edited)
        (folder / "perftest_native.py").write_text(on_native_api(original))
        changed = [(a, b) for a, b in zip(original.splitlines(), edited.splitlines()) if a != b]
        variants = [False, True] if base.complex else [False]
        runs = [measure_variant(url, LargeWorkload(batch=base.batch, fields=base.fields, seq_len=base.seq_len,
                                                           complex=c, seed=base.seed),
                                site, tq_python, repeat, warmup, folder) for c in variants]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {"perftest": str(site / PERFTEST), "edits": [f"{a.strip()} -> {b.strip()}" for a, b in changed],
            "tq_python": tq_python, "native_server": native_server, "repeat": repeat, "warmup": warmup,
            "runs": runs}
