"""The broker's cluster client (``_PacedCluster``) and its opening from a URL (``_open_cluster``): retries after a
connection failure paced and going on until the call's deadline, its pipelines sent again likewise, and a slot
map reload cut on every node taken for the connection failure it is."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from redis.cluster import ClusterPipeline, NodesManager, PipelineStrategy, RedisCluster

from broker.connection.deadlines import _DeadlinePassed, _expired, _passed, time_left
from broker.connection.pools import _BoundedPool
from broker.connection.retries import _BACKOFF, _ReconnectRetry
from broker.connection.sockets import _CUT, _TooLarge
from broker.connection.translate import redis_errors
from broker.connection.urls import redact
from broker.errors import BrokerError

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


class _FunctionSlots:
    """Mixin of the cluster client and its pipelines: the slot of an FCALL read from its arguments, as redis-py
    reads an EVALSHA's. redis-py asks a node (COMMAND GETKEYS) for the keys of every FCALL: a round trip more
    per call of the broker's functions, and, with that node dead, calls that stalled through a failover."""

    def determine_slot(self, *args: Any) -> Any:
        if args and str(args[0]).upper() in ("FCALL", "FCALL_RO") and len(args) > 2:
            keys = args[3: 3 + int(args[2])]
            if keys:
                slots = {self.keyslot(key) for key in keys}  # type: ignore[attr-defined]
                if len(slots) == 1:
                    return slots.pop()
        return super().determine_slot(*args)  # type: ignore[misc]


class _PacedPipeline(_FunctionSlots, _PacedRetries, ClusterPipeline):
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


class _PacedCluster(_FunctionSlots, _PacedRetries, RedisCluster):
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
        return self.on_every_primary("SCRIPT LOAD", script)

    def on_every_primary(self, *command: Any) -> Any:
        """Run ``command`` on every primary, each asked until it answers (see ``script_load``: the broker's
        function library is loaded the same way); the last primary's reply."""
        self._failures.count = 0
        done: set[str] = set()
        reply = None
        while pending := [node for node in self.get_primaries() if node.name not in done]:  # type: ignore[no-untyped-call]
            for node in pending:
                try:
                    reply = self._execute_command(node, *command)
                except _CUT as exc:
                    if type(exc) not in _CUT or (time_left() is None and self._failures.count > CLUSTER_ATTEMPTS):
                        raise
                    break  # paced already; the primaries again, from the reloaded slot map
                done.add(node.name)
        return reply

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


def spread_tags(client: Any, candidate: Callable[[int], str], count: int) -> tuple[str, ...]:
    """``count`` hash tags out of ``candidate(0), candidate(1), ...``, on as many different primaries of the
    cluster ``client`` as there are, in round-robin order over them (tag i on a primary other than tag i-1's
    while there are several); on one server, the first ``count`` candidates. The data shards of a dock and
    the partitions of a partitioned dock are placed so. A later resharding moves slots, and with them tags:
    clients follow (MOVED), the tags stay what they are."""
    if not isinstance(client, RedisCluster):
        return tuple(candidate(i) for i in range(count))
    primaries = sorted(node.name for node in client.get_primaries())
    free: dict[str, list[str]] = {p: [] for p in primaries}  # per primary, candidate tags landing there
    index = 0
    while sum(min(len(t), -(-count // len(primaries))) for t in free.values()) < count and index < 100_000:
        tag = candidate(index)
        node = client.nodes_manager.get_node_from_slot(client.keyslot("{" + tag + "}"))
        free.setdefault(node.name, []).append(tag)
        index += 1
    # Round robin over the primaries: consecutive tags (consecutive groups) on different nodes.
    out: list[str] = []
    while len(out) < count:
        for p in primaries:
            if free.get(p) and len(out) < count:
                out.append(free[p].pop(0))
    return tuple(out)
