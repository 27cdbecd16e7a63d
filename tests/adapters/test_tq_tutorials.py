"""TransferQueue's own tutorials and recipe, from the installed ``transferqueue`` wheel, run on the broker with
only the package name changed (``transfer_queue`` -> ``broker.transfer_queue``; the recipe's logging helper,
which is not part of the API, becomes ``logging.getLogger``). Skipped without the wheel, a test-only extra.

Each runs in its own process, as a user runs it: Ray started by the script, Redis found the way ``init`` finds
it (here the private redis-server the first ``init`` starts).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

tq = pytest.importorskip("transfer_queue")
pytest.importorskip("ray")

SITE = Path(tq.__file__).resolve().parent.parent
SCRIPTS = [
    "tutorial/02_kv_interface.py",
    "tutorial/03_metadata_concepts.py",
    "tutorial/05_custom_sampler.py",
    "tutorial/06_streaming_dataloader.py",
    "recipe/simple_use_case/single_controller_demo.py",
]

#: The only edits: the package's name in imports and in the recipe's lookup of its packaged config.yaml.
EDITS = [
    (re.compile(r"^import transfer_queue as tq\b", re.M), "import broker.transfer_queue as tq"),
    (re.compile(r"^import transfer_queue$", re.M), "import broker.transfer_queue as transfer_queue"),
    (re.compile(r"^from transfer_queue\.utils\.logging_utils import get_logger$", re.M),
     "from logging import getLogger as get_logger"),
    (re.compile(r"^(\s*)from transfer_queue(\.[\w.]+)? import", re.M), r"\1from broker.transfer_queue\2 import"),
    (re.compile(r"resources\.files\(\"transfer_queue\"\)"), 'resources.files("broker.transfer_queue")'),
]


def renamed(text: str) -> str:
    for pattern, repl in EDITS:
        text = pattern.sub(repl, text)
    return text


def test_the_edits_touch_only_the_package_name():
    for script in SCRIPTS:
        original = (SITE / script).read_text()
        edited = renamed(original)
        changed = [(a, b) for a, b in zip(original.splitlines(), edited.splitlines()) if a != b]
        assert changed, script
        for before, after in changed:
            assert "transfer_queue" in before and "broker.transfer_queue" in after or "get_logger" in before


@pytest.mark.once  # minutes: run once by .ci/run, apart from the README's test command
@pytest.mark.slow
def test_transfer_queues_scripts_run_to_their_end_on_the_broker(tmp_path):
    """All at once, each in its own process with its own Ray and private server: they spend most of their time
    in their own sleeps (tutorial 06 sleeps 5 s a step, the recipe 8 s), which run side by side; one after
    the other took 160-300 s of the suite."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    runs = {}
    for script in SCRIPTS:
        source = SITE / script
        folder = tmp_path / source.stem
        folder.mkdir()
        target = folder / source.name
        target.write_text(renamed(source.read_text()))
        runs[script] = subprocess.Popen(
            [sys.executable, str(target)], cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**env, "BROKER_TQ_DIR": str(folder)},  # its own private server, whatever else runs here
        )
    failed = []
    for script, run in runs.items():
        try:
            stdout, stderr = run.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            run.kill()
            stdout, stderr = run.communicate()
        tail = stdout[-3000:] + "\n--- stderr ---\n" + stderr[-6000:]
        if run.returncode != 0 or "Traceback" in stdout:
            failed.append(f"{script} (exit {run.returncode}):\n{tail}")
    assert not failed, "\n\n".join(failed)
