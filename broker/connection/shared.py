"""Clients from URLs: ``connect`` gives the client every user of a URL in this process shares (a plain one, or a
cluster client if the URL names a cluster node), ``disconnect`` hands it back, ``default_url`` says where tools
look when given none."""

from __future__ import annotations

import os
import threading

import redis
from redis.cluster import RedisCluster

from broker.connection.client import Client
from broker.connection.cluster import _open_cluster
from broker.connection.deadlines import _passed, time_left
from broker.connection.pools import POOL_SIZE, POOL_WAIT_SECONDS, _RetryingPool
from broker.connection.retries import default_retry
from broker.connection.translate import _timeout_error, redis_errors
from broker.connection.urls import redact, url_of
from broker.errors import BrokerError

#: Where tools look when no URL is given.
DEFAULT_URL = "redis://127.0.0.1:6379/0"


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
    is for opening the dock to say (control/server_checks.py).
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
