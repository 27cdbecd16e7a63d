"""A worker process SIGKILLed in the middle of a GRPO run: the driver restarts its group, its rows are redone,
and the run finishes with every row of every iteration trained exactly once.

The ledger is the trainer's own record (``trace``): per iteration, the rows each of its steps trained, from
the group that finished the iteration. A trainer group that lost a rank starts the iteration again from
the model and optimizer it began it with, and every row is offered to it again, so a row it had trained
before the kill is trained once in what the run keeps.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

pytest.importorskip("ray")

from broker.control.keys import DockKeys  # noqa: E402
from workers.algorithms.grpo import GRPO  # noqa: E402
from workers.config import Layout, RunConfig, with_layouts  # noqa: E402
from workers.runtime.pipeline import Pipeline, create_dock  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.slow]

PROMPTS, N = 8, 4
CAPACITY = PROMPTS * N
SMALL = {"actor_rollout": 8, "ref_log_prob": 8, "actor_log_prob": 16, "rule_reward": 8, "compute_advantage": 8,
         "actor_train": 8}


def make_config() -> RunConfig:
    base = RunConfig.for_algorithm("grpo", prompts=PROMPTS, n=N, batch_rows=dict(SMALL), trace=True,
                                   poll_seconds=0.5, stall_seconds=60.0, lease_seconds=30.0)
    return with_layouts(base, 1, 1, {"actor_rollout": Layout(1, 2), "actor_train": Layout(2, 1)})


def trained_rows(results: list[dict]) -> list[int]:
    """Every row the trainer's DP replicas trained in the iteration (TP rank 0 speaks for its group)."""
    return sorted(i for r in results if r["role"] == "actor_train" and r["tp_rank"] == 0
                  for batch in r["trace"] for i in batch["indexes"])


def kill_when(client: redis.Redis, consumed_key: str, rows: int, pid: int, delay: float) -> threading.Thread:
    """SIGKILL ``pid`` ``delay`` seconds after its role has taken ``rows`` rows of the iteration: a point in
    the middle of its work, whatever the machine's speed."""
    def kill() -> None:
        deadline = time.monotonic() + 120
        while client.bitcount(consumed_key) < rows and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(delay)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def pipeline_on(url: str, cfg: RunConfig) -> Iterator[Pipeline]:
    """The run's worker groups on a dock of its own, both gone at the end."""
    dock = create_dock(url, f"loss-{uuid.uuid4().hex[:6]}", cfg)
    pipeline = Pipeline(dock, cfg, cluster_cpus=2)
    try:
        yield pipeline
    finally:
        pipeline.shutdown()
        dock.delete()


def iterations_with_a_kill(pipeline: Pipeline, kill: Callable[[], threading.Thread]) -> Iterator[tuple[dict, list]]:
    """Iterations 1 to 3's metrics and results, ``kill()`` started as iteration 2 starts; the dock is cleared
    after each iteration has been checked."""
    for iteration in (1, 2, 3):
        killer = kill() if iteration == 2 else None
        metrics, results = pipeline.run_iteration(iteration)
        if killer is not None:
            killer.join()
        yield metrics, results
        pipeline.clear()


@pytest.mark.parametrize("victim", ["actor_train", "actor_rollout", "any"])
def test_a_killed_worker_is_replaced_and_every_row_is_trained_once(local_ray, real_url, victim):
    seed = int(os.environ.get("BROKER_KILL_SEED", random.randrange(1 << 30)))
    pick = random.Random(seed)
    cfg = make_config()
    client = redis.Redis.from_url(real_url)
    with pipeline_on(real_url, cfg) as pipeline:
        def kill() -> threading.Thread:
            role = pick.choice(GRPO.roles) if victim == "any" else victim
            rank = pick.randrange(len(pipeline.hosts[role]))
            rows, delay = pick.randrange(1, CAPACITY), pick.uniform(0.0, 0.3)
            print(f"seed {seed}: SIGKILL {role} rank {rank} {delay:.2f} s after it took row {rows} of iteration 2")
            return kill_when(client, DockKeys(pipeline.dock.name).consumed(role), rows,
                             pipeline.hosts[role][rank]["pid"], delay)

        for iteration, (metrics, results) in enumerate(iterations_with_a_kill(pipeline, kill), 1):
            assert trained_rows(results) == list(range(CAPACITY)), f"seed {seed}, iteration {iteration}"
            keys = DockKeys(pipeline.dock.name)
            for role in GRPO.roles:  # every stage consumed every row, and no lease is left out
                assert client.bitcount(keys.consumed(role)) == CAPACITY, (seed, iteration, role)
            assert all(s["leased"] == 0 for s in pipeline.dock.status()["consumers"].values()), seed
            assert metrics["train_steps"] == CAPACITY // SMALL["actor_train"], seed
        # The kill may land after the victim's last batch of the iteration (it then dies idle, and is found
        # dead by the next iteration's call): either way the group was restarted, once.
        assert pipeline.restarts == 1, seed


@pytest.mark.parametrize("algo, role, settings", [
    ("grpo", "actor_rollout", {"max_age": 2}),  # partial rollout: unfinished responses kept across passes
    ("dapo", "compute_advantage", {}),  # the filter: its drops and the driver's refills
], ids=["partial-rollout", "dapo-filter"])
def test_a_worker_killed_at_its_first_row_in_other_algorithms(local_ray, real_url, algo, role, settings):
    """The restart in the runs whose roles hold more than rows: partial responses across passes, groups dropped
    and refilled. Killed as soon as the role has taken a row of iteration 2 of 3; each iteration trains a full
    batch, each row once."""
    base = RunConfig.for_algorithm(algo, prompts=PROMPTS, n=N, trace=True, poll_seconds=0.5, stall_seconds=60.0,
                                   lease_seconds=30.0, **settings)
    cfg = with_layouts(base, 1, 1, {})
    client = redis.Redis.from_url(real_url)
    with pipeline_on(real_url, cfg) as pipeline:
        def kill() -> threading.Thread:
            return kill_when(client, DockKeys(pipeline.dock.name).consumed(role), 1, pipeline.hosts[role][0]["pid"],
                             0.0)

        for iteration, (metrics, results) in enumerate(iterations_with_a_kill(pipeline, kill), 1):
            trained = trained_rows(results)
            assert len(trained) == len(set(trained)) == CAPACITY, (iteration, trained)
            assert metrics["ledger"]["rows"] == CAPACITY
            assert all(s["leased"] == 0 for s in pipeline.dock.status()["consumers"].values())
        assert pipeline.restarts == 1
