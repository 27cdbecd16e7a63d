"""PPO with a critic (verl's ``RayPPOTrainer``, DeepSpeed-Chat's step 3): one sample per prompt is enough.

Per row: the rollout's response; the reference's and the sampling policy's log-probs; the critic's
values; per-token rewards, the KL penalty to the reference folded in and the task's score on the last
token (DeepSpeed-Chat's ``compute_rewards``); GAE advantages and returns; then the actor (clipped
surrogate on per-token advantages) and the critic (clipped value loss) each train ``epochs`` passes
over minibatches of the batch. Rows are handed out one by one (``get_n_samples=False``): nothing here
needs a prompt's samples together.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from ..model.transformer import response_values
from .base import Algorithm
from .ppo_math import clipped_value_loss, gae_advantages_and_returns, kl_penalized_rewards, masked_mean
from .roles import (
    ActorLogProb,
    ModelRole,
    Output,
    PolicyTrainer,
    RefLogProb,
    Role,
    Rollout,
    RuleReward,
    Trainer,
    length_mask,
    per_row,
    prompts_of,
    response_minibatch,
)


class CriticValue(ModelRole):
    """The critic's values of the states before each response token, under the critic's latest weights."""

    name = "critic_value"
    head = "value"

    @torch.no_grad()
    def compute(self, batch: Mapping[str, Tensor], indexes: list[int], iteration: int) -> Output:
        values = response_values(self.model, prompts_of(batch), batch["responses"])
        return {"values": per_row(values, batch["response_length"][:, 0])}


class KLPenalizedReward(RuleReward):
    """The task's score on each response's last token, minus ``kl_coef x (logp - ref_logp)`` on every token."""

    def shape(self, scores: Tensor, batch: Mapping[str, Tensor]) -> Output:
        old, ref = batch["old_log_probs"], batch["ref_log_probs"]
        mask = length_mask(batch["response_length"][:, 0], old.shape[1])
        rewards = kl_penalized_rewards(old, ref, scores, mask, self.cfg.kl_coef, self.cfg.clip_reward_value)
        self.add(kl_sum=float(((old - ref) * mask).sum()), kl_tokens=float(mask.sum()))
        return {"token_rewards": per_row(rewards, batch["response_length"][:, 0])}


class GAE(Role):
    """GAE advantages and returns per token (gamma, lam), advantages whitened over the stage's batch as
    verl does (``masked_whiten``): the scale of the KL-penalised rewards then does not set the step size."""

    name = "compute_advantage"

    def compute(self, batch: Mapping[str, Tensor], indexes: list[int], iteration: int) -> Output:
        values, rewards = batch["values"], batch["token_rewards"]
        mask = length_mask(batch["response_length"][:, 0], values.shape[1])
        advantages, returns = gae_advantages_and_returns(values, rewards, mask, self.cfg.gamma, self.cfg.lam)
        if mask.sum() > 1:
            mean = masked_mean(advantages, mask)
            var = (((advantages - mean) * mask) ** 2).sum() / (mask.sum() - 1)
            advantages = (advantages - mean) * torch.rsqrt(var + 1e-8) * mask
        lengths = batch["response_length"][:, 0]
        return {"advantages": per_row(advantages, lengths), "returns": per_row(returns, lengths)}


class PPOActorTrainer(PolicyTrainer):
    """The actor update: PPO's clipped surrogate on per-token advantages, averaged over tokens (DeepSpeed-Chat's
    ``actor_loss_fn``); the KL to the reference is already in the rewards."""

    per_token = True


class CriticTrainer(Trainer):
    """The critic update: DeepSpeed-Chat's clipped value loss against the GAE returns."""

    name = "critic_train"
    head = "value"

    def learning_rate(self) -> float:
        return self.cfg.critic_lr

    def minibatch(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return response_minibatch(batch, "values", "returns")

    def loss(self, mb: Mapping[str, Tensor], mask: Tensor) -> tuple[Tensor, dict[str, float]]:
        width = mask.shape[1]
        values = response_values(self.model, mb["prompts"], mb["responses"])
        returns = mb["returns"][:, :width]
        loss = clipped_value_loss(values, mb["values"][:, :width], returns, mask, self.cfg.cliprange_value)
        with torch.no_grad():
            metrics = {"value_loss": float(loss), "value_mean": float(masked_mean(values, mask)),
                       "return_mean": float(masked_mean(returns, mask))}
        return loss, metrics


RESPONSE = ("prompts", "prompt_length", "responses", "response_length")

PPO = Algorithm(
    name="ppo",
    summary="PPO with a critic: KL-penalised token rewards, GAE, clipped policy and value losses, ppo_epochs",
    roles=("actor_rollout", "ref_log_prob", "actor_log_prob", "critic_value", "rule_reward", "compute_advantage",
           "actor_train", "critic_train"),
    inputs={
        "actor_rollout": ("prompts", "prompt_length"),
        "ref_log_prob": RESPONSE,
        "actor_log_prob": RESPONSE,
        "critic_value": RESPONSE,
        "rule_reward": RESPONSE + ("old_log_probs", "ref_log_probs"),
        "compute_advantage": ("response_length", "token_rewards", "values"),
        "actor_train": RESPONSE + ("advantages", "old_log_probs"),
        "critic_train": RESPONSE + ("values", "returns"),
    },
    outputs={
        "actor_rollout": ("responses", "response_length"),
        "ref_log_prob": ("ref_log_probs",),
        "actor_log_prob": ("old_log_probs",),
        "critic_value": ("values",),
        "rule_reward": ("token_rewards",),
        "compute_advantage": ("advantages", "returns"),
        "actor_train": (),
        "critic_train": (),
    },
    role_classes={
        "actor_rollout": Rollout, "ref_log_prob": RefLogProb, "actor_log_prob": ActorLogProb,
        "critic_value": CriticValue, "rule_reward": KLPenalizedReward, "compute_advantage": GAE,
        "actor_train": PPOActorTrainer, "critic_train": CriticTrainer,
    },
    follows={"actor_rollout": "actor_train", "actor_log_prob": "actor_train", "critic_value": "critic_train"},
    batch_rows={
        "actor_rollout": 64, "ref_log_prob": 128, "actor_log_prob": 128, "critic_value": 128, "rule_reward": 128,
        "compute_advantage": 64, "actor_train": 64, "critic_train": 64,
    },
    min_n=1,
    row_sampling=True,
    defaults={"n": 1, "prompts": 512, "kl_coef": 0.01},
)
