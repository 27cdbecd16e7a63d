"""What a dock needs of its Redis server, checked when it opens (``check_server``, from ``TransferDock._open``).

Each of these was found late, or never, before:

- *Eviction.* A server whose ``maxmemory-policy`` evicts drops whatever key it picks once it is full: the
  dock's version (read as 0 after the trainer set 5), a consumer's consumed bitmap (rows it had consumed
  handed out again), a data hash (its rows given back until they are dead letters), all silently. Only
  ``noeviction`` keeps every key: a full server refuses writes instead (StoreFullError, nothing applied).
  A ``volatile-*`` policy evicts only keys with a TTL, and of a dock's keys only the kept replies have one
  (``td:{NAME}:reply:*``, a minute: lua/include/once.lua, and a release's mark): ``allow_volatile_eviction``
  accepts it, at a price: a call resent after a lost reply whose kept reply was evicted is applied twice
  (a resent get hands out other rows, and those of the first are lost unless leased; a resent put or
  drop is applied again). The policy is read with CONFIG GET or, where that is refused (a user confined
  by ``broker acl``), from INFO memory. A server that answers neither is used with a warning naming
  what could not be checked (fakeredis answers neither; it never evicts).
- *Commands.* A command the broker needs that is renamed (``rename-command``) or denied to the user failed
  the first call that sent it, as "EXEC without MULTI" or deep in a script ("Unknown Redis command called
  from script"). Each is tried here, and every missing one is named with what the broker needs it for.
- *PUBLISH.* A put's script announces it on the dock's channel. A refused PUBLISH (a Redis 7 ACL user
  without the channel, the default for a new user, or the command renamed) made every put raise after it
  had landed; the scripts now ignore the refusal (lua/include/mark_ready.lua), and it is logged here once
  per server: waiting readers then find new rows only by looking again, every second.

All of it is one pipeline, one round trip, to the node serving the dock's slot, in place of the probe of
script flags that opening a dock made before: a dock costs no extra round trip to open. A sharded dock's
data shards may be on other nodes, which ``check_data_nodes`` asks for their policy once the schema is
known (a round trip per node). A policy changed after a dock opened (CONFIG SET) is not seen.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.client import Pipeline
from redis.cluster import RedisCluster

from broker.connection import CLUSTER_ATTEMPTS, Client, time_left
from broker.connection.fanout import REDIRECTS
from broker.control.keys import DockKeys
from broker.control.scripts import ALLOW_OOM
from broker.control.scripts.functions import function_name, probe, settle
from broker.errors import ServerConfigError

log = logging.getLogger("broker")

#: Policies that evict only keys with a TTL (of a dock's keys, only the kept replies have one).
VOLATILE_POLICIES = frozenset({"volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl"})

_INFO_POLICY = re.compile(r"^maxmemory_policy:(\S+)", re.MULTILINE)
_INFO_ALLOCATOR = re.compile(r"^mem_allocator:(\S+)", re.MULTILINE)

_RETURN_1 = "return 1"
_RETURN_1_SHA = hashlib.sha1(_RETURN_1.encode()).hexdigest()

#: What the broker needs each command for, as the error names it.
_PURPOSES = {
    "EVAL": "to learn which script flags the server takes, where the broker's Redis 7 functions are not loaded "
            "(`broker functions`)",
    "SCRIPT LOAD": "to load its Lua scripts where the server does not have them (after a restart or failover)",
    "EVALSHA": "to run its Lua scripts (lua/), which every call uses",
    "TIME": "in its scripts, to time leases by the server's clock",
    "MULTI": "to write a put's bytes and its marks in one transaction",
    "EXEC": "to write a put's bytes and its marks in one transaction",
    "WAIT": "for wait_replicas: it waits for the replicas with it",
    "INFO": "for wait_replicas: it reads which replicas are in sync from INFO replication",
}


@dataclass(frozen=True)
class ServerFacts:
    """What opening learned of the server that the dock goes by."""

    #: The server takes Redis 7 script flags (see ``scripts.ALLOW_OOM``).
    script_flags: bool
    #: How puts announce themselves: PUBLISH, or on a Redis 7 cluster SPUBLISH, which stays on the shard of
    #: the dock's slot instead of being broadcast to every node (see put_listener.py).
    publish: str
    #: The server's allocator as INFO memory names it (``jemalloc-5.3.0``, ``libc``), "" if not told.
    allocator: str = ""


def check_server(
    client: Client, keys: DockKeys, server: str, *, wait_replicas: int = 0, allow_volatile: bool = False,
) -> ServerFacts:
    """Try, in one round trip to the node serving the dock's slot, what the broker needs of the server.

    Raises ServerConfigError naming every command that is missing or denied, or the eviction policy;
    logs (once per server) a refused PUBLISH and a policy that could not be read. ``server`` names the
    server in messages (its URL without the password).
    """
    # A Redis 6.2 cluster knows no SPUBLISH: its puts PUBLISH (see below).
    publish = "SPUBLISH" if isinstance(client, RedisCluster) else "PUBLISH"
    replies, node = _on_dock_node(client, keys.meta, lambda pipe: _probe(pipe, keys, publish, wait_replicas))
    server = f"{server}, node {node}" if node else server
    where = f"{server} (dock {keys.name!r})"
    library, flags, loaded, evalsha, time_, info, config, published, *rest = replies
    wait = rest.pop(0) if wait_replicas else None
    multi, exec_, discard = rest
    if isinstance(exec_, Exception) and not _says(discard, "without multi"):
        _drop_idle_connections(client, keys.meta)  # EXEC and DISCARD both gone: the connection may be in a MULTI

    # The broker's scripts as Redis 7 functions when the server has them (see scripts/functions.py): then
    # EVAL, SCRIPT LOAD and EVALSHA are not needed, and a worker of a shared server is not granted them.
    if isinstance(library, redis.exceptions.NoPermissionError) and "key" in str(library).lower():
        raise library  # the dock's own key denied: the usual error, naming the dock
    functions = settle(client, probe(library), where)
    scripts = () if functions else (("EVAL", flags), ("SCRIPT LOAD", loaded), ("EVALSHA", evalsha))
    missing = [(name, reply) for name, reply in (
        *scripts, ("TIME", time_), ("MULTI", multi),
        ("EXEC", None if isinstance(multi, Exception) else exec_), ("WAIT", wait),
        ("INFO", info if wait_replicas and _unknown(info) else None),  # denied: connection/replication.py waits for all
    ) if isinstance(reply, Exception) and _absent(reply)]
    if missing:
        raise ServerConfigError(f"Redis at {where}: " + "; ".join(_why(name, reply) for name, reply in missing))
    for reply in () if functions else (flags, evalsha):  # the dock's own key denied: the usual error, naming it
        if isinstance(reply, redis.exceptions.NoPermissionError):
            raise reply
    check_policy(config, info, server, allow_volatile)
    script_flags = functions or not isinstance(flags, Exception)
    if publish == "SPUBLISH" and not script_flags:
        publish = "PUBLISH"  # Redis 6.2: not tried here; the scripts ignore a refusal all the same
    elif isinstance(published, Exception):
        _tell_publish_refused(server, where, keys, publish, published)
    return ServerFacts(script_flags, publish, _allocator(info))


def _probe(pipe: Pipeline, keys: DockKeys, publish: str, wait_replicas: int) -> None:
    """Queue the probes, in the order ``check_server`` reads their replies."""
    pipe.execute_command("FCALL_RO", function_name("loaded"), 1, keys.meta)  # the broker's function library
    pipe.eval(ALLOW_OOM + _RETURN_1, 1, keys.meta)  # the script flags, and EVAL
    pipe.script_load(_RETURN_1)
    pipe.evalsha(_RETURN_1_SHA, 1, keys.meta)
    pipe.time()
    _info_memory(pipe)
    pipe.config_get("maxmemory-policy")
    pipe.execute_command(publish, keys.events, "0")  # a spurious wake-up: readers look and find nothing
    if wait_replicas:
        pipe.execute_command("WAIT", 0, 0)  # answers at once: no replica is asked to acknowledge
    # Last, and closed by DISCARD: were EXEC alone renamed, what followed it would be queued in the MULTI.
    pipe.execute_command("MULTI")
    pipe.execute_command("EXEC")
    pipe.execute_command("DISCARD")


def _tell_publish_refused(server: str, where: str, keys: DockKeys, publish: str, refusal: Exception) -> None:
    _once(("publish", server, publish), logging.WARNING,
          "Redis at %s refuses %s on the dock's channel %s (%s): puts land but wake no waiting reader, which "
          "finds new rows only when it looks again (every second). Grant the user the channel (&%s*, as "
          "`broker acl` does) or give %s back its name", where, publish, keys.events, _short(refusal), keys.base,
          publish)


def check_data_nodes(
    client: Client, keys: DockKeys, tags: Sequence[str], server: str, *, allow_volatile: bool = False
) -> None:
    """The eviction policy of the nodes holding a sharded dock's data shards ``tags`` other than the node
    of its slot, which ``check_server`` asked: a round trip per node (none on one server)."""
    if not isinstance(client, RedisCluster) or not tags:
        return
    asked = client.get_node_from_key(keys.meta).name
    nodes = {}
    for tag in tags:
        node = client.get_node_from_key(DockKeys.shard_replicated(tag))
        if node.name != asked:
            nodes[node.name] = node
    for name, node in sorted(nodes.items()):
        pipe = client.get_redis_connection(node).pipeline(transaction=False)
        _info_memory(pipe)
        pipe.config_get("maxmemory-policy")
        info, config = pipe.execute(raise_on_error=False)
        check_policy(config, info, f"{server}, node {name} (data shards of dock {keys.name!r})", allow_volatile)


def check_policy(config: Any, info: Any, where: str, allow_volatile: bool) -> None:
    """Refuse a server that evicts: ``config`` and ``info`` are the replies (or errors) of CONFIG GET
    maxmemory-policy and INFO memory of the server ``where`` names; a policy neither gives is logged once
    per server as unchecked."""
    policy = _policy(config, info)
    if policy is None:
        _once(("policy", where), logging.WARNING,
              "could not read the maxmemory-policy of Redis at %s (CONFIG GET: %s; INFO memory: %s): the broker "
              "cannot tell whether it evicts keys, and a dock that loses keys loses rows silently; make sure it "
              "runs maxmemory-policy noeviction", where, _short(config), _short(info))
        return
    if policy == "noeviction" or (allow_volatile and policy in VOLATILE_POLICIES):
        return
    fix = "Run CONFIG SET maxmemory-policy noeviction there (and set it in its configuration file)"
    if policy in VOLATILE_POLICIES:
        raise ServerConfigError(
            f"Redis at {where} runs maxmemory-policy {policy}: once full it evicts keys with a TTL, which of a "
            "dock's keys are the replies kept for resends, so a call resent after a lost reply may be applied "
            f"twice. {fix}, or open the dock with allow_volatile_eviction=True to accept that"
        )
    raise ServerConfigError(
        f"Redis at {where} runs maxmemory-policy {policy}: once full it evicts any key, and a dock that loses one "
        "loses rows silently (a consumed bitmap: rows handed out again; a data hash: rows never delivered; the "
        f"version: the staleness bound). {fix}: a full server then refuses writes (StoreFullError) and loses nothing"
    )


def _info_memory(pipe: Pipeline) -> None:
    """Queue INFO memory, its reply left as text: redis-py's parsing of the whole section cost as much as
    the rest of the probe (its callbacks go by the name given here, and "INFO MEMORY" has none)."""
    pipe.execute_command("INFO MEMORY")


def _policy(config: Any, info: Any) -> str | None:
    """The policy as CONFIG GET, or else INFO memory, tells it; None if neither does."""
    if isinstance(config, dict):
        for key, value in config.items():
            if _text(key) == "maxmemory-policy":
                return _text(value)
    if isinstance(info, (bytes, str)):
        found = _INFO_POLICY.search(_text(info))
        if found:
            return found.group(1)
    return None


def _allocator(info: Any) -> str:
    """The allocator INFO memory names, "" if it was refused or names none."""
    found = _INFO_ALLOCATOR.search(_text(info)) if isinstance(info, (bytes, str)) else None
    return found.group(1) if found else ""


def _on_dock_node(client: Client, key: str, build: Callable[[Pipeline], None]) -> tuple[list[Any], str]:
    """The replies of the plain pipeline ``build`` queues, sent to the node serving ``key``, errors as
    values; and that node's name ("" on one server). On a cluster a node that does not answer, or a slot
    that moved (a failover), refreshes the slot map and sends it again, as the cluster client would."""
    if not isinstance(client, RedisCluster):
        pipe = client.pipeline(transaction=False)
        build(pipe)
        return pipe.execute(raise_on_error=False), ""
    for attempt in range(1, CLUSTER_ATTEMPTS + 1):
        node = client.get_node_from_key(key)
        try:
            pipe = client.get_redis_connection(node).pipeline(transaction=False)
            build(pipe)
            replies = pipe.execute(raise_on_error=False)
            moved = [r for r in replies if isinstance(r, REDIRECTS)]
            if not moved:
                return replies, node.name
            left = time_left()  # the call's bound holds here too: a cluster that is down was asked for 8.5 s
            if attempt == CLUSTER_ATTEMPTS or (left is not None and left < 1.0):
                raise moved[0]
        except (redis.ConnectionError, redis.TimeoutError):
            left = time_left()
            if attempt == CLUSTER_ATTEMPTS or (left is not None and left < 1.0):
                raise
        client.nodes_manager.initialize()
        time.sleep(min(0.05 * 2**attempt, 1.0))
    raise AssertionError("unreachable")


def _drop_idle_connections(client: Client, key: str) -> None:
    """Close the idle connections of the pool the probe used: one of them may be left inside a MULTI."""
    node = client.get_redis_connection(client.get_node_from_key(key)) if isinstance(client, RedisCluster) else client
    node.connection_pool.disconnect(inuse_connections=False)


def _absent(reply: Any) -> bool:
    """Whether a probe's reply says its command is unknown (renamed, disabled) or denied to the user."""
    return _unknown(reply) or (isinstance(reply, redis.exceptions.NoPermissionError) and _says(reply, "to run"))


def _unknown(reply: Any) -> bool:
    return isinstance(reply, redis.ResponseError) and _says(reply, "unknown command")


def _why(name: str, reply: Exception) -> str:
    """What is wrong with command ``name`` and how to fix it, for the error."""
    if _unknown(reply):
        return (f"it does not know {name} (renamed or disabled: rename-command in its configuration), which the "
                f"broker needs {_PURPOSES[name]}; give {name.split()[0]} back its name")
    return (f"it denies this user {name}, which the broker needs {_PURPOSES[name]}; grant it "
            f"(ACL SETUSER ... +{name.lower().replace(' ', '|')}, as `broker acl` does)")


def _says(reply: Any, text: str) -> bool:
    return isinstance(reply, Exception) and text in str(reply).lower()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _short(reply: Any, limit: int = 120) -> str:
    text = str(reply)
    return text if len(text) <= limit else text[:limit] + "..."


_told: set[tuple[str, ...]] = set()
_told_lock = threading.Lock()


def _once(what: tuple[str, ...], level: int, message: str, *args: Any) -> None:
    """Log ``message`` the first time this process meets ``what`` (a warning per server, not per dock opened)."""
    with _told_lock:
        if what in _told:
            return
        _told.add(what)
    log.log(level, message, *args)
