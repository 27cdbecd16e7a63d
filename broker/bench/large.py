"""``broker bench --large``: the writer and reader sides of each system, and the processes they run in.

As TransferQueue's perftest does, a writer process holds the batch and puts it, a reader process gets
all of it, and the driver times each call from the outside (``large_run.py``). The writer and the
reader here each host every Redis system of the run, so the batch is built once per process:

``broker``       ``TransferDock.put_experience`` of the whole batch (stacked tensors, rows 0..batch-1),
                 ``read_rows`` of every column (``stack=True`` when this broker's ``read_rows`` takes it)
``redis-floor``  the same bytes raw: one HSET per column (field = row) framed by hand around views of
                 the arrays and sent with ``sendmsg``, all pipelined; one HMGET per column back, each
                 regular row received straight into one stacked tensor (``resp.py``)
``redis-floor-2conn``  the same over two connections at once (the broker's put uses two, PUT_LANES): the
                 columns dealt between them, each connection's commands pipelined in a thread of its own

TransferQueue runs in a child interpreter of its own (``large_tq.py``).
"""

from __future__ import annotations

import gc
import inspect
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import torch

from broker.bench.large_workload import RAGGED, REGULAR, LargeWorkload, as_bytes, checksum, make_batch
from broker.bench.resp import RespConnection, Value, command_parts

T = TypeVar("T")
R = TypeVar("R")

#: Consumers of the broker's dock; the large mode reads with read_rows, which involves none.
CONSUMERS = ["reader"]


def _broker_dock(url: str, name: str, w: LargeWorkload) -> Any:
    from broker.api.dock import TransferDock
    from broker.bench.docks import dock_target

    return TransferDock(dock_target(url), name, prompts_num=w.batch, n_samples_per_prompt=1,
                        columns=w.names(), consumers=CONSUMERS)


def reads_stacked(dock: Any) -> bool:
    """Whether this broker's ``read_rows`` can return one stacked tensor per column (``stack=True``)."""
    return "stack" in inspect.signature(dock.read_rows).parameters


#: The raw floors and how many connections each spreads its columns over.
FLOORS = {"redis-floor": 1, "redis-floor-2conn": 2}


def floor_key(prefix: str, column: str, system: str = "redis-floor") -> str:
    return f"bench:{{{prefix}-large-{system.replace('redis-', '')}}}:{column}"


def _floor_connections(url: str, systems: list[str]) -> dict[str, list[RespConnection]]:
    """Each raw floor of ``systems`` and its connections."""
    return {s: [RespConnection(url) for _ in range(FLOORS[s])] for s in systems if s in FLOORS}


@contextmanager
def _collector_paused() -> Iterator[None]:
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _dealt(items: list[T], ways: int) -> list[list[T]]:
    """``items`` dealt round-robin into ``ways`` lists (a floor's columns between its connections)."""
    return [items[i::ways] for i in range(ways)]


def _at_once(calls: list[Callable[[], R]]) -> list[R]:
    """Run ``calls`` at once, the first in this thread and each other in a thread of its own (a socket call
    lets go of the GIL); their results in order, or the first error raised."""
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # raised in the caller's thread below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(1, len(calls))]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


class Writer:
    """The writer process: the batch, a dock, and a raw connection; puts on command."""

    def __init__(self, url: str, prefix: str, w: LargeWorkload, systems: list[str]):
        self.w, self.prefix, self.systems = w, prefix, systems
        self.batch = make_batch(w)
        self.fields = [b"%d" % r for r in range(w.batch)]
        self.dock = _broker_dock(url, f"{prefix}-large-broker", w) if "broker" in systems else None
        if self.dock is not None:
            self.dock.clear()  # a dock left by an interrupted run of the same name
        self.floors = _floor_connections(url, systems)

    def expected(self) -> dict[str, int]:
        return checksum(self.batch, self.w.names())

    def put(self, system: str) -> float:
        """Put the batch; this process's CPU seconds in it."""
        began = time.process_time()
        if system == "broker":
            assert self.dock is not None
            self.dock.put_experience(self.batch, indexes=list(range(self.w.batch)))
        else:
            conns = self.floors[system]
            # The collector paused as the broker's put pauses it (data/collector.py): the floor is the wire's
            # cost, not that of a full pass its one view per row would otherwise bring on every other put.
            with _collector_paused():
                _at_once([partial(self._floor_put, system, c, names)
                          for c, names in zip(conns, _dealt(self.w.names(), len(conns)))])
        return time.process_time() - began

    def _floor_put(self, system: str, raw: RespConnection, names: list[str]) -> None:
        """Columns ``names`` on connection ``raw``: one HSET each, all in one pipeline."""
        parts: list[Value] = []
        for name in names:
            values = self.batch[name]
            args: list[Value] = [b"HSET", floor_key(self.prefix, name, system).encode()]
            for field, row in zip(self.fields, values):
                args += [field, row.encode() if isinstance(row, str) else as_bytes(row)]
            parts += command_parts(args)
        raw.send(parts)
        for _ in names:
            raw.reply()

    def reset(self, system: str) -> None:
        """Forget the batch in ``system`` (untimed, between passes): a cleared dock, deleted hashes."""
        if system == "broker":
            assert self.dock is not None
            self.dock.clear()
        elif system in self.floors:
            self.floors[system][0].call([b"DEL", *(floor_key(self.prefix, n, system).encode() for n in self.w.names())])

    def close(self) -> None:
        if self.dock is not None:
            from broker.bench.broker_dock import delete_dock

            delete_dock(self.dock)
        for system, conns in self.floors.items():
            self.reset(system)
            for conn in conns:
                conn.close()


class Reader:
    """The reader process: gets every row of every column on command, keeps what it got for ``got``."""

    def __init__(self, url: str, prefix: str, w: LargeWorkload, systems: list[str]):
        self.w, self.prefix = w, prefix
        self.rows = list(range(w.batch))
        self.fields = [b"%d" % r for r in self.rows]
        self.dock = _broker_dock(url, f"{prefix}-large-broker", w) if "broker" in systems else None
        self.stacked = self.dock is not None and reads_stacked(self.dock)
        self.floors = _floor_connections(url, systems)
        self.last: dict[str, Any] = {}

    def get(self, system: str) -> float:
        """Get every row of every column; this process's CPU seconds in it."""
        self.last = {}  # the previous pass's arrays go before this one's arrive
        began = time.process_time()
        if system == "broker":
            assert self.dock is not None
            kwargs = {"stack": True} if self.stacked else {}
            self.last = self.dock.read_rows(self.w.names(), self.rows, **kwargs)
        else:
            conns = self.floors[system]
            got = _at_once([partial(self._floor_get, system, c, cols)
                            for c, cols in zip(conns, _dealt(self.w.columns(), len(conns)))])
            columns = {name: value for part in got for name, value in part.items()}
            self.last = {name: columns[name] for name in self.w.names()}
        return time.process_time() - began

    def _floor_get(self, system: str, raw: RespConnection, columns: list[tuple[str, str]]) -> dict[str, Any]:
        """Columns ``columns`` on connection ``raw``: one HMGET each, all in one pipeline."""
        parts: list[Value] = []
        for name, _ in columns:
            parts += command_parts([b"HMGET", floor_key(self.prefix, name, system).encode(), *self.fields])
        raw.send(parts)
        out: dict[str, Any] = {}
        for name, kind in columns:
            if kind == REGULAR:  # rows land in one stacked tensor, allocated once
                dest = torch.empty(self.w.batch, self.w.seq_len, dtype=torch.float32)
                raw.reply(_rows_of(as_bytes(dest), self.w.seq_len * 4))
                out[name] = dest
            elif kind == RAGGED:
                out[name] = [torch.frombuffer(b, dtype=torch.float32) if b else torch.empty(0)
                             for b in raw.reply()]
            else:
                out[name] = [b.decode() for b in raw.reply()]
        return out

    def reads_stacked(self) -> bool:
        return self.stacked

    def forget(self) -> None:
        """Drop the last get's arrays (between passes, so two batches are never held at once)."""
        self.last = {}

    def got(self) -> dict[str, int]:
        """Checksums of the last get's columns (untimed)."""
        return checksum(self.last, self.w.names())

    def close(self) -> None:
        if self.dock is not None:
            self.dock.close()
        for conns in self.floors.values():
            for conn in conns:
                conn.close()


def _rows_of(stacked: memoryview, width: int) -> Callable[[int, int], memoryview | None]:
    """Where bulk i of an HMGET goes: row i of the stacked tensor (a row of another size gets its own buffer,
    and then fails the checksum)."""
    return lambda i, size: stacked[i * width : (i + 1) * width] if size == width else None


ROLES = {"writer": Writer, "reader": Reader}


def _serve(conn: Connection, role: str, args: tuple[Any, ...]) -> None:
    """A process's loop: build the role, then run ``(method, args)`` calls until ``close``."""
    try:
        obj = ROLES[role](*args)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        method, call_args = conn.recv()
        try:
            conn.send(("ok", getattr(obj, method)(*call_args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
        if method == "close":
            return


class ProcessActor:
    """A role in a process of its own; ``call`` runs a method and waits.

    The process is forked from the benchmark's forkserver (``concurrent.context``), as the other modes'
    processes are: it inherits none of the driver's state, only the server's imports, so a sweep's
    writer and reader for each size cost a fork each, not a torch import (seconds on a small machine)."""

    def __init__(self, role: str, *args: Any):
        from broker.bench.concurrent import context

        self.role = role
        ctx = context()
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, role, args), daemon=True, name=f"bench-large-{role}")
        self.proc.start()
        child.close()

    def ready(self) -> None:
        self._result()

    def call(self, method: str, *args: Any) -> Any:
        self._conn.send((method, args))
        return self._result()

    def _result(self) -> Any:
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"the large mode's {self.role} failed:\n{value}")
        return value

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("close")
        finally:
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join()
