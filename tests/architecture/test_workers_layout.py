"""workers/ keeps its layering: model/ below algorithms/ below config.py below runtime/, and no import circle.

Read from the source (every import, also the lazy and the type-only ones), so a circle cannot hide behind
``TYPE_CHECKING`` or a function-level import."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: What each part of workers/ may import of the others (its own modules aside).
ALLOWED = {
    "model": set(),
    "algorithms": {"model"},
    "config": {"model", "algorithms", "train_local"},
    "train_local": {"model", "algorithms"},
    "runtime": {"model", "algorithms", "config"},
    "options": set(),
    "demo": {"model", "algorithms", "config", "options", "runtime"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "workers").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the workers modules it imports (the nearest existing module for ``from x import name``)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def test_workers_has_no_import_circle():
    graph = _imports(_modules())
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        raise AssertionError(f"import circle in workers/: {' -> '.join(exc.args[1])}") from None


def test_each_part_of_workers_imports_only_the_parts_below_it():
    graph = _imports(_modules())
    assert {_part(m) for m in graph} - {""} == set(ALLOWED), "a new part of workers/: say where it sits in ALLOWED"
    wrong = sorted(
        f"{module} imports {target}"
        for module, targets in graph.items() if _part(module)
        for target in targets if _part(target) not in ALLOWED[_part(module)] | {_part(module), ""}
    )
    assert not wrong, wrong
