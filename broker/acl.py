"""Redis ACL rules that confine a worker to one dock.

A shared Redis holds many docks; a worker of dock A should neither read nor change dock B, nor run
server-wide commands. ``worker_rules("A")`` gives the rules for ``ACL SETUSER``::

    ACL SETUSER worker-a on >PASSWORD <rules...>

Keys: only ``td:{A}:*``. Channels: only ``td:{A}:*`` (the dock's put notifications). Commands: only
what the client and the Lua scripts call. Redis checks the keys that scripts touch against the same
patterns, so a script cannot reach another dock either. Server-wide commands (FLUSHDB, KEYS, CONFIG,
SCAN, ...) are not granted.
"""

from __future__ import annotations

from .keys import DockKeys

#: Commands sent by the client (dock methods and redis-py's connection set-up).
CLIENT_COMMANDS = (
    "ping", "select", "multi", "exec", "discard", "evalsha", "eval", "script|load", "script|exists",
    "hset", "hmget", "hgetall", "bitcount", "zcard", "get", "del", "subscribe", "unsubscribe",
)

#: Commands the Lua scripts in lua/ call.
SCRIPT_COMMANDS = (
    "type", "exists", "time", "hset", "hmget", "hgetall", "hdel", "hlen", "get", "set", "del", "incr", "incrby",
    "strlen", "setrange", "getrange", "bitfield", "bitop", "bitpos", "bitcount", "zadd", "zrem", "zcard",
    "zrangebyscore", "publish",
)


def worker_rules(dock: str) -> list[str]:
    """ACL SETUSER rules (without ``on`` and the password) letting a user work on dock ``dock`` only."""
    pattern = DockKeys(dock).base + "*"
    commands = sorted(set(CLIENT_COMMANDS) | set(SCRIPT_COMMANDS))
    return ["resetkeys", f"~{pattern}", "resetchannels", f"&{pattern}", "-@all", *(f"+{c}" for c in commands)]
