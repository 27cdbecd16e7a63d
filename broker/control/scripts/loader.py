"""The Lua scripts' texts: which file each script is (``SCRIPT_FILES``), where ``lua/`` is, and the includes
pasted into them.

A line ``-- @include NAME`` in a script is replaced by ``lua/include/NAME.lua`` so helpers are written
once; an include declares what it needs the same way (see ``expand_includes``). On Redis 7 the scripts run
as one function library (``functions.py``); elsewhere the wrappers send them with EVALSHA through redis-py
``Script`` objects (``base.py``), which load the text again when the server answers NOSCRIPT (after a
restart or ``SCRIPT FLUSH``); inside a pipeline ``run_pipeline`` does that.

Every script that changes the dock in a way a second run would change again carries a request id, made
once per call (``new_request_id``) and the same in every resend of it, and keeps its reply for
``REPLY_TTL_MS`` (lua/include/once.lua): a client retrying after a lost reply gets that reply back instead
of applying the call twice. The others are idempotent as they are (fence, reclaim, grow, columns_of,
version, unready, status, claim).
"""

from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Callable
from importlib import resources
from pathlib import Path

#: Script name -> file in lua/. Listed explicitly so a missing file fails at import, not mid-run.
SCRIPT_FILES = {
    "create": "create.lua",
    "put": "put.lua",
    "claim": "claim.lua",
    "unhold": "unhold.lua",
    "sample": "sample.lua",
    "take": "take.lua",
    "fence": "fence.lua",
    "release": "release.lua",
    "ack": "ack.lua",
    "reclaim": "reclaim.lua",
    "clear": "clear.lua",
    "prefetch": "prefetch.lua",
    "metrics": "metrics.lua",
    "grow": "grow.lua",
    "columns_of": "columns_of.lua",
    "reset": "reset.lua",
    "discard": "discard.lua",
    "version": "version.lua",
    "reserve": "reserve.lua",
    "unreserve": "unreserve.lua",
    "set_quota": "set_quota.lua",
    "unready": "unready.lua",
    "status": "status.lua",
    "mark": "mark.lua",
    "tq_rows": "tq_rows.lua",
    "tq_release": "tq_release.lua",
    "tq_lookup": "tq_lookup.lua",
    "tq_tags": "tq_tags.lua",
    "tq_begin": "tq_begin.lua",
    "tq_settled": "tq_settled.lua",
    "snapshot": "snapshot.lua",
    "restore": "restore.lua",
}

#: How long a script keeps its reply for a resend of the same call (lua/include/once.lua). A resend
#: comes within the client's retries, seconds after the call; a minute leaves room for slow retries.
REPLY_TTL_MS = 60_000


def new_request_id() -> str:
    """A request id for one call (see the module docstring): unique, the same in every resend of the call."""
    return uuid.uuid4().hex


#: Scripts run for many docks at once, outside any dock object (see ``StatusScript``).
SHARED = ("status",)

#: Redis 7 script flag letting a script write when the server is at ``maxmemory``. Without it a full
#: server refuses every script's first write, so consumers could not even mark rows consumed, and the
#: clear that would free memory fails too. Data itself never goes through scripts (puts HSET in the
#: MULTI, which a full server refuses whole), so the scripts' few bytes of status are safe to allow.
ALLOW_OOM = "#!lua flags=allow-oom\n"

_INCLUDE = re.compile(r"^-- @include (\w+)[ \t]*$", re.MULTILINE)


def lua_dir() -> Path:
    """The folder holding the Lua files: inside the installed package, or lua/ of a source checkout."""
    package = resources.files("broker")
    packaged = package / "lua"
    if packaged.is_dir():
        return Path(str(packaged))
    # A source checkout keeps lua/ beside the package (the wheel copies it in): found from the package, not
    # from this file, so the lookup does not depend on how deep this module sits.
    source = Path(str(package)).resolve().parent / "lua"
    if source.is_dir():
        return source
    raise FileNotFoundError(f"broker Lua scripts not found in {packaged} nor in {source}")


@functools.cache
def script_text(name: str) -> str:
    """Source of script ``name`` with its includes pasted in (see ``expand_includes``)."""
    folder = lua_dir()
    return expand_includes((folder / SCRIPT_FILES[name]).read_text(encoding="utf-8"),
                           lambda include: (folder / "include" / f"{include}.lua").read_text(encoding="utf-8"))


class IncludeError(Exception):
    """A Lua include is missing or includes itself, directly or not (a packaging or editing mistake)."""


def expand_includes(text: str, read: Callable[[str], str]) -> str:
    """``text`` with each ``-- @include NAME`` line replaced by ``read(NAME)``, itself expanded.

    An include declares what it needs with the same lines, so a script names only what it calls.
    Each include is pasted once per script, where it is first needed, after what it needs (Lua
    ``local function``s must be defined above their callers); a later mention pastes nothing. A
    cycle or a missing include raises IncludeError naming the chain.
    """
    pasted: set[str] = set()

    def expand(source: str, chain: tuple[str, ...]) -> str:
        def paste(match: re.Match[str]) -> str:
            include = match.group(1)
            if include in chain:
                raise IncludeError(f"Lua includes form a cycle: {' -> '.join((*chain, include))}")
            if include in pasted:
                return ""
            try:
                body = read(include)
            except FileNotFoundError:
                via = f" (needed by {' -> '.join(chain)})" if chain else ""
                raise IncludeError(f"Lua include {include!r} not found{via}") from None
            body = expand(body, (*chain, include))
            pasted.add(include)
            return body

        return _INCLUDE.sub(paste, source)

    return expand(text, ())


for _name in SCRIPT_FILES:  # fail at import if the package was built without its Lua files
    script_text(_name)
