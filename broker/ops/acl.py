"""Redis ACL rules that confine a worker to one dock.

A shared Redis holds many docks; a worker of dock A should neither read nor change dock B, nor run
server-wide commands. ``worker_rules("A")`` gives the rules for ``ACL SETUSER``::

    ACL SETUSER worker-a on >PASSWORD <rules...>

Keys: only ``td:{A}:*`` and the data shards ``td:{A~*}:*``, which are also a partitioned dock's partitions
(no other dock's keys match: ``~`` is not allowed in names). Channels: only those (the dock's put notifications,
each partition's). Commands: only what the
client and the Lua scripts call. Redis checks the keys that scripts touch against the same patterns, so
a script cannot reach another dock either. Nor another database: SELECT is granted for the database the
user's URL names only. Server-wide commands (FLUSHDB, KEYS, CONFIG, SCAN, ...) are not granted; INFO is
(it shows the server's counters and settings, no key's contents): opening a dock reads the server's
eviction policy from it, and CONFIG GET would show every setting, passwords included.
``reader_rules()`` gives the exporter's: every dock's counts and settings, reading only, not the rows.

On a Redis Cluster every node checks its own users: the user must be created on every node, primaries
and replicas (a replica promoted by a failover serves the same clients), with ``cluster=True``: the
broker tells a cluster node by INFO, and redis-py reads the slot map and the command table when it
connects. A Redis 7 cluster also announces puts with sharded pub/sub (SPUBLISH from the scripts,
SSUBSCRIBE by waiting readers), which Redis 6.2 does not know: ``redis7=False`` for its nodes.
"""

from __future__ import annotations

from broker.connection import Client
from broker.control.keys import PREFIX, DockKeys, shard_pattern
from broker.control.scripts.functions import load_library, uses_functions

#: Commands sent by the client (dock methods and redis-py's connection set-up).
CLIENT_COMMANDS = (
    "ping", "multi", "exec", "discard",
    "hset", "hget", "hmget", "hgetall", "hlen", "bitcount", "bitfield", "zcard", "get", "del", "subscribe",
    "unsubscribe", "hdel", "unlink", "incr", "wait",  # the data shards' puts and clears, wait_replicas
    "info",  # opening a dock reads maxmemory_policy (control/server_checks.py); wait_replicas, the replicas' state
    "hkeys",  # the TransferQueue adapter's partition list
    "zrange", "dump", "restore", "pexpire",  # a dock's checkpoints: the named takes' records, reading and staging keys
    "rename", "set", "type", "getdel",  # the bar around a put's HSETs (lua/put.lua), plain commands
)

#: How a client runs the broker's scripts: on Redis 7 as the loaded function library (FCALL runs those
#: functions and nothing else, see broker/control/scripts/functions.py); on Redis 6.2, which has no
#: functions, by EVALSHA, loading them with SCRIPT LOAD and sending the puts' short ones with EVAL. A user
#: granted EVAL runs any Lua, `while true do end` included, which stalls the whole server (BUSY for every
#: client) until an administrator's SCRIPT KILL: on 6.2, share a server only among teams that trust each
#: other.
FUNCTION_COMMANDS = ("fcall", "fcall_ro")
EVAL_COMMANDS = ("evalsha", "eval", "script|load", "script|exists")

#: Commands the Lua scripts in lua/ call.
SCRIPT_COMMANDS = (
    "type", "exists", "time", "hset", "hget", "hmget", "hgetall", "hdel", "hlen", "get", "set", "del", "incr", "incrby",
    "strlen", "setrange", "getrange", "bitfield", "bitop", "bitpos", "bitcount", "zadd", "zrem", "zcard",
    "zrangebyscore", "publish", "getbit", "setbit", "hincrby", "rename", "zcount", "zscore",
    "hexists", "llen", "lpop", "rpush",  # the TransferQueue adapter's free rows (tq_rows, tq_release)
    "zremrangebyscore",  # take: the index of named takes' records
    "copy", "pttl", "pexpire", "pexpireat", "persist",  # a dock's checkpoints (snapshot, restore)
    "hstrlen", "hkeys",  # a dock's byte quota (include/quota.lua, quota.lua)
)


#: What a cluster client sends beside the broker's own commands: INFO (``connect`` tells a cluster node by
#: it), and redis-py's reading of the slot map and of the command table.
CLUSTER_COMMANDS = ("info", "cluster|slots", "command")

#: Sharded pub/sub: put notifications on a Redis 7 cluster (unknown to Redis 6.2).
SHARDED_PUBSUB_COMMANDS = ("ssubscribe", "sunsubscribe", "spublish")

#: Commands the exporter and ``broker status`` send, and those lua/status.lua (and its includes) calls: reads
#: only, and on keys of the kinds ``reader_key_patterns`` names.
READER_COMMANDS = (
    "ping", "scan", "hgetall",
    "type", "hmget", "bitcount", "strlen", "zcard", "get", "zcount", "hlen", "getrange", "bitfield",
)


def reader_key_patterns() -> list[str]:
    """Every kind of key a reader reads, as ACL patterns: the meta, the status bitmaps and counters, the
    leases and dead letters (counted), the epoch (the exporter's shard memory); never a row's bytes (data,
    tail, set-aside hashes), a row's tags, the shared metrics or the TransferQueue adapter's keys."""
    k = DockKeys("x")
    kinds = [k.meta, k.ready("*"), k.group_ready("*"), k.consumed("*"), k.group_taken("*"), k.finished,
             k.group_finished, k.group_age(0)[:-1] + "*", k.group_wait(0)[:-1] + "*", k.leases("*"),
             k.redelivered("*"), k.dead("*"), k.version, k.discarded, k.group_versions, k.epoch]
    return [f"~{PREFIX}:{{*}}:" + key.removeprefix(k.base) for key in kinds]


def reader_rules(*, db: int = 0, cluster: bool = False, selectors: bool = True) -> list[str]:
    """ACL SETUSER rules for ``broker exporter`` and ``broker status``: counts and settings of every dock, read
    commands only; not the rows' bytes.

    Scripts run with the user's permissions, so granting EVALSHA grants no write: the only commands a
    script may call are the read commands listed here, on the keys listed. Two things a reader does touch
    a dock's data hashes: the status script counts the rows holding a response (HLEN), and the exporter
    measures every key's memory (MEMORY USAGE). Redis 7's ACL selectors grant exactly those two commands on
    those keys (``selectors``); Redis 6.2 has none, and there the reader gets every dock key (so it could
    read the rows: on 6.2, a reader is trusted with them, and with EVALSHA). ``db``: the database its URL names (see
    ``select_rules``). ``cluster``: for a Redis Cluster node (see above).
    """
    commands = set(READER_COMMANDS) | (set(CLUSTER_COMMANDS) if cluster else set())
    every_key = f"~{PREFIX}:*"
    if selectors:  # Redis 7: the status function (FCALL_RO) runs, and no Lua of the reader's own
        keys = [*reader_key_patterns(), f"({every_key} +memory|usage)", f"(~{PREFIX}:{{*}}:data:* +hlen)"]
        commands |= {"fcall_ro"}
    else:
        keys, commands = [every_key], commands | {"memory|usage", "evalsha", "script|load"}
    return ["resetkeys", *keys, "resetchannels", "-@all", *(f"+{c}" for c in sorted(commands)),
            *select_rules(db, cluster)]


def worker_rules(dock: str, *, db: int = 0, cluster: bool = False, redis7: bool = True) -> list[str]:
    """ACL SETUSER rules (without ``on`` and the password) letting a user work on dock ``dock`` only, in
    database ``db`` only (the one its URL names, see ``select_rules``), running the broker's operations only.

    ``redis7``: for Redis 7, where the user runs the loaded function library (FCALL) and no Lua of its own
    (an administrator loads the library: ``broker functions``); False for Redis 6.2, where it is granted
    EVAL (see ``FUNCTION_COMMANDS``). ``cluster``: for a Redis Cluster node (see above).
    """
    keys = DockKeys(dock)
    commands = set(CLIENT_COMMANDS) | set(SCRIPT_COMMANDS) | set(FUNCTION_COMMANDS if redis7 else EVAL_COMMANDS)
    if cluster:
        commands |= set(CLUSTER_COMMANDS) | (set(SHARDED_PUBSUB_COMMANDS) if redis7 else set())
    # A partitioned dock's partitions (td:{DOCK~pK}:*) match the shards' pattern, keys and channels alike.
    return ["resetkeys", f"~{keys.base}*", f"~{shard_pattern(dock)}", "resetchannels", f"&{keys.base}*",
            f"&{shard_pattern(dock)}", "-@all",
            *(f"+{c}" for c in sorted(commands)), *select_rules(db, cluster)]


def select_rules(db: int, cluster: bool = False) -> list[str]:
    """The SELECT a user may send: none for database 0 (a client of a URL naming no database never sends one),
    else only ``SELECT db`` (``+select|N``: a first argument, which Redis 6.2 and 7 both take), which
    redis-py sends when it connects. Key patterns are the same in every database, so a user granted SELECT
    of any database could write its dock's keys into another tenant's database. A cluster has database 0
    only."""
    if not isinstance(db, int) or db < 0 or (cluster and db):
        raise ValueError(f"database {db!r}: " + ("a Redis Cluster has database 0 only" if cluster and db
                                                 else "a database number is an int >= 0"))
    return [f"+select|{db}"] if db else []


def load_functions(client: Client) -> bool:
    """Load the broker's function library, which a worker confined by ``worker_rules`` runs but may not load
    (``broker functions``; on every primary of a cluster). False, loading nothing, where the server has no
    functions (Redis 6.2: workers run the scripts with EVALSHA, see ``FUNCTION_COMMANDS``)."""
    if not uses_functions(client):
        return False
    load_library(client)
    return True
