"""The broker's Lua scripts as one Redis 7 function library: what a worker of a shared server runs.

A user granted EVAL (or SCRIPT LOAD and EVALSHA) runs any Lua it likes, ``while true do end`` included: the
server then answers every other client BUSY until an administrator's SCRIPT KILL. Redis 7 functions close
that: an administrator loads the broker's operations once (``FUNCTION LOAD``; ``broker functions`` or
``broker acl ... --apply`` does it), they persist in the server's files and replicate, and a worker is
granted FCALL only, which runs the functions loaded and nothing else (``broker/ops/acl.py``).

The library holds every script of the core (``loader.CORE_SCRIPTS``), each the same text an EVAL would send
(includes pasted) as the body of a function ``(KEYS, ARGV)``, so both paths run the same code. Its name
carries a digest of its text (``LIBRARY``): clients of another broker version look for their own library,
and two versions can be loaded side by side. ``status`` is flagged ``no-writes`` (FCALL_RO: readers and
replicas); the dock's own scripts ``allow-oom`` (see ``loader.ALLOW_OOM``); the checkpoints' none, so a
server at ``maxmemory`` refuses their writes.

A slice's scripts (``loader.register_scripts``) are a library of their own, named the same way after the
slice's name: the core's library stays the same whichever slices a process imported, and a slice's functions
are flagged ``no-writes`` if read-only, else nothing. ``load_library`` loads the core's and every slice's
this process registered; a slice's library missing from the server is loaded on its first call, as a lost one
is.

Which path a client takes is decided once per client (``uses_functions``): FCALL when the library is loaded
or this user may load it; EVALSHA on Redis 6.2 (no functions), on servers that refuse FCALL to this user,
and on fakeredis builds without functions.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import Any

import redis

from broker.connection import Client
from broker.control.scripts.loader import CORE_SCRIPTS, SLICES, script_text
from broker.errors import ServerConfigError

log = logging.getLogger(__name__)

#: The core's scripts that run only as the checkpoints call them: no flag (a full server refuses their
#: writes); and its read-only one.
_PLAIN = ("snapshot", "restore")
_READ_ONLY = ("status",)


def _flags(name: str) -> str:
    entry = SLICES.get(name)
    if name in _READ_ONLY or (entry is not None and name in entry.read_only):
        return "{'no-writes'}"
    return "{}" if name in _PLAIN or entry is not None else "{'allow-oom'}"


def _body(scripts: tuple[str, ...], probe: bool) -> str:
    parts = [f"redis.register_function{{function_name='@LIB@_{name}', flags={_flags(name)}, "
             f"callback=function(KEYS, ARGV)\n{script_text(name)}\nend}}\n" for name in scripts]
    if probe:
        parts.append("redis.register_function{function_name='@LIB@_loaded', flags={'no-writes'}, "
                     "callback=function() return 1 end}\n")
    return "".join(parts)


@functools.cache
def _library(prefix: str, scripts: tuple[str, ...]) -> tuple[str, str]:
    """The name (``prefix``, ``_`` and a digest of its text) and the ``FUNCTION LOAD`` argument of the library of
    ``scripts``; the core's has the ``loaded`` function the probe calls."""
    body = _body(scripts, probe=prefix == "broker")
    name = f"{prefix}_" + hashlib.sha1(body.encode()).hexdigest()[:12]
    return name, f"#!lua name={name}\n" + body.replace("@LIB@", name)


#: The core library's name: ``broker_`` and a digest of its text.
LIBRARY = _library("broker", CORE_SCRIPTS)[0]


def _slice_libraries() -> list[tuple[str, str]]:
    """Name and text of the library of every slice registered."""
    slices = {entry.library: entry.names for entry in SLICES.values()}
    return [_library(f"broker_{prefix}", names) for prefix, names in sorted(slices.items())]


def library_names() -> list[str]:
    """The names of the core's library and of every registered slice's: what ``load_library`` loads."""
    return [LIBRARY, *(name for name, _ in _slice_libraries())]


def function_name(script: str) -> str:
    """The function of script ``script`` in its library (the core's, or the slice's that registered it)."""
    entry = SLICES.get(script)
    library = LIBRARY if entry is None else _library(f"broker_{entry.library}", entry.names)[0]
    return f"{library}_{script}"


#: Attribute set on a client once its path is known (see ``uses_functions``).
_MODE = "_broker_functions"


def load_library(client: Client) -> None:
    """``FUNCTION LOAD`` the core's library and every registered slice's (on every primary of a cluster).
    REPLACE: a library of this name has this very text (the name is its digest), and a cluster client would
    stop at the first primary that has it."""
    on_every_primary = getattr(client, "on_every_primary", None)  # a broker cluster client: paced, per primary
    try:
        for _, text in [_library("broker", CORE_SCRIPTS), *_slice_libraries()]:
            command = ("FUNCTION", "LOAD", "REPLACE", text)
            if on_every_primary is not None:
                on_every_primary(*command)
            else:
                client.execute_command(*command)  # type: ignore[no-untyped-call]
    except redis.exceptions.NoPermissionError as exc:
        # A confined worker (`broker acl`) may run the library, not load it: what it met is the server's
        # loss, which its administrator mends. Its call changed nothing (a put's bytes stay barred).
        raise ServerConfigError(
            f"the server no longer has the broker's function library (FUNCTION FLUSH, a restart that kept no "
            f"functions, a replica promoted without them), and this user may not load it ({exc}): an "
            "administrator runs `broker functions --url URL` once, then the call can be made again") from exc


def library_lost(error: Any) -> bool:
    """A reply saying the server does not have the function called: the library was never loaded there, or
    lost (FUNCTION FLUSH, a new primary). The function did not run."""
    return isinstance(error, redis.ResponseError) and "function not found" in str(error).lower()


def probe(reply: Any) -> str:
    """What a ``FCALL_RO LIBRARY_loaded`` reply says: "loaded", "missing" (the server has functions, not this
    library), or "no" (no functions here: Redis 6.2, or FCALL refused to this user)."""
    if not isinstance(reply, Exception):
        return "loaded"
    text = str(reply).lower()
    if isinstance(reply, redis.exceptions.NoPermissionError) or "unknown command" in text \
            or "doesn't exist" in text:
        return "no"
    return "missing" if library_lost(reply) else "no"


def settle(client: Client, found: str, where: str) -> bool:
    """Whether ``client`` calls functions, given the probe's ``found``; remembered on the client.

    A missing library is loaded if this user may. A user granted FCALL but not FUNCTION LOAD (a worker of
    ``broker acl``) cannot go on without it: ServerConfigError saying what the administrator runs.
    """
    use = found == "loaded"
    if found == "missing":
        try:
            load_library(client)
            use = True
        except redis.exceptions.NoPermissionError:
            raise ServerConfigError(
                f"Redis at {where} does not have the broker's Lua functions (library {LIBRARY}) and this user may "
                f"not load them: an administrator loads them once with `broker functions --url URL` (`broker acl "
                f"... --apply` does it too)") from None
        except redis.ResponseError as exc:  # a server whose functions differ from Redis's: the scripts path
            log.warning("could not load the broker's function library %s (%s); using EVALSHA", LIBRARY, exc)
            use = False
    setattr(client, _MODE, use)
    return use


def uses_functions(client: Client, where: str = "the server") -> bool:
    """Whether ``client`` runs the broker's scripts as functions (probed once per client, one round trip;
    a dock's opening probe settles it beforehand)."""
    known = getattr(client, _MODE, None)
    if known is not None:
        return bool(known)
    try:
        reply: Any = client.execute_command("FCALL_RO", function_name("loaded"), 0)  # type: ignore[no-untyped-call]
    except (redis.ResponseError, redis.exceptions.RedisClusterException) as exc:
        reply = exc
    except redis.RedisError as exc:  # a 6.2 cluster client refuses, unsent, a command its servers lack
        if "doesn't exist" not in str(exc):
            raise
        reply = exc
    return settle(client, probe(reply), where)
