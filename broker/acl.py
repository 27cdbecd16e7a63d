"""Redis ACL rules that confine a worker to one dock.

A shared Redis holds many docks; a worker of dock A should neither read nor change dock B, nor run
server-wide commands. ``worker_rules("A")`` gives the rules for ``ACL SETUSER``::

    ACL SETUSER worker-a on >PASSWORD <rules...>

Keys: only ``td:{A}:*``. Channels: only ``td:{A}:*`` (the dock's put notifications). Commands: only
what the client and the Lua scripts call. Redis checks the keys that scripts touch against the same
patterns, so a script cannot reach another dock either. Server-wide commands (FLUSHDB, KEYS, CONFIG,
SCAN, ...) are not granted. ``reader_rules()`` gives the exporter's: every dock, reading only.
"""

from __future__ import annotations

from .keys import PREFIX, DockKeys

#: Commands sent by the client (dock methods and redis-py's connection set-up).
CLIENT_COMMANDS = (
    "ping", "select", "multi", "exec", "discard", "evalsha", "eval", "script|load", "script|exists",
    "hset", "hget", "hmget", "hgetall", "hlen", "bitcount", "bitfield", "zcard", "get", "del", "subscribe",
    "unsubscribe",
)

#: Commands the Lua scripts in lua/ call.
SCRIPT_COMMANDS = (
    "type", "exists", "time", "hset", "hget", "hmget", "hgetall", "hdel", "hlen", "get", "set", "del", "incr", "incrby",
    "strlen", "setrange", "getrange", "bitfield", "bitop", "bitpos", "bitcount", "zadd", "zrem", "zcard",
    "zrangebyscore", "publish", "getbit", "setbit", "hincrby", "rename", "zcount", "zscore",
)


#: Commands the exporter and ``broker status`` send, and those lua/status.lua calls: reads only.
READER_COMMANDS = (
    "ping", "select", "scan", "hgetall", "evalsha", "script|load", "memory|usage",
    "type", "hmget", "bitcount", "strlen", "zcard", "get", "zcount", "hlen",
)


def reader_rules() -> list[str]:
    """ACL SETUSER rules for ``broker exporter`` and ``broker status``: every dock's keys, reads only.

    Scripts run with the user's permissions, so granting EVALSHA grants no write: the only commands a
    script may call are the read commands listed here.
    """
    return ["resetkeys", f"~{PREFIX}:*", "resetchannels", "-@all", *(f"+{c}" for c in sorted(READER_COMMANDS))]


def worker_rules(dock: str) -> list[str]:
    """ACL SETUSER rules (without ``on`` and the password) letting a user work on dock ``dock`` only."""
    pattern = DockKeys(dock).base + "*"
    commands = sorted(set(CLIENT_COMMANDS) | set(SCRIPT_COMMANDS))
    return ["resetkeys", f"~{pattern}", "resetchannels", f"&{pattern}", "-@all", *(f"+{c}" for c in commands)]
