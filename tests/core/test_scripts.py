"""The Lua loader: includes declare their own needs and are pasted once, dependencies first."""

from __future__ import annotations

import re

import pytest

import broker.transfer_queue.scripts  # noqa: F401 (its scripts are checked too)
from broker.control.scripts import SCRIPT_FILES, IncludeError, expand_includes, lua_dir, script_text
from broker.control.scripts.loader import script_path


def reader(files: dict[str, str]):
    def read(name: str) -> str:
        if name not in files:
            raise FileNotFoundError(name)
        return files[name]

    return read


def test_includes_expand_recursively_once_and_dependencies_first():
    files = {
        "bits": "BITS",
        "leases": "-- @include bits\nLEASES",
        "generations": "-- @include bits\nGENERATIONS",
    }
    text = expand_includes("HEADER\n-- @include leases\n-- @include generations\n-- @include bits\nBODY", reader(files))
    assert text.count("BITS") == 1 and text.count("LEASES") == 1 and text.count("GENERATIONS") == 1
    assert text.index("HEADER") < text.index("BITS") < text.index("LEASES") < text.index("GENERATIONS")
    assert text.index("GENERATIONS") < text.index("BODY")
    assert "@include" not in text


def test_a_cycle_names_the_chain():
    files = {"a": "-- @include b\n", "b": "-- @include c\n", "c": "-- @include a\n"}
    with pytest.raises(IncludeError, match="cycle: a -> b -> c -> a"):
        expand_includes("-- @include a\n", reader(files))
    with pytest.raises(IncludeError, match="cycle: self -> self"):
        expand_includes("-- @include self\n", reader({"self": "-- @include self\n"}))


def test_a_missing_include_names_who_needed_it():
    with pytest.raises(IncludeError, match="'bits' not found \\(needed by leases\\)"):
        expand_includes("-- @include leases\n", reader({"leases": "-- @include bits\n"}))
    with pytest.raises(IncludeError, match="'nope' not found$"):
        expand_includes("-- @include nope\n", reader({}))


def test_every_shipped_script_expands_whole():
    include_names = {p.stem for p in (lua_dir() / "include").glob("*.lua")}
    for name in SCRIPT_FILES:
        text = script_text(name)
        assert not re.search(r"^-- @include", text, re.MULTILINE), name
        assert text.startswith("--[[ " + name), name  # the KEYS/ARGV header stays first
        for include in include_names:  # each helper pasted at most once: a second copy would redefine locals
            marker = f"--[[ {include}:"
            assert text.count(marker) <= 1, (name, include)


#: Top-level names an include defines: ``local function NAME`` and ``local NAME = ...``.
_DEFINED = re.compile(r"^local (?:function )?(\w+)", re.MULTILINE)


def _code(text: str) -> str:
    """Lua source without its comments, so a helper named in prose does not count as called."""
    return re.sub(r"--.*$", "", re.sub(r"--\[\[.*?\]\]", "", text, flags=re.DOTALL), flags=re.MULTILINE)


def test_each_lua_file_includes_exactly_what_it_calls():
    # A file must declare every include whose helpers it calls (leases.lua once relied on its scripts
    # including bits), and only those: what an include needs is for the include to declare, so a
    # file's list says what the file itself calls and never goes stale when an include changes.
    folder = lua_dir()
    includes = {p.stem: p.read_text(encoding="utf-8") for p in (folder / "include").glob("*.lua")}
    # (the TransferQueue slice's scripts, registered at import, have no includes of their own)
    defined = {name: set(_DEFINED.findall(text)) for name, text in includes.items()}
    files = {f"include/{name}.lua": text for name, text in includes.items()}
    files |= {str(script_path(name)): script_path(name).read_text(encoding="utf-8") for name in SCRIPT_FILES}
    for path, text in files.items():
        words = set(re.findall(r"\w+", _code(text)))
        calls = {name for name, names in defined.items() if path != f"include/{name}.lua" and names & words}
        declared = set(re.findall(r"^-- @include (\w+)[ \t]*$", text, re.MULTILINE))
        assert declared == calls, f"{path}: includes {sorted(declared)} but calls helpers of {sorted(calls)}"
