"""``GRPOGroupNSampler``: whole groups of ``n_samples_per_prompt`` consecutive global indexes, or nothing."""

from __future__ import annotations

from typing import Any

from broker.errors import GetMetaError, InvalidExperienceError
from broker.transfer_queue.sampler.base import BaseSampler


class GRPOGroupNSampler(BaseSampler):
    """Samples whole prompt groups: a group is ``n_samples_per_prompt`` consecutive global indexes, all
    ready (the responses of one prompt are put next to each other).

    The ready indexes are sorted and scanned from the lowest: a run of ``n`` consecutive indexes is a
    group (taken, and the scan goes on after it); otherwise the scan moves one index on. The first
    ``batch_size / n`` groups found are handed out and consumed; if there are fewer, nothing is. With a
    ``dp_rank`` keyword the result is cached under ``(partition_id, task_name, dp_rank, batch_index)``
    and handed out again for the same key (before ``batch_size`` is even checked), as TransferQueue's.

    A ``batch_size`` that is not a multiple of ``n_samples_per_prompt`` raises ``GetMetaError``: a ``ValueError``
    as TransferQueue's sampler raises, and a ``RuntimeError`` as its ``get_meta`` raises it (the controller's
    reply), so a caller of either catches it as there.
    """

    def __init__(self, n_samples_per_prompt: int = 1) -> None:
        super().__init__()
        if n_samples_per_prompt <= 0:
            raise InvalidExperienceError(f"n_samples_per_prompt must be positive, got {n_samples_per_prompt}")
        self.n_samples_per_prompt = n_samples_per_prompt

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """``batch_size`` (a multiple of ``n_samples_per_prompt``) indexes in whole groups, or ``([], [])``.

        Keywords ``dp_rank`` and ``batch_index`` key the cache; others are ignored.
        """
        dp_rank = kwargs.get("dp_rank")
        batch_index = kwargs.get("batch_index")
        if dp_rank is not None:
            found = self.cached(partition_id, task_name, dp_rank, batch_index)
            if found is not None:
                return found
        sampled = self.whole_groups(ready_indexes, batch_size)
        if sampled is None:
            return [], []
        if dp_rank is not None:
            # the first result for a key stays: a later one never replaces it (TransferQueue's rule)
            self.remember(partition_id, task_name, dp_rank, batch_index, sampled)
        return sampled, list(sampled)

    def whole_groups(self, ready_indexes: list[int], batch_size: int) -> list[int] | None:
        """The first ``batch_size / n`` whole groups among ``ready_indexes``, or None if there are fewer."""
        n = self.n_samples_per_prompt
        if batch_size % n != 0:  # a ValueError as TransferQueue's, and get_meta's RuntimeError (its controller's)
            raise GetMetaError(
                f"batch_size ({batch_size}) must be a multiple of n_samples_per_prompt ({n})"
            )
        wanted = batch_size // n
        ready = sorted(ready_indexes)
        groups: list[int] = []
        found, i = 0, 0
        while found < wanted and i + n <= len(ready):
            run = ready[i : i + n]
            if all(b - a == 1 for a, b in zip(run, run[1:])):
                groups.extend(run)
                found += 1
                i += n
            else:
                i += 1
        return groups if found >= wanted else None
