"""``RankAwareSampler``: every rank of one DP group gets the same rows for the same batch."""

from __future__ import annotations

from typing import Any

from broker.errors import GetMetaError
from broker.transfer_queue.sampler.base import BaseSampler


class RankAwareSampler(BaseSampler):
    """The first call for ``(partition_id, task_name, dp_rank, batch_index)`` takes the first
    ``batch_size`` ready indexes (nothing if fewer are ready) and caches them; every later call for that
    key (the other ranks of the DP group) gets the same. ``_states`` holds the sampled list per key."""

    cache_pairs = False

    def __init__(self) -> None:
        super().__init__()

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        dp_rank: int,
        batch_index: int,
        task_name: str,
        partition_id: str,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        if dp_rank < 0:  # a ValueError as TransferQueue's, and get_meta's RuntimeError (its controller's reply)
            raise GetMetaError(f"dp_rank {dp_rank} must be greater than or equal to 0")
        # TransferQueue makes the nesting down to the rank even when it then hands out nothing
        self._states.setdefault(partition_id, {}).setdefault(task_name, {}).setdefault(dp_rank, {})
        found = self.cached(partition_id, task_name, dp_rank, batch_index)
        if found is not None:
            return found
        sampled = list(ready_indexes[:batch_size])
        if len(sampled) < batch_size:
            return [], []
        self.remember(partition_id, task_name, dp_rank, batch_index, sampled)
        return sampled, list(sampled)
