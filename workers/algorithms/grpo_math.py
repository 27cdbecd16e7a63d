"""GRPO math: group-normalised advantages and the clipped policy-gradient loss with a KL penalty.

Follows DeepSeekMath's GRPO: every sample of a prompt gets the same advantage, its reward
standardised within the prompt's group; the PPO-style clipped surrogate is applied per token, and
the KL to the frozen reference policy is the per-token k3 estimator
``exp(ref - logp) - (ref - logp) - 1`` (unbiased, always >= 0).
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from .ppo_math import clipped_policy_loss, k3_kl, masked_mean, policy_metrics, seq_mean


def group_advantages(scores: Tensor, n: int, eps: float = 1e-6) -> Tensor:
    """``(r - mean_group) / (std_group + eps)`` for ``scores`` laid out as consecutive groups of ``n``.

    The std is the sample std (Bessel-corrected, like TRL and verl). A group whose samples all
    scored the same gets advantage 0: it says nothing about which sample was better.
    """
    if n < 2:
        raise ValueError("group_advantages needs at least 2 samples per group")
    if scores.numel() % n:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {n}")
    groups = scores.float().view(-1, n)
    adv = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + eps)
    return adv.view(-1)


def response_mask(responses: Tensor, eos_id: int) -> Tensor:
    """Float mask [B, T]: 1 for response tokens up to and including the first ``eos_id``."""
    is_eos = (responses == eos_id).long()
    # Tokens after the first EOS have at least one EOS strictly before them.
    before = is_eos.cumsum(1) - is_eos
    return (before == 0).float()


def grpo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    ref_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    kl_coef: float = 0.04,
    agg: Literal["token_mean", "seq_mean"] = "token_mean",
    clip_high: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped GRPO loss over response tokens (the ratio clipped to ``[1 - clip_eps, 1 + clip_high]``,
    ``clip_high`` defaulting to ``clip_eps``).

    Shapes: ``log_probs`` (with grad), ``old_log_probs``, ``ref_log_probs`` and ``mask`` are [B, T];
    ``advantages`` is [B]. Per token::

        ratio = exp(logp - old)
        pg    = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)
        kl    = exp(ref - logp) - (ref - logp) - 1
        loss  = pg + kl_coef * kl

    ``agg="token_mean"`` averages over all unmasked tokens of the batch (long answers weigh more, as
    in DAPO); ``"seq_mean"`` averages within each sequence and then over sequences (DeepSeekMath).
    Metrics: ``clip_frac`` (share of tokens whose gradient the clip cut off), ``kl`` (mean k3),
    ``pg_loss`` and ``ratio`` (mean), all over unmasked tokens.
    """
    if agg not in ("token_mean", "seq_mean"):
        raise ValueError(f"unknown aggregation {agg!r}")
    token_level = agg == "token_mean"
    # The pieces are PPO's (ppo_math), so GRPO, PPO and DAPO share one surrogate; the sum of the two
    # aggregated terms equals aggregating their per-token sum.
    high = clip_eps if clip_high is None else clip_high
    pg = clipped_policy_loss(log_probs, old_log_probs, advantages, mask, clip_eps, high, token_level)
    kl = k3_kl(log_probs, ref_log_probs)
    mask = mask.to(log_probs.dtype)
    kl_term = masked_mean(kl, mask) if token_level else seq_mean(kl, mask)
    metrics = policy_metrics(log_probs, old_log_probs, advantages, mask, clip_eps, high)
    metrics["kl"] = float(masked_mean(kl.detach(), mask))
    return pg + kl_coef * kl_term, metrics
