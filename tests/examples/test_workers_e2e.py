"""Ray worker groups on a local Ray against a real Redis: the pipeline flows through the dock.

One role runs as 2 DP x 2 TP. Checked: every row reaches every stage exactly once (the ranks' own
records and the dock's consumed bitmaps agree), both TP ranks of a replica receive bit-identical
batches, weights flow trainer -> rollout/log-prob each iteration, DP trainers stay in sync, and the
dock is empty after clear. The same for PPO (a critic, rows handed out one by one) and for DAPO, whose
filter drops groups that come back as new prompts: there every row reaches every stage after the
filter exactly once, and the stages up to it once per prompt the row held.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import replace

import pytest
import redis

pytest.importorskip("ray")

import ray  # noqa: E402

from broker.control.keys import DockKeys  # noqa: E402
from workers.algorithms.grpo import GRPO  # noqa: E402
from workers.config import Layout, RunConfig, with_layouts  # noqa: E402
from workers.demo import iteration_line  # noqa: E402
from workers.runtime.pipeline import Pipeline, create_dock  # noqa: E402
from workers.runtime.report import MetricsLog, plot, read_metrics  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.slow]

PROMPTS, N = 8, 4
CAPACITY = PROMPTS * N
ROLES, COLUMNS = GRPO.roles, GRPO.columns
# Small gets, so each role takes several batches per iteration and the DP replicas really share the work.
SMALL = {"actor_rollout": 8, "ref_log_prob": 8, "actor_log_prob": 16, "rule_reward": 8, "compute_advantage": 8,
         "actor_train": 8}



def make_config(overrides: dict[str, Layout], algo: str = "grpo", **kwargs) -> RunConfig:
    settings = {"prompts": PROMPTS, "n": N, "batch_rows": dict(SMALL), **kwargs}
    base = RunConfig.for_algorithm(algo, trace=True, poll_seconds=1.0, stall_seconds=60.0, **settings)
    return with_layouts(base, 1, 1, overrides)


def leaders(results: list[dict], role: str) -> list[dict]:
    return [r for r in results if r["role"] == role and r["tp_rank"] == 0]


def check_every_row_once(results: list[dict], dock, client: redis.Redis) -> None:
    keys = DockKeys(dock.name)
    for role in ROLES:
        got = sorted(i for r in leaders(results, role) for batch in r["trace"] for i in batch["indexes"])
        assert got == list(range(CAPACITY)), f"{role} received rows {got}"
        assert client.bitcount(keys.consumed(role)) == CAPACITY, role
    status = dock.status()
    assert all(s["ready"] == CAPACITY for s in status["columns"].values()), status
    assert all(s["consumed"] == CAPACITY for s in status["consumers"].values()), status


def check_tp_ranks_agree(results: list[dict], role: str, dp: int) -> None:
    for d in range(dp):
        ranks = sorted((r for r in results if r["role"] == role and r["dp_rank"] == d), key=lambda r: r["tp_rank"])
        assert len(ranks) == 2
        assert ranks[0]["trace"], f"{role} dp{d} got no batch"
        # Indexes and a CRC32 of every padded tensor: the same batches, bit for bit, in the same order.
        assert ranks[0]["trace"] == ranks[1]["trace"], f"{role} dp{d}: TP ranks received different batches"


def checksums(pipeline: Pipeline, role: str) -> list[int]:
    return ray.get([a.weights_checksum.remote() for a in pipeline.groups[role].actors])


def check_the_demo_reports(cfg: RunConfig, records: list[dict], folder, line_says: str) -> None:
    """What ``broker demo --algo ALGO`` writes of these iterations: its JSONL records (every role busy, the
    rows, a reward), its progress line (``line_says``: the algorithm's own figure) and its picture with the
    algorithm's panel. The demo itself runs once in tests/examples/test_demo_smoke.py (GRPO); a demo run per
    algorithm would start Ray and every worker again for the same pipeline this test already ran."""
    log = MetricsLog(folder / "metrics.jsonl")
    for metrics in records:
        log.write(metrics)
    log.close()
    written = read_metrics(folder / "metrics.jsonl")
    assert [r["iteration"] for r in written] == [1, 2]
    for r in written:
        assert r["algo"] == cfg.algo and r["rows"] == cfg.capacity and r["samples_per_s"] > 0
        assert 0.0 <= r["reward"] <= 1.0
        assert {role for role, *_ in r["busy"]} == set(cfg.roles)
        assert line_says in iteration_line(cfg, r)
    picture = folder / f"{cfg.algo}.png"
    plot(written, picture)
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rows_flow_through_every_stage_once(local_ray, real_url):
    cfg = make_config({"actor_rollout": Layout(2, 2)})
    client = redis.Redis.from_url(real_url)
    dock = create_dock(real_url, f"e2e-{uuid.uuid4().hex[:6]}", cfg)
    pipeline = Pipeline(dock, cfg, cluster_cpus=2)
    try:
        ref_before = checksums(pipeline, "ref_log_prob")
        trained = None
        for iteration in (1, 2):
            metrics, results = pipeline.run_iteration(iteration)
            check_every_row_once(results, dock, client)
            check_tp_ranks_agree(results, "actor_rollout", dp=2)
            assert 0.0 <= metrics["reward"] <= 1.0 and metrics["train_steps"] == 2 * CAPACITY // SMALL["actor_train"]
            assert {b[0] for b in metrics["busy"]} == set(ROLES)
            if iteration == 2:
                # Iteration 2's log-prob rank ran on the weights the trainer had after iteration 1.
                assert checksums(pipeline, "actor_log_prob") == trained
            trained = checksums(pipeline, "actor_train")
            pipeline.clear()
            status = dock.status()
            assert all(s["ready"] == 0 for s in status["columns"].values()), status
            assert all(s["consumed"] == 0 for s in status["consumers"].values()), status
            assert not any(client.exists(DockKeys(dock.name).data(c)) for c in COLUMNS)
        assert checksums(pipeline, "ref_log_prob") == ref_before  # the reference never moves
        assert trained != ref_before
    finally:
        pipeline.shutdown()
        dock.delete()


def test_rows_flow_through_every_stage_once_on_a_partitioned_dock(local_ray, real_url):
    """The GRPO pipeline (its rollout as 2 DP ranks, rows leased) on a dock of three partitions: every row reaches
    every stage exactly once, by the ranks' own records and by the dock's (its partitions summed)."""
    cfg = make_config({"actor_rollout": Layout(2, 1)}, partitions=3)
    dock = create_dock(real_url, f"e2e-{uuid.uuid4().hex[:6]}", cfg)
    assert len(dock.partitions) == 3
    pipeline = Pipeline(dock, cfg, cluster_cpus=2)
    try:
        for iteration in (1, 2):
            _, results = pipeline.run_iteration(iteration)
            for role in ROLES:
                got = sorted(i for r in leaders(results, role) for batch in r["trace"] for i in batch["indexes"])
                assert got == list(range(CAPACITY)), f"{role} received rows {got}"
            status = dock.status()
            assert all(s["consumed"] == CAPACITY and s["leased"] == 0 for s in status["consumers"].values()), status
            pipeline.clear()
            assert all(s["ready"] == 0 for s in dock.status()["columns"].values())
    finally:
        pipeline.shutdown()
        dock.delete()


def test_guarantee_order_gives_each_dp_rank_its_range(local_ray, real_url):
    cfg = make_config({"actor_rollout": Layout(2, 2), "actor_train": Layout(2, 1)}, guarantee_order=True)
    client = redis.Redis.from_url(real_url)
    dock = create_dock(real_url, f"e2e-{uuid.uuid4().hex[:6]}", cfg)
    pipeline = Pipeline(dock, cfg, cluster_cpus=2)
    try:
        _, results = pipeline.run_iteration(1)
        check_every_row_once(results, dock, client)
        check_tp_ranks_agree(results, "actor_rollout", dp=2)
        half = CAPACITY // 2
        for role in ("actor_rollout", "actor_train"):
            for r in leaders(results, role):
                seen = list(itertools.chain.from_iterable(b["indexes"] for b in r["trace"]))
                assert seen == list(range(r["dp_rank"] * half, (r["dp_rank"] + 1) * half)), (role, r["dp_rank"])
        # Gradients are averaged over the DP trainers, so both hold the same weights after their steps.
        first, second = checksums(pipeline, "actor_train")
        assert first == second
        pipeline.clear()
    finally:
        pipeline.shutdown()
        dock.delete()


def test_config_rejects_bad_layouts():
    with pytest.raises(ValueError, match="divide"):
        with_layouts(RunConfig(), 1, 3).validate()
    with pytest.raises(ValueError, match="split evenly"):
        with_layouts(replace(RunConfig(), prompts=6), 4, 1).validate()
    assert make_config({}).rows_per_get("actor_train") == 8
    assert RunConfig(prompts=6, n=4).rows_per_get("actor_rollout") == 24  # 6 groups of 4 fit in 64 rows


def received(results: list[dict], role: str) -> list[int]:
    return sorted(i for r in leaders(results, role) for batch in r["trace"] for i in batch["indexes"])


def test_ppo_rows_flow_once_through_every_stage_and_the_critic(local_ray, real_url, tmp_path):
    """PPO: one sample per prompt, rows handed out one by one; a TP=2 critic writes values, GAE writes
    advantages and returns, and both trainers step; the critic's weights reach its value stage. The
    demo's report of the run shows the critic's loss."""
    small = {"actor_rollout": 8, "ref_log_prob": 8, "actor_log_prob": 8, "critic_value": 4, "rule_reward": 8,
             "compute_advantage": 8, "actor_train": 4, "critic_train": 4}
    cfg = make_config({"critic_value": Layout(1, 2), "critic_train": Layout(1, 2)}, algo="ppo", n=1, prompts=16,
                      batch_rows=small)
    client = redis.Redis.from_url(real_url)
    dock = create_dock(real_url, f"e2e-{uuid.uuid4().hex[:6]}", cfg)
    pipeline = Pipeline(dock, cfg, cluster_cpus=2)
    try:
        keys = DockKeys(dock.name)
        critic: list[int] = []
        records = []
        for iteration in (1, 2):
            metrics, results = pipeline.run_iteration(iteration)
            records.append(metrics)
            for role in cfg.roles:
                assert received(results, role) == list(range(16)), role
                assert client.bitcount(keys.consumed(role)) == 16, role
            check_tp_ranks_agree(results, "critic_value", dp=1)
            # Two epochs of 16 rows in mini-batches of 4, for the actor and the critic alike.
            assert metrics["train_steps"] == metrics["critic_steps"] == 8
            assert metrics["value_loss"] > 0
            if iteration == 2:
                assert checksums(pipeline, "critic_value") == critic
            critic = checksums(pipeline, "critic_train")
            pipeline.clear()
        assert critic != checksums(pipeline, "actor_train")  # a critic of its own, not the actor
        check_the_demo_reports(cfg, records, tmp_path, "value loss")
    finally:
        pipeline.shutdown()
        dock.delete()


def test_dapo_drops_equal_reward_groups_and_trains_only_a_full_batch_of_kept_ones(local_ray, real_url, tmp_path):
    """DAPO with n=2 (an untrained policy often scores both samples alike, so groups are dropped): the
    driver refills dropped groups, the stages after the filter see exactly the kept rows once, and the
    dock, the workers and the driver agree on how many groups were dropped. The demo's report of the run
    counts the filtered groups."""
    cfg = make_config({}, algo="dapo", n=2, batch_rows={"actor_rollout": 8, "rule_reward": 4,
                                                        "compute_advantage": 4, "actor_log_prob": 4,
                                                        "actor_train": 4})
    client = redis.Redis.from_url(real_url)
    dock = create_dock(real_url, f"e2e-{uuid.uuid4().hex[:6]}", cfg)
    pipeline = Pipeline(dock, cfg, cluster_cpus=2)
    capacity = cfg.capacity
    dropped_in_all = 0
    records = []
    try:
        keys = DockKeys(dock.name)
        for iteration in (1, 2):
            metrics, results = pipeline.run_iteration(iteration)
            records.append(metrics)
            dropped = metrics["filtered_groups"]
            dropped_in_all += dropped
            assert metrics["dropped_by_dock"] == dropped and metrics["prompts_put"] == PROMPTS + dropped
            assert metrics["judged_groups"] == PROMPTS + dropped
            kept_by_filter = sorted(i for r in leaders(results, "compute_advantage") for b in r["trace"]
                                    for i in b["kept"])
            assert kept_by_filter == list(range(capacity))  # the filter kept exactly one full batch
            for role in ("actor_log_prob", "actor_train"):
                assert received(results, role) == list(range(capacity)), role
            # Up to the filter, a row came once per prompt it held: the first and each replacement.
            up_to_filter = [received(results, role) for role in ("actor_rollout", "rule_reward", "compute_advantage")]
            assert up_to_filter[0] == up_to_filter[1] == up_to_filter[2]
            assert len(up_to_filter[0]) == capacity + cfg.n * dropped
            for role in cfg.roles:
                assert client.bitcount(keys.consumed(role)) == capacity, role
            pipeline.clear()
        assert dropped_in_all > 0, "no group was dropped: the test did not exercise dynamic sampling"
        check_the_demo_reports(cfg, records, tmp_path, "filtered groups")
    finally:
        pipeline.shutdown()
        dock.delete()
