"""DAPO's dynamic-sampling filter and overlong penalty (workers.algorithms.dapo_math)."""

from __future__ import annotations

import pytest
import torch

from workers.algorithms.dapo_math import groups_to_keep, overlong_penalty


def test_groups_to_keep_drops_groups_with_equal_rewards() -> None:
    # Groups of 3: all 1 (drop), mixed (keep), all 0 (drop), 0.2/0.2/0.3 (keep).
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.2, 0.2, 0.3])
    assert groups_to_keep(scores, 3).tolist() == [False, True, False, True]
    # The same scores in groups of 2: (1,1) (1,0) (1,0) (0,0) (0,0.2) (0.2,0.3)
    assert groups_to_keep(scores, 2).tolist() == [False, True, True, False, True, True]


def test_groups_to_keep_errors() -> None:
    with pytest.raises(ValueError, match="5 scores do not split into groups of 2"):
        groups_to_keep(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="n=1"):
        groups_to_keep(torch.zeros(4), 1)


def test_overlong_penalty_hand_values() -> None:
    # max_len 20, cache 4: no penalty up to 16; (16 - len) / 4 from 16 to 20; -1 beyond 20.
    lengths = torch.tensor([0, 16, 17, 18, 19, 20, 21, 100])
    expected = torch.tensor([0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    torch.testing.assert_close(overlong_penalty(lengths, max_len=20, cache_len=4), expected)
    # The whole length as the cache: the ramp starts at 0.
    torch.testing.assert_close(
        overlong_penalty(torch.tensor([0, 5, 10, 11]), 10, 10), torch.tensor([0.0, -0.5, -1.0, -1.0])
    )


def test_overlong_penalty_errors() -> None:
    with pytest.raises(ValueError, match=r"cache_len must be in \(0, max_len=20\], got 0"):
        overlong_penalty(torch.tensor([1]), 20, 0)
    with pytest.raises(ValueError, match="got 21"):
        overlong_penalty(torch.tensor([1]), 20, 21)
    with pytest.raises(ValueError, match="max_len must be > 0, got 0"):
        overlong_penalty(torch.tensor([1]), 0, 1)
