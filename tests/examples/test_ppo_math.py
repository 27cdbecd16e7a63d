"""DeepSpeed-Chat's PPO formulas (workers.algorithms.ppo_math) on small hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from workers.algorithms.ppo_math import (
    clipped_policy_loss,
    clipped_value_loss,
    gae_advantages_and_returns,
    kl_penalized_rewards,
)


def test_kl_penalized_rewards_hand_example() -> None:
    # kl_ctl 0.1, clip 5. Row 0: logp - ref = 0.5, -1.0, 0 -> -0.05, 0.1, 0; score 7 clipped to 5 on
    # token 2 (the last valid one). Row 1: logp - ref = 0, 0.2 -> 0, -0.02; score -0.3 on token 1 -> -0.32.
    # Row 2: a hole in the mask; last valid token is 2; score -9 clipped to -5; logp = ref -> no KL.
    # Masked positions are 0 whatever their log-probs.
    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.2, -0.4, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-0.2, -0.6, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 0.0]])
    score = torch.tensor([7.0, -0.3, -9.0])
    rewards = kl_penalized_rewards(logp, ref, score, mask, kl_ctl=0.1, clip_reward_value=5.0)
    expected = torch.tensor([[-0.05, 0.1, 5.0, 0.0], [0.0, -0.32, 0.0, 0.0], [0.0, 0.0, -5.0, 0.0]])
    torch.testing.assert_close(rewards, expected)


def test_kl_penalized_rewards_errors() -> None:
    x = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        kl_penalized_rewards(x, x, torch.zeros(2), mask, 0.1, 5.0)
    with pytest.raises(ValueError, match="-0.1"):
        kl_penalized_rewards(x, x, torch.zeros(2), torch.ones(2, 3), -0.1, 5.0)
    with pytest.raises(ValueError, match="clip_reward_value"):
        kl_penalized_rewards(x, x, torch.zeros(2), torch.ones(2, 3), 0.1, 0.0)
    with pytest.raises(ValueError, match=r"\(3,\)"):
        kl_penalized_rewards(x, x, torch.zeros(3), torch.ones(2, 3), 0.1, 5.0)


# Row 0: three valid tokens and a padding token whose value (9) and reward (7) must be ignored.
# Row 1: a hole at token 1 (value and reward 100): GAE steps over it, so row 1 equals row 0 on its
# valid tokens.
VALUES = torch.tensor([[0.5, 0.2, 0.4, 9.0], [0.5, 100.0, 0.2, 0.4]])
REWARDS = torch.tensor([[0.0, 0.1, 1.0, 7.0], [0.0, 100.0, 0.1, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0]])


def test_gae_gamma_lam_one_gives_reward_to_go() -> None:
    # gamma = lam = 1: t2 delta = 1.0 + 0 - 0.4 = 0.6 -> A = 0.6
    #                  t1 delta = 0.1 + 0.4 - 0.2 = 0.3 -> A = 0.9
    #                  t0 delta = 0 + 0.2 - 0.5 = -0.3 -> A = 0.6
    # returns = A + V = 1.1, 1.1, 1.0 = the undiscounted rewards-to-go.
    adv, ret = gae_advantages_and_returns(VALUES, REWARDS, MASK, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.6, 0.9, 0.6, 0.0], [0.6, 0.0, 0.9, 0.6]]))
    torch.testing.assert_close(ret, torch.tensor([[1.1, 1.1, 1.0, 0.0], [1.1, 0.0, 1.1, 1.0]]))


def test_gae_discounted() -> None:
    # gamma 0.9, lam 0.5 (gamma * lam = 0.45):
    #   t2 delta = 1.0 + 0.9*0 - 0.4 = 0.6            -> A = 0.6
    #   t1 delta = 0.1 + 0.9*0.4 - 0.2 = 0.26         -> A = 0.26 + 0.45*0.6 = 0.53
    #   t0 delta = 0 + 0.9*0.2 - 0.5 = -0.32          -> A = -0.32 + 0.45*0.53 = -0.0815
    # returns = A + V = 0.4185, 0.73, 1.0
    adv, ret = gae_advantages_and_returns(VALUES, REWARDS, MASK, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, torch.tensor([[-0.0815, 0.53, 0.6, 0.0], [-0.0815, 0.0, 0.53, 0.6]]))
    torch.testing.assert_close(ret, torch.tensor([[0.4185, 0.73, 1.0, 0.0], [0.4185, 0.0, 0.73, 1.0]]))


def test_gae_is_detached_and_checks_arguments() -> None:
    values = VALUES.clone().requires_grad_(True)
    adv, ret = gae_advantages_and_returns(values, REWARDS, MASK, gamma=1.0, lam=0.95)
    assert not adv.requires_grad and not ret.requires_grad
    with pytest.raises(ValueError, match="1.5"):
        gae_advantages_and_returns(VALUES, REWARDS, MASK, gamma=1.5, lam=0.95)
    with pytest.raises(ValueError, match="-0.1"):
        gae_advantages_and_returns(VALUES, REWARDS, MASK, gamma=1.0, lam=-0.1)


def test_clipped_value_loss_hand_example() -> None:
    # cliprange 0.2.
    # (0,0): V 1.0, old 0.5 -> clipped 0.7; R 2: (1-2)^2 = 1, (0.7-2)^2 = 1.69 -> 1.69
    # (0,1): V 0 = old, R 1: 1, 1 -> 1
    # (0,2): masked (would add max(9, 9))
    # (1,0): V 0, old 0.5 -> clipped 0.3; R 0.6: 0.36, 0.09 -> 0.36 (the unclipped one)
    # (1,1): V = old = R -> 0
    # loss = 0.5 * (1.69 + 1 + 0.36 + 0) / 4 = 0.38125
    values = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.5, 0.0]])
    old = torch.tensor([[0.5, 0.0, 0.0], [0.5, 0.5, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 5.0], [0.6, 0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    loss = clipped_value_loss(values, old, returns, mask, cliprange_value=0.2)
    assert loss.item() == pytest.approx(0.38125, abs=1e-6)
    # A wide clip range: the clip never binds; 0.5 * (1 + 1 + 0.36) / 4 = 0.295
    wide = clipped_value_loss(values, old, returns, mask, cliprange_value=10.0)
    assert wide.item() == pytest.approx(0.295, abs=1e-6)
    with pytest.raises(ValueError, match="cliprange_value must be > 0, got 0"):
        clipped_value_loss(values, old, returns, mask, cliprange_value=0)


# Ratios: row 0: 0.3/0.2 = 1.5, 0.1/0.2 = 0.5, then a masked token whose log-ratio (1000) would be
# inf unmasked. Row 1: 0.5, 1.5, 0.5/0.4 = 1.25. Per-token advantages: row 0 +1, row 1 -1, -1, -2.
P_LOGP = torch.log(torch.tensor([[0.3, 0.1, 1.0], [0.1, 0.3, 0.5]]))
P_OLD = torch.log(torch.tensor([[0.2, 0.2, 1.0], [0.2, 0.2, 0.4]])) - torch.tensor([[0.0, 0.0, 1000.0], [0, 0, 0]])
P_ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -2.0]])
P_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


def test_policy_loss_clip_higher_token_and_sequence_level() -> None:
    # clip_low 0.2, clip_high 0.28: ratio in [0.8, 1.28]; per token max(-A*r, -A*clip(r)):
    #   (0,0) A +1, r 1.5:  max(-1.5, -1.28) = -1.28   (clipped at the high side)
    #   (0,1) A +1, r 0.5:  max(-0.5, -0.8)  = -0.5
    #   (1,0) A -1, r 0.5:  max(0.5, 0.8)    = 0.8     (clipped at the low side)
    #   (1,1) A -1, r 1.5:  max(1.5, 1.28)   = 1.5
    #   (1,2) A -2, r 1.25: max(2.5, 2.5)    = 2.5
    # token level: (-1.28 - 0.5 + 0.8 + 1.5 + 2.5) / 5 = 0.604
    # sequence level: ((-1.78) / 2 + 4.8 / 3) / 2 = (-0.89 + 1.6) / 2 = 0.355
    tok = clipped_policy_loss(P_LOGP, P_OLD, P_ADV, P_MASK, clip_low=0.2, clip_high=0.28, token_level=True)
    seq = clipped_policy_loss(P_LOGP, P_OLD, P_ADV, P_MASK, clip_low=0.2, clip_high=0.28, token_level=False)
    assert math.isfinite(tok.item())
    assert tok.item() == pytest.approx(0.604, abs=1e-6)
    assert seq.item() == pytest.approx(0.355, abs=1e-6)
    # Symmetric 0.2: (0,0) becomes -1.2, the rest stay: (-1.2 - 0.5 + 0.8 + 1.5 + 2.5) / 5 = 0.62
    sym = clipped_policy_loss(P_LOGP, P_OLD, P_ADV, P_MASK, clip_low=0.2, clip_high=0.2)
    assert sym.item() == pytest.approx(0.62, abs=1e-6)


def test_policy_loss_sequence_advantages_broadcast() -> None:
    # Advantages [B] = [+1, -1]: only (1,2) changes, A -1, r 1.25: max(1.25, 1.25) = 1.25.
    # (-1.28 - 0.5 + 0.8 + 1.5 + 1.25) / 5 = 0.354
    loss = clipped_policy_loss(P_LOGP, P_OLD, torch.tensor([1.0, -1.0]), P_MASK, 0.2, 0.28)
    assert loss.item() == pytest.approx(0.354, abs=1e-6)


def test_policy_loss_gradient_is_cut_where_clipped() -> None:
    logp = P_LOGP.clone().requires_grad_(True)
    loss = clipped_policy_loss(logp, P_OLD, P_ADV, P_MASK, clip_low=0.2, clip_high=0.28)
    loss.backward()
    g = logp.grad
    assert g[0, 0] == 0 and g[1, 0] == 0  # clipped (high, low)
    assert g[0, 2] == 0  # masked
    # Unclipped: d(-A * r)/d logp = -A * r, over 5 tokens.
    assert g[0, 1].item() == pytest.approx(-1.0 * 0.5 / 5, abs=1e-6)
    assert g[1, 2].item() == pytest.approx(2.0 * 1.25 / 5, abs=1e-6)
    # With a higher clip_high the (0,0) token (r 1.5) is inside the range and learns again.
    logp.grad = None
    clipped_policy_loss(logp, P_OLD, P_ADV, P_MASK, clip_low=0.2, clip_high=0.6).backward()
    assert logp.grad[0, 0].item() == pytest.approx(-1.5 / 5, abs=1e-6)


def test_policy_loss_checks_clip_ranges() -> None:
    with pytest.raises(ValueError, match="clip_low must be in \\[0, 1\\), got 1.0"):
        clipped_policy_loss(P_LOGP, P_OLD, P_ADV, P_MASK, clip_low=1.0, clip_high=0.2)
    with pytest.raises(ValueError, match="clip_high must be >= 0, got -0.1"):
        clipped_policy_loss(P_LOGP, P_OLD, P_ADV, P_MASK, clip_low=0.2, clip_high=-0.1)
