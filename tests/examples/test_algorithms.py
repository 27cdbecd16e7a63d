"""The algorithm layer without Ray or Redis: each algorithm's wiring, its settings, the batch sizes its
trainers take, and what its own stages compute on a small batch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from workers.algorithms import ALGORITHMS, get_algorithm
from workers.algorithms.base import Algorithm
from workers.algorithms.dapo import FilteringAdvantage, OverlongShapedReward
from workers.algorithms.grpo import GRPO
from workers.algorithms.ppo import GAE, CriticValue, KLPenalizedReward
from workers.algorithms.roles import DROP, Trainer
from workers.config import Layout, RunConfig, with_layouts
from workers.model import task
from workers.model.parallel_state import ParallelState
from workers.options import ALGORITHM_NAMES, build_demo_parser

PROMPT_COLUMNS = {"prompts", "prompt_length"}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_column_a_role_reads_is_written_by_an_earlier_role(name):
    """The pipeline would stall on a column nobody writes, or one written only after its reader."""
    algorithm = get_algorithm(name)
    written = set(PROMPT_COLUMNS)
    for role in algorithm.roles:
        missing = set(algorithm.inputs[role]) - written
        assert not missing, f"{name}: {role} reads {sorted(missing)} before any earlier role writes them"
        written |= set(algorithm.outputs[role])
    assert set(algorithm.columns) == written
    for role in algorithm.follows:  # a role that follows a trainer holds the same kind of network
        assert algorithm.role_classes[role].head == algorithm.role_classes[algorithm.follows[role]].head


def test_the_parser_offers_every_algorithm_and_the_algorithms_say_what_they_are():
    assert set(ALGORITHM_NAMES) == set(ALGORITHMS)
    assert build_demo_parser().parse_args(["--algo", "ppo"]).algo == "ppo"
    assert get_algorithm("ppo").trainers == ("actor_train", "critic_train")
    assert get_algorithm("ppo").model_roles == (
        "actor_rollout", "ref_log_prob", "actor_log_prob", "critic_value", "actor_train", "critic_train")
    assert get_algorithm("dapo").before_filter == ("actor_rollout", "rule_reward", "compute_advantage")
    assert "ref_log_prob" not in get_algorithm("dapo").roles  # no KL term, no reference
    with pytest.raises(ValueError, match="unknown algorithm 'a2c'; known: grpo, ppo, dapo"):
        get_algorithm("a2c")


def test_an_algorithm_with_inconsistent_wiring_is_refused():
    with pytest.raises(ValueError, match="outputs names roles"):
        replace(GRPO, outputs={"actor_rollout": ()})
    with pytest.raises(ValueError, match="follows 'critic_value'"):
        replace(GRPO, follows={"critic_value": "actor_train"})
    with pytest.raises(ValueError, match="filter_role 'critic'"):
        replace(GRPO, filter_role="critic")
    with pytest.raises(ValueError, match="computed by GRPOTrainer, named 'actor_train'"):
        Algorithm(name="x", summary="", roles=("critic_train",), inputs={"critic_train": ()},
                  outputs={"critic_train": ()}, role_classes={"critic_train": GRPO.role_classes["actor_train"]})


def test_each_algorithm_brings_its_own_settings():
    ppo, dapo = RunConfig.for_algorithm("ppo"), RunConfig.for_algorithm("dapo")
    assert (ppo.n, ppo.prompts, ppo.kl_coef) == (1, 512, 0.01)
    assert (dapo.kl_coef, dapo.clip_eps, dapo.clip_high) == (0.0, 0.2, 0.28)
    assert RunConfig.for_algorithm("ppo", n=4).n == 4  # the user's word wins
    with pytest.raises(ValueError, match="grpo needs --n >= 2"):
        RunConfig(n=1).validate()
    RunConfig.for_algorithm("ppo").validate()  # n = 1 is PPO's normal case
    with pytest.raises(ValueError, match="dapo has no reference model and no KL term"):
        RunConfig.for_algorithm("dapo", kl_coef=0.01).validate()
    with pytest.raises(ValueError, match="clip ranges > 0"):
        RunConfig(clip_high=0.0).validate()
    with pytest.raises(ValueError, match="dropped groups come back"):
        RunConfig.for_algorithm("dapo", guarantee_order=True).validate()
    with pytest.raises(ValueError, match="dapo runs synchronously"):
        RunConfig.for_algorithm("dapo", max_age=2).validate()
    with pytest.raises(ValueError, match="ppo has no role 'rule'"):
        replace(RunConfig.for_algorithm("ppo"), layouts={"rule": Layout()}).validate()
    with pytest.raises(ValueError, match="critic_value: TP 3 must divide"):
        with_layouts(RunConfig.for_algorithm("ppo"), 1, 1, {"critic_value": Layout(1, 3)}).validate()


@pytest.mark.parametrize("mini, dp, tp, micro, rows, accum", [
    (16, 1, 1, None, 128, None),   # GRPO's default: 16 prompts x 8 = 128 rows per step
    (16, 2, 1, None, 64, None),    # two DP ranks split each mini-batch
    (16, 2, 2, None, 64, None),    # TP ranks of a replica see the same rows: still DP 2
    (16, 2, 2, 16, 64, 4),         # 4 micro-batches of 16 rows, gradients accumulated
])
def test_trainer_batch_sizes_are_normalized_per_dp_rank(mini, dp, tp, micro, rows, accum):
    cfg = with_layouts(RunConfig(prompts=64, n=8, mini_batch_prompts=mini, micro_batch_rows=micro), dp, tp)
    cfg.validate()
    sizes = cfg.rank_batch_sizes("actor_train")
    assert (sizes.dp_size, sizes.mini_batch_size, sizes.grad_accum_steps) == (dp, rows, accum)
    assert cfg.rows_per_get("actor_train") == rows


def test_bad_batch_sizes_name_the_numbers():
    with pytest.raises(ValueError, match="should be divisible by ppo_micro_batch_size_per_gpu 24"):
        with_layouts(RunConfig(mini_batch_prompts=16, micro_batch_rows=24), 2, 1).validate()
    with pytest.raises(ValueError, match=r"should be larger than 0 after normalization \(global 1 x n 8 // dp 16\)"):
        with_layouts(RunConfig(mini_batch_prompts=1), 16, 1).validate()
    # verl would take 12 rows per rank; the dock hands whole groups of 8 out, so the demo refuses.
    with pytest.raises(ValueError, match="mini-batch of 12 rows per DP rank .* whole groups of 8"):
        with_layouts(RunConfig(mini_batch_prompts=3), 2, 1).validate()
    with pytest.raises(ValueError, match="split the rank's 512 rows"):
        RunConfig(mini_batch_prompts=48).validate()
    RunConfig.for_algorithm("ppo", mini_batch_prompts=3, prompts=6).validate()  # rows one by one: any size


def _state() -> ParallelState:
    return ParallelState(Layout(), 0)


def _batch(responses: list[list[int]], **columns: torch.Tensor) -> dict[str, torch.Tensor]:
    """A padded batch as the dispatcher builds it (EOS for tokens, lengths as (rows, 1))."""
    width = max(len(r) for r in responses)
    prompts = torch.stack(task.make_prompts(len(responses), torch.Generator().manual_seed(0)))
    return {
        "prompts": prompts,
        "prompt_length": torch.full((len(responses), 1), prompts.shape[1]),
        "responses": torch.tensor([r + [task.EOS] * (width - len(r)) for r in responses]),
        "response_length": torch.tensor([[len(r)] for r in responses]),
        **columns,
    }


def test_filtering_advantage_drops_groups_with_equal_rewards_up_to_its_budget():
    cfg = RunConfig.for_algorithm("dapo", n=2, prompts=2, max_gen_batches=2)  # at most 2 drops per iteration
    stage = FilteringAdvantage(cfg, _state())
    rewards = torch.tensor([[0.5], [0.5], [0.1], [0.9], [0.0], [0.0]])
    # Rows arrive in any order; groups are rows // n: 0 (equal), 1 (differ), 2 (equal).
    out = stage.compute({"rewards": rewards[[5, 0, 2, 1, 3, 4]]}, [5, 0, 2, 1, 3, 4], iteration=1)
    assert out[DROP][0].tolist() == [0, 2]
    adv = torch.cat(out["advantages"])
    assert adv[[2, 4]].tolist() == pytest.approx([-0.7071, 0.7071], abs=1e-4)  # rows 2 and 3 of group 1
    again = stage.compute({"rewards": rewards[:2]}, [0, 1], iteration=1)
    assert again[DROP][0].tolist() == []  # the budget is spent: kept, with advantage 0
    assert stage.compute({"rewards": rewards[:2]}, [0, 1], iteration=2)[DROP][0].tolist() == [0]  # a new iteration
    with pytest.raises(ValueError, match="whole groups of 2"):
        stage.compute({"rewards": rewards[:3]}, [0, 1, 2], iteration=3)


def test_overlong_shaping_adds_dapos_penalty_to_the_task_score():
    cfg = RunConfig.for_algorithm("dapo", overlong_factor=1.0, overlong_buffer=2)
    stage = OverlongShapedReward(cfg, _state())
    batch = _batch([[1] * 7 + [task.EOS], [2] * 9, [3] * 10])  # lengths 8, 9, 10 against L_max 10, L_cache 2
    out = stage.compute(batch, [0, 1, 2], iteration=1)
    scores = [task.reward(p, r[: int(n)]) for p, r, n in zip(batch["prompts"], batch["responses"],
                                                              batch["response_length"][:, 0])]
    assert torch.cat(out["rewards"]).tolist() == pytest.approx([scores[0], scores[1] - 0.5, scores[2] - 1.0])


def test_ppo_stages_write_token_columns_cut_to_each_response():
    cfg = RunConfig.for_algorithm("ppo", kl_coef=0.1)
    batch = _batch([[4, 5, task.EOS], [6, task.EOS]])
    values = CriticValue(cfg, _state()).compute(batch, [0, 1], iteration=1)["values"]
    assert [v.shape[0] for v in values] == [3, 2]

    old = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, -1.0], [-1.0, -3.0, 0.0]])
    out = KLPenalizedReward(cfg, _state()).compute({**batch, "old_log_probs": old, "ref_log_probs": ref}, [0, 1], 1)
    score = [task.reward(p, r[:n]) for p, r, n in zip(batch["prompts"], batch["responses"], [3, 2])]
    # -0.1 x (old - ref) per token, the score on the last one (DeepSpeed-Chat's compute_rewards).
    assert out["token_rewards"][0].tolist() == pytest.approx([-0.05, 0.0, score[0]])
    assert out["token_rewards"][1].tolist() == pytest.approx([0.0, -0.2 + score[1]])

    padded = torch.nn.utils.rnn.pad_sequence(out["token_rewards"], batch_first=True)
    gae = GAE(cfg, _state()).compute({"response_length": batch["response_length"], "token_rewards": padded,
                                      "values": torch.zeros(2, 3)}, [0, 1], 1)
    # gamma 1, lam 0.95, values 0: A_t = r_t + 0.95 A_t+1 = R_t; advantages are A whitened over the 5 tokens.
    last = -0.2 + score[1]
    assert gae["returns"][1].tolist() == pytest.approx([0.95 * last, last])
    adv = torch.cat(gae["advantages"])
    assert adv.mean().item() == pytest.approx(0.0, abs=1e-6) and adv.std().item() == pytest.approx(1.0, abs=1e-4)


def test_a_trainer_accumulates_micro_batches_into_one_step_equal_to_the_whole_minibatch():
    """verl's loss x rows / mini_batch_size weighting makes 4 micro-batches of 2 one step on 8 rows."""
    batch = _batch([[d, d, task.EOS] for d in range(8)],
                   advantages=torch.linspace(-0.01, 0.01, 8).unsqueeze(1), old_log_probs=torch.full((8, 3), -2.5),
                   ref_log_probs=torch.full((8, 3), -2.5))
    steps = []
    for micro in (None, 2):
        cfg = RunConfig(micro_batch_rows=micro, epochs=1, kl_coef=0.0)
        trainer: Trainer = GRPO.role_classes["actor_train"](cfg, _state())
        trainer.compute(batch, list(range(8)), iteration=1)
        # The step's gradient (left on the parameters): Adam's update would magnify rounding noise.
        steps.append({name: p.grad for name, p in trainer.model.named_parameters()})
        stats = trainer.take_stats()
        assert stats["steps"] == 1 and stats["grad_norm"] < 1.0  # below the clip, which would hide a wrong scale
    # The GRPO loss is a token mean and every row here has 3 tokens, so row shares are token shares.
    for name, grad in steps[0].items():
        torch.testing.assert_close(steps[1][name], grad, atol=1e-7, rtol=1e-4, msg=name)
