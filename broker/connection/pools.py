"""The connection pools of the clients opened here, both handing out bounded connections (sockets.py) and both
waiting for a free one until the call's deadline: a URL's (``_RetryingPool``, its hand-out retried) and each
cluster node's (``_BoundedPool``)."""

from __future__ import annotations

import threading
from typing import Any

import redis

from broker.connection.deadlines import _expired, _passed, time_left
from broker.connection.sockets import _BOUNDED

#: Connections one pool opens at most (a URL's, or each node's of a cluster client), and how long a call
#: waits for a free one. The pool blocks rather than failing with "Too many connections": a hundred
#: threads may share one dock, and each holds a connection only for the round trip of its call.
POOL_SIZE = 100
POOL_WAIT_SECONDS = 30.0


class _WaitingPool(redis.BlockingConnectionPool):
    """A pool of bounded connections (see ``_Bounded``) whose hand-out waits for a free one, up to the
    pool's wait or the call's deadline, whichever comes first, and then says which ran out."""

    def __init__(self, connection_class: type[Any] = redis.Connection, **kwargs: Any):
        self._releasing = threading.Lock()
        super().__init__(  # type: ignore[no-untyped-call]
            connection_class=_BOUNDED.get(connection_class, connection_class), **kwargs
        )

    def release(self, connection: Any) -> None:
        # A connection released twice would be queued twice, and two threads would then share it: one's
        # disconnect cut the other's socket mid-call (TypeError from select). redis-py's cluster pipeline
        # releases again what it released already when re-reading the slot map fails (connections cut in a
        # storm of CLIENT KILLs); a plain ConnectionPool ignores a second release, and so does this one.
        with self._releasing:
            with self.pool.mutex:
                if connection in self.pool.queue:  # in C: the queue holds max_connections places (None if free)
                    return
            super().release(connection)  # type: ignore[no-untyped-call]

    # BlockingConnectionPool waits ``self.timeout`` for a free connection: the pool's own wait, or the
    # time left of the calling thread's call if that is shorter.
    @property
    def timeout(self) -> float | None:
        left = time_left()
        if left is None:
            return self._wait_seconds
        left = max(0.0, left)
        return left if self._wait_seconds is None else min(self._wait_seconds, left)

    @timeout.setter
    def timeout(self, seconds: float | None) -> None:
        self._wait_seconds = seconds

    def _waited_for(self, *args: Any, **kwargs: Any) -> Any:
        """A connection, or the error saying whether the call's deadline or the pool's wait ran out."""
        try:
            return super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        except redis.ConnectionError as exc:
            if str(exc) == "No connection available.":  # BlockingConnectionPool's wait ran out
                if _expired():
                    raise _passed("waiting for a free connection of the pool") from None
                raise _PoolExhausted(
                    f"all {self.max_connections} connections of the pool stayed busy for {self._wait_seconds} s"
                ) from None
            raise


class _BoundedPool(_WaitingPool):
    """The pool of each node of a cluster client. redis-py gives a node a plain ConnectionPool of 100, which
    fails the 101st thread at once ("Too many connections"); this one makes it wait, as a URL's pool does.

    The cluster client gives ``connection_class`` to its nodes' pools, but from a ``rediss://`` URL
    its own parsing replaces any given class with ``SSLConnection``; the pool class it takes as it is,
    so the swap happens here, for every scheme. A hand-out is not retried here: the cluster client
    handles a node it cannot reach (it reloads the slot map and follows a failover).
    """

    def __init__(self, connection_class: type[Any] = redis.Connection, **kwargs: Any):
        kwargs.setdefault("max_connections", POOL_SIZE)
        kwargs.setdefault("timeout", POOL_WAIT_SECONDS)
        super().__init__(connection_class, **kwargs)

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        return self._waited_for(*args, **kwargs)


class _RetryingPool(_WaitingPool):
    """A URL's pool, which retries handing out a connection, as the client retries commands.

    redis-py retries a command that fails on its connection, but not the reconnect and liveness
    check done when the pool hands a connection out: a connection cut at that moment (a server
    restart, a CLIENT KILL) surfaced as an error although nothing had been sent. Since nothing has
    been sent yet, retrying there is always safe. A socket that cannot be opened at all is not tried
    again here: the reconnect has already retried it (see ``_ReconnectRetry``), and a pool that had
    no free connection for ``POOL_WAIT_SECONDS`` is reported at once.
    """

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        # The pool has already released the failed connection; nothing more to undo between tries.
        return self.connection_kwargs["retry"].call_with_retry(
            lambda: self._waited_for(*args, **kwargs), lambda _error: None,
            lambda error: not isinstance(error, _PoolExhausted)
        )


class _PoolExhausted(redis.ConnectionError):
    """No connection of a pool came free in time (not worth retrying: it already waited)."""
