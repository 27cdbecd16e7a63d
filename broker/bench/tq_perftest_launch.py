"""Host of one run of TransferQueue's ``perftest.py`` for ``broker bench --tq-perftest``: run as a script.

``python tq_perftest_launch.py [--measure] SCRIPT ARG...`` starts Ray, then runs SCRIPT (the wheel's
perftest, or its copy with the package name changed) as ``__main__`` with ARG... and
``--head_node_ip`` of this node, exactly as ``python SCRIPT ARG...`` would, except for two things
perftest cannot do itself on a small machine:

- Ray is told of at least 4 CPUs: TransferQueue's controller and each of its two storage units claim a
  whole CPU, which a 2-core machine could not place (claims are bookkeeping; every process shares
  the machine's cores). perftest starts no Ray of its own when one is running.
- perftest places its actors on ``node:<head_node_ip>``, the node's address as Ray sees it, which only
  Ray knows once it runs.

A logging handler on perftest's logger reads, at each of its "Starting ..." lines (logged before and
after each timed call, outside the timings), the CPU seconds of this run's Ray actors by class (this
process's descendants only: other Ray sessions on the machine are not counted), and with ``--measure``
(the broker's runs) ``used_memory`` and the CPU seconds of the Redis server: the one ``$BROKER_BENCH_URL``
names (the native API's run), else the one the drop-in's writer started, found as every other process of
the run finds it (the ``TransferQueueController`` actor's conf). Each
reading is printed on a line starting with ``@@perftest``. Nothing of perftest is changed or wrapped.

Only the standard library, Ray, psutil (Ray's) and (with ``--measure``) redis-py are imported here:
TransferQueue's run may use an interpreter without the broker.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import sys
from typing import Any

# Run as a script, this file's folder is sys.path[0], and its siblings would shadow the standard library
# (concurrent.py): it goes before anything else is imported.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path.pop(0)

TAG = "@@perftest "

#: perftest's log lines that open each step, and the step each reading is taken before.
MARKS = {"Starting PUT": "put", "Starting LIST_KEYS": "list", "Starting GET_DATA": "get",
         "Starting DELETE": "delete"}


#: Ray's own processes, not the run's actors.
_NOT_ACTORS = {"IDLE", "DashboardAgent", "RuntimeEnvAgent"}


def actor_cpu() -> dict[str, tuple[str, float]]:
    """``{pid: (actor class, CPU seconds so far, user + system)}`` of this process's Ray actors (Ray titles an
    actor's worker ``ray::CLASS``)."""
    import psutil  # type: ignore[import-untyped]  # Ray's dependency; no stubs here

    out: dict[str, tuple[str, float]] = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            title = (proc.cmdline() or [""])[0]
            if not title.startswith("ray::"):
                continue
            role = title[5:].split(".")[0].split()[0] if title[5:].strip() else "?"
            if role in _NOT_ACTORS:
                continue
            times = proc.cpu_times()
            out[str(proc.pid)] = (role, times.user + times.system)
        except (psutil.Error, IndexError):
            continue  # a worker that ended, or whose title cannot be read
    return out


class ServerReadings(logging.Handler):
    """At each of perftest's "Starting ..." lines: the run's actors' CPU seconds and, with ``redis``, the
    drop-in's server's ``used_memory`` and CPU seconds."""

    def __init__(self, redis: bool) -> None:
        super().__init__(logging.INFO)
        self.redis = redis
        self.client: Any = None

    def _server(self) -> Any:
        if self.client is None:
            import ray
            import redis

            url = os.environ.get("BROKER_BENCH_URL")  # the native API's run (broker/bench/tq_native.py)
            if not url:  # the drop-in's: its embedded server, found as every process of the run finds it
                from_actor = ray.get_actor("TransferQueueController", namespace="transfer_queue")
                url = ray.get(from_actor.get_config.remote())["broker"]["url"]
            self.client = redis.Redis.from_url(url)
            info = self.client.info("server")
            memory = self.client.info("memory")
            _say(server={"version": info.get("redis_version"), "allocator": memory.get("mem_allocator"),
                         "executable": info.get("executable", ""), "io_threads": info.get("io_threads_active")})
        return self.client

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        step = next((s for mark, s in MARKS.items() if message.startswith(mark)), None)
        if step is None:
            return
        try:
            reading: dict[str, Any] = {"step": step, "actors": actor_cpu()}
            if self.redis:
                client = self._server()
                cpu = client.info("cpu")
                reading.update(used_memory=int(client.info("memory")["used_memory"]),
                               cpu=float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]))
            _say(**reading)
        except Exception as exc:  # noqa: BLE001 - a reading lost is reported, never a reason to stop perftest
            _say(step=step, error=f"{type(exc).__name__}: {exc}")


def _say(**fields: Any) -> None:
    print(TAG + json.dumps(fields), flush=True)


def main(argv: list[str]) -> int:
    measure = bool(argv) and argv[0] == "--measure"
    if measure:
        argv = argv[1:]
    if not argv:
        print("usage: tq_perftest_launch.py [--measure] SCRIPT ARG...", file=sys.stderr)
        return 2
    script, args = argv[0], argv[1:]
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    # A Ray of its own ("local"), never one the benchmark or another job on the machine runs.
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR)
    logging.getLogger("__main__").addHandler(ServerReadings(measure))  # perftest's logger, run as __main__
    sys.argv = [script, *args, "--head_node_ip", ray.util.get_node_ip_address()]  # type: ignore[no-untyped-call]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
