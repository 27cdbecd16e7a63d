"""Registry of the Lua scripts in ``lua/``: one file per atomic operation.

A line ``-- @include NAME`` in a script is replaced by ``lua/include/NAME.lua`` so helpers are
written once. Scripts are sent with EVALSHA through redis-py ``Script`` objects, which load the
text again when the server answers NOSCRIPT (after a restart or ``SCRIPT FLUSH``).
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path

import redis
from redis.commands.core import Script

#: Script name -> file in lua/. Listed explicitly so a missing file fails at import, not mid-run.
SCRIPT_FILES = {
    "create": "create.lua",
    "put": "put.lua",
    "sample": "sample.lua",
    "take": "take.lua",
    "clear": "clear.lua",
    "ack": "ack.lua",
}

_INCLUDE = re.compile(r"^-- @include (\w+)[ \t]*$", re.MULTILINE)


def lua_dir() -> Path:
    """The folder holding the Lua files: inside the installed package, or lua/ of a source checkout."""
    packaged = resources.files("broker") / "lua"
    if packaged.is_dir():
        return Path(str(packaged))
    source = Path(__file__).resolve().parent.parent / "lua"
    if source.is_dir():
        return source
    raise FileNotFoundError(f"broker Lua scripts not found in {packaged} nor in {source}")


@functools.cache
def script_text(name: str) -> str:
    """Source of script ``name`` with its includes pasted in."""
    folder = lua_dir()
    text = (folder / SCRIPT_FILES[name]).read_text(encoding="utf-8")
    return _INCLUDE.sub(lambda m: (folder / "include" / f"{m.group(1)}.lua").read_text(encoding="utf-8"), text)


#: Redis 7 script flag letting a script write when the server is at ``maxmemory``. Without it a full
#: server refuses every script's first write, so consumers could not even mark rows consumed, and the
#: clear that would free memory fails too. Data itself never goes through scripts (puts HSET in the
#: MULTI, which a full server refuses whole), so the scripts' few bytes of status are safe to allow.
ALLOW_OOM = "#!lua flags=allow-oom\n"


def supports_flags(client: redis.Redis) -> bool:
    """Whether the server takes Redis 7 script flags (Redis 6.2 and fakeredis do not)."""
    try:
        client.eval(ALLOW_OOM + "return 1", 0)
    except redis.ResponseError:
        return False
    return True


class Scripts:
    """The dock's scripts bound to one client; call as ``scripts.put(keys, args, client=pipe)``."""

    def __init__(self, client: redis.Redis, *, allow_oom: bool):
        prefix = ALLOW_OOM if allow_oom else ""

        def load(name: str) -> Script:
            return client.register_script(prefix + script_text(name))

        self.create = load("create")
        self.put = load("put")
        self.sample = load("sample")
        self.take = load("take")
        self.clear = load("clear")
        self.ack = load("ack")


for _name in SCRIPT_FILES:  # fail at import if the package was built without its Lua files
    script_text(_name)
