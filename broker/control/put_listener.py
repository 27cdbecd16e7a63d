"""One pub/sub subscription per dock object, shared by every thread that waits on it.

A reader that finds too few rows waits for puts: every put publishes on the dock's events channel.
Holding a subscription per waiting call cost a connection each, and a hundred waiting threads emptied
the pool (redis-py caps it at 100): waiters starved, puts queued behind them, waits overran. Here one
background thread holds the dock object's one subscription and wakes every waiter on each message;
waiters hold no connection while they wait, only while their own attempt runs.

Pub/sub delivers at most once (a reconnect can drop a message), so a waiter also re-checks every
``recheck`` seconds on its own. That bounds the cost of a lost message; it is not polling.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import redis

from broker.connection import Client

T = TypeVar("T")

#: How often the listener looks up from its socket to notice close() and idleness.
_TICK_SECONDS = 0.2

#: Longest a waiter waits for the first subscription before it relies on its re-checks alone.
_SUBSCRIBE_WAIT_SECONDS = 2.0


class PutListener:
    """Wakes threads waiting for puts on one channel, or several (a partitioned dock's partitions: a put into
    any of them wakes its readers); see the module docstring.

    ``wait`` is the whole interface; ``close`` stops the listener thread and frees its connection.
    The thread starts on the first wait that needs it and ends after ``idle_seconds`` with no waiter.
    """

    def __init__(self, client: Client, channel: str | Sequence[str], *, idle_seconds: float = 30.0,
                 sharded: bool = False):
        self._client = client
        self._channels = (channel,) if isinstance(channel, str) else tuple(channel)
        #: Sharded pub/sub (SSUBSCRIBE, Redis 7 clusters): the puts announce with SPUBLISH.
        self._sharded = sharded
        self._idle_seconds = idle_seconds
        self._cond = threading.Condition()
        self._wakeups = 0  # messages seen, and reconnects: each is a reason to try again
        self._subscribed = False
        self._waiters = 0
        self._idle_since = time.monotonic()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._pid = os.getpid()

    def wait(self, attempt: Callable[[], T | None], timeout: float | None, recheck: float) -> T | None:
        """Run ``attempt`` until it returns a value or ``timeout`` seconds pass; the value, or None.

        ``timeout`` None or 0: one attempt. ``float("inf")``: until a value comes. Each put on the
        channel wakes every waiter to attempt again, and so does ``recheck`` seconds without one. A
        waiter never sleeps past its deadline, and makes its last attempt then. After ``close`` a
        waiter makes one last attempt and returns what it gives.
        """
        result = attempt()
        if result is not None or not timeout:
            return result
        deadline = time.monotonic() + timeout
        with self._registered(deadline):
            while True:
                # Read the wake-up count before attempting: a put landing after this read (and so
                # possibly missed by the attempt) bumps it, and the wait below returns at once.
                with self._cond:
                    seen = self._wakeups
                result = attempt()
                remaining = deadline - time.monotonic()
                if result is not None or remaining <= 0:
                    return result
                with self._cond:
                    woken = lambda seen=seen: self._wakeups != seen or self._closed  # noqa: E731
                    self._cond.wait_for(woken, min(remaining, recheck))
                    closed = self._closed
                if closed:
                    return attempt()

    def close(self) -> None:
        """Stop the listener and free its connection; idempotent."""
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5 * _TICK_SECONDS + 1)

    @contextmanager
    def _registered(self, deadline: float) -> Iterator[None]:
        """Count this waiter in, with the listener running and (within bounds) subscribed."""
        with self._cond:
            if os.getpid() != self._pid:  # a forked child inherits no thread: start afresh
                self._pid, self._thread, self._subscribed, self._waiters = os.getpid(), None, False, 0
            self._waiters += 1
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=f"put-listener {self._channels[0]}", daemon=True)
                self._thread.start()
            # Until subscribed, a put can be missed: wait for the subscription, then attempt. If it is
            # slow (server trouble), go on: the re-checks still bound every wait.
            until = min(deadline, time.monotonic() + _SUBSCRIBE_WAIT_SECONDS)
            self._cond.wait_for(lambda: self._subscribed or self._closed, max(0.0, until - time.monotonic()))
        try:
            yield
        finally:
            with self._cond:
                self._waiters -= 1
                if self._waiters == 0:
                    self._idle_since = time.monotonic()

    def _wake(self, subscribed: bool | None = None) -> None:
        with self._cond:
            self._wakeups += 1
            if subscribed is not None:
                self._subscribed = subscribed
            self._cond.notify_all()

    def _should_stop(self) -> bool:
        with self._cond:
            idle = self._waiters == 0 and time.monotonic() - self._idle_since > self._idle_seconds
            if self._closed or idle:
                self._thread, self._subscribed = None, False
                return True
            return False

    def _run(self) -> None:
        """The listener thread: hold the subscription, wake waiters on every message."""
        pubsub: Any = None
        confirmed = 0  # channels whose subscription the server confirmed
        backoff = 0.05
        try:
            while not self._should_stop():
                try:
                    if pubsub is None:
                        confirmed = 0
                        pubsub = self._client.pubsub()  # type: ignore[no-untyped-call,unused-ignore]  # untyped before redis-py 8.2
                        if self._sharded:  # on a cluster, one subscription per node of the channels
                            pubsub.ssubscribe(*self._channels)
                        else:
                            pubsub.subscribe(*self._channels)
                    if self._sharded:
                        message = pubsub.get_sharded_message(timeout=_TICK_SECONDS)
                    else:
                        message = pubsub.get_message(timeout=_TICK_SECONDS)
                    if message is not None:
                        # A (re)subscription confirms that no put from now on is missed, once every channel
                        # confirmed, and puts may have landed before it: either way the waiters try again.
                        confirmed += message["type"] in ("subscribe", "ssubscribe")
                        self._wake(subscribed=True if confirmed >= len(self._channels) else None)
                    backoff = 0.05
                except (redis.RedisError, OSError, ValueError, TypeError, AttributeError):
                    # Dropped or refused (server restart, CLIENT KILL), or the client was closed under
                    # the listener (redis-py then fails in its socket checks with TypeError or
                    # AttributeError on the torn-down connection). The waiters
                    # try again now, which reports a lasting fault to them through their own calls;
                    # the listener starts a fresh subscription after a pause.
                    _close_quietly(pubsub)
                    pubsub = None
                    self._wake(subscribed=False)
                    time.sleep(backoff)
                    backoff = min(2 * backoff, 1.0)
        finally:
            _close_quietly(pubsub)
            with self._cond:
                if self._thread is threading.current_thread():  # ended by an error, not by _should_stop
                    self._thread, self._subscribed = None, False
                self._wakeups += 1
                self._cond.notify_all()


def _close_quietly(pubsub: Any) -> None:
    if pubsub is not None:
        try:
            pubsub.close()
        except (redis.RedisError, OSError):
            pass
