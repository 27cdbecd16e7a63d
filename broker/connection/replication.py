"""Waiting for replicas: the dock's optional durability (``TransferDock(..., wait_replicas=k)``).

Redis replicates asynchronously: a primary answers a write before any replica has it, and a primary
that dies in that window takes the write with it when its replica is promoted (see docs/cluster.md,
"What replication does and does not promise"). ``WAIT k timeout`` blocks until k replicas acknowledged
every write the calling connection made before it, which narrows that window to nothing for the writes it
covers (it does not make Redis strongly consistent: a replica that acknowledged may still lose a failover
election to one that did not, and a timeout returns what was reached).

WAIT covers only the writes of its own connection, and a broker call writes through pooled
connections (on a cluster, one per node). So each node touched gets, on one connection, a tiny write
to a key of the dock on that node (``td:{TAG}:replicated``, a counter) followed by WAIT: the
replication stream of a primary is ordered, so once the replicas have the tiny write they have every
write the node applied before it, the call's own included.

Which calls wait: every call that writes, through one place in the dock (``TransferDock._replicated``),
after its writes were applied: on the control slot's node, and on the data shards' nodes where the call
wrote or deleted bytes (a put, a clear or drop on a sharded dock, ``delete``). A sharded put also waits
for the shards' replicas before it marks its rows ready (see data/sharded_store.py). Two outcomes of a shortfall:

- A call that hands something out (``get_experience``, ``prefetch_request_index``, ``reserve_groups``)
  logs it and returns what it handed out: raising would lose rows (or groups, or cursor positions)
  handed out without a lease, since they are marked handed out on the primary already. The same holds
  for any error of the wait itself (a connection lost, a timeout): the hand-out logs it and returns.
- Every other call raises ReplicationError after it was applied (its ``result`` attribute holds what the
  call returns, ``applied`` says whether the call's effect is in place); the message says whether repeating
  the call is safe: a repeat made at once does the same and nothing more for a put without a lease, clear()
  and clear(rows), set_version, ack, reset_consumer, unready, register_consumer_columns, update_metrics
  without ``cumulate``, grow, all_consumed, delete and the dock's creation. It is not for
  clear(consumer=...) and age_groups (a repeat ages the groups again), update_metrics(cumulate=True) (it
  appends again), drop_groups (a repeat counts the groups as discarded again, or with a delivery is
  refused as fenced), and a put that acked its lease (a repeat is refused as fenced).

A node with fewer replicas attached than asked — a replica promoted after its primary died has none
until the old primary comes back as its replica — cannot meet ``k``: waiting for it would stall every
worker for good, which is worse than the risk it guards against. Such a node is waited on for the
replicas it has (none: not at all), and the dock logs once that it runs degraded there, and once more
when it is whole again. A replica counts as attached once the primary reports it ``online`` *and* it has
acknowledged an offset: a replica that rejoins is reported online while it still loads the primary's
snapshot, and could not acknowledge a WAIT until it is done.

The WAIT's reply is read once, on the connection its tiny write went through, and may take the WAIT's
timeout plus a margin whatever the socket timeout: a WAIT is never sent again by a retry loop (a resend
would wait again, and a timeout turned into a connection error would hide that the call was applied).
Each WAIT is cut to the time left of the call's bound (``call_timeout``); a wait cut short, or failing
in any way after the call's writes were applied, is a shortfall like a late acknowledgement.

One window stays open on a cluster: the wait goes to the node the client's slot map names when it
starts. If the primary that took a call's writes died and another thread reloaded the map before this
call's wait, the wait goes to the promoted node and cannot tell that the writes were lost with the old
one. It takes a primary failing within the moment between a call's writes and its wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster

from broker.connection import fanout
from broker.connection.client import Client
from broker.connection.deadlines import slow_reply, time_left
from broker.errors import ClusterError, ReplicationError

log = logging.getLogger("broker")

#: How long a node's count of attached replicas is trusted before it is read again.
_REPLICAS_TTL_SECONDS = 2.0

#: How long a node may be short only of replicas that are online and acknowledged nothing yet before the dock
#: says it runs degraded there: a new primary's replicas are so for about a second (every node of a freshly
#: formed cluster, once per process), a rejoining replica's while it loads. Missing replicas are said at once.
_SILENT_GRACE_SECONDS = 5.0

#: How much later than its timeout the reply of a WAIT may come (the round trip, a busy server) before
#: the node is taken as not answering: the server answers a WAIT only at its timeout when replicas lag.
REPLY_MARGIN_SECONDS = 1.0

@dataclass(frozen=True)
class Repeat:
    """What a ReplicationError says of repeating its call at once: whether that is ``safe`` (its
    ``repeat_safe``), and the words saying so or why not (its message)."""

    safe: bool
    said: str


#: A call that a repeat made at once does again with no other effect.
REPEAT_SAFE = Repeat(True, "repeating it is safe")


def do_not_repeat(because: str) -> Repeat:
    """A call a repeat would apply again: ``because`` says what it would do."""
    return Repeat(False, f"do not repeat it: {because}")


class Replication:
    """``wait_replicas`` of one dock object: waits on the nodes a call wrote to (see the module docstring)."""

    def __init__(self, client: Client, replicas: int, timeout_ms: int):
        self._client = client
        self.replicas = replicas
        self._timeout_ms = max(1, timeout_ms)  # WAIT k 0 would block for ever
        self._attached: dict[str, tuple[int, float]] = {}  # node -> (replicas attached, read at)
        self._degraded: set[str] = set()
        self._short_since: dict[str, float] = {}  # node -> when it was first read short of replicas, lately
        self._lock = threading.Lock()

    def wait(
        self, keys: Sequence[str], what: str, *, hands_out: bool = False, result: Any = None,
        outcome: str = "it was applied on the primaries", repeat: Repeat = REPEAT_SAFE, applied: bool = True,
        drop: bool = False, hands_out_outcome: str | None = None,
    ) -> bool:
        """Block until the replicas of every node holding one of ``keys`` (counters of the dock, one per
        node at most) have all writes made there so far; True if they have (or none is asked for).

        A shortfall on a whole node, or a failure of the wait, raises ReplicationError naming ``what``
        and saying ``outcome`` and ``repeat`` (with ``result`` and ``applied``); with ``hands_out`` it is
        logged instead (saying ``hands_out_outcome``), whatever the error, and the wait returns False.
        ``drop``: delete the counters again (``delete`` leaves no key).
        """
        if self.replicas <= 0:
            return True
        short: list[str] = []
        cause: BaseException | None = None
        try:
            nodes = self._per_node(keys)
        except Exception as exc:  # the slot map names no node: the cluster is failing over
            nodes, cause = [], exc
            short.append(f"{list(keys)}: {_brief(exc)}")
        for name, node_client, key in nodes:
            try:
                want = min(self.replicas, self._attached_replicas(name, node_client))
                if want == 0:
                    continue
                acked = self._wait_node(node_client, key, want, drop)
            except Exception as exc:
                # The call's writes were applied before: whatever broke the wait (a connection lost, the
                # node failed over, the call's bound reached), all it leaves unknown is the replicas.
                self._forget_node(name, exc)
                short.append(f"{name} ({key}): the wait failed: {_brief(exc)}")
                cause = exc
                continue
            if acked < want:
                with self._lock:
                    self._attached.pop(name, None)  # a replica may have gone: read the count again next time
                short.append(f"{name} ({key}): {acked} of {want}")
        if not short:
            return True
        message = (f"{what}: fewer replicas than attached acknowledged within {self._timeout_ms} ms: "
                   f"{', '.join(short)}")
        if hands_out:
            log.warning("%s; the call was applied and %s", message,
                        hands_out_outcome or "returned what it handed out (raising would lose it)")
            return False
        raise ReplicationError(f"{message}; {outcome}; {repeat.said}", result, applied, repeat.safe) from cause

    def _wait_node(self, node_client: redis.Redis, key: str, want: int, drop: bool) -> int:
        """INCR ``key`` (then DEL it, with ``drop``) and WAIT for ``want`` replicas, on one connection of
        the node; how many acknowledged.

        Not through redis-py's command or pipeline: their retry loops send a command again when its
        reply times out, and a WAIT sent again waits again. Here the WAIT's reply is read once, allowed
        the WAIT's timeout plus a margin beyond the socket timeout (the call's bound still holds).
        """
        timeout_ms = self._timeout_ms
        left = time_left()
        if left is not None:  # a WAIT outlasting the call's bound would be cut: ask the server for less
            timeout_ms = max(1, min(timeout_ms, int(left * 1000)))
        commands: list[tuple[Any, ...]] = [("INCR", key), *([("DEL", key)] if drop else []), ("WAIT", want, timeout_ms)]
        pool = node_client.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(conn.pack_commands(commands))
            for _ in commands[:-1]:
                conn.read_response()
            allowance = timeout_ms / 1000 + REPLY_MARGIN_SECONDS
            with slow_reply(allowance):  # a bounded connection's socket timeout grows by it
                return int(conn.read_response(timeout=allowance))
        except BaseException:
            conn.disconnect()  # a reply may still be due on it: no later call must read it as its own
            raise
        finally:
            pool.release(conn)

    def _forget_node(self, name: str, error: Exception) -> None:
        """After a wait on node ``name`` failed: read its replicas again next time, and on a cluster reload
        the slot map (best effort), so that the caller's next call goes to a promoted node."""
        with self._lock:
            self._attached.pop(name, None)
        if isinstance(self._client, RedisCluster) and isinstance(error, redis.RedisError):
            try:
                self._client.nodes_manager.initialize()
            except Exception:  # no node answers now: the next call reloads it again
                pass

    def _attached_replicas(self, name: str, node_client: redis.Redis) -> int:
        """Replicas attached to node ``name`` and in sync now (read at most every few seconds); logs the node
        becoming degraded (fewer than asked) or whole again."""
        now = time.monotonic()
        with self._lock:
            known = self._attached.get(name)
        if known is not None and now - known[1] < _REPLICAS_TTL_SECONDS:
            return known[0]
        try:
            info = node_client.info("replication")
        except redis.exceptions.NoPermissionError:
            # A user confined by `broker acl` without INFO cannot see its replicas: wait for all it asks.
            return self.replicas
        entries = [value for key, value in info.items() if key.startswith("slave")]
        count = sum(1 for value in entries if _in_sync(value))
        silent = sum(1 for value in entries if isinstance(value, dict) and value.get("state") == "online") - count
        with self._lock:
            self._attached[name] = (count, now)
            if count >= self.replicas:
                self._short_since.pop(name, None)
                if name in self._degraded:
                    self._degraded.discard(name)
                    log.warning("Redis at %s has %d replicas again: wait_replicas=%d holds there", name, count,
                                self.replicas)
                return count
            since = self._short_since.setdefault(name, now)
            # Short only of replicas online that acknowledged nothing yet: said once it lasts (see the grace).
            lasting = count + silent < self.replicas or now - since >= _SILENT_GRACE_SECONDS
            if lasting and name not in self._degraded:
                self._degraded.add(name)
                log.warning("Redis at %s has %d of the %d replicas wait_replicas asks for%s: writes there are "
                            "waited on for %d until more attach", name, count, self.replicas,
                            f" in sync ({silent} more online that acknowledged nothing yet: still loading, or "
                            "stopped)" if silent else "", count)
        return count

    def _per_node(self, keys: Sequence[str]) -> list[tuple[str, redis.Redis, str]]:
        """(node name, the node's own client, one of ``keys`` it holds) per node holding any of ``keys``."""
        client = self._client
        if not isinstance(client, RedisCluster):
            return [("the server", client, keys[0])] if keys else []
        groups = fanout.by_node(client, keys)
        if groups is None:
            raise ClusterError(f"no live primary serves one of {list(keys)} (the cluster is failing over?)")
        return [(name, node.redis_connection, keys[positions[0]]) for name, (node, positions) in groups.items()]


def _in_sync(replica: Any) -> bool:
    """Whether an INFO replication ``slaveN`` entry is a replica that can acknowledge a WAIT now.

    Only one ``online`` can: one still receiving the primary's snapshot (a killed primary rejoining as a
    replica) would make WAIT time out on every call until it is done. And only one that acknowledged an
    offset: the primary reports a replica online once the snapshot is sent, while the replica may still
    be loading it (seconds for a large one), acknowledging nothing; its offset stays 0 until then.

    The price: the replicas of a new primary (one that had replicated nothing when they synced) show
    offset 0 until they acknowledge its first write, within a second. A dock that reads their count in
    that second waits on the node for the replicas it has in sync until it reads the count again, a few
    seconds later; it says nothing of it unless it lasts (``_SILENT_GRACE_SECONDS``).
    """
    if not isinstance(replica, dict) or replica.get("state") != "online":
        return False
    return _offset(replica.get("offset")) > 0


def _offset(value: Any) -> int:
    """A replication offset from INFO (0 if absent or not a number)."""
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def _brief(error: BaseException, limit: int = 200) -> str:
    """An error as ``Type: text``, cut to ``limit`` characters."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= limit else text[:limit] + "..."
