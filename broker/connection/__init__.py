"""Opening Redis clients from URLs, and turning redis-py errors into broker errors where they enter."""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import re
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar
from urllib.parse import quote

import redis
from redis.backoff import AbstractBackoff, EqualJitterBackoff
from redis.cluster import ClusterPipeline, NodesManager, PipelineStrategy, RedisCluster
from redis.connection import AbstractConnection
from redis.retry import Retry
from redis.utils import SENTINEL

from broker.errors import (
    BrokerConnectionError,
    BrokerError,
    BrokerTimeoutError,
    ClusterError,
    DataLostError,
    DecodeError,
    DockNotFoundError,
    ExperienceTooLargeError,
    FencedError,
    RedisCommandError,
    SchemaError,
    StoreFullError,
    VersionError,
)

T = TypeVar("T")

#: What the broker talks to: one Redis server, or a Redis Cluster (any of whose nodes a URL may name).
Client = redis.Redis | RedisCluster

#: Where tools look when no URL is given.
DEFAULT_URL = "redis://127.0.0.1:6379/0"


# -- a call's bound ------------------------------------------------------------------------------
#
# A dock call runs under a deadline (``call_deadline``), kept per thread: the connections of the
# clients opened here (``_Bounded``) bound every socket operation by the time left, and once none is
# left fail with ``_DeadlinePassed``, which no retry loop repeats. A thread with no deadline (the put
# listener's, a tool's) sees redis-py's behaviour unchanged.

#: The bound of a dock call that has no ``timeout`` of its own (``TransferDock(call_timeout=...)``),
#: retries and reconnects included. Long enough for what a healthy call may need: riding out a restart
#: (the reconnect retries span 4-7 s), following a cluster failover at Redis's default
#: ``cluster-node-timeout`` of 15 s, moving a batch of a few GB. Short enough that a server that stops
#: answering is reported within half a minute, where the 60 s socket timeout and its retries took 75 s.
DEFAULT_CALL_TIMEOUT = 30.0

#: The least time an attempt of a waiting call (``get_experience(timeout=T)``) is given, even past T:
#: the wait makes its last attempt at T, and that attempt needs a round trip to answer anything. So an
#: attempt begun in the last half second of the wait may end up to half a second after T.
LAST_TRY_SECONDS = 0.5

#: The errors of a connection cut or timed out, as the cluster client's retry loops match them: by exact type.
_CUT = (redis.ConnectionError, redis.TimeoutError)

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


class _Hopeless(redis.RedisError):
    """A connection failure that trying again cannot mend: a certificate refused, a certificate file
    missing, TLS spoken to a port that does not speak it. Like ``_DeadlinePassed`` neither a redis-py
    ConnectionError nor a TimeoutError, so no retry loop repeats it; ``redis_errors`` reports it as a
    BrokerConnectionError at once."""


class _TooLarge(redis.RedisError):
    """The server closed the connection while a command too large to check was sent (see ``sizes_unchecked``),
    and answered on a new connection: it refused the size. Like ``_Hopeless``, no retry loop repeats it;
    ``redis_errors`` reports it as an ExperienceTooLargeError."""


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


class _Bounded(AbstractConnection):
    """Mixin of the connections of clients opened here: each socket operation bounded by the call's deadline.

    Under ``call_deadline`` a connect (TLS handshake included), a send, a read (the health-check PING's
    too) waits at most the time left, and one that finds none left, or times out at the deadline,
    closes the connection and raises ``_DeadlinePassed``. Under ``slow_reply`` the socket timeout grows
    by the allowance. Under ``sizes_unchecked`` a large command whose size the server refuses is not sent
    again (see ``_refused``). Otherwise each method is redis-py's own. (redis-py's methods are untyped:
    they are called through ``Any``.)
    """

    def _op_timeout(self) -> float | None:
        """The next operation's socket timeout; None: the connection's own (no deadline, no allowance)."""
        deadlines, allowance = _bounds.deadlines, _bounds.allowance
        if not deadlines and not allowance:
            return None
        own = self._socket_timeout
        timeout = None if own is None else own + allowance
        if deadlines:
            left = deadlines[-1][0] - time.monotonic()
            if left <= _DEADLINE_SLACK:
                conn: Any = self
                conn.disconnect()  # a reply may be due on it: no later call must read it as its own
                raise _passed(f"no time left for a request to {conn._host_error()}")
            timeout = left if timeout is None else min(timeout, left)
        return timeout

    @contextlib.contextmanager
    def _cut_at_deadline(self) -> Iterator[None]:
        try:
            yield
        except _CUT as exc:
            if _expired():
                conn: Any = self
                conn.disconnect()
                raise _passed(f"{exc}") from exc
            raise

    def _connect(self) -> Any:
        base: Any = super()
        timeout = self._op_timeout()
        if timeout is None:
            return base._connect()
        # Opening the socket and a TLS handshake read these two; the parser reads the socket timeout only
        # after, so it keeps the connection's own.
        own, own_connect = self._socket_timeout, self._socket_connect_timeout
        self._socket_timeout = timeout
        self._socket_connect_timeout = timeout if own_connect is None else min(own_connect, timeout)
        try:
            sock = base._connect()
        finally:
            self._socket_timeout, self._socket_connect_timeout = own, own_connect
        sock.settimeout(own)  # as redis-py leaves it; every operation under a deadline sets its own
        return sock

    def connect_check_health(self, check_health: bool = True, retry_socket_connect: bool = True) -> None:
        base: Any = super()
        if self._op_timeout() is None:
            base.connect_check_health(check_health, retry_socket_connect)
            return
        with self._cut_at_deadline():
            base.connect_check_health(check_health, retry_socket_connect)

    #: Bytes of the last command sent, if it was one whose size could not be checked (see ``sizes_unchecked``).
    _sent_unchecked = 0

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        base: Any = super()
        conn: Any = self
        size = _unchecked_size(command)
        self._sent_unchecked = 0  # until the command itself is sent: the PING of a health check may come first
        if size:
            # A PING first, whenever it last answered: the server closing this connection while the command
            # is sent must mean it refused the command, not that it had dropped an idle connection.
            conn.next_health_check = -math.inf
        elif self._op_timeout() is None:
            base.send_packed_command(command, check_health)
            return
        with self._cut_at_deadline():  # without a deadline, it passes every error on
            # redis-py's own steps before the send (each bounded by its own operations), then the send.
            if not conn._sock:
                self.connect_check_health(check_health=False)
            if check_health:
                conn.check_health()
            sock, timeout = conn._sock, self._op_timeout()
            if timeout is not None:
                sock.settimeout(timeout)
            self._sent_unchecked = size
            try:
                base.send_packed_command(command, check_health=False)
            except redis.ConnectionError as exc:
                if size:
                    self._refused(exc)
                raise
            finally:
                if timeout is not None and conn._sock is sock:
                    sock.settimeout(self._socket_timeout)

    def read_response(self, disable_decoding: bool = False, *, timeout: Any = SENTINEL, **kwargs: Any) -> Any:
        base: Any = super()
        bound = self._op_timeout()
        if bound is not None and (timeout is SENTINEL or timeout is None or timeout > bound):
            timeout = bound  # the parser sets it on the socket for each read, then restores the own one
        try:  # what _cut_at_deadline does, inline: a pipeline reads a reply per command, on the hot path
            return base.read_response(disable_decoding, timeout=timeout, **kwargs)
        except _CUT as exc:
            if bound is not None and _expired():
                base.disconnect()
                raise _passed(f"{exc}") from exc
            if self._sent_unchecked and isinstance(exc, redis.ConnectionError):
                self._refused(exc)  # the server may close only once the command is in: its replies come first
            raise

    def _refused(self, exc: redis.ConnectionError) -> None:
        """After the connection failed while a command of unchecked size was sent, or its replies read: raise
        ``_TooLarge`` if the server answers a PING on a new connection; else return (the caller raises ``exc``).

        A server over a limit on one value (``proto-max-bulk-len``, ``client-query-buffer-limit``) closes the
        connection and goes on serving: sent again, the command would be refused again, each time only after
        all its bytes travelled. A server that is restarting, or unreachable, does not answer: the usual
        retries then go on (the command is safe to repeat). Only the socket is tried, once: no retries here.
        """
        size, self._sent_unchecked = self._sent_unchecked, 0
        conn: Any = self
        conn.disconnect()
        try:
            conn.connect_check_health(check_health=False, retry_socket_connect=False)
            conn.send_command("PING", check_health=False)
            conn.read_response()
        except redis.ResponseError:
            pass  # an answer all the same (a PING denied, say)
        except (redis.RedisError, OSError):  # not answering (or out of time): the failure was the connection's
            return
        finally:
            conn.disconnect()
        raise _TooLarge(
            f"closed the connection while a command of {size:,} bytes was sent, and answered on a new one: it "
            f"refused the size of {_bounds.unchecked}. A server closes the connection over a value longer than its "
            "proto-max-bulk-len, or a client's query buffer over its client-query-buffer-limit; the broker could not "
            "read them to check before sending (CONFIG GET is not granted to this user, or renamed). Nothing was "
            "marked ready, and the command was not sent again. Split the row, or raise the limit on the server"
        ) from exc


class _BoundedConnection(_Bounded, redis.Connection):
    """A TCP connection bounded by the call's deadline (see ``_Bounded``)."""


#: OpenSSL's reasons for a handshake answered by something that does not speak TLS.
_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE", "HTTP_REQUEST",
                      "UNKNOWN_PROTOCOL"})


class _BoundedSSLConnection(_Bounded, redis.SSLConnection):
    """A TLS connection bounded by the call's deadline (see ``_Bounded``), whose handshake is bounded by the
    connect timeout and whose hopeless failures (see ``_Hopeless``) are not retried.

    redis-py shakes hands under the socket timeout (60 s), and a plain Redis port answers a TLS hello
    with nothing (it waits for the rest of a command): each of the retries waited a minute. A refused
    certificate, or a certificate file that is not there, fails the same way every time.
    """

    def _wrap_socket_with_ssl(self, sock: socket.socket) -> Any:
        conn: Any = self
        self._check_files()
        took = conn.socket_connect_timeout  # under a deadline, no longer than the time left (see _connect)
        sock.settimeout(took)
        try:
            wrapped = super()._wrap_socket_with_ssl(sock)  # type: ignore[no-untyped-call]
        except ssl.SSLCertVerificationError as exc:
            raise _Hopeless(
                f"{self._where()} presented a certificate this client does not trust: {exc.verify_message}. "
                "Check ssl_ca_certs (the CA that signed the server's certificate) and the host name in the URL"
            ) from exc
        except TimeoutError as exc:  # the builtin: socket.timeout
            if _expired():
                raise _passed(f"TLS handshake with {self._where()}") from exc
            raise _Hopeless(
                f"{self._where()} did not complete a TLS handshake within {took} s (the connect timeout): is this "
                "port TLS? A server speaking plain Redis on it waits for the rest of a command (as a stalled one "
                "would); rediss:// needs the server's tls-port"
            ) from exc
        except ssl.SSLError as exc:
            if exc.library in ("PEM", "X509"):
                raise _Hopeless(f"the certificate files for {self._where()} could not be loaded: {exc}") from exc
            if exc.reason in _NOT_TLS:
                raise _Hopeless(f"{self._where()} did not answer in TLS ({exc.reason}): is this port TLS?") from exc
            raise
        wrapped.settimeout(conn.socket_timeout)
        return wrapped

    def _check_files(self) -> None:
        """Name a certificate file or folder that is not there (ssl only says "No such file or directory")."""
        conn: Any = self
        for setting, path in (("ssl_ca_certs", conn.ca_certs), ("ssl_ca_path", conn.ca_path),
                              ("ssl_certfile", conn.certfile), ("ssl_keyfile", conn.keyfile)):
            if isinstance(path, (str, os.PathLike)) and not os.path.exists(path):
                raise _Hopeless(f"{setting} {os.fspath(path)!r} for {self._where()}: no such file or folder")

    def _where(self) -> str:
        conn: Any = self
        return f"{conn.host}:{conn.port}"


class _BoundedUnixConnection(_Bounded, redis.UnixDomainSocketConnection):
    """A unix-socket connection bounded by the call's deadline (see ``_Bounded``)."""


#: redis-py's connection classes, and the bounded one that stands for each.
_BOUNDED: dict[type[Any], type[Any]] = {
    redis.Connection: _BoundedConnection,
    redis.SSLConnection: _BoundedSSLConnection,
    redis.UnixDomainSocketConnection: _BoundedUnixConnection,
}


class _BoundedPool(redis.ConnectionPool):
    """The pool of each node of a cluster client: its connections are bounded ones.

    The cluster client gives ``connection_class`` to its nodes' pools, but from a ``rediss://`` URL
    its own parsing replaces any given class with ``SSLConnection``; the pool class it takes as it is,
    so the swap happens here, for every scheme.
    """

    def __init__(self, connection_class: type[Any] = redis.Connection, **kwargs: Any):
        super().__init__(connection_class=_BOUNDED.get(connection_class, connection_class), **kwargs)


class _BoundedBackoff(AbstractBackoff):
    """A backoff whose pauses end at the calling thread's deadline."""

    def __init__(self, backoff: AbstractBackoff):
        self._backoff = backoff

    def reset(self) -> None:
        self._backoff.reset()

    def compute(self, failures: int) -> float:
        pause = self._backoff.compute(failures)
        left = time_left()
        return pause if left is None else max(0.0, min(pause, left))


#: Attribute set on an error that a retry loop has given up on.
_RETRIED = "_broker_retried"


class _ReconnectRetry(Retry):
    """Retries connection failures once over, and never refused credentials: those will not get better.

    redis-py nests its retries: a command's retry (or the pool's hand-out retry below) wraps a
    reconnect whose own retry wraps opening the socket. Against a dead server the attempts multiply
    (9 x 9 sockets, over a minute instead of seconds). An error that has already been through one
    retry loop is marked, and the loops around it pass it on at once. Nothing is retried once the
    call's deadline has passed (see ``call_deadline``).
    """

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[[Exception], Any] | Callable[[Exception, int], Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        def retryable(error: Exception) -> bool:
            if getattr(error, _RETRIED, False) or _expired():
                return False
            if isinstance(error, (redis.AuthenticationError, redis.exceptions.AuthorizationError)):
                return False
            return is_retryable is None or is_retryable(error)

        try:
            return super().call_with_retry(do, fail, retryable, with_failure_count)
        except Exception as error:
            setattr(error, _RETRIED, True)
            raise


#: Connections one URL's pool opens at most, and how long a call waits for a free one. The pool
#: blocks rather than failing with "Too many connections": a hundred threads may share one dock,
#: and each holds a connection only for the round trip of its call.
POOL_SIZE = 100
POOL_WAIT_SECONDS = 30.0


class _RetryingPool(redis.BlockingConnectionPool):
    """A pool that retries handing out a connection, as the client retries commands.

    redis-py retries a command that fails on its connection, but not the reconnect and liveness
    check done when the pool hands a connection out: a connection cut at that moment (a server
    restart, a CLIENT KILL) surfaced as an error although nothing had been sent. Since nothing has
    been sent yet, retrying there is always safe. A socket that cannot be opened at all is not tried
    again here: the reconnect has already retried it (see ``_ReconnectRetry``), and a pool that had
    no free connection for ``POOL_WAIT_SECONDS`` is reported at once.

    Its connections are bounded ones (see ``_Bounded``), and so is the wait for a free one: it ends at
    the call's deadline.
    """

    def __init__(self, connection_class: type[Any] = redis.Connection, **kwargs: Any):
        super().__init__(  # type: ignore[no-untyped-call]
            connection_class=_BOUNDED.get(connection_class, connection_class), **kwargs
        )

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

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        def get() -> Any:
            try:
                return super(_RetryingPool, self).get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
            except redis.ConnectionError as exc:
                if str(exc) == "No connection available.":  # BlockingConnectionPool's wait ran out
                    if _expired():
                        raise _passed("waiting for a free connection of the pool") from None
                    raise _PoolExhausted(
                        f"all {self.max_connections} connections of the pool stayed busy for {self._wait_seconds} s"
                    ) from None
                raise

        # The pool has already released the failed connection; nothing more to undo between tries.
        return self.connection_kwargs["retry"].call_with_retry(
            get, lambda _error: None, lambda error: not isinstance(error, _PoolExhausted)
        )


class _PoolExhausted(redis.ConnectionError):
    """No connection of a pool came free in time (not worth retrying: it already waited)."""


#: The pause before a retry, by failures so far, for plain and cluster clients alike (EqualJitterBackoff
#: keeps no state, so one serves every retry loop), ending at the call's deadline if sooner.
_BACKOFF = _BoundedBackoff(EqualJitterBackoff(cap=2.0, base=0.05))


def default_retry() -> Retry:
    """Retry policy of clients opened from URLs: 8 reconnect attempts over about 4-7 s, then an error.

    Long enough to ride through a Redis restart or a failover, short enough that a dead server is
    reported while someone is still looking.

    Every broker call is safe to resend: puts, acks and clears are idempotent, and a sampling call
    carries a request id whose reply Redis keeps, so a resend after a lost reply gets the same rows.
    """
    return _ReconnectRetry(_BACKOFF, retries=8)


def default_url() -> str:
    """``$REDIS_URL`` if set, else the local default."""
    return os.environ.get("REDIS_URL") or DEFAULT_URL


class _Shared:
    """One URL's client, shared by its users in this process, and the opening of it."""

    def __init__(self) -> None:
        self.client: Client | None = None  # None while it is being opened, and if opening failed
        self.users = 0
        self.opened = threading.Event()  # set once the opening ended, either way


#: URL -> its shared client: every dock opened from one URL in a process shares one client and its
#: pool, so a process holds a few connections per server however many docks it opens. The lock guards
#: only this table, never a round trip: opening a URL (one INFO, retries included: up to a call's
#: bound) happens outside it, so a server that does not answer holds up only the users of its own URL.
_shared: dict[str, _Shared] = {}
_shared_lock = threading.Lock()


def connect(target: str | Client) -> tuple[Client, str | None]:
    """A client for ``target`` (a URL or a client) and the URL that reopens it, if one is known.

    A URL gives the client shared by every user of that URL in this process; hand it back with
    ``disconnect(url)``. A URL naming any node of a Redis Cluster gives a ``RedisCluster`` client,
    which finds the other nodes itself. A client passed in (``redis.Redis`` or ``RedisCluster``) is
    the caller's, used as it is and never closed here.
    """
    if isinstance(target, str):
        return _shared_client(target), target
    if not isinstance(target, (redis.Redis, RedisCluster)):
        raise BrokerError(
            f"expected a Redis URL, a redis.Redis or a redis.cluster.RedisCluster client, got {type(target).__name__}"
        )
    if target.get_encoder().decode_responses:
        raise BrokerError("the Redis client must be created with decode_responses=False: tensors are bytes")
    return target, url_of(target)


def _shared_client(url: str) -> Client:
    """The shared client of ``url``, opened by the first thread that asks; one more user of it.

    Threads asking while it is being opened wait for that opening (up to their call's bound), so a URL
    is opened once. The interleavings, each under the table's lock:

    - *the last user hands it back while another asks*: the hand-back removes the entry before closing
      the client, so the asker either counted itself in first (and the client stays open) or finds no
      entry and opens a new client.
    - *the opening fails*: the opener removes its entry; a waiter finds the entry gone and opens anew
      itself, within its own bound (a server may come back between the two).
    - *a waiter's bound passes*: it never counted itself in, so it leaves nothing to hand back.
    """
    while True:
        with _shared_lock:
            entry = _shared.get(url)
            opener = entry is None
            if entry is None:
                entry = _shared[url] = _Shared()
            elif entry.client is not None:
                entry.users += 1
                return entry.client
        if opener:
            return _open_shared(url, entry)
        left = time_left()
        if not entry.opened.wait(None if left is None else max(0.0, left)):
            raise _timeout_error(redact(url), _passed("waiting for another thread of this process to open it"))


def _open_shared(url: str, entry: _Shared) -> Client:
    """Open ``url`` for ``entry`` (which this thread put in the table) and count this thread its first user."""
    try:
        client = _open_url(url)
    except BaseException:
        with _shared_lock:
            if _shared.get(url) is entry:
                del _shared[url]
        entry.opened.set()
        raise
    with _shared_lock:
        entry.client, entry.users = client, 1
    entry.opened.set()
    return client


def disconnect(url: str) -> None:
    """Hand back a client ``connect(url)`` gave; the last user's hand-back closes its connections."""
    with _shared_lock:
        entry = _shared.get(url)
        if entry is None or entry.client is None:  # none, or being opened: not this caller's to hand back
            return
        entry.users -= 1
        if entry.users > 0:
            return
        del _shared[url]
    entry.client.close()  # outside the lock: closing may wait on sockets


def _open_url(url: str) -> Client:
    """The client of ``url``: a plain one, or a cluster client if the server is a cluster node.

    One INFO round trip tells which (``cluster_enabled``). A user not granted INFO, or a server with INFO
    renamed, is taken to be a plain server; were it a cluster node, its first command on another node's
    slot fails with a broker error naming the cluster (see ``redis_errors``). Whether the dock needs INFO
    is for opening the dock to say (server_checks.py).
    """
    client = _open_node(url)
    try:
        with redis_errors(redact(url)):
            try:
                clustered = bool(client.info("cluster").get("cluster_enabled"))
            except redis.exceptions.NoPermissionError:
                clustered = False
            except redis.ResponseError as exc:
                if "unknown command" not in str(exc).lower():
                    raise
                clustered = False
    except BaseException:
        client.close()
        raise
    if not clustered:
        return client
    client.close()
    return _open_cluster(url)


#: How many times a cluster client follows MOVED/ASK redirects or rides a CLUSTERDOWN out before it
#: reports the error: enough for a failover (a replica promoted within seconds) with the backoff
#: below, few enough that a cluster that stays broken is reported within a minute.
CLUSTER_ATTEMPTS = 12

#: Socket timeout (and connect timeout) of one attempt of a cluster client, against 60 s (10 s) for a
#: plain one. A primary that stops answering is failed over by the cluster after its
#: ``cluster-node-timeout`` (Redis's default 15 s; 2 s in the local test cluster) and a second or two
#: of election; a call waiting on it for a minute would never see that. With a second per attempt the
#: call times out, the client reloads its slot map, and after the promotion its next attempt reaches
#: the new primary, within a second or two of it. Resending a timed-out attempt is safe: broker calls
#: are idempotent, and a sampling call's resend gets its first reply back (request ids). A reply that
#: takes longer than this is sent again too; WAIT is given its own allowance (``slow_reply``). A
#: URL's ``?socket_timeout=`` overrides it.
CLUSTER_ATTEMPT_SECONDS = 1.0


class _PacedRetries:
    """Mixin of the cluster client and its pipelines: a pause before each retry after a connection failure,
    and retries up to the call's deadline.

    redis-py's cluster client retries a command whose connection failed (having reloaded the slot map)
    at once, up to its retry count, with no backoff: a connection cut, or a node restarting, used every
    retry up within milliseconds and the call failed where a plain client rides it out. Here the error
    goes back to that retry loop only after the backoff's pause, so the retries span seconds.

    Under a call's deadline, a command whose connection failures used up those ``CLUSTER_ATTEMPTS`` is
    sent again, paced the same way, until the deadline (then a BrokerTimeoutError): the call's bound is
    what bounds a call. Seen without it: with every node's clients killed every few ms on a loaded
    machine, a SCRIPT LOAD (sent to every primary, each on a new connection) failed 13 times within
    13 s, and the reader gave up far inside its 30 s bound. Every broker call is safe to resend (see
    ``default_retry``). Without a deadline (a tool's own client), ``CLUSTER_ATTEMPTS`` ends the retries.
    """

    _failures = threading.local()  # connection failures of the calling thread's current command

    def _internal_execute_command(self, *args: Any, **kwargs: Any) -> Any:
        self._failures.count = 0
        targets = kwargs.get("target_nodes")
        # Nodes the caller named are not retried by redis-py (a reloaded slot map may drop them); nor here.
        resend = targets is None or self._is_nodes_flag(targets)  # type: ignore[attr-defined]
        while True:
            try:
                return super()._internal_execute_command(*args, **kwargs)  # type: ignore[misc]
            except _CUT as exc:
                # redis-py's retries ran out, each failure paused (below); the deadline, once passed, ends
                # the call there with a _DeadlinePassed, which is neither type.
                if not resend or time_left() is None or type(exc) not in _CUT:
                    raise

    def _execute_command(self, target_node: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._execute_command(target_node, *args, **kwargs)  # type: ignore[misc]
        except _CUT as exc:
            if _expired():  # the call is over: no retry (the loop above goes by the error's type)
                raise _passed(f"{exc}") from exc
            if type(exc) in RedisCluster.ERRORS_ALLOW_RETRY:  # not a refused password, nor a full pool
                count = getattr(self._failures, "count", 0) + 1
                self._failures.count = count
                if count <= CLUSTER_ATTEMPTS or time_left() is not None:  # a retry follows: pause first
                    time.sleep(_BACKOFF.compute(count))  # ends at the deadline
                    if _expired():
                        raise _passed(f"{exc}") from exc
            raise


class _PacedPipeline(_PacedRetries, ClusterPipeline):
    """A cluster pipeline whose commands retried one by one (after a connection failure) are paced, and
    which is sent again until the call's deadline when redis-py's own retries found no connection.

    redis-py resends a (non-transaction) pipeline whose connection could not be had (a reload of the slot
    map in between, nothing sent yet) at once, ``CLUSTER_ATTEMPTS`` times within a fraction of a second:
    connections cut every few ms failed them all. As with commands (see ``_PacedRetries``), a call with
    a deadline then pauses and sends it again, the same commands, until the deadline. (redis-py resends
    such a pipeline whole itself, so it must be safe to resend, as every broker pipeline is.) A MULTI/EXEC
    pipeline keeps redis-py's paced retries (``_ReconnectRetry``): its state is not the queue alone.
    """

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        strategy: Any = self._execution_strategy
        queued = list(strategy.command_queue) if isinstance(strategy, PipelineStrategy) else None
        failures = 0
        while True:
            try:
                replies: list[Any] = super().execute(raise_on_error)
                break
            except _CUT as exc:
                if queued is None or type(exc) not in _CUT or time_left() is None:
                    raise
                failures += 1
                time.sleep(_BACKOFF.compute(failures))  # ends at the deadline
                if _expired():
                    raise _passed(f"{exc}") from exc
                strategy.command_queue = list(queued)  # execute emptied it
        # The pipeline keeps any error of a node's reads as that command's reply; a deadline that
        # passed, or a size the server refused, ends the call instead of passing for a reply.
        for reply in replies:
            if isinstance(reply, (_DeadlinePassed, _TooLarge)):
                raise reply
        return replies


class _PacedNodes(NodesManager):
    """The cluster client's slot map, whose reload is cut like any request when every node's connection is.

    After a command's connection fails, redis-py reloads the slot map (CLUSTER SLOTS) before the command
    is retried, asking each node once on a connection that does not retry; if every one of those is cut
    too, it raises a RedisClusterException, which no retry loop repeats: a CLIENT KILL landing on each
    node during the reload (seen with the nodes' clients killed every few ms on a loaded machine) ended
    the call although every node was up. Such a reload failure is the connection failure it is, of its
    exact type (the retry loops match types exactly): the command's retries, paced and bounded by the
    call's deadline, go on, and the old slot map, left as it was, serves the next attempt. A reload that
    failed any other way (a node not in cluster mode, a refused password, the deadline) is unchanged.
    """

    def initialize(self, *args: Any, **kwargs: Any) -> None:
        try:
            super().initialize(*args, **kwargs)
        except redis.exceptions.RedisClusterException as exc:
            cut = exc.__cause__  # set only when no node answered: the last node's error
            # Exactly these types (isinstance, for the type checker): not a refused password (a ConnectionError
            # too), which will not get better.
            if isinstance(cut, _CUT) and type(cut) in _CUT:
                raise type(cut)(f"reloading the slot map failed on every node's connection (the last: {cut})") from exc
            raise


class _PacedCluster(_PacedRetries, RedisCluster):
    """The broker's cluster client: retries after connection failures are paced (see ``_PacedRetries``), and
    a slot map reload cut on every node is such a failure (see ``_PacedNodes``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Built and first loaded by redis-py as it opens (a failure there is reported as it was); later
        # reloads, the client's and its pipelines' (which share it), are the paced ones.
        self.nodes_manager.__class__ = _PacedNodes

    def script_load(self, script: Any) -> Any:
        """Load ``script`` on every primary (its SHA1, the same from each), each primary asked until it answers.

        redis-py sends SCRIPT LOAD to every primary as one command, and a connection failure on any one
        sends it to all of them again, each on a new connection (a handshake of several round trips first).
        With every node's clients killed every few ms on a loaded machine, no attempt got through all three
        within the call's 30 s bound. Here a primary that answered is not asked again; a failure is paced
        and reloads the slot map (see ``_PacedRetries``), and the primaries are read from it again (a
        failover may have changed them). Retried until the call's deadline, or ``CLUSTER_ATTEMPTS`` times
        outside any.
        """
        self._failures.count = 0
        loaded: set[str] = set()
        sha = None
        while pending := [node for node in self.get_primaries() if node.name not in loaded]:  # type: ignore[no-untyped-call]
            for node in pending:
                try:
                    sha = self._execute_command(node, "SCRIPT LOAD", script)
                except _CUT as exc:
                    if type(exc) not in _CUT or (time_left() is None and self._failures.count > CLUSTER_ATTEMPTS):
                        raise
                    break  # paced already; the primaries again, from the reloaded slot map
                loaded.add(node.name)
        return sha

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        pipe: ClusterPipeline = super().pipeline(transaction, shard_hint)  # type: ignore[no-untyped-call]
        pipe.__class__ = _PacedPipeline  # built by redis-py with its own arguments; only the class changes
        return pipe


def _open_cluster(url: str) -> RedisCluster:
    """A cluster client for ``url`` (any node's), with the retries of a plain one and short attempts
    (``CLUSTER_ATTEMPT_SECONDS``); its nodes' connections are bounded (see ``_BoundedPool``)."""
    try:
        with redis_errors(redact(url)):
            return _PacedCluster.from_url(
                url, retry=_ReconnectRetry(_BACKOFF, retries=CLUSTER_ATTEMPTS), connection_pool_class=_BoundedPool,
                health_check_interval=30, socket_connect_timeout=CLUSTER_ATTEMPT_SECONDS,
                socket_timeout=CLUSTER_ATTEMPT_SECONDS, socket_keepalive=True,
            )
    except ValueError as exc:
        raise BrokerError(f"invalid Redis Cluster URL {redact(url)!r}: {exc}") from None


def _open_node(url: str) -> redis.Redis:
    try:
        # Keepalive and health checks: training runs hold connections idle for minutes. The timeouts
        # turn a silent peer into an error (no broker command runs for a minute); the URL's query
        # (?socket_timeout=..., ?max_connections=...) overrides them.
        tcp = {} if url.startswith("unix:") else {"socket_keepalive": True}  # unix sockets take no keepalive
        # The pool swaps the URL's connection class (TCP, TLS, unix) for its bounded one.
        pool = _RetryingPool.from_url(
            url, health_check_interval=30, retry=default_retry(), socket_connect_timeout=10, socket_timeout=60,
            max_connections=POOL_SIZE, timeout=POOL_WAIT_SECONDS, **tcp,
        )
    except ValueError as exc:
        raise BrokerError(f"invalid Redis URL {redact(url)!r}: {exc}") from None
    client = redis.Redis(connection_pool=pool)
    client.auto_close_connection_pool = True  # closing the client closes the pool, as from_url does
    return client


#: Redis's defaults for the two limits on one value sent to it, used where CONFIG GET is refused
#: (ACL users confined to a dock are not granted CONFIG: it would show them the server's settings).
DEFAULT_VALUE_LIMITS = {"proto-max-bulk-len": 512 * 1024 * 1024, "client-query-buffer-limit": 1024 * 1024 * 1024}

#: The least either limit may be set to (Redis refuses lower ones): a value this long fits on any server.
MIN_VALUE_LIMIT = 1024 * 1024 - 2


class ValueLimit(NamedTuple):
    """The largest value (bytes) a server takes in one command argument, and the setting that says so."""

    bytes: int
    setting: str
    read: bool  #: whether the server's settings were read; else Redis's defaults stand in for them


_value_limits: weakref.WeakKeyDictionary[Client, ValueLimit] = weakref.WeakKeyDictionary()


def value_limit(client: Client) -> ValueLimit:
    """The largest value the server takes in one command argument, and the setting that says so.

    Redis refuses a bulk longer than ``proto-max-bulk-len`` and closes a connection whose query buffer
    passes ``client-query-buffer-limit``; a big argument is read into the buffer whole, with its
    CRLF, so it must stay 2 bytes under that. Either way the request fails only after it was sent,
    and the client's retries send it again: so puts check sizes first. Read once per client. Where
    CONFIG GET is refused, Redis's defaults stand in (``read`` False), and a put's values longer than
    ``MIN_VALUE_LIMIT`` are sent under ``sizes_unchecked``.
    """
    known = _value_limits.get(client)
    if known is None:
        limits = dict(DEFAULT_VALUE_LIMITS)
        read = True
        for name in limits:
            try:
                reply: Any = client.config_get(name)
                limits[name] = int(reply[name])
            except (redis.ResponseError, ValueError, TypeError, KeyError):  # refused, unknown command, odd reply
                read = False
        limits["client-query-buffer-limit"] -= 2
        setting = min(limits, key=lambda name: limits[name])
        known = _value_limits[client] = ValueLimit(limits[setting], setting, read)
    return known


@contextlib.contextmanager
def sizes_unchecked(largest: str | None) -> Iterator[None]:
    """Send the block's commands knowing that a value of theirs may be over a limit of the server that could
    not be read (``largest`` describes the largest value; None: nothing unchecked, nothing changes).

    A command longer than ``MIN_VALUE_LIMIT`` whose connection the server closes while it is sent, or its
    replies read, is then not sent again if the server answers a new connection: the call raises
    ExperienceTooLargeError (see ``_Bounded._refused``). Clients passed in by the user are not watched.
    """
    saved = _bounds.unchecked
    _bounds.unchecked = largest
    try:
        yield
    finally:
        _bounds.unchecked = saved


def _unchecked_size(command: Any) -> int:
    """The length of a packed command sent under ``sizes_unchecked`` if over ``MIN_VALUE_LIMIT``, else 0."""
    if _bounds.unchecked is None:
        return 0
    size = len(command) if isinstance(command, (str, bytes)) else sum(len(chunk) for chunk in command)
    return size if size > MIN_VALUE_LIMIT else 0


def url_of(client: Client) -> str | None:
    """A URL reopening ``client``'s server, or None for clients that have none (fakeredis, custom pools).

    For a cluster client, the URL of one of its nodes: opening it finds the others (see ``connect``).
    """
    if isinstance(client, RedisCluster):
        node = client.get_default_node() or next(iter(client.get_primaries()), None)
        return None if node is None or node.redis_connection is None else url_of(node.redis_connection)
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    cls = {bounded: plain for plain, bounded in _BOUNDED.items()}.get(pool.connection_class, pool.connection_class)
    if cls is redis.UnixDomainSocketConnection:
        url = f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
        auth = _auth(kwargs)
        return url.replace("unix://", f"unix://{auth}", 1)
    if cls in (redis.Connection, redis.SSLConnection) and "host" in kwargs:
        scheme, query = ("rediss", _tls_query(kwargs)) if cls is redis.SSLConnection else ("redis", "")
        return f"{scheme}://{_auth(kwargs)}{kwargs['host']}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}{query}"
    return None


#: How each TLS setting of a client that is not redis-py's default goes into a URL: redis-py's
#: ``from_url`` reads these query arguments back (strings as they are, the rest through its parsers).
_CERT_REQS = {ssl.CERT_NONE: "none", ssl.CERT_OPTIONAL: "optional", ssl.CERT_REQUIRED: "required"}
_TLS_QUERY: dict[str, Callable[[Any], str | None]] = {
    "ssl_ca_certs": lambda v: None if v is None else os.fspath(v),
    "ssl_ca_path": lambda v: None if v is None else os.fspath(v),
    "ssl_certfile": lambda v: None if v is None else os.fspath(v),
    "ssl_keyfile": lambda v: None if v is None else os.fspath(v),
    "ssl_password": lambda v: v,
    "ssl_cert_reqs": lambda v: None if (name := "none" if v is None else _CERT_REQS.get(v, v)) == "required" else name,
    "ssl_check_hostname": lambda v: None if v or v is None else "false",
    "ssl_min_version": lambda v: None if v is None else str(int(v)),
    "ssl_ciphers": lambda v: v,
    "ssl_include_verify_flags": lambda v: ",".join(flag.name for flag in v) if v else None,
    "ssl_exclude_verify_flags": lambda v: ",".join(flag.name for flag in v) if v else None,
}

#: TLS settings (and how a client authenticates) that a URL cannot carry, and what each is when unset.
_NOT_IN_URLS = {"ssl_ca_data": None, "ssl_ocsp_context": None, "ssl_ocsp_expected_cert": None,
                "ssl_validate_ocsp": False, "ssl_validate_ocsp_stapled": False, "credential_provider": None}


def _tls_query(kwargs: dict[str, Any]) -> str:
    """The query of a ``rediss://`` URL carrying the client's TLS settings (empty if all are defaults)."""
    pairs = [(name, text) for name, carry in _TLS_QUERY.items() if (text := carry(kwargs.get(name))) is not None]
    return "?" + "&".join(f"{name}={quote(str(text), safe='/:,')}" for name, text in pairs) if pairs else ""


def uncarried(client: Client) -> list[str]:
    """The settings of ``client`` that the URL ``url_of`` gives cannot carry: a CA in memory
    (``ssl_ca_data``), OCSP checks, a credential provider. A process reopening that URL would connect
    without them (and fail the certificate check, or the password)."""
    if isinstance(client, RedisCluster):
        node = client.get_default_node() or next(iter(client.get_primaries()), None)
        return [] if node is None or node.redis_connection is None else uncarried(node.redis_connection)
    kwargs = client.connection_pool.connection_kwargs
    return [name for name, unset in _NOT_IN_URLS.items() if kwargs.get(name, unset) not in (unset, None)]


def _auth(kwargs: dict[str, Any]) -> str:
    user, password = kwargs.get("username"), kwargs.get("password")
    if not password:
        return ""
    return f"{quote(user or '', safe='')}:{quote(password, safe='')}@"


def redact(url: str) -> str:
    """``url`` with any password hidden (the user's, and a TLS key's ``ssl_password``), for messages."""
    url = re.sub(r"([?&]ssl_password=)[^&]*", r"\1***", url)
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"


@contextlib.contextmanager
def bounded(where: str, seconds: float = DEFAULT_CALL_TIMEOUT) -> Iterator[None]:
    """A tool's reads (``broker status``, its live view, the exporter's scrape): bounded like a dock's
    call, and their Redis errors turned into broker errors naming ``where``."""
    with call_deadline(seconds), redis_errors(where):
        yield


@contextlib.contextmanager
def redis_errors(where: str) -> Iterator[None]:
    """Re-raise redis-py errors as broker errors; ``where`` names the server for the message."""
    try:
        yield
    except _DeadlinePassed as exc:
        raise _timeout_error(where, exc) from exc
    except redis.AuthenticationError as exc:
        raise BrokerConnectionError(f"Redis at {where} refused the credentials: {exc}") from exc
    except redis.exceptions.AskError as exc:  # MovedError too: redis-py keeps only "SLOT HOST:PORT" of it
        kind = "MOVED" if isinstance(exc, redis.exceptions.MovedError) else "ASK"
        raise ClusterError(
            f"Redis at {where} is a Redis Cluster node and redirected the call ({kind} {exc}: slot {exc.slot_id} "
            f"is served by {exc.host}:{exc.port}); the redirects did not settle. Open the dock from a URL so the "
            "broker uses a cluster client, or pass a redis.cluster.RedisCluster client (from a URL, a user not "
            "granted INFO cannot be told it is on a cluster: grant +info, as broker acl --cluster does)"
        ) from exc
    except redis.exceptions.ClusterDownError as exc:
        raise ClusterError(
            f"Redis Cluster at {where} is down ({_short(exc)}): a primary failed and no replica took over in time"
        ) from exc
    except redis.exceptions.TryAgainError as exc:
        raise ClusterError(f"Redis Cluster at {where} is moving the slot of this call's keys: {_short(exc)}") from exc
    except redis.exceptions.ClusterCrossSlotError as exc:
        raise ClusterError(
            f"Redis Cluster at {where} refused keys of several slots in one command: {_short(exc)}"
        ) from exc
    except redis.exceptions.ClusterError as exc:
        raise ClusterError(f"Redis Cluster at {where}: {_short(exc)}") from exc
    except redis.exceptions.RedisClusterException as exc:  # not a RedisError: cross-slot MULTI, uncovered slot
        cut = _cut_by_deadline(exc)  # a slot map reload that found no node answering in time
        if cut is not None:
            raise _timeout_error(where, cut) from exc
        raise ClusterError(f"Redis Cluster at {where} refused the call: {_short(exc)}") from exc
    except _Hopeless as exc:
        raise BrokerConnectionError(f"Redis at {where}: {exc}") from exc
    except _TooLarge as exc:
        raise ExperienceTooLargeError(f"Redis at {where} {exc}") from exc
    except _CUT as exc:
        cut = _cut_by_deadline(exc)  # a retry loop that stopped at the deadline
        if cut is not None:
            raise _timeout_error(where, cut) from exc
        raise BrokerConnectionError(f"Redis at {where}: {_short(exc)}") from exc
    except redis.exceptions.OutOfMemoryError as exc:
        raise StoreFullError(
            f"Redis at {where} is out of memory (maxmemory reached); nothing of this call was applied: "
            f"{_short(exc)}"
        ) from exc
    except redis.exceptions.NoPermissionError as exc:
        raise RedisCommandError(f"Redis at {where} denied this user a command or key: {_short(exc)}") from exc
    except redis.ResponseError as exc:
        # Our scripts flag keys holding foreign data with a CORRUPT error before writing anything, and
        # a dock whose schema vanished or changed under them with NODOCK or SCHEMA.
        error = script_error(exc)
        if error is not None:
            raise type(error)(f"Redis at {where}: {error}") from None
        raise RedisCommandError(f"Redis at {where} refused a command: {_short(exc)}") from exc
    except redis.RedisError as exc:
        raise RedisCommandError(f"Redis at {where} refused a command: {_short(exc)}") from exc


def _timeout_error(where: str, cut: _DeadlinePassed) -> BrokerTimeoutError:
    return BrokerTimeoutError(
        f"Redis at {where} did not answer within the call's bound of {cut.bound}; the call was given up "
        f"and may or may not have been applied ({_short(Exception(cut.detail))})"
    )


#: Error prefixes of the Lua scripts, and the broker error each stands for.
_SCRIPT_ERRORS = {"CORRUPT ": DecodeError, "NODOCK ": DockNotFoundError, "SCHEMA ": SchemaError,
                  "VERSION ": VersionError, "FENCED ": FencedError, "LOST ": DataLostError}


def script_error(exc: redis.ResponseError) -> BrokerError | None:
    """The broker error a script's error reply stands for (CORRUPT, NODOCK, SCHEMA, VERSION, FENCED, LOST), or
    None."""
    text = str(exc)
    for prefix, error in _SCRIPT_ERRORS.items():
        if text.startswith(prefix):
            return error(text[len(prefix) :])
    return None


def _short(exc: Exception, limit: int = 300) -> str:
    """An error's text with the values of commands it quotes elided (see ``elide_values``), cut to ``limit``."""
    text = elide_values(str(exc))
    return text if len(text) <= limit else text[:limit] + "..."


#: How redis-py quotes the command of a pipeline whose reply was an error (its first 100 characters).
_PIPELINE_COMMAND = re.compile(r"(Command # \d+ \()(.*)(\) of pipeline caused error: )", re.DOTALL)
#: How Redis quotes the arguments of a command it does not know (renamed, say): the first ones, 128 bytes.
_ECHOED_ARGS = re.compile(r"(with args beginning with: )(.*)", re.DOTALL)
#: Commands whose first arguments up to the first key are not values: the script (or function), numkeys.
_SCRIPT_CALLS = frozenset({"EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO"})
#: What a byte that is no text looks like once redis-py decoded it (a control character, or U+FFFD).
_NOT_TEXT = re.compile(r"\S*[\x00-\x08\x0b-\x1f\x7f\ufffd]\S*")
_ELIDED = "<values elided>"


def elide_values(text: str) -> str:
    """``text`` without the values of the commands it quotes (a row's encoded tensor, raw bytes).

    redis-py quotes a pipeline's failed command, and Redis the first arguments of a command it does not
    know: with a put's HSET, that is the start of a tensor's bytes. The command's name and its key stay
    (for a script call, up to its first key); the rest becomes ``<values elided>``. Bytes that are no
    text anywhere else are elided too.
    """
    text = _PIPELINE_COMMAND.sub(lambda m: m.group(1) + _command_and_key(m.group(2)) + m.group(3), text)
    text = _ECHOED_ARGS.sub(lambda m: m.group(1) + _first_word(m.group(2)), text)
    return _NOT_TEXT.sub("<bytes elided>", text)


def _command_and_key(command: str) -> str:
    words = command.split(" ")
    kept = 4 if words[0].upper() in _SCRIPT_CALLS else 2
    return command if len(words) <= kept else " ".join(words[:kept] + [_ELIDED])


def _first_word(args: str) -> str:
    first, _, rest = args.partition(" ")
    return f"{first} {_ELIDED}" if rest.strip() else args
