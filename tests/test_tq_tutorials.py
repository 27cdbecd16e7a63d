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


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_transfer_queue_script_runs_to_its_end_on_the_broker(script, tmp_path):
    source = SITE / script
    target = tmp_path / source.name
    target.write_text(renamed(source.read_text()))
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    env["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    env["BROKER_TQ_DIR"] = str(tmp_path)  # its own private server, whatever else runs here
    done = subprocess.run([sys.executable, str(target)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    tail = (done.stdout[-3000:] + "\n--- stderr ---\n" + done.stderr[-6000:])
    assert done.returncode == 0, tail
    assert "Traceback" not in done.stdout, tail
