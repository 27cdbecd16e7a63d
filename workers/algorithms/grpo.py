"""GRPO (DeepSeekMath; MindSpeed-RL's flow): n samples per prompt, advantages standardised within each
group, a clipped policy loss with a k3 KL penalty against the frozen reference. No critic."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from .base import Algorithm
from .grpo_math import group_advantages, grpo_loss
from .roles import (
    ActorLogProb,
    Output,
    RefLogProb,
    Role,
    Rollout,
    RuleReward,
    Trainer,
    in_groups,
    policy_minibatch,
    scalars,
)


class GroupAdvantage(Role):
    """GRPO advantages: each reward standardised within its prompt's group of n (batches hold whole groups)."""

    name = "compute_advantage"

    def compute(self, batch: Mapping[str, Tensor], indexes: list[int], iteration: int) -> Output:
        order = torch.tensor(in_groups(indexes, self.cfg.n, self.name))
        adv = torch.empty(len(indexes))
        adv[order] = group_advantages(batch["rewards"][:, 0][order], self.cfg.n)
        return {"advantages": scalars(adv)}


class GRPOTrainer(Trainer):
    """The actor update with GRPO's loss: clipped surrogate on the group advantage, plus k3 KL to the reference."""

    def minibatch(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return policy_minibatch(batch, "ref_log_probs")

    def loss(self, mb: Mapping[str, Tensor], mask: Tensor) -> tuple[Tensor, dict[str, float]]:
        width = mb["responses"].shape[1]
        lp = self.log_probs(mb)
        return grpo_loss(lp, mb["old_log_probs"][:, :width], mb["ref_log_probs"][:, :width], mb["advantages"],
                         mask, self.cfg.clip_eps, self.cfg.kl_coef, clip_high=self.cfg.clip_high)


#: Stage order and columns: the log-prob stages and the reward all start as soon as responses land.
ROLES = ("actor_rollout", "ref_log_prob", "actor_log_prob", "rule_reward", "compute_advantage", "actor_train")

GRPO = Algorithm(
    name="grpo",
    summary="GRPO: group-relative advantages over n samples per prompt, clipped loss, KL to the reference",
    roles=ROLES,
    inputs={
        "actor_rollout": ("prompts", "prompt_length"),
        "ref_log_prob": ("prompts", "prompt_length", "responses", "response_length"),
        "actor_log_prob": ("prompts", "prompt_length", "responses", "response_length"),
        "rule_reward": ("prompts", "prompt_length", "responses", "response_length"),
        "compute_advantage": ("rewards",),
        "actor_train": ("prompts", "prompt_length", "responses", "response_length", "advantages", "old_log_probs",
                        "ref_log_probs"),
    },
    outputs={
        "actor_rollout": ("responses", "response_length"),
        "ref_log_prob": ("ref_log_probs",),
        "actor_log_prob": ("old_log_probs",),
        "rule_reward": ("rewards",),
        "compute_advantage": ("advantages",),
        "actor_train": (),
    },
    role_classes={
        "actor_rollout": Rollout, "ref_log_prob": RefLogProb, "actor_log_prob": ActorLogProb,
        "rule_reward": RuleReward, "compute_advantage": GroupAdvantage, "actor_train": GRPOTrainer,
    },
    follows={"actor_rollout": "actor_train", "actor_log_prob": "actor_train"},
    batch_rows={
        "actor_rollout": 64, "ref_log_prob": 128, "actor_log_prob": 128, "rule_reward": 128,
        "compute_advantage": 64,
        "actor_train": 128,  # one minibatch: train_local's value, which learns the task in ~25 iterations
    },
    min_n=2,
)
