"""``broker bench --large``: the writer and reader sides of each system, and the processes they run in.

As TransferQueue's perftest does, a writer process holds the batch and puts it, a reader process gets
all of it, and the driver times each call from the outside (``large_run.py``). The writer and the
reader here each host every Redis system of the run, so the batch is built once per process:

``broker``       ``TransferDock.put_experience`` of the whole batch (stacked tensors, rows 0..batch-1),
                 ``read_rows`` of every column (``stack=True`` when this broker's ``read_rows`` takes it)
``redis-floor``  the same bytes raw: one HSET per column (field = row) framed by hand around views of
                 the arrays and sent with ``sendmsg``, all pipelined; one HMGET per column back, each
                 regular row received straight into one stacked tensor (``resp.py``)

TransferQueue runs in a child interpreter of its own (``large_tq.py``).
"""

from __future__ import annotations

import inspect
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from broker.bench.large_workload import RAGGED, REGULAR, LargeWorkload, as_bytes, checksum, make_batch
from broker.bench.resp import RespConnection, Value, command_parts

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


def floor_key(prefix: str, column: str) -> str:
    return f"bench:{{{prefix}-large-floor}}:{column}"


class Writer:
    """The writer process: the batch, a dock, and a raw connection; puts on command."""

    def __init__(self, url: str, prefix: str, w: LargeWorkload, systems: list[str]):
        self.w, self.prefix, self.systems = w, prefix, systems
        self.batch = make_batch(w)
        self.fields = [b"%d" % r for r in range(w.batch)]
        self.dock = _broker_dock(url, f"{prefix}-large-broker", w) if "broker" in systems else None
        if self.dock is not None:
            self.dock.clear()  # a dock left by an interrupted run of the same name
        self.raw = RespConnection(url) if "redis-floor" in systems else None

    def expected(self) -> dict[str, int]:
        return checksum(self.batch, self.w.names())

    def put(self, system: str) -> float:
        """Put the batch; this process's CPU seconds in it."""
        began = time.process_time()
        if system == "broker":
            assert self.dock is not None
            self.dock.put_experience(self.batch, indexes=list(range(self.w.batch)))
        else:
            self._floor_put()
        return time.process_time() - began

    def _floor_put(self) -> None:
        assert self.raw is not None
        parts: list[Value] = []
        for name in self.w.names():
            values = self.batch[name]
            args: list[Value] = [b"HSET", floor_key(self.prefix, name).encode()]
            for field, row in zip(self.fields, values):
                args += [field, row.encode() if isinstance(row, str) else as_bytes(row)]
            parts += command_parts(args)
        self.raw.send(parts)  # every column's HSET in one pipeline
        for _ in self.w.columns():
            self.raw.reply()

    def reset(self, system: str) -> None:
        """Forget the batch in ``system`` (untimed, between passes): a cleared dock, deleted hashes."""
        if system == "broker":
            assert self.dock is not None
            self.dock.clear()
        elif self.raw is not None:
            self.raw.call([b"DEL", *(floor_key(self.prefix, n).encode() for n in self.w.names())])

    def close(self) -> None:
        if self.dock is not None:
            from broker.bench.broker_dock import delete_dock

            delete_dock(self.dock)
        if self.raw is not None:
            self.reset("redis-floor")
            self.raw.close()


class Reader:
    """The reader process: gets every row of every column on command, keeps what it got for ``got``."""

    def __init__(self, url: str, prefix: str, w: LargeWorkload, systems: list[str]):
        self.w, self.prefix = w, prefix
        self.rows = list(range(w.batch))
        self.fields = [b"%d" % r for r in self.rows]
        self.dock = _broker_dock(url, f"{prefix}-large-broker", w) if "broker" in systems else None
        self.stacked = self.dock is not None and reads_stacked(self.dock)
        self.raw = RespConnection(url) if "redis-floor" in systems else None
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
            self.last = self._floor_get()
        return time.process_time() - began

    def _floor_get(self) -> dict[str, Any]:
        assert self.raw is not None
        parts: list[Value] = []
        for name in self.w.names():
            parts += command_parts([b"HMGET", floor_key(self.prefix, name).encode(), *self.fields])
        self.raw.send(parts)
        out: dict[str, Any] = {}
        for name, kind in self.w.columns():
            if kind == REGULAR:  # rows land in one stacked tensor, allocated once
                dest = torch.empty(self.w.batch, self.w.seq_len, dtype=torch.float32)
                self.raw.reply(_rows_of(as_bytes(dest), self.w.seq_len * 4))
                out[name] = dest
            elif kind == RAGGED:
                out[name] = [torch.frombuffer(b, dtype=torch.float32) if b else torch.empty(0)
                             for b in self.raw.reply()]
            else:
                out[name] = [b.decode() for b in self.raw.reply()]
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
        if self.raw is not None:
            self.raw.close()


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
