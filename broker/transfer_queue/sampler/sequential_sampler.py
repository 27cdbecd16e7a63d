"""``SequentialSampler``: the first ``batch_size`` ready rows, in the order given (TransferQueue's default)."""

from __future__ import annotations

from typing import Any

from broker.transfer_queue.sampler.base import BaseSampler


class SequentialSampler(BaseSampler):
    """Hands out and consumes ``ready_indexes[:batch_size]``: fewer if fewer are ready (Python's slice,
    so a negative ``batch_size`` drops that many from the end, as TransferQueue's does). Caches nothing."""

    def __init__(self) -> None:
        super().__init__()

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        sampled = list(ready_indexes[:batch_size])
        return sampled, sampled
