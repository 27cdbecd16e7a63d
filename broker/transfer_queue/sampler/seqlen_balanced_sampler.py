"""``SeqlenBalancedSampler``: whole GRPO groups for every DP rank at once, balanced by token count."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from broker.api.balance import karmarkar_karp
from broker.errors import GetMetaError, InvalidExperienceError
from broker.transfer_queue.sampler.grpo_group_n_sampler import GRPOGroupNSampler

logger = logging.getLogger(__name__)


class CustomMetaSource(Protocol):
    """What the sampler reads the rows' lengths from (TransferQueue passes its ``DataPartitionStatus``):
    each global index's custom_meta, missing indexes left out."""

    def get_custom_meta(self, global_indices: list[int]) -> Mapping[int, Mapping[str, Any]]: ...


class SeqlenBalancedSampler(GRPOGroupNSampler):
    """Whole prompt groups for all ``dp_size`` ranks, split so each rank gets nearly the same tokens.

    The first call for a ``(partition_id, task_name, batch_index)`` takes ``batch_size * dp_size`` rows
    in whole groups (``batch_size`` is per rank) as ``GRPOGroupNSampler`` does, weighs each group by the
    sum of its rows' ``custom_meta["total_lengths"]`` (1 for a row without it) read from the
    ``partition`` keyword, and splits the groups into ``dp_size`` equal shares with Karmarkar-Karp
    (``broker.api.balance``, which breaks ties as verl's copy in TransferQueue does). Share ``r`` is
    cached for rank ``r``; every later call for that batch returns its rank's share (an empty one for a
    rank ``>= dp_size``). Without ``partition`` the rows are cut into ``dp_size`` consecutive shares.

    The shares live in ``_states`` only (``_balanced_cache`` is a view of it, kept for TransferQueue's
    checkpoints), so a client mirroring ``_states`` mirrors this sampler whole. A batch's shares are
    decided together: to drop one, drop every rank's (``forget`` each).

    Its errors at sampling are ``GetMetaError``: a ``ValueError`` (as the base sampler's checks raise) and a
    ``RuntimeError``, as TransferQueue's ``get_meta`` raises whatever its controller's sampler raised.
    Differences from TransferQueue's: too few groups to give every rank one raise it where TransferQueue's
    sampler fails an ``assert`` (its ``get_meta``: a ``RuntimeError`` too); so does a ``dp_rank`` that is not
    an int >= 0 (TransferQueue's hands rank -1 the last rank's share, by Python's negative indexing).
    """

    def __init__(self, n_samples_per_prompt: int = 1, dp_size: int = 1) -> None:
        super().__init__(n_samples_per_prompt=n_samples_per_prompt)
        if dp_size <= 0:
            raise InvalidExperienceError(f"dp_size must be positive, got {dp_size}")
        self.dp_size = dp_size

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        task_name: str = "",
        partition_id: str = "",
        *args: Any,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        """This rank's share of the batch: ``batch_size`` rows per rank. Keywords: ``dp_rank`` (default 0),
        ``batch_index`` (default 0), ``partition`` (a :class:`CustomMetaSource`, for the lengths)."""
        dp_rank = kwargs.get("dp_rank", 0)
        batch_index = kwargs.get("batch_index", 0)
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
            raise GetMetaError(f"dp_rank must be an int >= 0, got {dp_rank!r}")
        if self._batch_decided(partition_id, task_name, batch_index):
            found = self.cached(partition_id, task_name, dp_rank, batch_index)
            return found if found is not None else ([], [])
        rows = self.whole_groups(ready_indexes, batch_size * self.dp_size)
        if not rows:
            return [], []
        shares = self._shares(rows, kwargs.get("partition"))
        for rank, share in enumerate(shares):
            self.remember(partition_id, task_name, rank, batch_index, share)
        mine = shares[dp_rank] if dp_rank < len(shares) else []
        return list(mine), list(mine)

    def _batch_decided(self, partition_id: str, task_name: str, batch_index: Any) -> bool:
        """Whether some rank's share of this batch is cached (the first call decides all of them)."""
        return any(self.cached(partition_id, task_name, r, batch_index) is not None for r in range(self.dp_size))

    def _shares(self, rows: list[int], partition: CustomMetaSource | None) -> list[list[int]]:
        """``rows`` (whole groups, in order) split into ``dp_size`` shares."""
        if partition is None:
            logger.warning(
                "SeqlenBalancedSampler: no partition object provided, falling back to equal-split without balancing."
            )
            size = len(rows) // self.dp_size
            return [rows[r * size : (r + 1) * size if r < self.dp_size - 1 else len(rows)]
                    for r in range(self.dp_size)]
        meta = partition.get_custom_meta(rows)
        lengths = [meta.get(i, {}).get("total_lengths", 1) for i in rows]
        n = self.n_samples_per_prompt
        # rows holds batch_size * dp_size rows in whole groups, so it always splits into groups of n:
        # balance whole groups, and every rank keeps its groups whole (GRPO's advantages need them).
        group_cost = [sum(lengths[g * n : (g + 1) * n]) for g in range(len(rows) // n)]
        try:
            balanced = karmarkar_karp(group_cost, self.dp_size, equal_size=True)
        except InvalidExperienceError as exc:  # fewer groups than ranks: get_meta's RuntimeError as well
            raise GetMetaError(str(exc)) from exc
        return [[rows[g * n + j] for g in groups for j in range(n)] for groups in balanced]

    @property
    def _balanced_cache(self) -> dict[tuple[Any, Any, Any], list[list[int]]]:
        """TransferQueue's ``{(partition_id, task_name, batch_index): [share of rank 0, ...]}``, read from
        ``_states``."""
        view: dict[tuple[Any, Any, Any], list[list[int]]] = {}
        for c in self.cached_results():
            if isinstance(c.dp_rank, int) and 0 <= c.dp_rank < self.dp_size:
                shares = view.setdefault((c.partition_id, c.task_name, c.batch_index), [[]] * self.dp_size)
                shares[c.dp_rank] = c.sampled
        return view

    def save_checkpoint(self) -> dict[str, Any]:
        """``_states`` and, as TransferQueue's, ``_balanced_cache`` (derived from it)."""
        state = super().save_checkpoint()
        state["_balanced_cache"] = self._balanced_cache
        return state

    def load_checkpoint(self, state: dict[str, Any]) -> None:
        """Restore ``_states``; shares in a TransferQueue checkpoint's ``_balanced_cache`` that ``_states``
        lacks are added to it."""
        super().load_checkpoint(state)
        balanced: Mapping[tuple[Any, Any, Any], Sequence[list[int]]] = state.get("_balanced_cache") or {}
        for (pid, task, index), shares in balanced.items():
            for rank, share in enumerate(shares):
                if self.cached(pid, task, rank, index) is None:
                    self.remember(pid, task, rank, index, share)


def get_seqlen_balanced_partitions(
    seqlen_list: Sequence[float], k_partitions: int, equal_size: bool
) -> list[list[int]]:
    """TransferQueue's (verl's) helper of that name: the indexes of ``seqlen_list`` in ``k_partitions``
    partitions of nearly equal sums (of equal sizes with ``equal_size``), each sorted, heaviest first.

    Too few items, or a count that does not split evenly, raise ``InvalidExperienceError`` (TransferQueue:
    ``AssertionError``).
    """
    return karmarkar_karp(seqlen_list, k_partitions, equal_size)

