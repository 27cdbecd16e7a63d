"""verl's per-DP-rank normalisation of the PPO mini- and micro-batch sizes (workers.algorithms.batch_sizes)."""

from __future__ import annotations

import dataclasses

import pytest

from workers.algorithms.batch_sizes import RankBatchSizes, normalize_ppo_batch_sizes


@pytest.mark.parametrize(
    ("mini", "n", "world", "sp", "micro", "micro_gpu", "expected"),
    [
        # 16 prompts x 4 = 64 rows over dp 8 -> 8 per rank; micro 16 // 8 = 2 -> 4 accumulation steps
        (16, 4, 8, 1, 16, None, RankBatchSizes(8, 8, 2, 4)),
        # sp 2: dp = 8 // 2 = 4 -> 64 // 4 = 16; micro 16 // 4 = 4 -> 4 steps
        (16, 4, 8, 2, 16, None, RankBatchSizes(4, 16, 4, 4)),
        # micro given per GPU is taken as is: 64 // 8 = 8 rows, micro 8 -> 1 step
        (16, 4, 8, 1, None, 8, RankBatchSizes(8, 8, 8, 1)),
        # no micro-batch: only the mini-batch is normalised; n = 1 (PPO with a critic)
        (4, 1, 2, 1, None, None, RankBatchSizes(2, 2, None, None)),
        # verl floors: 3 x 1 // 2 = 1 (one prompt's rows are lost, as in verl)
        (3, 1, 2, 1, None, None, RankBatchSizes(2, 1, None, None)),
    ],
)
def test_normalization_examples(
    mini: int, n: int, world: int, sp: int, micro: int | None, micro_gpu: int | None, expected: RankBatchSizes
) -> None:
    got = normalize_ppo_batch_sizes(
        mini, n, world, sp, ppo_micro_batch_size=micro, ppo_micro_batch_size_per_gpu=micro_gpu
    )
    assert got == expected


def test_result_is_frozen() -> None:
    sizes = normalize_ppo_batch_sizes(16, 4, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sizes.mini_batch_size = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # 1 x 1 // 4 = 0
        (
            dict(ppo_mini_batch_size=1, n=1, world_size=4),
            "ppo_mini_batch_size 0 should be larger than 0 after normalization",
        ),
        # 64 // 8 = 8 rows, not divisible by 3
        (
            dict(ppo_mini_batch_size=16, n=4, world_size=8, ppo_micro_batch_size_per_gpu=3),
            "normalized ppo_mini_batch_size 8 should be divisible by ppo_micro_batch_size_per_gpu 3",
        ),
        # global micro 16 // 8 = 2; 8 rows x 1 // 8 = 1, not divisible by 2
        (
            dict(ppo_mini_batch_size=8, n=1, world_size=8, ppo_micro_batch_size=16),
            "normalized ppo_mini_batch_size 1 should be divisible by ppo_micro_batch_size_per_gpu 2",
        ),
        # global micro 2 // dp 4 = 0
        (
            dict(ppo_mini_batch_size=16, n=1, world_size=4, ppo_micro_batch_size=2),
            "ppo_micro_batch_size_per_gpu 0 should be larger than 0 after normalization",
        ),
        (dict(ppo_mini_batch_size=16, n=1, world_size=6, sp_size=4), "world_size 6 is not divisible by sp_size 4"),
        (
            dict(ppo_mini_batch_size=16, n=1, world_size=2, ppo_micro_batch_size=2, ppo_micro_batch_size_per_gpu=1),
            "You have set both 'ppo_micro_batch_size' AND 'ppo_micro_batch_size_per_gpu'",
        ),
        (dict(ppo_mini_batch_size=16, n=0, world_size=2), "n must be > 0, got 0"),
        (dict(ppo_mini_batch_size=16, n=1, world_size=2, ppo_micro_batch_size_per_gpu=0), "got 0"),
    ],
)
def test_errors_name_the_numbers(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError) as err:
        normalize_ppo_batch_sizes(**kwargs)
    assert message in str(err.value)
