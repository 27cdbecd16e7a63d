"""Waiting for replicas: the dock's optional durability (``TransferDock(..., wait_replicas=k)``).

Redis replicates asynchronously: a primary answers a write before any replica has it, and a primary
that dies in that window takes the write with it when its replica is promoted (see the README,
"Beyond one machine"). ``WAIT k timeout`` blocks until k replicas acknowledged every write the
calling connection made before it, which narrows that window to nothing for the writes it covers
(it does not make Redis strongly consistent: a replica that acknowledged may still lose a failover
election to one that did not, and a timeout returns what was reached).

WAIT covers only the writes of its own connection, and a broker call writes through pooled
connections (on a cluster, one per node). So each node touched gets, on one connection, a tiny write
to a key of the dock on that node (``td:{TAG}:replicated``, a counter) followed by WAIT: the
replication stream of a primary is ordered, so once the replicas have the tiny write they have every
write the node applied before it, the call's own included.

A node with fewer replicas attached than asked — a replica promoted after its primary died has none
until the old primary comes back as its replica — cannot meet ``k``: waiting for it would stall every
worker for good, which is worse than the risk it guards against. Such a node is waited on for the
replicas it has (none: not at all), and the dock logs once that it runs degraded there, and once more
when it is whole again. A node whose replicas are attached but did not acknowledge in time raises
ReplicationError (for a put, which is safe to repeat; a call that handed rows out logs it instead and
returns its rows: throwing them away would lose rows handed out without a lease).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import redis
from redis.cluster import RedisCluster

from . import fanout
from .connection import Client, slow_reply
from .errors import ClusterError

log = logging.getLogger("broker")

#: How long a node's count of attached replicas is trusted before it is read again.
_REPLICAS_TTL_SECONDS = 2.0


class ReplicationError(ClusterError):
    """Fewer replicas than asked acknowledged a put in time, although that many are attached. The put
    was applied on the primaries; repeating it is safe (puts are idempotent)."""


class Replication:
    """``wait_replicas`` of one dock object: waits on the nodes a call wrote to (see the module docstring)."""

    def __init__(self, client: Client, replicas: int, timeout_ms: int):
        self._client = client
        self.replicas = replicas
        self._timeout_ms = max(1, timeout_ms)  # WAIT k 0 would block for ever
        self._attached: dict[str, tuple[int, float]] = {}  # node -> (replicas attached, read at)
        self._degraded: set[str] = set()
        self._lock = threading.Lock()

    def wait(self, keys: Sequence[str], what: str, *, must: bool) -> None:
        """Block until the replicas of every node holding one of ``keys`` (counters of the dock, one per
        node at most) have all writes made there so far. With ``must``, a shortfall on a whole node
        raises ReplicationError naming ``what``; without, it is logged."""
        if self.replicas <= 0:
            return
        short = []
        try:
            for name, node_client, key in self._per_node(keys):
                want = min(self.replicas, self._attached_replicas(name, node_client))
                if want == 0:
                    continue
                pipe = node_client.pipeline(transaction=False)
                pipe.incr(key)
                pipe.execute_command("WAIT", want, self._timeout_ms)
                # The server answers WAIT only after up to its timeout: a reply allowed that much beyond a
                # cluster client's short socket timeout (the call's deadline still holds).
                with slow_reply(self._timeout_ms / 1000):
                    acked = int(pipe.execute()[-1])
                if acked < want:
                    self._attached.pop(name, None)  # a replica may have gone: read the count again next time
                    short.append(f"{name} ({key}): {acked} of {want}")
        except (redis.ConnectionError, redis.TimeoutError):
            # The node the slot map named is gone (a failover): refresh the map, so that the caller's
            # retry of this call, which the broker error it gets invites, goes to the promoted node.
            if isinstance(self._client, RedisCluster):
                self._client.nodes_manager.initialize()
            raise
        if short:
            message = (f"{what}: fewer replicas than attached acknowledged within {self._timeout_ms} ms: "
                       f"{', '.join(short)}")
            if must:
                raise ReplicationError(message + "; it was applied on the primaries, and repeating it is safe")
            log.warning("%s; the call was applied and returned its rows", message)

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
        # Only replicas in sync can acknowledge: one still loading the primary's snapshot (a killed primary
        # rejoining as a replica) would make WAIT time out on every call until it is done.
        count = sum(1 for key, value in info.items()
                    if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online")
        with self._lock:
            self._attached[name] = (count, now)
            if count < self.replicas and name not in self._degraded:
                self._degraded.add(name)
                log.warning("Redis at %s has %d of the %d replicas wait_replicas asks for: writes there are "
                            "waited on for %d until more attach", name, count, self.replicas, count)
            elif count >= self.replicas and name in self._degraded:
                self._degraded.discard(name)
                log.warning("Redis at %s has %d replicas again: wait_replicas=%d holds there", name, count,
                            self.replicas)
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
