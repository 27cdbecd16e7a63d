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
"""

from __future__ import annotations

from collections.abc import Sequence

import redis
from redis.cluster import RedisCluster

from .connection import Client
from .errors import ClusterError


class ReplicationError(ClusterError):
    """Fewer replicas than asked acknowledged a call's writes in time. The call was applied on the
    primaries; repeating it is safe (puts, acks and clears are idempotent)."""


def wait_for_replicas(client: Client, keys: Sequence[str], replicas: int, timeout_ms: int, what: str) -> None:
    """Block until ``replicas`` replicas of every node holding one of ``keys`` (counters of the dock,
    one per node at most) have all writes made there so far; ReplicationError naming ``what`` if not."""
    if replicas <= 0:
        return
    short = []
    for node_client, key in _per_node(client, keys):
        pipe = node_client.pipeline(transaction=False)
        pipe.incr(key)
        pipe.execute_command("WAIT", replicas, timeout_ms)
        acked = int(pipe.execute()[-1])
        if acked < replicas:
            short.append(f"{key}: {acked}")
    if short:
        raise ReplicationError(
            f"{what}: fewer than {replicas} replica(s) acknowledged within {timeout_ms} ms ({', '.join(short)}); "
            "it was applied on the primaries, and repeating it is safe"
        )


def _per_node(client: Client, keys: Sequence[str]) -> list[tuple[redis.Redis, str]]:
    """(the node's own client, one of ``keys`` it holds) per node holding any of ``keys``."""
    if not isinstance(client, RedisCluster):
        return [(client, keys[0])] if keys else []
    out: dict[str, tuple[redis.Redis, str]] = {}
    for key in keys:
        node = client.get_node_from_key(key)
        if node is None or node.redis_connection is None:
            raise ClusterError(f"no live primary serves {key} (the cluster is failing over?)")
        out.setdefault(node.name, (node.redis_connection, key))
    return list(out.values())
