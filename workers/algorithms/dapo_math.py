"""DAPO's dynamic sampling filter and overlong reward shaping.

From DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale"):

* dynamic sampling: a prompt whose ``n`` sampled answers all got the same reward has a
  group-normalised advantage of 0 everywhere, so it gives no gradient; such groups are dropped
  (and replaced by new prompts until the batch is full);
* soft overlong punishment (eq. 13): with ``L_max = max_len`` and ``L_cache = cache_len``,
  ``0`` if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` if
  ``L_max - L_cache < |y| <= L_max``; ``-1`` if ``|y| > L_max``. It is added to the task reward.
"""

from __future__ import annotations

import torch
from torch import Tensor


def groups_to_keep(scores: Tensor, n: int) -> Tensor:
    """Bool per group of ``n`` consecutive ``scores``: False where all ``n`` rewards are equal (exactly)."""
    if n < 2:
        raise ValueError(f"groups_to_keep needs at least 2 samples per group, got n={n}")
    if scores.numel() % n:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {n}")
    groups = scores.reshape(-1, n)
    return groups.amax(1) != groups.amin(1)


def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int) -> Tensor:
    """DAPO's soft overlong punishment per response length (float tensor, values in [-1, 0])."""
    if max_len <= 0:
        raise ValueError(f"max_len must be > 0, got {max_len}")
    if not 0 < cache_len <= max_len:
        raise ValueError(f"cache_len must be in (0, max_len={max_len}], got {cache_len}")
    lengths = lengths.to(torch.float32)
    expected = max_len - cache_len
    # The ramp is >= 0 up to max_len - cache_len and < -1 beyond max_len: the clamp gives 0 and -1 there.
    return ((expected - lengths) / cache_len).clamp(-1.0, 0.0)
