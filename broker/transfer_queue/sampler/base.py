"""``BaseSampler``: what TransferQueue's samplers share, and the cache hook the broker's client uses.

A sampler chooses, from the rows ready for a task, which to hand out (``sampled``) and which to mark
consumed (``consumed``). On the broker it runs in the caller's process over candidates read from Redis,
and the client claims the chosen rows atomically, sampling again on a conflict; so each sampler's
choice is a function of its arguments and of ``_states`` only.

``_states`` is TransferQueue's cache: ``_states[partition_id][task_name][dp_rank][batch_index]`` is the
result handed to that DP rank for that batch, so that every rank of a DP group (and a retried call) gets
the same rows. ``GRPOGroupNSampler`` and ``SeqlenBalancedSampler`` keep ``(sampled, consumed)`` there,
``RankAwareSampler`` keeps the sampled list (consumed is the same). Users' samplers may keep anything
else in ``_states`` (an RNG, say); the hook below only touches entries of that four-level shape.

The hook, for a client that mirrors the cache elsewhere (the broker keeps it in Redis, so ranks in other
processes see it): :meth:`cached` reads one result, :meth:`remember` writes one in the sampler's own
format, :meth:`forget` drops one, :meth:`cached_results` lists them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterator
from typing import Any, NamedTuple


class CachedResult(NamedTuple):
    """One cached choice: who asked (partition, task, DP rank, batch) and what they were given."""

    partition_id: Any
    task_name: Any
    dp_rank: Any
    batch_index: Any
    sampled: list[int]
    consumed: list[int]


class BaseSampler(ABC):
    """Base class of samplers (TransferQueue's ``transfer_queue.sampler.BaseSampler``).

    Subclasses implement :meth:`sample`; calling the sampler calls it. Always return both lists, the
    sampled and the consumed indexes (they may be the same list).
    """

    #: Whether ``_states`` entries are ``(sampled, consumed)`` pairs (True) or the sampled list (False).
    cache_pairs = True

    def __init__(self) -> None:
        self._states: dict[Any, Any] = {}

    @abstractmethod
    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """Choose from ``ready_indexes`` (the global indexes ready for the task and not consumed by it).

        Returns ``(sampled, consumed)``: the indexes to hand out, and those to mark consumed (never
        handed to this task again). Raises ``ValueError`` if ``batch_size`` is invalid: the built-in samplers
        raise the broker's ``GetMetaError``, a ``RuntimeError`` as well, as TransferQueue's ``get_meta``
        raises what its controller's sampler raised.
        """

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[list[int], list[int]]:
        return self.sample(*args, **kwargs)

    def has_cached_result(
        self, partition_id: str, task_name: str, sampling_config: dict[str, Any] | None = None
    ) -> bool:
        """Whether a result is cached for the ``dp_rank`` and ``batch_index`` of ``sampling_config``
        (False without a ``dp_rank``)."""
        config = sampling_config or {}
        dp_rank = config.get("dp_rank")
        if dp_rank is None:
            return False
        return self.cached(partition_id, task_name, dp_rank, config.get("batch_index")) is not None

    def clear_cache(self, partition_id: str) -> None:
        """Forget every cached result of the partition (its rows are gone)."""
        self._states.pop(partition_id, None)

    def save_checkpoint(self) -> dict[str, Any]:
        """The sampler's state, for :meth:`load_checkpoint` (the live ``_states``, not a copy)."""
        return {"_states": self._states}

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`save_checkpoint` returned."""
        self._states = state["_states"]

    # ==================== The cache hook ====================

    def _ranks(self, partition_id: Any, task_name: Any) -> dict[Any, Any] | None:
        """``_states[partition_id][task_name]`` if it has that shape."""
        tasks = self._states.get(partition_id)
        ranks = tasks.get(task_name) if isinstance(tasks, dict) else None
        return ranks if isinstance(ranks, dict) else None

    def cached(
        self, partition_id: Any, task_name: Any, dp_rank: Any, batch_index: Any
    ) -> tuple[list[int], list[int]] | None:
        """The ``(sampled, consumed)`` cached for that DP rank and batch, or None."""
        batches = (self._ranks(partition_id, task_name) or {}).get(dp_rank)
        if not isinstance(batches, dict) or batch_index not in batches:
            return None
        entry = batches[batch_index]
        if isinstance(entry, tuple) and len(entry) == 2:
            return list(entry[0]), list(entry[1])
        return list(entry), list(entry)

    def remember(
        self,
        partition_id: Hashable,
        task_name: Hashable,
        dp_rank: Hashable,
        batch_index: Hashable,
        sampled: list[int],
        consumed: list[int] | None = None,
    ) -> None:
        """Cache a result for that DP rank and batch, as the sampler itself would (``consumed``
        defaults to ``sampled``)."""
        entry: Any = (list(sampled), list(sampled if consumed is None else consumed)) if self.cache_pairs \
            else list(sampled)
        tasks = self._states.setdefault(partition_id, {})
        tasks.setdefault(task_name, {}).setdefault(dp_rank, {})[batch_index] = entry

    def forget(self, partition_id: Any, task_name: Any, dp_rank: Any, batch_index: Any) -> None:
        """Drop the result cached for that DP rank and batch, if any (say, when claiming its rows failed)."""
        batches = (self._ranks(partition_id, task_name) or {}).get(dp_rank)
        if isinstance(batches, dict):
            batches.pop(batch_index, None)

    def cached_results(self, partition_id: Any = None, task_name: Any = None) -> Iterator[CachedResult]:
        """Every cached result (of one partition, and of one task, if given), in ``_states``'s order."""
        for pid, tasks in list(self._states.items()):
            if (partition_id is not None and pid != partition_id) or not isinstance(tasks, dict):
                continue
            for task in list(tasks):
                if task_name is not None and task != task_name:
                    continue
                for rank, batches in list((self._ranks(pid, task) or {}).items()):
                    for index in list(batches if isinstance(batches, dict) else ()):
                        found = self.cached(pid, task, rank, index)
                        if found is not None:
                            yield CachedResult(pid, task, rank, index, *found)
