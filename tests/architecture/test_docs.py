"""The README and docs/: links that lead somewhere, a README that stays short, and tables that match the code.

``python -m tests.architecture.test_docs`` writes the generated key layout table in docs/operations.md again.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import broker.transfer_queue.keys  # noqa: F401 (adds the TransferQueue slice's keys to the layout)
from broker.control.keys import DockKeys, key_layout, key_layout_markdown

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
OPERATIONS = DOCS / "operations.md"

#: The README is the way in, not the manual: what it does not say belongs in docs/.
README_MAX_LINES = 250

TABLE_START = re.compile(r"^<!-- generated from .*? -->\n", re.MULTILINE)
TABLE_END = "<!-- end of the generated table -->\n"

_FENCE = re.compile(r"^```.*?^```[^\n]*$", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w./-]*\w")
#: Source files named in prose: they move with restructurings, and a stale path misleads a newcomer.
_SOURCE_PATH = re.compile(r"(?<![\w/.-])(?:broker|workers|tests|lua)/[\w./-]*\.(?:py|lua)\b")


def documents() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose(path: Path) -> str:
    """The Markdown of ``path`` without its fenced code blocks, where brackets and '#' mean code."""
    return _FENCE.sub("", path.read_text(encoding="utf-8"))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces made hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(path), re.MULTILINE):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers a repeated heading's anchor
    return found


def exists(target: Path) -> bool:
    return target.exists()


@pytest.mark.parametrize("doc", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(doc: Path):
    broken = []
    for target in _LINK.findall(prose(doc)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto: are not ours to check
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not exists(path):
            broken.append(f"{target}: no file {path.relative_to(ROOT)}")
        elif anchor and path.exists() and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading with anchor #{anchor} in {path.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_docs_path_named_exists(doc: Path):
    named = set(_DOCS_PATH.findall(doc.read_text(encoding="utf-8")))
    missing = sorted(p for p in named if not exists(ROOT / p))
    assert not missing, f"{doc.relative_to(ROOT)} names {missing}"


@pytest.mark.parametrize("doc", documents(), ids=lambda p: p.name)
def test_every_source_file_named_exists(doc: Path):
    named = set(_SOURCE_PATH.findall(doc.read_text(encoding="utf-8")))
    missing = sorted(n for n in named if not (ROOT / n).exists() and not re.search(r"/[A-Z_]+\.", n))  # NAME.lua
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def test_the_readme_stays_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move the detail into docs/"


def test_every_doc_is_in_the_readme_contents():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in _LINK.findall(prose(README))}
    unlisted = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert not unlisted, f"docs not in the README's contents: {unlisted}"


def generated_table(text: str) -> tuple[int, int]:
    """Where the generated key table sits in docs/operations.md: (start, end) offsets of its rows."""
    start = TABLE_START.search(text)
    assert start, "docs/operations.md lost the marker opening the generated key table"
    end = text.index(TABLE_END, start.end())
    return start.end(), end


def test_the_key_table_in_the_docs_is_the_one_the_code_renders():
    text = OPERATIONS.read_text(encoding="utf-8")
    start, end = generated_table(text)
    assert text[start:end] == key_layout_markdown(), (
        "the key layout in docs/operations.md differs from the code's: run `python -m tests.architecture.test_docs`"
    )


def _pattern(key: str) -> re.Pattern[str]:
    """A regex matching the real keys of a layout pattern (NAME, COLUMN, K, ... standing for parts)."""
    parts = re.split(r"(NAME|COLUMN|CONSUMER|REQUEST|EPOCH|K|W|S)", key)
    stands = {"K": r"\d+", "W": r"\d+", "S": r"\d+", "EPOCH": r"\d+"}
    return re.compile("".join(stands.get(p, r"[\w.-]+") if i % 2 else re.escape(p) for i, p in enumerate(parts)))


def test_every_key_a_dock_deletes_is_in_the_layout():
    patterns = [_pattern(row.key) for row in key_layout()]
    dock = DockKeys("grpo")
    keys = dock.every_key(["prompts", "responses"], ["actor_train"], age_buckets=3)
    keys += [dock.reply("abc"), DockKeys.shard_data("grpo~2", "prompts", 7), DockKeys.shard_replicated("grpo~2")]
    unlisted = [key for key in keys if not any(p.fullmatch(key) for p in patterns)]
    assert not unlisted, f"keys missing from broker.control.keys.key_layout(): {unlisted}"


def test_the_lua_scripts_listed_in_the_docs_are_the_ones_in_lua():
    text = (DOCS / "development.md").read_text(encoding="utf-8")
    section = text[text.index("## The Lua scripts"):text.index("## Adding a script")]
    listed = set(re.findall(r"^- `(\w+)`(?: and `(\w+)`)?", section, re.MULTILINE))
    names = {name for pair in listed for name in pair if name}
    shipped = {p.stem for p in (ROOT / "lua").glob("*.lua")} | {p.stem for p in ROOT.glob("broker/*/lua/*.lua")}
    assert names == shipped, f"only listed: {sorted(names - shipped)}; only in lua/: {sorted(shipped - names)}"


def test_every_test_file_is_in_the_layout_of_the_tests():
    """docs/development.md's table of the tests names every tests/FOLDER/test_*.py in its folder's row (and no
    file that is gone); no test file lies at tests/ itself or in a folder the table has no row for."""
    text = (DOCS / "development.md").read_text(encoding="utf-8")
    section = text[text.index("## Layout of the tests"):text.index("## Where the time goes")]
    rows = re.findall(r"^\| `tests/(\w+)/` \|(.*)\|\s*$", section, re.MULTILINE)
    listed = {f"{folder}/{name}" for folder, cells in rows for name in re.findall(r"`(test_\w+\.py)`", cells)}
    present = {p.relative_to(ROOT / "tests").as_posix() for p in (ROOT / "tests").rglob("test_*.py")}
    assert listed == present, (f"missing from the table (or in another folder than its row's): "
                               f"{sorted(present - listed)}; in the table but not there: {sorted(listed - present)}")


def test_the_readme_test_command_is_the_one_ci_runs():
    """The README's test command is, verbatim, a line of .ci/run: CI runs what a developer is told to run."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Run the tests"):]
    command = re.search(r"^```bash\n(.+)$", section, re.MULTILINE)
    assert command, "no bash block under the README's 'Run the tests'"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert command.group(1) in ci, f".ci/run does not run the README's test command {command.group(1)!r}"


def write_key_table() -> None:
    """Write the code's key layout table into docs/operations.md between its markers."""
    text = OPERATIONS.read_text(encoding="utf-8")
    start, end = generated_table(text)
    OPERATIONS.write_text(text[:start] + key_layout_markdown() + text[end:], encoding="utf-8")


if __name__ == "__main__":
    write_key_table()
    print(f"wrote the key layout table into {OPERATIONS.relative_to(ROOT)}")
