"""Every command and snippet of README.md and docs/*.md runs as a reader would run it, or says in the document
why it is only illustrative.

A fenced block's language says what it is. ``python`` and ``bash`` blocks are run. ``text`` (diagrams,
synopses), ``yaml`` and ``conf`` are not programs and are checked as what they are: YAML is parsed, and
redis.conf lines are given to a redis-server. A ``python`` or ``bash`` block that cannot run as it stands
here (it needs your cluster, runs for minutes, or is the suite itself) is marked on the line above its fence::

    <!-- illustrative: why it is not run here -->

It is still checked as far as that goes without running it: every ``broker`` command in it parses with the
command's own parser, and Python compiles. In every shell block, the package's programs are run as the
README runs them, ``.venv/bin/broker``, ``.venv/bin/python``: bare ``broker`` or ``python`` fails outside an
activated venv.

Each document's blocks run in its order against one private redis-server (emptied first), from a scratch
folder where ``.venv`` is this interpreter's environment: a reader who set up as the README says, standing
in the clone. The documented server, ``127.0.0.1:6379``, becomes the private one (in a block's text, in
``$REDIS_URL`` and as ``redis-cli``'s port). A block may use what an earlier block of its document made:
the README's ``broker status grpo`` reads the dock its first program made.

``python -m tests.architecture.test_doc_blocks`` lists every block and what is done with it, without running any.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from broker.ops.local_redis import RedisServer
from tests.helpers import redis_server_binary, required

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Languages of blocks that are run, and of blocks that are not programs (checked as what they are).
PROGRAMS = {"python", "bash"}
NOT_PROGRAMS = {"text", "yaml", "conf"}
#: Where the documents' examples say the server is; the private server stands in for it.
DOCUMENTED_SERVER = "127.0.0.1:6379"
#: The package's programs, which a reader runs from the venv the README makes.
VENV_PROGRAMS = {"broker", "python", "python3", "pip", "pytest"}
#: Longest a block may take: the slowest runs a few gets that wait out their timeouts.
BLOCK_SECONDS = 300

_BLOCK = re.compile(
    r"^(?:<!-- illustrative: (?P<why>.+?) -->\n)?```(?P<lang>[^\n`]*)\n(?P<body>.*?)^```[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  #: of the opening fence, 1-based
    lang: str
    body: str
    why: str | None  #: why it is only illustrative, or None: it runs

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line} ({self.lang or 'no language'})"


def blocks(doc: Path) -> list[Block]:
    text = doc.read_text(encoding="utf-8")
    found = []
    for m in _BLOCK.finditer(text):
        fence = m.start("lang") - 3
        found.append(Block(doc, text.count("\n", 0, fence) + 1, m["lang"].strip(), m["body"], m["why"]))
    return found


def disposition(block: Block) -> str:
    """What the test does with ``block``, in a few words."""
    if block.lang in PROGRAMS:
        return f"illustrative ({block.why}): checked, not run" if block.why else "run"
    return {"text": "not a program", "yaml": "parsed", "conf": "given to a redis-server"}.get(block.lang, "?")


# -- the shell blocks' commands


def commands(body: str) -> list[list[str]]:
    """The shell commands of a block: lines joined at a trailing backslash, split as the shell splits words
    (comments dropped), one list per command of a line (``&&``, ``;``, ``|`` and ``&`` separate them)."""
    joined = re.sub(r"\\\n", " ", body)
    out = []
    for line in joined.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for word in lexer:
            if set(word) <= set(";&|"):
                if words:
                    out.append(words)
                words = []
            else:
                words.append(word)
        if words:
            out.append(words)
    return out


def program(words: list[str]) -> tuple[str, list[str]]:
    """A command's program and its arguments, past the environment assignments that open it."""
    i = 0
    while i < len(words) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[i]):
        i += 1
    rest = words[i:] or [""]
    return rest[0].removeprefix("$("), rest[1:]


def bare_programs(block: Block) -> list[str]:
    """The block's commands that run a program of the package without its venv path."""
    bad = []
    for words in commands(block.body):
        name, args = program(words)
        if name == "python3" and args[:2] == ["-m", "venv"]:
            continue  # how the venv is made
        if name in VENV_PROGRAMS:
            bad.append(" ".join(words))
    return bad


def check_broker_commands(block: Block) -> None:
    """Every ``broker`` command of ``block`` parses with the ``broker`` command's parser."""
    from broker.cli import build_parser

    for words in commands(block.body):
        name, args = program(words)
        if Path(name).name != "broker":
            continue
        try:
            build_parser().parse_args(args)
        except SystemExit as exc:
            pytest.fail(f"{block}: `{' '.join(words)}` does not parse (exit status {exc.code}; argparse said why "
                        "above)")


# -- running a document


def test_every_block_says_what_it_is():
    """A block without a language could hide a command nobody runs; a marker on a non-program means nothing."""
    wrong = []
    for doc in DOCUMENTS:
        for block in blocks(doc):
            if block.lang not in PROGRAMS | NOT_PROGRAMS:
                wrong.append(f"{block}: give the fence a language ({', '.join(sorted(PROGRAMS | NOT_PROGRAMS))})")
            elif block.why and block.lang not in PROGRAMS:
                wrong.append(f"{block}: only python and bash blocks can be illustrative")
            elif block.lang == "bash":
                wrong += [f"{block}: `{c}`: run it from the venv, as the README does (.venv/bin/...)"
                          for c in bare_programs(block)]
    assert not wrong, "\n".join(wrong)


@pytest.fixture(scope="module")
def doc_server():
    required(redis_server_binary(), "redis-server", "the documents' blocks")
    with RedisServer() as server:
        yield server


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_documents_blocks_run(doc: Path, doc_server: RedisServer, tmp_path: Path):
    with doc_server.client() as admin:
        admin.flushall()
    (tmp_path / ".venv").symlink_to(sys.prefix)
    report = []
    for block in blocks(doc):
        began = time.monotonic()
        run_block(block, doc_server, tmp_path)
        report.append(f"{str(block):45} {disposition(block)} ({time.monotonic() - began:.1f} s)")
    print("\n" + "\n".join(report))


def run_block(block: Block, server: RedisServer, cwd: Path) -> None:
    if block.why or block.lang not in PROGRAMS:
        check(block)
        return
    body = block.body.replace(DOCUMENTED_SERVER, f"127.0.0.1:{server.port}")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "REDIS_URL", "BROKER_REDIS_SERVER")}
    env["REDIS_URL"] = server.url
    if block.lang == "python":
        argv = [sys.executable, "-c", body]
    else:
        if "redis-cli" in body:
            required(shutil.which("redis-cli"), "redis-cli", "the documents' redis-cli recipes")
        argv = ["bash", "-c", _shell_preamble(server.port) + body]
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=BLOCK_SECONDS)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{block} ran past {BLOCK_SECONDS} s:\n{block.body}\n{exc.output or ''}")
    if done.returncode != 0:
        pytest.fail(f"{block} failed (exit status {done.returncode}):\n{block.body}\n--- it printed:\n"
                    f"{done.stdout[-4000:]}")


def _shell_preamble(port: int) -> str:
    """Shell blocks run with ``set -e``; ``redis-cli`` talks to the private server and fails on an error reply
    (redis-cli itself exits 0 on one)."""
    return (f"set -euo pipefail\n"
            f"redis-cli() {{ local out; out=$(command redis-cli -p {port} \"$@\"); printf '%s\\n' \"$out\"; "
            "case \"$out\" in ERR*|WRONGTYPE*|NOPERM*|NOSCRIPT*|\"(error)\"*) return 1;; esac; }\n")


def check(block: Block) -> None:
    """What can be checked of a block that is not run."""
    if block.lang == "python":
        compile(block.body, str(block), "exec")
    elif block.lang == "bash":
        check_broker_commands(block)
    elif block.lang == "yaml":
        yaml.safe_load(block.body)
    elif block.lang == "conf":
        settings = [line.split("#", 1)[0].split() for line in block.body.splitlines()]
        args = [word if i else f"--{word}" for words in settings for i, word in enumerate(words)]
        with RedisServer(*args) as server, server.client() as client:
            for words in filter(None, settings):  # the server took each setting as written
                assert client.config_get(words[0])[words[0]] == " ".join(words[1:]), f"{block}: {words}"


def test_a_broken_block_fails_the_test(doc_server: RedisServer, tmp_path: Path):
    """The runner can fail: a command that fails, a redis-cli error reply, a broker command that does not parse."""
    (tmp_path / ".venv").symlink_to(sys.prefix)
    doc = ROOT / "README.md"
    for lang, body in (("python", "raise SystemExit(3)\n"), ("bash", "redis-cli NO-SUCH-COMMAND\n"),
                       ("bash", "false\ntrue\n")):
        with pytest.raises(pytest.fail.Exception):
            run_block(Block(doc, 1, lang, body, None), doc_server, tmp_path)
    with pytest.raises(pytest.fail.Exception, match="does not parse"):
        check(Block(doc, 1, "bash", ".venv/bin/broker status --no-such-flag\n", "for the test"))
    assert bare_programs(Block(doc, 1, "bash", "REDIS_URL=x broker demo\n$(python -c 'x') &\n", None)) == [
        "REDIS_URL=x broker demo", "$(python -c x)"]


if __name__ == "__main__":
    for document in DOCUMENTS:
        for each in blocks(document):
            print(f"{str(each):45} {disposition(each)}")
    sys.exit(0)
