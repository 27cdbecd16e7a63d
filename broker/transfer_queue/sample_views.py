"""``BatchMeta.samples``: read-only per-sample views of a columnar batch, as TransferQueue's ``_SampleView``.

A view reads its batch when asked (it holds the batch and a position, not a copy), and hands out
``MappingProxyType``s, so writing through it raises ``TypeError``: it is a window, not a sample to edit.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from types import MappingProxyType
from typing import Any, Protocol

from broker.errors import RowIndexError
from broker.transfer_queue.errors import MetaIndexTypeError


class Columns(Protocol):
    """What a view reads of its batch (a ``BatchMeta``): described here, so this module needs nothing of the
    one that holds the batches."""

    @property
    def global_indexes(self) -> Sequence[int]: ...

    @property
    def partition_ids(self) -> Sequence[str]: ...

    @property
    def production_status(self) -> Any: ...

    @property
    def custom_meta(self) -> Sequence[dict[str, Any]]: ...

    @property
    def field_schema(self) -> dict[str, dict[str, Any]]: ...

    @property
    def size(self) -> int: ...


class SampleView:
    """One sample of a batch: its global index, partition, production status, custom_meta and fields."""

    __slots__ = ("_batch", "_idx")

    def __init__(self, batch: Columns, idx: int) -> None:
        self._batch = batch
        self._idx = idx

    @property
    def global_index(self) -> int:
        return self._batch.global_indexes[self._idx]

    @property
    def partition_id(self) -> str:
        return self._batch.partition_ids[self._idx]

    @property
    def production_status(self) -> int:
        return int(self._batch.production_status[self._idx])

    @property
    def custom_meta(self) -> MappingProxyType[str, Any]:
        return MappingProxyType(self._batch.custom_meta[self._idx])

    @property
    def fields(self) -> MappingProxyType[str, MappingProxyType[str, Any]]:
        """Each field's schema for this sample: a nested field's ``shape`` is this sample's own shape,
        and ``per_sample_shapes`` is left out."""
        result: dict[str, MappingProxyType[str, Any]] = {}
        for name, meta in self._batch.field_schema.items():
            shapes = meta.get("per_sample_shapes")
            own = dict(meta)
            if shapes is not None:
                del own["per_sample_shapes"]
                own["shape"] = shapes[self._idx]
            result[name] = MappingProxyType(own)
        return MappingProxyType(result)

    def __repr__(self) -> str:
        return (f"_SampleView(global_index={self.global_index}, partition_id={self.partition_id!r}, "
                f"production_status={self.production_status}, fields={list(self._batch.field_schema)})")


class SampleViews:
    """The views of every sample of a batch: ``len``, ``views[i]`` (negative counts from the end), iteration."""

    __slots__ = ("_batch",)

    def __init__(self, batch: Columns) -> None:
        self._batch = batch

    def __len__(self) -> int:
        return self._batch.size

    def __getitem__(self, idx: int) -> SampleView:
        try:
            i = operator.index(idx)
        except TypeError:
            raise MetaIndexTypeError(f"samples are indexed by an int, got {type(idx).__name__}") from None
        size = self._batch.size
        if not -size <= i < size:
            raise RowIndexError(f"sample {i} is outside a batch of {size}")
        return SampleView(self._batch, i % size)

    def __iter__(self) -> Iterator[SampleView]:
        return (SampleView(self._batch, i) for i in range(self._batch.size))
