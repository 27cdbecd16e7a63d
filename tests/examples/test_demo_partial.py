"""The GRPO demo's partial rollout (``--max-age``) and asynchronous rollout (``--max-staleness``), end to end
on a local Ray and a real Redis, a few iterations at tiny sizes.

Checked per iteration: every stage after the rollout received exactly the groups the trainer trained
(whole groups, no row twice), the trained groups are forgotten at the iteration's end (so no group is
trained twice), the kept groups age (``--max-age``), and the trained data lags the trainer by at most
the bound while the dock's version follows the trainer (``--max-staleness``).
"""

from __future__ import annotations

import uuid

import pytest

pytest.importorskip("ray")


from workers.algorithms.grpo import ROLES  # noqa: E402
from workers.config import RunConfig, with_layouts  # noqa: E402
from workers.runtime.pipeline import Pipeline, create_dock  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.slow]

PROMPTS, N, ITERATIONS = 4, 4, 4
SMALL = {"actor_rollout": 8, "ref_log_prob": 8, "actor_log_prob": 8, "rule_reward": 8, "compute_advantage": 8,
         "actor_train": 8}



def run(real_url: str, **options) -> tuple[list[dict], list[dict]]:
    """ITERATIONS iterations; returns each iteration's metrics and the dock's status right after its clear."""
    cfg = with_layouts(RunConfig(prompts=PROMPTS, n=N, trace=True, batch_rows=dict(SMALL), poll_seconds=0.5,
                                 stall_seconds=60.0, **options), 1, 1)
    dock = create_dock(real_url, f"demo-{uuid.uuid4().hex[:6]}", cfg)
    pipeline = Pipeline(dock, cfg, cluster_cpus=2)
    records, after_clear = [], []
    try:
        for iteration in range(1, ITERATIONS + 1):
            metrics, results = pipeline.run_iteration(iteration)
            check_trained_once(results)
            pipeline.clear()
            status = dock.status()
            # The trained groups are forgotten (free for new prompts): none can be trained again.
            assert status["columns"]["prompts"]["groups_ready"] == cfg.dock_groups - PROMPTS, status
            assert status["consumers"]["actor_train"]["consumed"] == 0
            records.append(metrics)
            after_clear.append(status)
    finally:
        pipeline.shutdown()
        dock.delete()
    return records, after_clear


def check_trained_once(results: list[dict]) -> None:
    def rows(role: str) -> list[int]:
        return [i for r in results if r["role"] == role and r["tp_rank"] == 0 for b in r["trace"] for i in b["indexes"]]

    trained = rows("actor_train")
    assert len(trained) == len(set(trained)) == PROMPTS * N, trained
    groups = {i // N for i in trained}
    assert sorted(trained) == [g * N + j for g in sorted(groups) for j in range(N)], "whole groups only"
    for role in ROLES[1:-1]:  # every stage between rollout and trainer handled exactly the trained rows
        assert sorted(rows(role)) == sorted(trained), role


#: On a dock of two partitions too (each holds its share of the batch): a run more, so behind ``once``.
PARTITIONS = pytest.mark.parametrize("partitions", [1, pytest.param(2, marks=pytest.mark.once)],
                                     ids=["whole", "partitioned"])


@PARTITIONS
def test_partial_rollout_trains_each_group_once_and_ages_the_rest(local_ray, real_url, partitions):
    records, after_clear = run(real_url, max_age=3, partitions=partitions)
    # The first iteration fills the dock (2 x PROMPTS groups), every later one refills what was trained.
    assert [r["prompts_put"] for r in records] == [2 * PROMPTS] + [PROMPTS] * (ITERATIONS - 1)
    assert all(0.0 <= r["reward"] <= 1.0 for r in records)
    # Responses are continued across passes of at most ceil(10 / 3) = 4 tokens; some groups are kept
    # from one iteration to the next, so ages above 0 appear.
    assert any(int(a) >= 1 and c for r in records for a, c in r["groups_by_age"].items()), records
    assert any(age >= 1 and c for s in after_clear for age, c in s["rollout"]["groups_by_age"].items())


@PARTITIONS
def test_asynchronous_rollout_stays_within_the_staleness_bound(local_ray, real_url, partitions):
    k = 1
    records, after_clear = run(real_url, max_staleness=k, partitions=partitions)
    # The rollout ran ahead: the dock was filled with K + 1 batches, then refilled one per iteration.
    assert [r["prompts_put"] for r in records] == [(k + 1) * PROMPTS] + [PROMPTS] * (ITERATIONS - 1)
    assert records[0]["version_lag"] == 0.0  # the first batch: the initial weights, not yet updated
    assert all(0.0 <= r["version_lag"] <= r["version_lag_max"] <= k for r in records), records
    assert any(r["version_lag"] > 0 for r in records), "the rollout never ran ahead of the trainer"
    assert [s["version"] for s in after_clear] == list(range(1, ITERATIONS + 1))
    # Nothing went stale (the admission control kept the rollout within the bound), or it was counted.
    assert sum(r["stale_dropped"] for r in records) == after_clear[-1]["discarded"].get("stale", 0)
