"""Soak: N client processes putting and consuming on one dock for a while, then an exact accounting.

The dock has ``groups_per_client`` groups per client. The benchmark process fills every group once
(generation 0); from then on each client loops: sample one group (with a lease when ``leases``),
check its bytes, ack it, ``clear`` those rows and put the group's next generation into them. So every
client both consumes and puts, all the time, and the dock never fills up. An *item* is one
(group, generation). Clients append fixed-size records to their own log file with one ``write``
each, so a client killed with SIGKILL leaves a readable log of what it finished.

When the time is up the clients stop putting and drain the dock; then the logs must show:

* without leases: every item put was consumed exactly once (none lost, none handed out twice);
* with leases (and ``kill``: a random client SIGKILLed every ``kill_every`` seconds on average and
  replaced): every item put was consumed at least once; repeats are counted and must not exceed
  the dock's ``redelivered`` count;
* always: no corrupt bytes, no item consumed that was never put, and the dock drained.

With ``churn`` the clients only read (with leases, they ack too), and the benchmark process is a driver
that, as fast as it can, clears the whole dock or a few random groups and writes the next generation
into what it cleared: a clear lands between the sampling and the read of some calls again and again.
Items cleared before anyone read them are counted (``cleared_unread``), not failures; the checks are
that no item is read twice, none has the bytes of another, and none was never put.
"""

from __future__ import annotations

import os
import random
import signal
import struct
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from broker.api.dock import TransferDock
from broker.bench.broker_dock import delete_dock
from broker.bench.docks import dock_target
from broker.bench.sampling import percentiles

CONSUMER, COLUMN = "soak", "payload"
# kind, group, generation, latency (s), monotonic time (s)
_RECORD = struct.Struct("<BxxxIIfd")
GOT, EMPTY, PUT_BEGIN, PUT_DONE, ACK, ACK_LATE, CLEAR, CORRUPT = range(1, 9)
_OPS = {GOT: "get", EMPTY: "get_empty", PUT_DONE: "put", ACK: "ack", CLEAR: "clear"}


@dataclass(frozen=True)
class SoakConfig:
    """What to run; see the module docstring."""

    clients: int = 16
    seconds: float = 30.0
    leases: bool = False
    kill: bool = False
    lease_seconds: float = 5.0
    kill_every: float = 1.0
    churn: bool = False
    n: int = 8
    groups_per_client: int = 4
    row_ints: int = 256
    seed: int = 0

    @property
    def groups(self) -> int:
        return self.clients * self.groups_per_client


def content(cfg: SoakConfig, group: int, gen: int) -> list[torch.Tensor]:
    """The rows of item (group, gen): each names its row and generation, then a pattern of both."""
    out = []
    for row in range(group * cfg.n, (group + 1) * cfg.n):
        values = (row * 7919 + gen * 104_729 + np.arange(cfg.row_ints, dtype=np.int64)) & 0x7FFFFFFF
        values[:2] = (row, gen)
        out.append(torch.from_numpy(values.astype(np.int32)))
    return out


#: A log record as ``read_logs`` returns it: (kind, a, b, latency in s, monotonic time in s).
Record = tuple[int, int, int, float, float]


class RecordLog:
    """A process's log of fixed-size records (kind, two unsigned ints, a latency), appended with one
    ``os.write`` each: a process killed with SIGKILL leaves every record it finished, whole."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, kind: int, a: int = 0, b: int = 0, latency: float = 0.0) -> None:
        # One write per record: a SIGKILL lands between records, never inside one.
        os.write(self.fd, _RECORD.pack(kind, a, b, latency, time.monotonic()))

    def close(self) -> None:
        os.close(self.fd)


class Flag:
    """A flag processes share, read and set without a lock, so a process SIGKILLed while it looks leaves
    nothing held. A multiprocessing Event takes a lock to read, and its ``set`` waits until every process
    waiting on it has woken: one killed inside ``is_set`` or ``wait`` hung whoever set it, for ever."""

    def __init__(self, ctx: Any):
        self._value = ctx.RawValue("b", 0)

    def set(self) -> None:
        self._value.value = 1

    def is_set(self) -> bool:
        return bool(self._value.value)

    def wait(self, seconds: float) -> bool:
        """Sleep ``seconds`` or until the flag is set; whether it is."""
        end = time.monotonic() + seconds
        while not self.is_set() and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
        return self.is_set()


class Workers:
    """Worker processes in numbered slots; each incarnation of a slot logs to a file of its own.

    Slot i runs ``target(*args(i, incarnation), log_path)`` with its log at
    ``folder / f"{names[i]}-{incarnation:04d}.log"``. ``tick`` replaces a worker that died on its own (a
    bug: its exit code goes to ``crashed``) and, with ``kill_every``, SIGKILLs a random one every
    ``kill_every`` seconds on average and replaces it (counted in ``kills``).
    """

    def __init__(self, ctx: Any, folder: Path, names: Sequence[str], target: Callable[..., None],
                 args: Callable[[int, int], tuple[Any, ...]], kill_every: float | None = None, seed: int = 0):
        self.ctx, self.folder, self.names, self.target, self.args = ctx, folder, list(names), target, args
        self.procs: dict[int, Any] = {}
        self.incarnations = Counter[int]()
        self.crashed: list[int] = []
        self.kills = 0
        self._rng = random.Random(seed)
        self._kill_every = kill_every
        self._next_kill = float("inf")

    def start(self) -> None:
        for slot in range(len(self.names)):
            self._spawn(slot)
        if self._kill_every:
            self._next_kill = time.monotonic() + self._rng.expovariate(1 / self._kill_every)

    def _spawn(self, slot: int) -> None:
        incarnation = self.incarnations[slot]
        self.incarnations[slot] += 1
        log = self.folder / f"{self.names[slot]}-{incarnation:04d}.log"
        proc = self.ctx.Process(target=self.target, args=(*self.args(slot, incarnation), str(log)), daemon=True)
        proc.start()
        self.procs[slot] = proc

    def tick(self) -> None:
        for slot, p in self.procs.items():
            if p.exitcode is not None:  # died without our help: a bug, reported by the caller
                self.crashed.append(p.exitcode)
                self._spawn(slot)
        if self._kill_every and time.monotonic() >= self._next_kill:
            slot = self._rng.randrange(len(self.names))
            os.kill(self.procs[slot].pid, signal.SIGKILL)
            self.procs[slot].join()
            self.kills += 1
            self._spawn(slot)
            self._next_kill = time.monotonic() + self._rng.expovariate(1 / self._kill_every)

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for each worker to end; kill those still running."""
        for p in self.procs.values():
            p.join(timeout)
            if p.is_alive():
                p.kill()

    def kill_all(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                p.kill()


def _client(url: str, name: str, params: dict[str, Any], stop: Flag, done: Flag, log_path: str) -> None:
    torch.set_num_threads(1)
    cfg = SoakConfig(**params)
    dock = TransferDock.attach(dock_target(url), name)
    log = RecordLog(Path(log_path))
    lease = cfg.lease_seconds if cfg.leases else None
    while not done.is_set():
        t0 = time.perf_counter()
        batch, rows = dock.get_experience(CONSUMER, [COLUMN], cfg.n, timeout=0.2, lease=lease)
        latency = time.perf_counter() - t0
        if batch is None or rows is None:
            log(EMPTY, latency=latency)
            continue
        group, gen = rows[0] // cfg.n, int(batch[COLUMN][0][1])
        if not all(torch.equal(a, b) for a, b in zip(batch[COLUMN], content(cfg, group, gen))):
            log(CORRUPT, group, gen)
        log(GOT, group, gen, latency)
        if lease is not None:
            t0 = time.perf_counter()
            still_leased = dock.ack(CONSUMER, rows)
            log(ACK, group, gen, time.perf_counter() - t0)
            if still_leased < len(rows):
                # Our lease ran out and the rows went to someone else, who will recycle them.
                log(ACK_LATE, group, gen)
                continue
        if stop.is_set() or cfg.churn:  # in churn mode the driver alone clears and puts
            continue
        t0 = time.perf_counter()
        dock.clear(rows)
        log(CLEAR, group, gen, time.perf_counter() - t0)
        log(PUT_BEGIN, group, gen + 1)
        t0 = time.perf_counter()
        # The next item is a new prompt in rows this client cleared itself: a producer's put, named by a
        # plain list (the rows object would fence it: the clear ended that delivery).
        dock.put_experience({COLUMN: content(cfg, group, gen + 1)}, indexes=list(rows))
        log(PUT_DONE, group, gen + 1, time.perf_counter() - t0)


def _churn(
    dock: TransferDock, cfg: SoakConfig, log: RecordLog, rng: random.Random, gen: int, until: float
) -> tuple[int, int, int]:
    """Clear and refill until ``until``; returns (next generation, whole clears, partial clears)."""
    whole = partial = 0
    while time.monotonic() < until:
        if rng.random() < 0.5:
            dock.clear()
            groups = list(range(cfg.groups))
            whole += 1
        else:
            groups = sorted(rng.sample(range(cfg.groups), rng.randint(1, max(1, cfg.groups // 4))))
            dock.clear([r for g in groups for r in range(g * cfg.n, (g + 1) * cfg.n)])
            partial += 1
        for g in groups:
            log(PUT_BEGIN, g, gen)
        rows = [r for g in groups for r in range(g * cfg.n, (g + 1) * cfg.n)]
        dock.put_experience({COLUMN: [t for g in groups for t in content(cfg, g, gen)]}, indexes=rows)
        for g in groups:
            log(PUT_DONE, g, gen)
        gen += 1
        time.sleep(rng.random() * 0.004)  # vary where the next clear lands in the readers' calls
    return gen, whole, partial


def read_logs(folder: Path, pattern: str) -> list[Record]:
    """Every record of the logs in ``folder`` matching ``pattern``, each log's in the order written."""
    records: list[Record] = []
    for path in sorted(folder.glob(pattern)):
        raw = path.read_bytes()
        usable = len(raw) - len(raw) % _RECORD.size  # a torn tail cannot happen, but costs nothing to allow
        records += [_RECORD.unpack_from(raw, i) for i in range(0, usable, _RECORD.size)]
    return records


def remove_folder(folder: Path) -> None:
    """Remove a run's log folder (flat: the logs only)."""
    for path in folder.iterdir():
        path.unlink()
    folder.rmdir()


def run_soak(url: str, name: str, cfg: SoakConfig) -> dict[str, Any]:
    """Run the soak and return its figures and accounting; ``ok`` says whether every check passed."""
    from broker.bench.concurrent import context

    if cfg.kill and not cfg.leases:
        raise ValueError("killing clients needs leases: without them a killed client's rows are lost by design")
    if cfg.kill and cfg.churn:
        raise ValueError("churn and kill are separate soaks: a killed reader's redone rows would count as repeats")
    dock = TransferDock(dock_target(url), name, prompts_num=cfg.groups, n_samples_per_prompt=cfg.n, columns=[COLUMN],
                        consumers=[CONSUMER])
    folder = Path(tempfile.mkdtemp(prefix="broker-soak-"))
    ctx = context()
    stop, done = Flag(ctx), Flag(ctx)
    rng = random.Random(cfg.seed)
    params = asdict(cfg)
    workers = Workers(ctx, folder, [f"client{slot:03d}" for slot in range(cfg.clients)], _client,
                      lambda slot, incarnation: (url, name, params, stop, done),
                      kill_every=cfg.kill_every if cfg.kill else None, seed=cfg.seed)
    try:
        dock.clear()
        fill = RecordLog(folder / "driver.log")  # the fill, and in churn mode every put of the driver
        for g in range(cfg.groups):
            fill(PUT_BEGIN, g, 0)
            dock.put_experience({COLUMN: content(cfg, g, 0)}, indexes=list(range(g * cfg.n, (g + 1) * cfg.n)))
            fill(PUT_DONE, g, 0)
        workers.start()
        start = time.monotonic()
        end = start + cfg.seconds
        churn = {"generations": 0, "whole_clears": 0, "partial_clears": 0}
        gen = 1
        while (now := time.monotonic()) < end:
            if cfg.churn:
                gen, whole, partial = _churn(dock, cfg, fill, rng, gen, min(end, now + 0.05))
                churn["whole_clears"] += whole
                churn["partial_clears"] += partial
                churn["generations"] = gen - 1
            else:
                time.sleep(min(0.05, max(end - now, 0)))
            workers.tick()
        load_end = time.monotonic()
        stop.set()
        drained, drain_seconds = _drain(dock, deadline=time.monotonic() + 2 * cfg.lease_seconds + 30)
        done.set()
        workers.join(30)
        fill.close()
        final = dock.status()
    finally:
        stop.set()
        done.set()
        workers.kill_all()
        delete_dock(dock)
    result = _account(read_logs(folder, "client*.log"), read_logs(folder, "driver.log"), cfg, start, load_end, final)
    result.update(config=asdict(cfg), kills=workers.kills, crashed=workers.crashed, drained=drained,
                  drain_seconds=drain_seconds, load_seconds=load_end - start)
    if cfg.churn:
        result["churn"] = churn
    result["ok"] = result["ok"] and drained and not workers.crashed
    remove_folder(folder)
    return result


def _drain(dock: TransferDock, deadline: float) -> tuple[bool, float]:
    """Wait until every ready row was consumed and no lease is out."""
    start = time.monotonic()
    while time.monotonic() < deadline:
        status = dock.status()
        consumer = status["consumers"][CONSUMER]
        if consumer["consumed"] == status["columns"][COLUMN]["ready"] and consumer["leased"] == 0:
            return True, time.monotonic() - start
        time.sleep(0.1)
    return False, time.monotonic() - start


def _account(
    records: list[Any], driver: list[Any], cfg: SoakConfig, start: float, load_end: float, final: dict[str, Any]
) -> dict[str, Any]:
    """The checks and figures from the clients' records and the driver's (rates count the clients only)."""
    clients = records
    records = clients + driver
    put_begun = {(g, k) for kind, g, k, _, _ in records if kind == PUT_BEGIN}
    put_done = {(g, k) for kind, g, k, _, _ in records if kind == PUT_DONE}
    consumed = Counter((g, k) for kind, g, k, _, _ in records if kind == GOT)
    corrupt = sum(1 for r in records if r[0] == CORRUPT)
    lost = sorted(put_done - consumed.keys())
    unknown = sorted(consumed.keys() - put_begun)
    repeats = sum(c - 1 for c in consumed.values())
    redelivered = final["consumers"][CONSUMER]["redelivered"]
    in_load = [r for r in clients if start <= r[4] <= load_end]
    seconds = max(load_end - start, 1e-9)
    ops = {name: [r[3] for r in in_load if r[0] == kind] for kind, name in _OPS.items()}
    calls = sum(len(v) for v in ops.values())
    cleared_unread = 0
    if cfg.churn:
        # The driver clears items nobody read yet on purpose; only each group's last item, which
        # nothing cleared, must have been read.
        last: dict[int, int] = {}
        for g, k in put_done:
            last[g] = max(k, last.get(g, k))
        still_lost = [item for item in lost if last[item[0]] == item[1]]
        cleared_unread = len(lost) - len(still_lost)
        lost = still_lost
    ok = not lost and not unknown and corrupt == 0 and (repeats <= redelivered if cfg.leases else repeats == 0)
    return {
        "ok": ok,
        "items_put": len(put_done), "items_consumed": len(consumed), "lost": len(lost),
        "cleared_unread": cleared_unread, "repeats": repeats,
        "unknown": len(unknown), "corrupt": corrupt, "redelivered_rows": redelivered,
        "late_acks": sum(1 for r in records if r[0] == ACK_LATE),
        "stranded_groups": cfg.groups - final["columns"][COLUMN]["groups_ready"],
        "ops_per_second": calls / seconds,
        "items_per_second": sum(1 for r in in_load if r[0] == GOT) / seconds,
        "latency": {name: {"calls": len(v), **percentiles(v)} for name, v in ops.items() if v},
        "examples": {"lost": lost[:5], "unknown": unknown[:5]},
    }
