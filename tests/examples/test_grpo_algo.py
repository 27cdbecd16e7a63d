"""GRPO math and the digit-reversal reward, on hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from workers.algorithms.grpo_math import group_advantages, grpo_loss, response_mask
from workers.model import task

# A tiny case, worked by hand (clip_eps 0.2, kl_coef 0.1):
#   row 0, A = +1:   tok0 ratio 0.3/0.2 = 1.5 -> clipped to 1.2, pg = -1.2; ref = logp, kl = 0
#                    tok1 ratio 1,           pg = -1;  ref/p = 0.5, kl = 0.5 - ln 0.5 - 1
#   row 1, A = -0.5: tok0 ratio 0.2/0.4 = 0.5 -> clipped to 0.8, pg = 0.4; ref/p = 2, kl = 2 - ln 2 - 1
#                    tok1 masked out
LOGP = torch.log(torch.tensor([[0.3, 0.5], [0.2, 0.9]]))
OLD = torch.log(torch.tensor([[0.2, 0.5], [0.4, 0.1]]))
REF = torch.log(torch.tensor([[0.3, 0.25], [0.4, 0.5]]))
ADV = torch.tensor([1.0, -0.5])
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
KL01 = 0.5 - math.log(0.5) - 1
KL10 = 2 - math.log(2) - 1


def test_group_advantages_hand_example() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.3, 0.6, 0.9])
    adv = group_advantages(scores, 4)
    s = math.sqrt(1 / 3)  # sample std of [1, 0, 0, 1]
    g3_std = math.sqrt((0.45**2 + 0.15**2) * 2 / 3)
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0] + [x / g3_std for x in (-0.45, -0.15, 0.15, 0.45)]
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_group_advantages_rejects_bad_layout() -> None:
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(6), 4)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(6), 1)


def test_loss_matches_hand_computation() -> None:
    loss, m = grpo_loss(LOGP, OLD, REF, ADV, MASK, clip_eps=0.2, kl_coef=0.1)
    per_token = [-1.2, -1.0 + 0.1 * KL01, 0.4 + 0.1 * KL10]
    assert loss.item() == pytest.approx(sum(per_token) / 3, abs=1e-6)
    assert loss.item() == pytest.approx(-1.75 / 3, abs=1e-6)  # KL01 + KL10 = 0.5 exactly
    assert m["clip_frac"] == pytest.approx(2 / 3)
    assert m["kl"] == pytest.approx(0.5 / 3, abs=1e-6)

    seq, _ = grpo_loss(LOGP, OLD, REF, ADV, MASK, clip_eps=0.2, kl_coef=0.1, agg="seq_mean")
    expected_seq = ((per_token[0] + per_token[1]) / 2 + per_token[2]) / 2
    assert seq.item() == pytest.approx(expected_seq, abs=1e-6)


def test_clipped_tokens_get_no_gradient() -> None:
    # Extra row: A > 0 but ratio 0.5 < 1 - eps; the min keeps the unclipped term there, so it learns.
    logp = torch.cat([LOGP, torch.log(torch.tensor([[0.1, 0.5]]))]).requires_grad_(True)
    old = torch.cat([OLD, torch.log(torch.tensor([[0.2, 0.5]]))])
    ref = torch.cat([REF, torch.log(torch.tensor([[0.1, 0.5]]))])
    adv = torch.tensor([1.0, -0.5, 1.0])
    mask = torch.cat([MASK, torch.ones(1, 2)])
    loss, _ = grpo_loss(logp, old, ref, adv, mask, clip_eps=0.2, kl_coef=0.0)
    loss.backward()
    g = logp.grad
    assert g[0, 0] == 0 and g[1, 0] == 0  # clipped
    assert g[1, 1] == 0  # masked
    assert g[0, 1] < 0 and g[2, 0] < 0 and g[2, 1] < 0  # A > 0: raise their log-probs
    # Unclipped gradient of -ratio * A / n_tokens with respect to logp is -ratio * A / n_tokens.
    assert g[2, 0].item() == pytest.approx(-0.5 * 1.0 / 5, abs=1e-6)


def test_kl_pulls_towards_reference() -> None:
    logp = torch.log(torch.tensor([[0.5]])).requires_grad_(True)
    ref = torch.log(torch.tensor([[0.25]]))
    loss, m = grpo_loss(logp, logp.detach(), ref, torch.zeros(1), torch.ones(1, 1), kl_coef=1.0)
    loss.backward()
    assert m["kl"] == pytest.approx(KL01, abs=1e-6)
    assert logp.grad.item() > 0  # descending lowers logp towards ref


def test_response_mask() -> None:
    e = task.EOS
    resp = torch.tensor([[1, 2, e, e], [e, 3, 3, 3], [1, 2, 3, 4]])
    assert response_mask(resp, e).tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]]


def _prompt(digits: list[int]) -> torch.Tensor:
    return torch.tensor([task.BOS, *digits, task.SEP])


def test_reward_hand_examples() -> None:
    k = task.NUM_DIGITS
    digits = [(3 * i + 1) % 10 for i in range(k)]
    p = _prompt(digits)
    rev = digits[::-1]
    e = task.EOS

    def r(resp: list[int]) -> float:
        return task.reward(p, torch.tensor(resp))

    assert r(rev + [e]) == 1.0
    assert r(rev + [e, e, 4]) == 1.0  # anything after the first EOS is ignored
    assert r([e]) == 0.0
    assert r(rev[:2] + [e]) == pytest.approx(2 / (k + 1))
    assert r(rev + [rev[0]]) == pytest.approx(k / (k + 1))  # never stops
    assert r(rev + [7, e]) == pytest.approx(k / (k + 2))  # one digit too many
    assert r(digits + [e]) == pytest.approx((sum(a == b for a, b in zip(digits, rev, strict=True)) + 1) / (k + 1))
    for resp in ([], [0] * 20, rev + [e]):
        assert 0.0 <= r(resp) <= 1.0


def test_make_prompts() -> None:
    a = task.make_prompts(5, torch.Generator().manual_seed(0))
    b = task.make_prompts(5, torch.Generator().manual_seed(0))
    assert len(a) == 5 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for prompt in a:
        assert prompt.shape == (task.PROMPT_LEN,)
        assert prompt[0] == task.BOS and prompt[-1] == task.SEP
        assert bool(((prompt[1:-1] >= 0) & (prompt[1:-1] <= 9)).all())
        assert task.target(prompt) == prompt[1:-1].flip(0).tolist() + [task.EOS]
