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

A slice outside the core (``broker/transfer_queue/``) brings its own scripts without the core importing it:
at its import it calls ``register_scripts`` with its folder of Lua files and their names. They join
``SCRIPT_FILES`` (so every wrapper can run them), they include the core's helpers (``lua/include/``), and on
Redis 7 they form the slice's own function library (``functions.py``), so the core's library is the same in
every process whichever slices it imported.
"""

from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

#: Script name -> file in lua/. Listed explicitly so a missing file fails at import, not mid-run.
SCRIPT_FILES = {
    "create": "create.lua",
    "partition": "partition.lua",
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
    "snapshot": "snapshot.lua",
    "restore": "restore.lua",
}

#: The core's own scripts (``SCRIPT_FILES`` before any slice registered its own).
CORE_SCRIPTS = tuple(SCRIPT_FILES)


@dataclass(frozen=True)
class SliceScripts:
    """Scripts a slice registered (``register_scripts``): its library's name, its folder, the scripts' names
    and those of them that only read (flagged ``no-writes`` in its function library)."""

    library: str
    folder: Path
    names: tuple[str, ...]
    read_only: frozenset[str]


#: Script name -> the slice that registered it (none for the core's).
SLICES: dict[str, SliceScripts] = {}


def register_scripts(library: str, folder: Path, files: Mapping[str, str], *, read_only: Sequence[str] = ()) -> None:
    """Make a slice's scripts (name -> file in ``folder``) known: the hook a slice outside the core calls at
    its import, so the core runs them without importing it (see the module docstring). ``library`` names the
    slice's Redis 7 function library (``functions.py``); ``read_only`` lists its scripts that only read. The
    files are read at once, so a missing one fails the slice's import. Registering the same again is a no-op;
    a name the core or another slice has raises ValueError."""
    entry = SliceScripts(library, Path(folder), tuple(files), frozenset(read_only))
    for name in files:
        known = SLICES.get(name)
        if (known is None and name in SCRIPT_FILES) or (known is not None and known != entry):
            raise ValueError(f"Lua script {name!r} is registered already")
    for name, file in files.items():
        SCRIPT_FILES[name] = file
        SLICES[name] = entry
    for name in files:
        script_text(name)


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


def script_path(name: str) -> Path:
    """The Lua file of script ``name``: in ``lua/``, or in the folder of the slice that registered it."""
    entry = SLICES.get(name)
    return (lua_dir() if entry is None else entry.folder) / SCRIPT_FILES[name]


@functools.cache
def script_text(name: str) -> str:
    """Source of script ``name`` with its includes pasted in (see ``expand_includes``); a slice's scripts
    include the core's helpers (``lua/include/``), as the core's do."""
    include = lua_dir() / "include"
    return expand_includes(script_path(name).read_text(encoding="utf-8"),
                           lambda helper: (include / f"{helper}.lua").read_text(encoding="utf-8"))


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


for _name in CORE_SCRIPTS:  # fail at import if the package was built without its Lua files
    script_text(_name)
