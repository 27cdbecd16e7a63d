"""The pipeline soak of ``broker bench --soak --pipeline``: slow and killed workers, fenced writes, and the
accounting that must catch a mispaired row, a prompt trained twice and a lost prompt."""

from __future__ import annotations

import json

import pytest

from broker.bench.pipeline_soak import (
    F_DROPPED,
    MISPAIRED_PROMPT,
    MISPAIRED_REWARD,
    PUT,
    R_WROTE,
    TRAINED,
    PipelineSoakConfig,
    account,
    run_pipeline_soak,
)
from broker.cli import main

pytestmark = pytest.mark.real

#: Short and busy: 30 % of batches sleep 1.5 x a 0.3 s lease. Measured on the 2-core machine: about 5 s a
#: run; fenced with kills, 10 runs of 10 ok, each refusing 20-29 late writes; unfenced, 10 of 10 showed
#: 24-52 mispaired rows.
SHORT = {"per_stage": 3, "seconds": 3.0, "lease_seconds": 0.3, "slow": 0.3}


def test_slow_and_killed_workers_train_every_prompt_once_and_correctly_paired(real_url):
    result = run_pipeline_soak(real_url, "bench-test-pipeline-soak",
                               PipelineSoakConfig(**SHORT, kill=True, kill_every=0.4))
    assert result["ok"] and not result["failed"], result
    assert result["mispaired_rows"] == 0 and result["rewritten"] == {"responses": 0, "rewards": 0}, result
    assert result["lost"] == result["trained_twice"] == result["trained_rejected"] == 0
    assert result["prompts_put"] == result["trained"] + result["dropped"] + result["in_dock"]
    assert result["in_dock"] == 0 and result["drained"] and not result["crashed"]
    assert result["dropped"] == result["discarded"] > 0
    # The run did what it is for: workers slept past their lease, the fence refused their late writes,
    # workers were killed and their rows redone.
    assert result["late_writes"]["refused"] > 0 and sum(result["fenced"].values()) > 0
    assert result["kills"] >= 2 and result["redelivered_rows"]["rollout"] > 0
    assert result["trained"] > 20


def test_the_unfenced_control_run_from_the_command_line_trains_mispaired_rows(real_url, capsys):
    """Plain lists of rows, as before the fence: the same load makes the trainer learn from mispairs."""
    args = ["bench", "--url", real_url, "--soak", "--pipeline", "--unfenced", "--seconds", "3", "--per-stage", "3",
            "--lease-seconds", "0.3", "--slow", "0.3", "--json"]
    assert main(args) == 1
    soak = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["soak"]
    assert not soak["ok"] and soak["mispaired_rows"] > 0
    assert soak["late_writes"]["refused"] == 0 and soak["config"]["unfenced"]


def test_pipeline_only_options_are_refused_elsewhere(capsys):
    assert main(["bench", "--soak", "--unfenced"]) == 2
    assert main(["bench", "--soak", "--pipeline", "--slow", "2"]) == 2
    assert main(["bench", "--soak", "--pipeline", "--churn"]) == 2
    assert "pipeline soak" in capsys.readouterr().err


def test_the_accounting_catches_mispairs_repeats_losses_and_wrong_drops():
    put = [(PUT, p, p % 4, 0.0, 1.0) for p in range(1, 9)]  # prompt 7 is the filter's to drop (drop_every=7)

    def trained(*prompts: int) -> list:
        return [(TRAINED, p, p % 4, 0.0, 2.0) for p in prompts]

    def check(records: list, discarded: int = 1, in_dock: tuple = ()) -> dict:
        return account(put + records + [(F_DROPPED, 7, 3, 0.0, 1.5)], discarded, in_dock, drop_every=7)

    exact = check(trained(1, 2, 3, 4, 5, 6, 8))
    assert exact["ok"] and exact["trained"] == 7 and exact["dropped"] == 1 and exact["lost"] == 0
    assert exact["failed"] == []
    mispaired = check(trained(1, 2, 3, 4, 5, 6, 8) + [(MISPAIRED_REWARD, 3, 13, 0.0, 2.0)])
    assert not mispaired["ok"] and mispaired["mispaired_rows"] == 1 and mispaired["failed"] == ["paired"]
    assert mispaired["mispaired"]["reward_after_a_rewrite"] == 0
    # The same mispair where prompt 3's responses landed twice (a redo after a landed write): counted apart.
    rewrote = [(R_WROTE, 3, 3, 0.0, 1.2)] * 2
    redone = check(trained(1, 2, 3, 4, 5, 6, 8) + rewrote + [(MISPAIRED_REWARD, 3, 13, 0.0, 2.0)])
    assert redone["failed"] == ["paired"] and redone["mispaired"]["reward_after_a_rewrite"] == 1
    assert redone["rewritten"]["responses"] == 1
    wrong_prompt = check(trained(1, 2, 3, 4, 5, 6, 8) + [(MISPAIRED_PROMPT, 5, 4, 0.0, 2.0)])
    assert not wrong_prompt["ok"] and wrong_prompt["mispaired"]["response_of_another_prompt"] == 1
    twice = check(trained(1, 2, 3, 3, 4, 5, 6, 8))
    assert not twice["ok"] and twice["trained_twice"] == 1 and twice["examples"]["trained_twice"] == [3]
    assert twice["failed"] == ["trained_once"]
    lost = check(trained(1, 2, 3, 4, 6, 8))
    assert not lost["ok"] and lost["lost"] == 1 and lost["examples"]["lost"] == [5]
    assert lost["failed"] == ["nothing_lost"]
    # A prompt still in the dock is accounted, not lost (the drain decides whether that is a failure).
    assert check(trained(1, 2, 3, 4, 6, 8), in_dock=(5,))["ok"]
    unknown = check(trained(1, 2, 3, 4, 5, 6, 8, 99))
    assert not unknown["ok"] and unknown["unknown"] == 1
    # The filter's rejected prompt reached the trainer (and nothing was dropped, so every count agrees).
    rejected = account(put + trained(1, 2, 3, 4, 5, 6, 7, 8), 0, (), drop_every=7)
    assert not rejected["ok"] and rejected["trained_rejected"] == 1 and rejected["dropped"] == 0
    # The dock counted a drop more than the prompts that left it untrained (a late drop of a refilled group).
    assert not check(trained(1, 2, 3, 4, 5, 6, 8), discarded=2)["ok"]
    # A filter logged a drop that the dock did not count.
    assert not check(trained(1, 2, 3, 4, 5, 6, 8) + [(F_DROPPED, 7, 3, 0.0, 1.6)])["ok"]
