"""A call's bound: the calling thread's deadline (``call_deadline``, ``extend_call``, ``waiting_call``,
``time_left``), its allowance for slow replies (``slow_reply``), and the error of a call cut by it.

A dock call runs under a deadline (``call_deadline``), kept per thread: the connections of the
clients opened here (``_Bounded``, sockets.py) bound every socket operation by the time left, and once none is
left fail with ``_DeadlinePassed``, which no retry loop repeats. A thread with no deadline (the put
listener's, a tool's) sees redis-py's behaviour unchanged. The same per-thread state carries the size of
a put that could not be checked (``sizes_unchecked``, sizes.py).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import redis

T = TypeVar("T")

#: The bound of a dock call that has no ``timeout`` of its own (``TransferDock(call_timeout=...)``),
#: retries and reconnects included. Long enough for what a healthy call may need: riding out a restart
#: (the reconnect retries span 4-7 s), following a cluster failover at Redis's default
#: ``cluster-node-timeout`` of 15 s, moving a batch of a few GB. Short enough that a server that stops
#: answering is reported within half a minute, where the 60 s socket timeout and its retries took 75 s.
DEFAULT_CALL_TIMEOUT = 30.0

#: The least time an attempt of a waiting call (``get_experience(timeout=T)``) is given, even past T:
#: the wait makes its last attempt at T, and that attempt needs a round trip to answer anything. So an
#: attempt begun in the last second of the wait may end up to a second after T. Half a second was too
#: little for a loaded client: 120 threads of one process whose waits end together, on two busy cores,
#: took longer than that to be scheduled for their last round trip, and raised BrokerTimeoutError
#: where an empty result was due.
LAST_TRY_SECONDS = 1.0

#: A deadline this close counts as passed: a socket timeout of the time left may end a hair early.
_DEADLINE_SLACK = 0.001


class _CallBounds(threading.local):
    """The calling thread's deadlines (outermost first) and its allowance for slow replies."""

    def __init__(self) -> None:
        self.deadlines: list[tuple[float, str]] = []  # (time.monotonic() deadline, the bound, for messages)
        self.allowance = 0.0
        self.unchecked: str | None = None  # the largest value of a put whose size could not be checked


_bounds = _CallBounds()


@contextlib.contextmanager
def call_deadline(seconds: float | None, *, bound: str | None = None) -> Iterator[None]:
    """Bound what the block does with Redis, retries included, to ``seconds`` from now.

    Every socket operation of a client opened here (connect, send, read, the health-check PING, the wait
    for a free pooled connection) waits at most the time left, and once none is left the call fails
    with a BrokerTimeoutError (through ``redis_errors``) that no retry loop repeats; pauses between
    retries end at the deadline too. A nested block never moves the deadline later: the earlier one
    holds (``extend_call`` is the explicit exception). ``None`` adds no bound. ``bound`` says what the
    bound is in error messages (default: the seconds). Clients passed in by the user are not bounded.
    """
    if seconds is None:
        yield
        return
    deadlines = _bounds.deadlines
    entry = (time.monotonic() + seconds, bound or f"{seconds:g} s")
    if deadlines and deadlines[-1][0] <= entry[0]:
        entry = deadlines[-1]  # the outer deadline comes first: it holds
    deadlines.append(entry)
    try:
        yield
    finally:
        deadlines.pop()


def extend_call(seconds: float, *, bound: str | None = None) -> None:
    """Give the rest of the current call, its outer ``call_deadline`` blocks included, ``seconds`` from now
    if its deadline is sooner. The one way to move a deadline later: for work that must not be cut once
    begun (the rows a script has handed out are read whole, or they would be lost). ``bound`` replaces
    what error messages call the bound."""
    until = time.monotonic() + seconds
    _bounds.deadlines[:] = [(until, bound or text) if deadline < until else (deadline, text)
                            for deadline, text in _bounds.deadlines]


def waiting_call(timeout: Any, call_timeout: float) -> contextlib.AbstractContextManager[None]:
    """The deadline of a call that waits up to ``timeout`` seconds for rows (``get_experience``).

    A finite ``timeout`` > 0 bounds the wait and every attempt (an attempt is given at least
    ``LAST_TRY_SECONDS``: the caller extends the call by that much as each begins; and a shorter
    ``timeout`` bounds the call by that much, so that its round trips before the wait are not cut).
    ``float("inf")`` sets none: the wait is unbounded by request, and each attempt still has
    ``call_timeout`` (the dock's ``_run``). Otherwise (None, 0: no wait) the whole call has
    ``call_timeout``. An invalid ``timeout`` gets ``call_timeout``; the call rejects it.
    """
    if isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        wait = float(timeout)
        if wait == math.inf:
            return contextlib.nullcontext()
        if 0 < wait < math.inf:
            if wait >= LAST_TRY_SECONDS:
                return call_deadline(wait, bound=f"{wait:g} s (get_experience's timeout)")
            return call_deadline(LAST_TRY_SECONDS, bound=f"{LAST_TRY_SECONDS:g} s (get_experience's timeout of "
                                                         f"{wait:g} s, raised to the least a round trip gets)")
    return call_deadline(call_timeout)


def in_thread(work: Callable[[], T]) -> Callable[[], T]:
    """``work``, to be run by another thread under the calling thread's bounds as they are now (its
    deadline, slow-reply allowance and unchecked size): a call that spreads its requests over threads
    stays one call, cut at one deadline."""
    deadlines, allowance, unchecked = list(_bounds.deadlines), _bounds.allowance, _bounds.unchecked

    def run() -> T:
        saved = _bounds.deadlines, _bounds.allowance, _bounds.unchecked
        _bounds.deadlines, _bounds.allowance, _bounds.unchecked = list(deadlines), allowance, unchecked
        try:
            return work()
        finally:
            _bounds.deadlines, _bounds.allowance, _bounds.unchecked = saved

    return run


def time_left() -> float | None:
    """Seconds left before the calling thread's deadline (<= 0: passed), None outside any."""
    deadlines = _bounds.deadlines
    return deadlines[-1][0] - time.monotonic() if deadlines else None


def _expired() -> bool:
    left = time_left()
    return left is not None and left <= _DEADLINE_SLACK


@contextlib.contextmanager
def slow_reply(seconds: float) -> Iterator[None]:
    """Let each reply read in the block take ``seconds`` beyond the socket timeout (the call's deadline
    still holds): for WAIT, which the server answers only after up to its own timeout."""
    saved = _bounds.allowance
    _bounds.allowance = saved + seconds
    try:
        yield
    finally:
        _bounds.allowance = saved


class _DeadlinePassed(redis.RedisError):
    """A Redis operation cut because the call's deadline passed.

    Deliberately neither a redis-py ConnectionError nor a TimeoutError: redis-py's retries, the cluster
    client's and ours go by those types, so none sends the call again. The connection it happened on
    is closed (a reply may still be due on it).
    """

    def __init__(self, bound: str, detail: str):
        super().__init__(f"no answer within the call's bound of {bound} ({detail})")
        self.bound = bound
        self.detail = detail


def _passed(detail: str) -> _DeadlinePassed:
    deadlines = _bounds.deadlines
    return _DeadlinePassed(deadlines[-1][1] if deadlines else "its deadline", detail)


def _cut_by_deadline(exc: BaseException) -> _DeadlinePassed | None:
    """The deadline that ended the call with ``exc``, if one did: a ``_DeadlinePassed`` it stems from,
    or a connection failure (a retry loop given up) once the deadline has passed."""
    seen: BaseException | None = exc
    for _ in range(8):  # causes and contexts: redis-py wraps and re-raises
        if seen is None:
            break
        if isinstance(seen, _DeadlinePassed):
            return seen
        seen = seen.__cause__ or seen.__context__
    if _expired():
        return _passed(str(exc)[:300])
    return None
