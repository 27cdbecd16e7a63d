"""What a partitioned dock says of its rows' status, joined from its partitions: dead letters, ready and consumed
rows, in the dock's row indexes. A base of ``PartitionedDock`` (partitioned.py)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from broker.api.partitioned_parts import PartitionedParts


class PartitionedRowStatus(PartitionedParts):
    """Per-row status over the partitions: a base of ``PartitionedDock``."""


    def dead_letters(self, consumer: str | None = None) -> dict[str, dict[int, str]]:
        out: dict[str, dict[int, str]] = {}
        for p, part in enumerate(self._parts):
            for c, letters in part.dead_letters(consumer).items():
                out.setdefault(c, {}).update({self._pmap.global_row(p, r): why for r, why in letters.items()})
        return {c: dict(sorted(letters.items())) for c, letters in out.items()}

    def drop_dead_letters(self, consumer: str | None = None) -> list[int]:
        return sorted(self._pmap.global_row(p, r) for p, part in enumerate(self._parts)
                      for r in part.drop_dead_letters(consumer))

    def ready_rows(self, columns: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        return self._joined([part.ready_rows(columns) for part in self._parts])

    def consumed_rows(self, consumers: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        return self._joined([part.consumed_rows(consumers) for part in self._parts])

    def _joined(self, per_part: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Per-row tensors of the partitions as one of the dock's rows."""
        out: dict[str, torch.Tensor] = {}
        for p, tensors in enumerate(per_part):
            index = torch.tensor(self._pmap.global_rows(p, range(self._pmap.prompts_of(p) * self._pmap.n)),
                                 dtype=torch.long)
            for key, values in tensors.items():
                joined = out.setdefault(key, torch.zeros(self._pmap.prompts_num * self._pmap.n, dtype=values.dtype))
                joined[index] = values
        return out
