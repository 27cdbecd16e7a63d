"""Per-DP-rank PPO batch sizes from the global ones, as verl's FSDP workers normalise them.

verl (``fsdp_workers.py``, actor init) takes ``ppo_mini_batch_size`` in prompts and
``ppo_micro_batch_size`` in samples (prompt + response rows), both global, and turns them into
per-rank sizes::

    dp   = world_size // sp_size           # ranks of one SP group see the same data
    mini = ppo_mini_batch_size * n // dp   # rows per rank per optimizer step
    micro_per_gpu = ppo_micro_batch_size // dp   # rows per forward/backward (grad accumulation)

Like verl, the divisions floor: a global size that does not divide by ``dp`` is silently rounded
down, and only the checks below raise.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankBatchSizes:
    """Per-DP-rank sizes, in rows (samples, after ``n``)."""

    dp_size: int
    mini_batch_size: int
    micro_batch_size: int | None
    grad_accum_steps: int | None  # micro-batches per mini-batch


def normalize_ppo_batch_sizes(
    ppo_mini_batch_size: int,
    n: int,
    world_size: int,
    sp_size: int = 1,
    ppo_micro_batch_size: int | None = None,
    ppo_micro_batch_size_per_gpu: int | None = None,
) -> RankBatchSizes:
    """Normalise global ``ppo_mini_batch_size`` (prompts) and micro-batch sizes to one DP rank.

    Checks made by verl, with its messages: ``ppo_micro_batch_size`` and
    ``ppo_micro_batch_size_per_gpu`` are mutually exclusive (verl's ``check_mutually_exclusive``);
    the normalised mini-batch is > 0; it is divisible by the per-GPU micro-batch; and it is at least
    one micro-batch (implied by the previous two, kept because verl checks it). Added here, where
    verl would fail later or elsewhere: ``n``, ``world_size``, ``sp_size`` and the sizes are positive,
    ``world_size`` divides by ``sp_size`` (verl's device mesh needs it), and the per-GPU micro-batch
    is > 0 after normalisation (verl would hit a modulo by zero).
    """
    for name, value in (
        ("ppo_mini_batch_size", ppo_mini_batch_size),
        ("n", n),
        ("world_size", world_size),
        ("sp_size", sp_size),
    ):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if world_size % sp_size:
        raise ValueError(f"world_size {world_size} is not divisible by sp_size {sp_size}")
    if ppo_micro_batch_size is not None and ppo_micro_batch_size_per_gpu is not None:
        raise ValueError(
            "You have set both 'ppo_micro_batch_size' AND 'ppo_micro_batch_size_per_gpu'. Please remove "
            "'ppo_micro_batch_size' because only 'ppo_micro_batch_size_per_gpu' is supported (the former is "
            "deprecated)."
        )
    dp = world_size // sp_size
    mini = ppo_mini_batch_size * n // dp
    if mini <= 0:
        raise ValueError(
            f"ppo_mini_batch_size {mini} should be larger than 0 after normalization "
            f"(global {ppo_mini_batch_size} x n {n} // dp {dp})"
        )
    micro = ppo_micro_batch_size_per_gpu
    if micro is not None and micro <= 0:
        raise ValueError(f"ppo_micro_batch_size_per_gpu must be > 0, got {micro}")
    if ppo_micro_batch_size is not None:
        if ppo_micro_batch_size <= 0:
            raise ValueError(f"ppo_micro_batch_size must be > 0, got {ppo_micro_batch_size}")
        micro = ppo_micro_batch_size // dp
        if micro <= 0:
            raise ValueError(
                f"ppo_micro_batch_size_per_gpu {micro} should be larger than 0 after normalization "
                f"(global ppo_micro_batch_size {ppo_micro_batch_size} // dp {dp})"
            )
    if micro is None:
        return RankBatchSizes(dp_size=dp, mini_batch_size=mini, micro_batch_size=None, grad_accum_steps=None)
    if mini % micro:
        raise ValueError(
            f"normalized ppo_mini_batch_size {mini} should be divisible by ppo_micro_batch_size_per_gpu {micro}"
        )
    if mini // micro <= 0:  # unreachable after the two checks above; verl asserts it all the same
        raise ValueError(
            f"normalized ppo_mini_batch_size {mini} should be larger than ppo_micro_batch_size_per_gpu {micro}"
        )
    return RankBatchSizes(dp_size=dp, mini_batch_size=mini, micro_batch_size=micro, grad_accum_steps=mini // micro)
