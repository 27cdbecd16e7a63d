"""The planes of docs/design.md, held against the code: each folder of broker/ imports only the planes
below it, so a change to the data path never has to look up into the dock, the adapters or the tools.

The rules are the table in docs/design.md ("Which plane may import which"); a new import that breaks one
fails here, naming the file and the import. ALLOWED is read against that table too, so changing a rule means
changing both, and a cell that differs is named.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

BROKER = Path(__file__).resolve().parents[2] / "broker"

#: Plane -> the planes its modules may import (besides their own). "face" is broker/__init__.py and the
#: old import paths kept for users' code; "cli" is the ``broker`` command.
ALLOWED = {
    "errors": set(),
    "connection": {"errors"},
    "control": {"connection", "errors"},
    "data": {"control", "connection", "errors"},
    "api": {"data", "control", "connection", "errors"},
    "adapters": {"face", "api", "ops", "control", "connection", "errors"},
    # TransferQueue's drop-in, one slice owning its Lua, wrappers, keys and system code: it may import what
    # an adapter may, and nothing of the core imports it (its scripts and keys join the core's by hooks).
    "transfer_queue": {"face", "api", "ops", "control", "connection", "errors"},
    "ops": {"api", "data", "control", "connection", "errors"},
    "bench": {"face", "adapters", "transfer_queue", "ops", "api", "errors"},
    "face": {"adapters", "ops", "api", "control", "connection", "errors"},
    "cli": {"face", "bench", "adapters", "transfer_queue", "ops", "api", "data", "control", "connection", "errors"},
}
FOLDERS = {"connection", "control", "data", "api", "adapters", "transfer_queue", "ops", "bench"}


def plane_of(module: str) -> str:
    """The plane of a dotted module name inside broker (``broker.api.dock`` -> ``api``)."""
    parts = module.split(".")
    if len(parts) == 1:
        return "face"
    if parts[1] in FOLDERS:
        return parts[1]
    if parts[1] in ("errors", "cli"):
        return parts[1]
    if parts[1] == "__main__":  # ``python -m broker``: the command
        return "cli"
    return "face"  # the old import paths


def module_name(path: Path) -> str:
    rel = path.relative_to(BROKER.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def broker_imports(path: Path, *, module_level: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import of a broker module in ``path``, relative ones resolved (``module_level``:
    see ``imports_in``)."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    return imports_in(path.read_text(), package, module_level=module_level)


def imports_in(source: str, package: list[str], *, module_level: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import of a broker module in ``source``, a module of ``package``; with
    ``module_level``, only those run when the module is imported (not inside a function or class, nor under
    ``if TYPE_CHECKING:``)."""
    found = []
    tree = ast.parse(source)
    for node in _module_level(tree.body) if module_level else ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "broker"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "broker":
                continue
            # ``from broker.api import dock`` imports broker.api.dock: judge the module, not the package.
            subs = [f"{target}.{a.name}" for a in node.names if is_module(f"{target}.{a.name}")]
            found += [(node.lineno, s) for s in subs] or [(node.lineno, target)]
    return found


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of ``body`` run at import: into ``if``/``try``/``with`` blocks, not into functions,
    classes or ``if TYPE_CHECKING:``."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                yield from _module_level(node.body)
            yield from _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                yield from _module_level(block)
        elif isinstance(node, ast.With):
            yield from _module_level(node.body)


def is_module(dotted: str) -> bool:
    path = BROKER.parent / dotted.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


SOURCES = sorted(p for p in BROKER.rglob("*.py"))


def test_every_module_has_a_plane():
    assert SOURCES
    for path in SOURCES:
        assert plane_of(module_name(path)) in ALLOWED, path


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(BROKER.parent)))
def test_imports_go_down_the_planes(path):
    mine = plane_of(module_name(path))
    wrong = [
        f"{path.relative_to(BROKER.parent)}:{line} imports {target} ({plane_of(target)}), "
        f"but {mine} may import only {sorted(ALLOWED[mine])}"
        for line, target in broker_imports(path)
        if plane_of(target) != mine and plane_of(target) not in ALLOWED[mine]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_rules_catch_an_upward_import():
    """The check can fail: a control-plane module importing the dock, even inside a function or through
    its package, is reported."""
    source = "def f():\n    from broker.api.dock import TransferDock\n\nfrom broker.api import handout\n"
    found = imports_in(source, ["broker", "control"])
    assert found == [(4, "broker.api.handout"), (2, "broker.api.dock")] or sorted(found) == [
        (2, "broker.api.dock"), (4, "broker.api.handout")]
    assert {plane_of(t) for _, t in found} == {"api"}
    assert "api" not in ALLOWED["control"]


def import_circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The circles of the import graph ``edges`` (module -> modules it imports): each one found once, as the
    chain of modules from its first back to it."""
    circles, done = [], set()
    for start in sorted(edges):
        stack, on_path = [(start, iter(sorted(edges.get(start, ()))))], [start]
        while stack:
            node, todo = stack[-1]
            nxt = next(todo, None)
            if nxt is None:
                stack.pop()
                on_path.pop()
                done.add(node)
            elif nxt in on_path:
                circle = on_path[on_path.index(nxt):] + [nxt]
                if not any(set(circle) == set(c) for c in circles):
                    circles.append(circle)
            elif nxt not in done:
                stack.append((nxt, iter(sorted(edges.get(nxt, ())))))
                on_path.append(nxt)
    return circles


def test_broker_has_no_import_circle():
    """No module of broker/ imports, at import time, one that imports it back (directly or through others):
    a circle makes the import order matter and leaves half-made modules to whoever comes first. Imports
    inside functions and under ``TYPE_CHECKING`` run later, and are left out."""
    edges = {module_name(p): {t for _, t in broker_imports(p, module_level=True)} - {module_name(p)}
             for p in SOURCES}
    circles = import_circles(edges)
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_the_circle_check_can_fail():
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import broker.api\ndef f():\n" \
             "    import broker.data\ntry:\n    import broker.ops\nexcept ImportError:\n    pass\n"
    assert imports_in(source, ["broker"], module_level=True) == [(7, "broker.ops")]


def test_no_core_plane_may_import_the_transfer_queue_slice():
    core = ("errors", "connection", "control", "data", "api")
    assert not [p for p in core if "transfer_queue" in ALLOWED[p]]
DESIGN = BROKER.parent / "docs" / "design.md"


def plane_named(word: str) -> str:
    """The plane a name in design.md's table means: `api/`, `errors.py`, `cli.py`, `__main__.py` (the command),
    `__init__.py` or `broker` (the face), or the words "the command" and "the face"."""
    word = word.strip().strip("`").strip()
    word = re.sub(r"^(the\s+|broker/)", "", word).strip()
    word = re.sub(r"(/|\.py)$", "", word)
    return {"__main__": "cli", "command": "cli", "__init__": "face", "broker": "face"}.get(word, word)


def without_remarks(cell: str) -> str:
    """A cell of the table without its remarks, which say why, not which: in parentheses, or after a colon."""
    while True:
        shorter = re.sub(r"\s*\([^()]*\)", "", cell)
        if shorter == cell:
            return cell.split(":", 1)[0]
        cell = shorter


def design_rules(text: str) -> dict[str, set[str]]:
    """Plane -> the planes it may import, as design.md's table "Which plane may import which" states them.

    A row is `| planes | may import |`: the first cell names its planes in backticks (`cli.py`, `__main__.py`:
    one plane), the second lists planes separated by commas or "and", or says "nothing of the broker",
    "everything" or "everything but ..." (every plane of the table but the row's own and those named);
    remarks, in parentheses or after a colon, are left out. The header and a row naming no plane in backticks
    are skipped."""
    start = text.index("**Which plane may import which**")
    table = re.search(r"(?:^\|.*\n?)+", text[start:], re.MULTILINE)
    assert table, "design.md: no table after 'Which plane may import which'"
    named = {}
    for planes, imports in re.findall(r"^\|([^|\n]*)\|([^|\n]*)\|", table.group(0), re.MULTILINE):
        for plane in {plane_named(p) for p in re.findall(r"`([^`]+)`", without_remarks(planes))}:
            named[plane] = imports.strip()
    rules = {}
    for plane, imports in named.items():
        words = [w for w in re.split(r",|;|\band\b", without_remarks(imports)) if w.strip()]
        first = words[0].strip() if words else ""
        if first == "nothing of the broker" and len(words) == 1:
            rules[plane] = set()
        elif first.startswith("everything"):
            but = [re.sub(r"^everything\s*(but)?", "", first), *words[1:]]
            rules[plane] = set(named) - {plane} - {plane_named(w) for w in but if w.strip()}
        else:
            rules[plane] = {plane_named(w) for w in words}
    return rules


def test_the_rules_are_the_ones_design_md_states():
    """docs/design.md's table "Which plane may import which" and ALLOWED are the same rules, so the doc
    and the check cannot drift: a row or a cell that differs is named."""
    stated = design_rules(DESIGN.read_text(encoding="utf-8"))
    differ = [f"plane {plane!r}: design.md's row says it may import {sorted(stated[plane])}, "
              f"ALLOWED {sorted(ALLOWED[plane])} (only in design.md: {sorted(stated[plane] - ALLOWED[plane])}; "
              f"only in ALLOWED: {sorted(ALLOWED[plane] - stated[plane])})"
              for plane in sorted(stated.keys() & ALLOWED.keys()) if stated[plane] != ALLOWED[plane]]
    differ += [f"plane {plane!r} has a row in design.md's table but no entry in ALLOWED"
               for plane in sorted(stated.keys() - ALLOWED.keys())]
    differ += [f"plane {plane!r} is in ALLOWED but has no row in design.md's table"
               for plane in sorted(ALLOWED.keys() - stated.keys())]
    assert not differ, "\n".join(differ)


def test_the_table_reader_reads_what_design_md_may_write():
    """The reader of design.md's table takes remarks, "and", "everything but" and a row of two files."""
    text = ("**Which plane may import which** (remark):\n\nA paragraph between.\n\n| plane | may import |\n|---|---|\n"
            "| `errors.py` | nothing of the broker |\n| `data/` | `control/` (its scripts) and errors |\n"
            "| `tq/` | the face (`broker`), data (the bytes, (nested): x), errors: why (y, z) |\n"
            "| `bench/` | everything but the command and tq |\n| `cli.py`, `__main__.py` | everything |\n\nWhy")
    assert design_rules(text) == {
        "errors": set(), "data": {"control", "errors"}, "tq": {"face", "data", "errors"},
        "bench": {"errors", "data"}, "cli": {"errors", "data", "tq", "bench"}}


#: "About 400 lines" (docs/design.md): a module a few lines past 400 is not cut in two for it.
LONG = 420
#: What a longer module says near its top, followed by why it is one module.
REASON = "Over 400 lines:"


def long_without_reason(paths: list[Path], root: Path = BROKER.parent) -> list[str]:
    """The modules of ``paths`` (named from ``root``) over ``LONG`` lines whose first 20 lines do not say why
    (``REASON``)."""
    found = []
    for path in paths:
        lines = path.read_text().splitlines()
        if len(lines) > LONG and not any(REASON in line for line in lines[:20]):
            found.append(f"{path.relative_to(root)} ({len(lines)} lines)")
    return found


def test_no_module_is_long_without_saying_why():
    """A module over about 400 lines says at its top why it is one ("Over 400 lines: ..."), or is cut along
    what it holds: a long module is where a newcomer loses the thread."""
    paths = SOURCES + sorted((BROKER.parent / "workers").rglob("*.py"))
    assert not long_without_reason(paths), long_without_reason(paths)


def test_the_length_check_can_fail(tmp_path):
    long = tmp_path / "long.py"
    long.write_text('"""A module."""\n' + "x = 1\n" * LONG)
    said = tmp_path / "said.py"
    said.write_text(f'"""A module.\n\n{REASON} one contract.\n"""\n' + "x = 1\n" * LONG)
    assert long_without_reason([long, said], tmp_path) == ["long.py (421 lines)"]
