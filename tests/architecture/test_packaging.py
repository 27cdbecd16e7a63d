"""A wheel built from this tree carries the Lua scripts and py.typed, and a non-editable install finds them."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SMOKE = """
import sys, fakeredis, torch, broker, broker.control.scripts
import broker.transfer_queue.scripts  # reads the slice's Lua files: a wheel without them fails here
from broker import TransferDock
site = sys.argv[1]
assert broker.__file__.startswith(site), broker.__file__
assert str(broker.control.scripts.lua_dir()).startswith(site), broker.control.scripts.lua_dir()
dock = TransferDock(fakeredis.FakeRedis(), "w", prompts_num=2, n_samples_per_prompt=2, columns=["a"], consumers=["c"])
dock.put_experience({"a": torch.arange(4)}, indexes=[0, 1, 2, 3])
print(dock.get_experience("c", ["a"], 4)[1])
"""


@pytest.mark.slow
def test_non_editable_install_finds_the_lua_scripts(tmp_path):
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next(tmp_path.glob("*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    import broker.transfer_queue.scripts  # noqa: F401 (the slice's scripts ship inside it)
    from broker.control.scripts import SCRIPT_FILES
    from broker.control.scripts.loader import SLICES, script_path

    for name, file in SCRIPT_FILES.items():
        inside = f"broker/lua/{file}" if name not in SLICES else str(script_path(name).relative_to(ROOT))
        assert inside in names, inside
    assert "broker/py.typed" in names  # type checkers of users' code read the package's annotations
    assert "broker/lua/include/bits.lua" in names

    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stderr[-2000:]
    # From an empty folder with only the installed copy first on the path: the source tree is not used.
    run = subprocess.run(
        [sys.executable, "-c", SMOKE, str(site)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[0, 1, 2, 3]"
