"""PPO-with-a-critic math: KL-penalised token rewards, GAE, the clipped value and policy losses.

The formulas follow DeepSpeed-Chat's ``ppo_trainer.py`` (``compute_rewards``,
``get_advantages_and_returns``, ``critic_loss_fn``, ``actor_loss_fn``), written here on response
tokens only (DeepSpeed-Chat slices ``[:, start:]`` off the prompt first) and with an explicit mask:

* reward per token: ``-kl_ctl * (logp - ref_logp)``, plus ``clamp(score, -c, c)`` on the last valid
  token of each response;
* GAE (Schulman et al. 2016): ``delta_t = r_t + gamma * V_{t+1} - V_t``,
  ``A_t = delta_t + gamma * lam * A_{t+1}``, ``R_t = A_t + V_t``;
* value loss: ``0.5 * mean(max((V - R)^2, (clamp(V, V_old - c, V_old + c) - R)^2))``;
* policy loss: PPO's clipped surrogate with DAPO's clip-higher (the ratio is clipped to
  ``[1 - clip_low, 1 + clip_high]``) and DAPO's token-level averaging as an option.

All tensors are [B, T] over response tokens; ``mask`` is 1 on real response tokens, 0 on padding.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _last_valid_index(mask: Tensor) -> Tensor:
    """Index of the last 1 in each row of ``mask`` [B, T]; ValueError if a row has none."""
    valid = mask > 0
    empty = ~valid.any(1)
    if empty.any():
        rows = empty.nonzero().flatten().tolist()
        raise ValueError(f"rows {rows} of the mask have no valid token")
    t = mask.shape[1]
    return t - 1 - valid.flip(1).long().argmax(1)


def kl_penalized_rewards(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    reward_score: Tensor,
    mask: Tensor,
    kl_ctl: float,
    clip_reward_value: float,
) -> Tensor:
    """Per-token rewards [B, T]: ``-kl_ctl * (logp - ref_logp)`` on valid tokens, 0 on padding, and the
    sequence score ``reward_score`` [B], clipped to ``[-clip_reward_value, clip_reward_value]``, added
    at the last valid token of each row.

    ``log_probs`` are those of the policy that sampled the responses (DeepSpeed-Chat's experience
    ``logprobs``), not the policy being trained.
    """
    if kl_ctl < 0:
        raise ValueError(f"kl_ctl must be >= 0, got {kl_ctl}")
    if clip_reward_value <= 0:
        raise ValueError(f"clip_reward_value must be > 0, got {clip_reward_value}")
    if reward_score.shape != log_probs.shape[:1]:
        raise ValueError(f"reward_score has shape {tuple(reward_score.shape)}, expected ({log_probs.shape[0]},)")
    mask = mask.to(log_probs.dtype)
    rewards = -kl_ctl * (log_probs - ref_log_probs) * mask
    last = _last_valid_index(mask)
    clipped = reward_score.to(rewards.dtype).clamp(-clip_reward_value, clip_reward_value)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += clipped
    return rewards


def gae_advantages_and_returns(
    values: Tensor, rewards: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns [B, T], computed backwards over the valid tokens of each row.

    A masked position is skipped: it neither contributes a TD error nor breaks the chain, so the
    value after a response's last valid token is 0 (the episode ends there), and padding in the
    middle of a row would be stepped over. Advantages and returns are 0 at masked positions;
    elsewhere ``returns = advantages + values``. Both are detached (they are targets).
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    values = values.detach()
    rewards = rewards.detach()
    mask = mask.to(values.dtype)
    batch, length = values.shape
    next_value = values.new_zeros(batch)
    last_gae = values.new_zeros(batch)
    advantages = torch.zeros_like(values)
    for t in reversed(range(length)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        advantages[:, t] = gae * m
        next_value = values[:, t] * m + next_value * (1 - m)
        last_gae = gae * m + last_gae * (1 - m)
    returns = (advantages + values) * mask
    return advantages, returns


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over every valid token of the batch (0 when there is none)."""
    return (x * mask).sum() / mask.sum().clamp_min(1.0)


def seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean within each row's valid tokens, then over rows (a row without valid tokens counts as 0)."""
    return ((x * mask).sum(1) / mask.sum(1).clamp_min(1.0)).mean()


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cliprange_value: float
) -> Tensor:
    """``0.5 * masked_mean(max((V - R)^2, (clamp(V, V_old - c, V_old + c) - R)^2))`` over all valid tokens."""
    if cliprange_value <= 0:
        raise ValueError(f"cliprange_value must be > 0, got {cliprange_value}")
    mask = mask.to(values.dtype)
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    loss1 = (values - returns) ** 2
    loss2 = (clipped - returns) ** 2
    return 0.5 * masked_mean(torch.max(loss1, loss2), mask)


def clipped_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    token_level: bool = True,
) -> Tensor:
    """PPO's clipped surrogate, ``mean(max(-A * ratio, -A * clamp(ratio, 1 - clip_low, 1 + clip_high)))``.

    ``ratio = exp(logp - old_logp)``; ``advantages`` is [B, T] (per token, from GAE) or [B] (one per
    sequence, as GRPO/DAPO). ``clip_high > clip_low`` is DAPO's clip-higher. ``token_level=True``
    averages over every valid token of the batch (DAPO); ``False`` averages within each sequence and
    then over sequences (a row without valid tokens counts as 0). As DeepSpeed-Chat, the log-ratio is
    masked before ``exp`` so padding can never turn into inf * 0.
    """
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    mask = mask.to(log_probs.dtype)
    adv = advantages.to(log_probs.dtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    ratio = torch.exp((log_probs - old_log_probs) * mask)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = torch.max(loss1, loss2)
    return masked_mean(per_token, mask) if token_level else seq_mean(per_token, mask)


def policy_metrics(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, clip_low: float, clip_high: float
) -> dict[str, float]:
    """Means over valid tokens of what :func:`clipped_policy_loss` saw: ``clip_frac`` (share of tokens
    whose gradient the clip cut off), ``ratio`` and ``pg_loss`` (the per-token surrogate)."""
    with torch.no_grad():
        mask = mask.to(log_probs.dtype)
        adv = advantages.to(log_probs.dtype)
        if adv.dim() == 1:
            adv = adv.unsqueeze(1)
        ratio = torch.exp((log_probs - old_log_probs) * mask)
        per_token = torch.max(-adv * ratio, -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high))
        clipped = ((adv > 0) & (ratio > 1 + clip_high)) | ((adv < 0) & (ratio < 1 - clip_low))
        return {
            "clip_frac": float(masked_mean(clipped.to(mask.dtype), mask)),
            "ratio": float(masked_mean(ratio, mask)),
            "pg_loss": float(masked_mean(per_token, mask)),
        }


def k3_kl(log_probs: Tensor, ref_log_probs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased)."""
    delta = ref_log_probs - log_probs
    return torch.exp(delta) - delta - 1
