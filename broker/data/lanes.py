"""The slices of a large put on one slot (data/slices.py), sent over ``PUT_LANES`` connections at once.

``SlotStore`` sends a put's first slice alone (its quota check covers the whole put, so a refused put writes
nothing) and hands the others here: each lane is a thread with a connection of its own, sending its slices
back to back, each one MULTI ... EXEC of the bar, lua/put.lua and the HSETs (``SlotStore._queue``). Slices hold
disjoint rows, so their order between lanes does not matter. On connections opened by broker.connection a
lane goes through ``exchange``: each slice is framed as it is sent and its replies read as the next one
travels, so the bytes flow from the first slice on and the server makes one slice while the next arrives
(one pipeline per lane framed every slice before the first byte went out, and read every reply after the
last). A lane cut short (its connection lost) is sent again whole by ``exchange``'s retry: the slices that
landed find their kept replies (lua/put.lua) and write nothing twice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, overload

import redis
from redis.client import Pipeline

from broker.connection import Client
from broker.connection.deadlines import in_thread
from broker.connection.replies import RespReader, exchange
from broker.control.scripts import DockScripts, resent_once, scripts_lost
from broker.data.requests import PutRequest
from broker.data.slices import Outcome
from broker.errors import BrokerError

T = TypeVar("T")

#: Connections a put on one slot sends its slices over at once. The server takes a large put in faster from two
#: connections than from one, even on one thread (docs/operations.md has the figures); more gained nothing on
#: 2 cores.
PUT_LANES = 2


class Lanes:
    """The lanes of one dock's puts: ``queue`` queues one slice's commands on a pipeline (the bar, put.lua, the
    HSETs, the bar undone: ``SlotStore._queue``) and says how many; ``receives``: the client's connections were
    opened by broker.connection, on one server (then ``exchange``)."""

    def __init__(
        self, client: Client, scripts: DockScripts, name: str, queue: Callable[[Pipeline, PutRequest, str], int],
        receives: bool,
    ):
        self._client, self._scripts, self._name, self._queue, self._receives = client, scripts, name, queue, receives

    def put(
        self, parts: Sequence[PutRequest], request_ids: Sequence[str], todo: Sequence[int], outcomes: list[Outcome],
    ) -> None:
        """Slices ``todo`` of ``parts``, each as its own MULTI, over ``PUT_LANES`` connections at once; sets the
        outcome of each (its error if it did not land, else None) in ``outcomes`` as its reply comes."""
        lanes = [list(todo[first::PUT_LANES]) for first in range(min(PUT_LANES, len(todo)))]
        failures: list[BaseException] = []

        def lane(mine: list[int]) -> Callable[[], None]:
            def run() -> None:
                try:
                    self._lane(parts, request_ids, mine, outcomes)
                except BaseException as exc:  # raised in the caller's thread below
                    failures.append(exc)
            return run

        others = [threading.Thread(target=in_thread(lane(mine)), daemon=True) for mine in lanes[1:]]
        for thread in others:
            thread.start()
        try:
            self._lane(parts, request_ids, lanes[0], outcomes)
        finally:
            for thread in others:
                thread.join()  # each bounded by the call's deadline, as this thread is
        if failures:
            raise failures[0]

    def _lane(
        self, parts: Sequence[PutRequest], request_ids: Sequence[str], todo: list[int],
        outcomes: list[Outcome],
    ) -> None:
        """The slices ``todo`` back to back on one connection, each one MULTI ... EXEC. A slice whose put.lua the
        server could not run (it lost the scripts since the first slice: the bar kept its bytes out) is sent
        again once the scripts are loaded, alone with the others that were not run."""
        todo = list(todo)

        def send() -> list[int]:
            """Send the slices ``todo``, set their outcomes; those whose script did not run, to send again."""
            if self._receives:
                self._exchange(parts, request_ids, todo, outcomes)
            else:
                self._pipelined(parts, request_ids, todo, outcomes)
            todo[:] = [i for i in todo if scripts_lost(outcomes[i])]  # put.lua's own error: the bar kept the bytes out
            return todo

        resent_once(send, lambda: self._scripts.load_all(self._client), lost=bool)

    def _exchange(
        self, parts: Sequence[PutRequest], request_ids: Sequence[str], todo: list[int], outcomes: list[Outcome],
    ) -> None:
        """The slices ``todo`` through ``exchange``, one unit each, framed as they go; sets their outcomes."""
        assert isinstance(self._client, redis.Redis)  # _receives
        sizes: dict[int, int] = {}

        def unit(k: int) -> list[tuple[Any, ...]]:
            i = todo[k]
            pipe = self._client.pipeline(transaction=False)
            pipe.execute_command("MULTI")
            sizes[i] = self._queue(pipe, parts[i], request_ids[i])
            pipe.execute_command("EXEC")
            return [args for args, _ in pipe.command_stack]

        def read(reader: RespReader) -> None:
            for i in todo:
                reader.advance()  # the next slice goes out as this one's replies are read
                reader.reply()  # MULTI's OK
                queued = [reader.reply() for _ in range(sizes[i])]
                outcomes[i] = self._executed(len(parts[i].encoded), queued, reader.executed())

        exchange(self._client, _Lazy(unit, len(todo)), read)

    def _pipelined(
        self, parts: Sequence[PutRequest], request_ids: Sequence[str], todo: list[int], outcomes: list[Outcome],
    ) -> None:
        """The slices ``todo`` as one pipeline of MULTI ... EXEC per slice (clients not opened here); sets their
        outcomes."""
        sizes: dict[int, int] = {}
        pipe = self._client.pipeline(transaction=False)
        for i in todo:
            pipe.execute_command("MULTI")
            sizes[i] = self._queue(pipe, parts[i], request_ids[i])
            pipe.execute_command("EXEC")
        replies = pipe.execute(raise_on_error=False)
        for i in todo:  # per slice: MULTI's OK, a QUEUED per command, EXEC's array
            size = sizes[i]
            queued, replies = replies[: size + 2], replies[size + 2 :]
            outcomes[i] = self._executed(len(parts[i].encoded), queued[1:-1], queued[-1])

    def _executed(self, columns: int, queued: list[Any], executed: Any) -> BaseException | None:
        """A slice's outcome (of ``columns`` columns) from the replies of its queued commands and of its EXEC."""
        if isinstance(executed, Exception) or not isinstance(executed, list):
            # EXECABORT names no cause: the command refused as it was queued does (OOM on a full
            # server, which the caller's translation makes a StoreFullError).
            cause = next((r for r in queued if isinstance(r, Exception)), executed)
            return cause if isinstance(cause, Exception) else BrokerError(
                f"dock {self._name!r}: a put's transaction was not run (EXEC answered {executed!r})")
        return self._scripts.outcome(executed, columns)


class _Lazy(Sequence[T]):
    """``make(k)`` for k in ``range(n)``, made each time it is asked for: the units of an ``exchange`` built as
    they are sent."""

    def __init__(self, make: Callable[[int], T], n: int):
        self._make, self._n = make, n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, k: int) -> T: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[T]: ...
    def __getitem__(self, k: int | slice) -> T | Sequence[T]:
        if isinstance(k, slice):
            return [self._make(j) for j in range(self._n)[k]]
        if not -self._n <= k < self._n:
            raise IndexError(k)
        return self._make(k % self._n)
