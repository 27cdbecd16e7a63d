"""Tenants: two teams on one Redis, one of them hostile. What the other sees of it.

Three ACL users are made on the server as ``broker acl`` makes them: a worker of dock ``PREFIX-normal``, a
worker of dock ``PREFIX-hostile`` and a reader (``broker exporter``'s rules). On Redis 7 the broker's function
library is loaded first (workers get FCALL, no Lua of their own). Then, in alternated rounds, the normal
tenant runs the soak (``soak.py``: client processes putting, sampling under leases, acking and clearing,
then an exact accounting) alone, and again while a hostile process works as its user can:

- long scripts: ``EVAL "while true do end"``, ``SCRIPT LOAD``, ``FUNCTION LOAD`` (refused on Redis 7;
  on Redis 6.2, whose workers are granted EVAL, a stall: 6.2 is documented as trusted tenants only, and
  this soak refuses to run there);
- oversized writes: puts of ``HOSTILE_PUT_BYTES`` through the broker into a dock with a quota of half that
  (refused whole, ``QuotaExceededError``), and raw ``HSET`` of as much into its own dock's keys (allowed:
  the bytes go into memory, bounded by ``maxmemory``), deleted again;
- garbage meta: ``"[" * 100000`` into its dock's meta for ``pause`` seconds at a time, and stray keys shaped
  like another dock's (``td:{HOSTILE~x}:meta``, which its rules allow);

with ``pause`` seconds between two misbehaviours. An exporter serving the reader's view is scraped all the
time. The report: the normal tenant's calls per second and p99 latency with and without the hostile one
(ratios of the medians over rounds), its accounting (nothing lost, repeated or corrupt), every scrape
answered (HTTP 200, ``broker_up 1``, the normal dock up), and what the hostile process's attempts met.
"""

from __future__ import annotations

import json
import secrets
import statistics
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import redis

from broker.bench.soak import Flag, SoakConfig, remove_folder, run_soak

#: Bytes of one oversized write of the hostile tenant, and its dock's quota (half of it).
HOSTILE_PUT_BYTES = 16 << 20


class Unsupported(ValueError):
    """The server cannot be shared among tenants that do not trust each other (Redis 6.2)."""


@dataclass(frozen=True)
class TenantsConfig:
    """What to run; see the module docstring."""

    clients: int = 4
    seconds: float = 10.0
    rounds: int = 2
    pause: float = 0.05
    seed: int = 0


def _as_user(url: str, user: str, password: str) -> str:
    """``url`` (the administrator's) with ``user`` and ``password`` in place of its credentials."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise Unsupported(f"the tenants soak logs its users in over TCP: redis:// or rediss://, not {parts.scheme}://")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _users(admin: redis.Redis, prefix: str, url: str) -> dict[str, str]:
    """The three users, made on the server as ``broker acl --apply`` makes them; their URLs."""
    from broker.ops.acl import reader_rules, worker_rules

    password = secrets.token_hex(8)
    rules = {f"{prefix}-normal": worker_rules(f"{prefix}-normal"),
             f"{prefix}-hostile": worker_rules(f"{prefix}-hostile"),
             f"{prefix}-reader": reader_rules()}
    for user, granted in rules.items():
        admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", *granted)
    return {user.rsplit("-", 1)[1]: _as_user(url, user, password) for user in rules}


def _hostile(url: str, dock: str, pause: float, stop: Flag, out: str) -> None:
    """The hostile tenant's process: its misbehaviours in turn until ``stop``; what each met, into ``out``."""
    import torch

    from broker import TransferDock
    from broker.ops.keys import meta_key

    met: Counter[str] = Counter()
    client = redis.Redis.from_url(url, socket_timeout=30)
    meta = meta_key(dock)
    client.delete(meta)  # its dock afresh: the last round left garbage in its meta
    quota_dock = TransferDock(url, dock, prompts_num=4, n_samples_per_prompt=1, columns=["blob"],
                              consumers=["c"], shards=0)
    quota_dock.set_quota(HOSTILE_PUT_BYTES // 2)
    columns = client.hget(meta, "columns")
    blob = torch.zeros(HOSTILE_PUT_BYTES // 4, dtype=torch.float32)

    def garbage_meta() -> None:
        # Its own dock unreadable for a while (the exporter must show it down, and only it), then mended, so
        # that its puts go on meeting the quota.
        client.hset(meta, "columns", "[" * 100_000)
        time.sleep(pause)
        client.hset(meta, "columns", columns)

    raw = b"x" * HOSTILE_PUT_BYTES
    attempts: list[tuple[str, Callable[[], Any]]] = [
        ("eval while true", lambda: client.eval("while true do end", 0)),
        ("script load", lambda: client.script_load("while true do end")),
        ("function load", lambda: client.execute_command(
            "FUNCTION", "LOAD", "#!lua name=h\nredis.register_function('h', function() while true do end end)")),
        ("put past its quota", lambda: quota_dock.put_experience({"blob": blob.reshape(1, -1)}, indexes=[0])),
        ("raw hset of its own key", lambda: (client.hset(quota_dock.keys.data("junk"), "0", raw),
                                             client.delete(quota_dock.keys.data("junk")))),
        ("garbage meta", garbage_meta),
        ("stray dock key", lambda: client.hset(f"td:{{{dock}~x}}:meta", "columns", "[" * 100_000)),
    ]
    try:
        while not stop.is_set():
            for what, attempt in attempts:
                if stop.is_set():
                    break
                try:
                    attempt()
                    met[f"{what}: done"] += 1
                except Exception as exc:  # noqa: BLE001 - what each attempt meets is the finding
                    met[f"{what}: {type(exc).__name__}"] += 1
                time.sleep(pause)
    finally:
        Path(out).write_text(json.dumps(met))
        client.close()


class _Scraper:
    """Scrapes an exporter every ``interval`` s from a thread: how many scrapes, and which failed how. The
    normal dock must read as up whenever it exists (made and deleted by each soak: a scrape may find it not
    yet seen, or gone; ``meta`` is read to tell)."""

    def __init__(self, port: int, dock: str, admin: redis.Redis, meta: str, interval: float = 0.25):
        self._url = f"http://127.0.0.1:{port}/metrics"
        self._dock, self._interval, self._admin, self._meta = dock, interval, admin, meta
        self.total = 0
        self.failed: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        while not self._stop.wait(self._interval):
            self.total += 1
            try:
                with urllib.request.urlopen(self._url, timeout=10) as reply:
                    text = reply.read().decode()
            except Exception as exc:  # noqa: BLE001 - a scrape that fails is counted, by how
                self.failed[type(exc).__name__] += 1
                continue
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for family in text_string_to_metric_families(text) for s in family.samples}
            if samples.get(("broker_up", ())) != 1:
                self.failed["broker_up 0"] += 1
            elif samples.get(("broker_dock_up", (("dock", self._dock),))) == 0 and self._admin.exists(self._meta):
                self.failed["normal dock down"] += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15)


def run_tenants(url: str, prefix: str, cfg: TenantsConfig) -> dict[str, Any]:
    """Run the rounds on the server of ``url`` (an administrator's: it makes the users, and deletes them and
    their keys after); the report, ``ok`` saying whether every check held."""
    from broker.bench.concurrent import context
    from broker.ops.acl import load_functions
    from broker.ops.exporter import serve
    from broker.ops.keys import meta_key

    admin = redis.Redis.from_url(url)
    if admin.info("cluster").get("cluster_enabled"):
        admin.close()
        raise Unsupported("the tenants soak runs on one server: its ACL users would be made on one node of the "
                          "cluster only")
    if not load_functions(admin):
        admin.close()
        raise Unsupported("the tenants soak needs Redis 7's functions: on Redis 6.2 a worker may run any Lua, "
                         "and one tenant stalls all (docs/operations.md: 6.2 is for trusted tenants only)")
    urls = _users(admin, prefix, url)
    normal, hostile = f"{prefix}-normal", f"{prefix}-hostile"
    exporter = serve(redis.Redis.from_url(urls["reader"]), where="reader", port=0, addr="127.0.0.1",
                     rescan_seconds=1.0)
    scraper = _Scraper(exporter.server_port, normal, admin, meta_key(normal))
    ctx = context()
    folder = Path(tempfile.mkdtemp(prefix="broker-tenants-"))
    soak = SoakConfig(clients=cfg.clients, seconds=cfg.seconds, leases=True, seed=cfg.seed)
    runs: dict[str, list[dict[str, Any]]] = {"alone": [], "beside a hostile tenant": []}
    met: Counter[str] = Counter()
    stop, process = Flag(ctx), None
    try:
        for r in range(cfg.rounds):
            for phase in runs:
                stop, process = Flag(ctx), None
                if phase != "alone":
                    out = folder / f"hostile-{r}.json"
                    process = ctx.Process(target=_hostile, args=(urls["hostile"], hostile, cfg.pause, stop, str(out)))
                    process.start()
                runs[phase].append(run_soak(urls["normal"], normal, soak))
                if process is not None:
                    stop.set()
                    process.join(60)
                    if out.exists():
                        met.update(json.loads(out.read_text()))
                    else:  # it failed before its first misbehaviour: this round measured nothing beside it
                        met[f"the hostile process exited with {process.exitcode} before reporting"] += 1
    finally:
        stop.set()
        if process is not None and process.is_alive():
            process.kill()
        scraper.close()
        exporter.shutdown()
        exporter.server_close()
        for key in admin.scan_iter(match=f"td:{{{prefix}-*"):
            admin.delete(key)
        for user in urls:
            admin.execute_command("ACL", "DELUSER", f"{prefix}-{user}")
        admin.close()
        remove_folder(folder)
    return _report(cfg, runs, met, scraper)


def _report(cfg: TenantsConfig, runs: dict[str, list[dict[str, Any]]], met: Counter[str],
            scraper: _Scraper) -> dict[str, Any]:
    def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "calls_per_second": statistics.median(r["ops_per_second"] for r in results),
            "p99_ms": {op: statistics.median(r["latency"][op]["p99_ms"] for r in results)
                       for op in ("get", "put", "ack", "clear") if all(op in r["latency"] for r in results)},
            "lost": sum(r["lost"] for r in results), "repeats": sum(r["repeats"] for r in results),
            "corrupt": sum(r["corrupt"] for r in results), "unknown": sum(r["unknown"] for r in results),
            "ok": all(r["ok"] for r in results),
        }

    alone, beside = (summary(v) for v in runs.values())
    ratios = {"calls_per_second": alone["calls_per_second"] / beside["calls_per_second"]}
    ratios.update({f"p99 {op}": beside["p99_ms"][op] / alone["p99_ms"][op] for op in alone["p99_ms"]
                   if op in beside["p99_ms"] and alone["p99_ms"][op] > 0})
    scrapes = {"total": scraper.total, "failed": dict(scraper.failed)}
    return {
        "config": asdict(cfg), "alone": alone, "beside_hostile": beside,
        "slowdown": ratios,  # > 1: the normal tenant was slower beside the hostile one
        "hostile_attempts": dict(sorted(met.items())), "scrapes": scrapes,
        "ok": alone["ok"] and beside["ok"] and not scraper.failed and scraper.total > 0
              and not any(k.startswith("the hostile process exited") for k in met),
    }
