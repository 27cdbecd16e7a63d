"""The README's set-up and run commands, verbatim, in a fresh clone: what a new user meets first.

The commands are read from README.md's "Set up and run the demo" block, not copied here, and each line is
run with bash from the clone's root, as a reader pastes it: no flag added, no path made absolute, no
``$REDIS_URL`` or Ray of ours (the demo starts its own). The clone is of this checkout's HEAD with its
uncommitted changes laid over it (CI's checkout has none), so a developer tries what they are about to commit.

Marked ``once``: it takes minutes (a venv made, the demo's full run), so the README's test command leaves it
out and ``.ci/run`` runs it once, after that command.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from workers.options import build_demo_parser
from workers.runtime.report import first_last

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SECTION = "## Set up and run the demo"
#: Each command's bound: the set-up installs torch and Ray from the machine's cache; the demo trains 25 iterations.
COMMAND_SECONDS = 1500
#: What a user's shell does not have: our venv, our servers, our Ray.
NOT_THE_USERS = ("VIRTUAL_ENV", "PYTHONPATH", "REDIS_URL", "RAY_ADDRESS", "BROKER_REDIS_SERVER", "BROKER_TQ_DIR",
                 "PYTEST_XDIST_WORKER", "PYTEST_CURRENT_TEST")

pytestmark = [pytest.mark.once, pytest.mark.slow]


def readme_commands() -> list[str]:
    """The lines of the first bash block under the README's set-up heading."""
    text = README.read_text(encoding="utf-8")
    section = text[text.index(SECTION):]
    block = re.search(r"^```bash\n(.*?)^```", section, re.M | re.S)
    assert block, f"README.md's {SECTION!r} has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def fresh_clone(dest: Path) -> None:
    """``git clone`` of this checkout into ``dest``, with the working tree's uncommitted changes and untracked
    files (not ignored ones) laid over it."""
    git = ["git", "-C", str(ROOT)]
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(dest)], check=True)
    diff = subprocess.run([*git, "diff", "HEAD", "--binary"], check=True, capture_output=True).stdout
    if diff:
        subprocess.run(["git", "-C", str(dest), "apply", "--whitespace=nowarn"], input=diff, check=True)
    listed = subprocess.run([*git, "ls-files", "--others", "--exclude-standard", "-z"], check=True,
                            capture_output=True).stdout.decode()
    for name in filter(None, listed.split("\0")):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)


def users_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in NOT_THE_USERS}
    ours = str(Path(sys.prefix) / "bin")
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != ours)
    return env


def test_the_readmes_commands_set_up_and_run_the_demo_in_a_fresh_clone(tmp_path: Path):
    commands = readme_commands()
    assert any("broker demo" in c for c in commands), f"no demo among the README's commands {commands}"
    clone = tmp_path / "redis-transfer-dock"
    fresh_clone(clone)
    for command in commands:
        log = tmp_path / f"command-{commands.index(command)}.log"
        with open(log, "w+") as out:
            try:
                done = subprocess.run(["bash", "-c", command], cwd=clone, env=users_environment(), stdout=out,
                                      stderr=subprocess.STDOUT, timeout=COMMAND_SECONDS)
            except subprocess.TimeoutExpired:
                pytest.fail(f"`{command}` ran past {COMMAND_SECONDS} s:\n{log.read_text()[-4000:]}")
        printed = log.read_text(errors="replace")
        assert done.returncode == 0, f"`{command}` failed (exit status {done.returncode}):\n{printed[-4000:]}"
        assert "Traceback" not in printed, f"`{command}` printed a traceback:\n{printed[-4000:]}"

    out = clone / "grpo-demo"  # the default --out, relative to where the user stands
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == build_demo_parser().parse_args([]).iterations
    first, last = first_last([r["reward"] for r in records])
    assert last > first + 0.3, f"the demo did not learn: reward {first:.3f} (first 3) -> {last:.3f} (last 3)"
    assert (out / "grpo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "checkpoint" / "state.json").is_file()  # what the README's --resume goes on from
