"""TransferQueue's ``KVBatchMeta``: rows addressed by key in one partition (what the KV interface hands
out), as ``transfer_queue.metadata`` 0.1.11 has it; ``broker.transfer_queue.metadata`` exports it beside
``BatchMeta`` (see that module for where both differ from TransferQueue's, deliberately).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from broker.errors import InvalidExperienceError, RowIndexError
from broker.transfer_queue.errors import MissingKeysError
from broker.transfer_queue.meta_common import chunk_bounds, merged_extra_info, positions, repeated

logger = logging.getLogger("broker.transfer_queue.metadata")  # as BatchMeta's: TransferQueue logs from one module


@dataclass
class KVBatchMeta:
    """Metadata of rows addressed by key (TransferQueue's KV interface): keys, one tag dict per key, and
    optionally the partition, the fields to read and batch-level extra_info.

    Keys must be unique, as must fields; tags and extra_info are deep-copied.
    """

    keys: list[str] = field(default_factory=list)
    tags: list[dict[str, Any]] = field(default_factory=list)
    partition_id: str | None = None
    fields: list[str] | None = None
    extra_info: dict[str, Any] | None = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.tags):
            raise InvalidExperienceError(
                f"keys and tags must have same length, but got {len(self.keys)} and {len(self.tags)}"
            )
        if len(self.keys) != len(set(self.keys)):
            raise InvalidExperienceError(f"Got duplicated keys: {repeated(self.keys)}")
        if self.fields is not None and len(self.fields) != len(set(self.fields)):
            raise InvalidExperienceError(f"Got duplicated fields: {repeated(self.fields)}")
        self.keys = list(self.keys)
        self.fields = None if self.fields is None else list(self.fields)
        # deep copies: chunks and concats must not share a tag with the batch they came from
        self.tags = copy.deepcopy(list(self.tags))
        self.extra_info = copy.deepcopy(self.extra_info)

    @property
    def size(self) -> int:
        """The number of keys."""
        return len(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def __str__(self) -> str:
        return f"KVBatchMeta(size={self.size}, field_names={self.fields}, extra_info={self.extra_info})"

    def select_keys(self, keys_to_select: Sequence[str]) -> KVBatchMeta:
        """A new batch of these keys (in this order) with their tags."""
        if len(set(keys_to_select)) != len(keys_to_select):
            raise InvalidExperienceError(f"Contain duplicate keys: {repeated(keys_to_select)}")
        position = {k: i for i, k in enumerate(self.keys)}
        missing = [k for k in keys_to_select if k not in position]
        if missing:
            raise MissingKeysError(f"Keys {missing} not found in current batch.")
        return KVBatchMeta(
            keys=list(keys_to_select),
            tags=[self.tags[position[k]] for k in keys_to_select],
            partition_id=self.partition_id,
            fields=self.fields,
            extra_info=self.extra_info,
        )

    def reorder(self, indexes: Sequence[int]) -> None:
        """Put the keys in this order, in place: ``indexes`` is a permutation of ``range(size)``."""
        order = positions(indexes, "reorder")
        if len(order) != self.size:
            raise InvalidExperienceError(
                f"Attempted to reorder with indexes length {len(order)} that does not match the batch size "
                f"{self.size}."
            )
        if len(set(order)) != len(order):
            raise InvalidExperienceError(f"Contain duplicate indexes: {repeated(order)}")
        outside = [i for i in order if not 0 <= i < self.size]
        if outside:
            raise RowIndexError(f"reorder indexes {outside} are outside [0, {self.size})")
        self.keys = [self.keys[i] for i in order]
        self.tags = [self.tags[i] for i in order]

    def chunk(self, chunks: int) -> list[KVBatchMeta]:
        """``chunks`` consecutive batches; the first ``size % chunks`` hold one key more (some may be empty)."""
        return [
            KVBatchMeta(keys=self.keys[a:b], tags=self.tags[a:b], partition_id=self.partition_id,
                        fields=self.fields, extra_info=self.extra_info)
            for a, b in chunk_bounds(self.size, chunks, "KVBatchMeta")
        ]

    @classmethod
    def concat(cls, data: Sequence[KVBatchMeta | None]) -> KVBatchMeta:
        """The keys of every batch, one after the other (empty batches skipped); all must share the
        partition and the fields. extra_info is the union of theirs (None if empty), a key whose values
        differ refused."""
        batches = [b for b in data if b is not None and b.size > 0]
        if not batches:
            logger.warning("No valid KVBatchMeta chunks to concatenate. Returning empty KVBatchMeta.")
            return cls()
        first = batches[0]
        fields = set(first.fields or ())
        for b in batches:
            if b.fields is not None and set(b.fields) != fields:
                raise InvalidExperienceError(
                    f"Field names do not match for concatenation: {first.fields} and {b.fields}"
                )
            if b.partition_id != first.partition_id:
                raise InvalidExperienceError(
                    f"Partition do not match for concatenation: {first.partition_id!r} and {b.partition_id!r}"
                )
        extra = merged_extra_info([b.extra_info for b in batches], "KVBatchMeta")
        return cls(
            keys=[k for b in batches for k in b.keys],
            tags=[t for b in batches for t in b.tags],
            partition_id=first.partition_id,
            fields=first.fields,
            extra_info=extra or None,  # as TransferQueue: no info at all is None, not {}
        )
