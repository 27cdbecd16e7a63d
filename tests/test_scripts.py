"""The Lua loader: includes declare their own needs and are pasted once, dependencies first."""

from __future__ import annotations

import re

import pytest

from broker.scripts import SCRIPT_FILES, IncludeError, expand_includes, lua_dir, script_text


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


def test_leases_and_generations_declare_that_they_need_bits():
    folder = lua_dir() / "include"
    for include in ("leases", "generations"):
        assert re.search(r"^-- @include bits$", (folder / f"{include}.lua").read_text(), re.MULTILINE)
