"""Opening Redis clients from URLs, and turning redis-py errors into broker errors where they enter."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import quote

import redis
from redis.backoff import EqualJitterBackoff
from redis.cluster import ClusterPipeline, RedisCluster
from redis.retry import Retry

from .errors import (
    BrokerConnectionError,
    BrokerError,
    ClusterError,
    DecodeError,
    DockNotFoundError,
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


#: Attribute set on an error that a retry loop has given up on.
_RETRIED = "_broker_retried"


class _ReconnectRetry(Retry):
    """Retries connection failures once over, and never refused credentials: those will not get better.

    redis-py nests its retries: a command's retry (or the pool's hand-out retry below) wraps a
    reconnect whose own retry wraps opening the socket. Against a dead server the attempts multiply
    (9 x 9 sockets, over a minute instead of seconds). An error that has already been through one
    retry loop is marked, and the loops around it pass it on at once.
    """

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[[Exception], Any] | Callable[[Exception, int], Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        def retryable(error: Exception) -> bool:
            if getattr(error, _RETRIED, False):
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
    """

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        def get() -> Any:
            try:
                return super(_RetryingPool, self).get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
            except redis.ConnectionError as exc:
                if str(exc) == "No connection available.":  # BlockingConnectionPool's wait ran out
                    raise _PoolExhausted(
                        f"all {self.max_connections} connections of the pool stayed busy for {self.timeout} s"
                    ) from None
                raise

        # The pool has already released the failed connection; nothing more to undo between tries.
        return self.connection_kwargs["retry"].call_with_retry(
            get, lambda _error: None, lambda error: not isinstance(error, _PoolExhausted)
        )


class _PoolExhausted(redis.ConnectionError):
    """No connection of a pool came free in time (not worth retrying: it already waited)."""


#: The pause before a retry, by failures so far, for plain and cluster clients alike (EqualJitterBackoff
#: keeps no state, so one serves every retry loop).
_BACKOFF = EqualJitterBackoff(cap=2.0, base=0.05)


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


#: URL -> [client, number of users]: every dock opened from one URL in a process shares one client
#: and its pool, so a process holds a few connections per server however many docks it opens.
_shared: dict[str, list[Any]] = {}
_shared_lock = threading.Lock()


def connect(target: str | Client) -> tuple[Client, str | None]:
    """A client for ``target`` (a URL or a client) and the URL that reopens it, if one is known.

    A URL gives the client shared by every user of that URL in this process; hand it back with
    ``disconnect(url)``. A URL naming any node of a Redis Cluster gives a ``RedisCluster`` client,
    which finds the other nodes itself. A client passed in (``redis.Redis`` or ``RedisCluster``) is
    the caller's, used as it is and never closed here.
    """
    if isinstance(target, str):
        with _shared_lock:
            entry = _shared.get(target)
            if entry is None:
                entry = _shared[target] = [_open_url(target), 0]
            entry[1] += 1
            return entry[0], target
    if not isinstance(target, (redis.Redis, RedisCluster)):
        raise BrokerError(
            f"expected a Redis URL, a redis.Redis or a redis.cluster.RedisCluster client, got {type(target).__name__}"
        )
    if target.get_encoder().decode_responses:
        raise BrokerError("the Redis client must be created with decode_responses=False: tensors are bytes")
    return target, url_of(target)


def disconnect(url: str) -> None:
    """Hand back a client ``connect(url)`` gave; the last user's hand-back closes its connections."""
    with _shared_lock:
        entry = _shared.get(url)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _shared[url]
    entry[0].close()


def _open_url(url: str) -> Client:
    """The client of ``url``: a plain one, or a cluster client if the server is a cluster node.

    One INFO round trip tells which (``cluster_enabled``). A user not granted INFO is taken to be on a
    plain server; were it a cluster node, its first command on another node's slot fails with a
    broker error naming the cluster (see ``redis_errors``).
    """
    client = _open_node(url)
    try:
        with redis_errors(redact(url)):
            try:
                clustered = bool(client.info("cluster").get("cluster_enabled"))
            except redis.exceptions.NoPermissionError:
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




class _PacedRetries:
    """Mixin of the cluster client and its pipelines: a pause before each retry after a connection failure.

    redis-py's cluster client retries a command whose connection failed (having reloaded the slot map)
    at once, up to its retry count, with no backoff: a connection cut, or a node restarting, used every
    retry up within milliseconds and the call failed where a plain client rides it out. Here the error
    goes back to that retry loop only after the backoff's pause, so the retries span seconds.
    """

    _failures = threading.local()  # connection failures of the calling thread's current command

    def _internal_execute_command(self, *args: Any, **kwargs: Any) -> Any:
        self._failures.count = 0
        return super()._internal_execute_command(*args, **kwargs)  # type: ignore[misc]

    def _execute_command(self, target_node: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return super()._execute_command(target_node, *args, **kwargs)  # type: ignore[misc]
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            if type(exc) in RedisCluster.ERRORS_ALLOW_RETRY:  # not a refused password, nor a full pool
                count = getattr(self._failures, "count", 0) + 1
                self._failures.count = count
                if count <= CLUSTER_ATTEMPTS:
                    time.sleep(_BACKOFF.compute(count))
            raise


class _PacedPipeline(_PacedRetries, ClusterPipeline):
    """A cluster pipeline whose commands retried one by one (after a connection failure) are paced."""


class _PacedCluster(_PacedRetries, RedisCluster):
    """The broker's cluster client: retries after connection failures are paced (see ``_PacedRetries``)."""

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> ClusterPipeline:
        pipe: ClusterPipeline = super().pipeline(transaction, shard_hint)  # type: ignore[no-untyped-call]
        pipe.__class__ = _PacedPipeline  # built by redis-py with its own arguments; only the class changes
        return pipe


def _open_cluster(url: str) -> RedisCluster:
    """A cluster client for ``url`` (any node's), with the same timeouts and retries as a plain one."""
    try:
        with redis_errors(redact(url)):
            return _PacedCluster.from_url(
                url, retry=_ReconnectRetry(_BACKOFF, retries=CLUSTER_ATTEMPTS),
                health_check_interval=30, socket_connect_timeout=10, socket_timeout=60, socket_keepalive=True,
            )
    except ValueError as exc:
        raise BrokerError(f"invalid Redis Cluster URL {redact(url)!r}: {exc}") from None


def _open_node(url: str) -> redis.Redis:
    try:
        # Keepalive and health checks: training runs hold connections idle for minutes. The timeouts
        # turn a silent peer into an error (no broker command runs for a minute); the URL's query
        # (?socket_timeout=..., ?max_connections=...) overrides them.
        tcp = {} if url.startswith("unix:") else {"socket_keepalive": True}  # unix sockets take no keepalive
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

_value_limits: weakref.WeakKeyDictionary[Client, tuple[int, str]] = weakref.WeakKeyDictionary()


def value_limit(client: Client) -> tuple[int, str]:
    """The largest value (bytes) the server takes in one command argument, and the setting that says so.

    Redis refuses a bulk longer than ``proto-max-bulk-len`` and closes a connection whose query buffer
    passes ``client-query-buffer-limit``; a big argument is read into the buffer whole, with its
    CRLF, so it must stay 2 bytes under that. Either way the request fails only after it was sent,
    and the client's retries send it again: so puts check sizes first. Read once per client.
    """
    known = _value_limits.get(client)
    if known is None:
        limits = dict(DEFAULT_VALUE_LIMITS)
        for name in limits:
            try:
                limits[name] = int(client.config_get(name).get(name) or limits[name])
            except (redis.ResponseError, ValueError, TypeError):  # refused, unknown command, odd reply
                pass
        limits["client-query-buffer-limit"] -= 2
        setting = min(limits, key=lambda name: limits[name])
        known = _value_limits[client] = (limits[setting], setting)
    return known


def url_of(client: Client) -> str | None:
    """A URL reopening ``client``'s server, or None for clients that have none (fakeredis, custom pools).

    For a cluster client, the URL of one of its nodes: opening it finds the others (see ``connect``).
    """
    if isinstance(client, RedisCluster):
        node = client.get_default_node() or next(iter(client.get_primaries()), None)
        return None if node is None or node.redis_connection is None else url_of(node.redis_connection)
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    cls = pool.connection_class
    if cls is redis.UnixDomainSocketConnection:
        url = f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
        auth = _auth(kwargs)
        return url.replace("unix://", f"unix://{auth}", 1)
    if cls in (redis.Connection, redis.SSLConnection) and "host" in kwargs:
        scheme = "rediss" if cls is redis.SSLConnection else "redis"
        return f"{scheme}://{_auth(kwargs)}{kwargs['host']}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
    return None


def _auth(kwargs: dict[str, Any]) -> str:
    user, password = kwargs.get("username"), kwargs.get("password")
    if not password:
        return ""
    return f"{quote(user or '', safe='')}:{quote(password, safe='')}@"


def redact(url: str) -> str:
    """``url`` with any password hidden, for messages."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.rsplit("@", 1)
    user = creds.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}"


@contextlib.contextmanager
def redis_errors(where: str) -> Iterator[None]:
    """Re-raise redis-py errors as broker errors; ``where`` names the server for the message."""
    try:
        yield
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
            f"Redis Cluster at {where} is down ({exc}): a primary failed and no replica took over in time"
        ) from exc
    except redis.exceptions.TryAgainError as exc:
        raise ClusterError(f"Redis Cluster at {where} is moving the slot of this call's keys: {exc}") from exc
    except redis.exceptions.ClusterCrossSlotError as exc:
        raise ClusterError(f"Redis Cluster at {where} refused keys of several slots in one command: {exc}") from exc
    except redis.exceptions.ClusterError as exc:
        raise ClusterError(f"Redis Cluster at {where}: {exc}") from exc
    except redis.exceptions.RedisClusterException as exc:  # not a RedisError: cross-slot MULTI, uncovered slot
        raise ClusterError(f"Redis Cluster at {where} refused the call: {_short(exc)}") from exc
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise BrokerConnectionError(f"Redis at {where}: {exc}") from exc
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
        raise RedisCommandError(f"Redis at {where} refused a command: {exc}") from exc
    except redis.RedisError as exc:
        raise RedisCommandError(f"Redis at {where} refused a command: {exc}") from exc


#: Error prefixes of the Lua scripts, and the broker error each stands for.
_SCRIPT_ERRORS = {"CORRUPT ": DecodeError, "NODOCK ": DockNotFoundError, "SCHEMA ": SchemaError,
                  "VERSION ": VersionError, "FENCED ": FencedError}


def script_error(exc: redis.ResponseError) -> BrokerError | None:
    """The broker error a script's error reply stands for (CORRUPT, NODOCK, SCHEMA, VERSION, FENCED), or None."""
    text = str(exc)
    for prefix, error in _SCRIPT_ERRORS.items():
        if text.startswith(prefix):
            return error(text[len(prefix) :])
    return None


def _short(exc: Exception, limit: int = 300) -> str:
    """An error's text cut to ``limit``: redis-py quotes whole pipelines, tensors included."""
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."
