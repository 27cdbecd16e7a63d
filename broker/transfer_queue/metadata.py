"""TransferQueue's batch metadata: ``BatchMeta`` (sampled rows, columnar) and ``KVBatchMeta`` (rows by key,
in ``kv_metadata.py``, exported here too; what both share is ``meta_common.py``).

The constructor arguments, attributes, properties, methods and error classes of
``transfer_queue.metadata`` 0.1.11, as plain data: both are dataclasses of lists, dicts and one numpy
array, so they pickle across Ray and DataLoader process boundaries (``production_status`` comes back
writable after Ray's zero-copy deserialisation, which hands out read-only arrays).

Bad input raises the broker's errors, each also the built-in TransferQueue raises:
``InvalidExperienceError`` (``ValueError``), ``RowIndexError`` (``IndexError``), ``UnknownColumnError``
(``KeyError``), and this adapter's ``MetaIndexTypeError`` (``TypeError``) and ``MissingKeysError``
(``RuntimeError``).

Where ours differs, deliberately:

- ``size``, ``field_names`` and ``is_ready`` are read from the attributes each time. TransferQueue
  caches them when the batch is built (and in ``add_fields``), so assigning ``production_status``,
  ``field_schema`` or ``global_indexes`` directly leaves them stale there.
- ``chunk(n)`` with ``n < 1`` raises ``InvalidExperienceError`` (TransferQueue: ``ZeroDivisionError``
  for 0, an empty list for a negative n).
- ``KVBatchMeta.reorder`` takes only a permutation of ``range(size)``: an index outside it raises
  ``RowIndexError`` (TransferQueue takes negative ones, which can repeat a key, and raises a bare
  ``IndexError`` past the end).
- Lists handed to ``KVBatchMeta`` (keys, fields) are copied: TransferQueue keeps the caller's list, and
  its chunks share one ``fields`` list.
"""

from __future__ import annotations

import copy
import logging
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from broker.errors import InvalidExperienceError, RowIndexError, UnknownColumnError
from broker.transfer_queue.errors import MetaIndexTypeError
from broker.transfer_queue.field_schema import (
    FieldSchema,
    batch_rows,
    concat_field_schema,
    extract_field_schema,
)
from broker.transfer_queue.kv_metadata import KVBatchMeta
from broker.transfer_queue.meta_common import (
    DELIVERY,
    chunk_bounds,
    merged_extra_info,
    positions,
)
from broker.transfer_queue.sample_views import SampleView, SampleViews

__all__ = ["DELIVERY", "BatchMeta", "KVBatchMeta", "SampleView", "SampleViews", "extract_field_schema"]

logger = logging.getLogger(__name__)

#: ``production_status`` of a sample whose fields are all written (TransferQueue's READY_FOR_CONSUME).
READY = 1


@dataclass(init=False, eq=False)
class BatchMeta:
    """Metadata of a batch of samples, one column per attribute (TransferQueue's ``BatchMeta``).

    ``global_indexes`` and ``partition_ids`` name the samples; ``field_schema`` describes the fields
    (see ``field_schema.py``); ``production_status`` holds one int8 per sample (1 = every field
    written); ``extra_info`` is batch-level; ``custom_meta`` and ``_custom_backend_meta`` hold one dict
    per sample. Every argument is copied, so the caller's lists and dicts stay the caller's.
    """

    global_indexes: list[int]
    partition_ids: list[str]
    field_schema: FieldSchema
    production_status: npt.NDArray[np.int8]
    extra_info: dict[str, Any]
    custom_meta: list[dict[str, Any]]
    _custom_backend_meta: list[dict[str, Any]]

    def __init__(
        self,
        global_indexes: Sequence[int],
        partition_ids: Sequence[str],
        field_schema: FieldSchema | None = None,
        production_status: Any = None,
        extra_info: dict[str, Any] | None = None,
        custom_meta: Sequence[dict[str, Any]] | None = None,
        _custom_backend_meta: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        self.global_indexes = list(global_indexes)
        self.partition_ids = list(partition_ids)
        size = len(self.global_indexes)
        if len(self.partition_ids) != size:
            raise InvalidExperienceError(
                f"Length mismatch: global_indexes has {size}, partition_ids has {len(self.partition_ids)}"
            )
        self.field_schema = {name: dict(meta) for name, meta in (field_schema or {}).items()}
        for name, meta in self.field_schema.items():
            shapes = meta.get("per_sample_shapes")
            if shapes is not None:
                if len(shapes) != size:
                    raise InvalidExperienceError(
                        f"Field '{name}' per_sample_shapes length {len(shapes)} != batch_size {size}"
                    )
                meta["per_sample_shapes"] = list(shapes)
        if production_status is None:  # nothing produced yet (an empty batch too)
            self.production_status = np.zeros(size, dtype=np.int8)
        else:
            self.production_status = np.array(production_status, dtype=np.int8, copy=True)
            if self.production_status.ndim != 1 or len(self.production_status) != size:
                raise InvalidExperienceError(
                    f"production_status length {len(self.production_status)} != batch_size {size} "
                    f"(shape {self.production_status.shape})"
                )
        self.extra_info = dict(extra_info or {})
        self.custom_meta = self._per_sample(custom_meta, "custom_meta")
        self._custom_backend_meta = self._per_sample(_custom_backend_meta, "_custom_backend_meta")

    def _per_sample(self, dicts: Sequence[dict[str, Any]] | None, name: str) -> list[dict[str, Any]]:
        """One dict per sample: copies of ``dicts``, or empty ones where none (or an empty list) is given."""
        if not dicts:
            return [{} for _ in range(self.size)]
        if len(dicts) != self.size:
            raise InvalidExperienceError(f"{name} length {len(dicts)} != batch_size {self.size}")
        return [dict(d) for d in dicts]

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled; Ray's zero-copy deserialisation gives read-only arrays, and add_fields writes this one."""
        self.__dict__.update(state)
        if not self.production_status.flags.writeable:
            self.production_status = self.production_status.copy()

    # ==================== Properties ====================

    @property
    def size(self) -> int:
        """The number of samples."""
        return len(self.global_indexes)

    @property
    def field_names(self) -> list[str]:
        """The fields of the schema, sorted."""
        return sorted(self.field_schema)

    @property
    def samples(self) -> SampleViews:
        """Read-only per-sample views: ``samples[i].fields['a']``, ``len(samples)``, ``for s in samples``."""
        return SampleViews(self)

    @property
    def is_ready(self) -> bool:
        """Whether the batch has samples and every one of them is produced."""
        return self.size > 0 and bool(np.all(self.production_status == READY))

    def get_dtypes(self, field_name: str) -> list[Any]:
        """The field's dtype once per sample (one dtype per field)."""
        return [self._schema_of(field_name).get("dtype")] * self.size

    def get_shapes(self, field_name: str) -> list[Any]:
        """The field's shape per sample: each sample's own for a nested field, else the one shape repeated."""
        meta = self._schema_of(field_name)
        shapes = meta.get("per_sample_shapes")
        return list(shapes) if shapes is not None else [meta.get("shape")] * self.size

    def _schema_of(self, field_name: str) -> dict[str, Any]:
        if field_name not in self.field_schema:
            raise UnknownColumnError(f"Field '{field_name}' not found in field_schema")
        return self.field_schema[field_name]

    # ==================== extra_info (batch level) ====================

    def get_extra_info(self, key: str, default: Any = None) -> Any:
        return self.extra_info.get(key, default)

    def set_extra_info(self, key: str, value: Any) -> None:
        self.extra_info[key] = value

    def get_all_extra_info(self) -> dict[str, Any]:
        """A deep copy of extra_info."""
        return copy.deepcopy(self.extra_info)

    def update_extra_info(self, info_dict: dict[str, Any]) -> None:
        self.extra_info.update(info_dict)

    def remove_extra_info(self, key: str) -> Any:
        """Remove a key and return its value (None if it was not there)."""
        return self.extra_info.pop(key, None)

    def clear_extra_info(self) -> None:
        self.extra_info.clear()

    def has_extra_info(self, key: str) -> bool:
        return key in self.extra_info

    # ==================== custom_meta (sample level) ====================

    def get_all_custom_meta(self) -> list[dict[str, Any]]:
        """A deep copy of custom_meta, one dict per sample in the batch's order."""
        return copy.deepcopy(self.custom_meta)

    def update_custom_meta(self, custom_meta: Sequence[dict[str, Any]] | None) -> None:
        """Update each sample's custom_meta with the dict at its position (None: nothing to do)."""
        if custom_meta is None:
            return
        if len(custom_meta) != self.size:
            raise InvalidExperienceError(
                f"The length of custom_meta list {len(custom_meta)} must match the batch size: {self.size}"
            )
        for mine, new in zip(self.custom_meta, custom_meta):
            mine.update(new)

    def clear_custom_meta(self) -> None:
        self.custom_meta = [{} for _ in range(self.size)]

    # ==================== Operations ====================

    def add_fields(self, tensor_dict: Any, set_all_ready: bool = True) -> BatchMeta:
        """Add (or replace) the fields of a TensorDict of this batch's size, in place; returns self.

        With ``set_all_ready`` every sample is marked produced. An empty TensorDict changes nothing.
        """
        rows = batch_rows(tensor_dict)
        if rows == 0:
            logger.warning(f"Input TensorDict is empty with batch_size={rows}. No action is taken.")
            return self
        if rows != self.size:
            raise InvalidExperienceError(f"add_fields batch size mismatch: self.size={self.size} vs tensor_dict={rows}")
        self.field_schema.update(extract_field_schema(tensor_dict))
        if set_all_ready:
            self.production_status[:] = READY
        return self

    def select_samples(self, sample_indices: Sequence[int]) -> BatchMeta:
        """A new batch of the samples at these positions (in this order; repeats allowed)."""
        rows = positions(sample_indices, "select_samples")
        if any(i < 0 or i >= self.size for i in rows):
            raise InvalidExperienceError(f"Sample indices must be in range [0, {self.size})")
        schema = copy.deepcopy(self.field_schema)
        for meta in schema.values():
            shapes = meta.get("per_sample_shapes")
            if shapes is not None:
                meta["per_sample_shapes"] = [shapes[i] for i in rows]
        return BatchMeta(
            global_indexes=[self.global_indexes[i] for i in rows],
            partition_ids=[self.partition_ids[i] for i in rows],
            field_schema=schema,
            production_status=self.production_status[rows],
            extra_info=self.extra_info,
            custom_meta=[copy.deepcopy(self.custom_meta[i]) for i in rows],
            _custom_backend_meta=[copy.deepcopy(self._custom_backend_meta[i]) for i in rows],
        )

    def select_fields(self, field_names: Sequence[str]) -> BatchMeta:
        """A new batch of every sample with only these fields (names not in the schema are skipped)."""
        wanted = set(field_names)
        return BatchMeta(
            global_indexes=self.global_indexes,
            partition_ids=self.partition_ids,
            field_schema={f: copy.deepcopy(self.field_schema[f]) for f in field_names if f in self.field_schema},
            production_status=self.production_status,
            extra_info=copy.deepcopy(self.extra_info),
            custom_meta=copy.deepcopy(self.custom_meta),
            # a backend's own entries ("_"-prefixed) go with every selection
            _custom_backend_meta=[{f: v for f, v in m.items() if f.startswith("_") or f in wanted}
                                  for m in self._custom_backend_meta],
        )

    def copy(self) -> BatchMeta:
        """A deep copy."""
        return BatchMeta(
            global_indexes=self.global_indexes,
            partition_ids=self.partition_ids,
            field_schema=copy.deepcopy(self.field_schema),
            production_status=self.production_status,
            extra_info=copy.deepcopy(self.extra_info),
            custom_meta=copy.deepcopy(self.custom_meta),
            _custom_backend_meta=copy.deepcopy(self._custom_backend_meta),
        )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, item: int | slice) -> BatchMeta:
        """``batch[i]`` (negative counts from the end) or ``batch[a:b:c]``: a new batch of those samples."""
        if isinstance(item, slice):
            return self.select_samples(list(range(*item.indices(self.size))))
        try:
            i = operator.index(item)
        except TypeError:
            raise MetaIndexTypeError(f"Indexing with {type(item)} is not supported.") from None
        if not -self.size <= i < self.size:
            raise RowIndexError(f"BatchMeta index {i} out of range for a batch of {self.size}")
        return self.select_samples([i % self.size])

    def __iter__(self) -> Iterator[BatchMeta]:
        """One single-sample batch per sample, as TransferQueue's (which iterates through ``__getitem__``)."""
        return (self.select_samples([i]) for i in range(self.size))

    def chunk(self, chunks: int) -> list[BatchMeta]:
        """``chunks`` consecutive batches; the first ``size % chunks`` hold one sample more (some may be empty)."""
        return [self.select_samples(list(range(a, b))) for a, b in chunk_bounds(self.size, chunks, "BatchMeta")]

    def chunk_by_partition(self) -> list[BatchMeta]:
        """One batch per partition id, in the order the ids first appear."""
        rows: dict[str, list[int]] = {}
        for i, pid in enumerate(self.partition_ids):
            rows.setdefault(pid, []).append(i)
        return [self.select_samples(r) for r in rows.values()]

    def union(self, other: BatchMeta | None) -> BatchMeta:
        """A new batch of the same samples with the fields of both (``other``'s win on a name both have).

        Both must name the same samples in the same order. A sample is produced if it is in both; extra
        info and each sample's custom_meta are merged, ``other``'s winning. An empty side gives a copy
        of the other.
        """
        if other is None or other.size == 0:
            return self.copy()
        if self.size == 0:
            return other.copy()
        if self.global_indexes != other.global_indexes:
            raise InvalidExperienceError(
                f"BatchMeta.union: global_indexes do not match. self.global_indexes={self.global_indexes}, "
                f"other.global_indexes={other.global_indexes}"
            )
        if self.partition_ids != other.partition_ids:
            raise InvalidExperienceError(
                f"BatchMeta.union: partition_ids do not match. self.partition_ids={self.partition_ids}, "
                f"other.partition_ids={other.partition_ids}"
            )
        # Each side may cover other fields: a sample is ready only where both say so.
        return BatchMeta(
            global_indexes=self.global_indexes,
            partition_ids=self.partition_ids,
            field_schema=copy.deepcopy({**self.field_schema, **other.field_schema}),
            production_status=np.bitwise_and(self.production_status, other.production_status),
            extra_info={**self.extra_info, **other.extra_info},
            custom_meta=[copy.deepcopy({**a, **b}) for a, b in zip(self.custom_meta, other.custom_meta)],
            _custom_backend_meta=[copy.deepcopy({**a, **b})
                                  for a, b in zip(self._custom_backend_meta, other._custom_backend_meta)],
        )

    @classmethod
    def concat(cls, data: Sequence[BatchMeta | None], validate: bool = True) -> BatchMeta:
        """The samples of every batch, one batch after the other (empty batches are skipped).

        With ``validate`` the batches must have the same fields with the same dtypes. extra_info is the
        union of theirs; a key whose values differ is refused.
        """
        batches = [b for b in data if b is not None and b.size > 0]
        if not batches:
            logger.warning("No valid BatchMeta chunks to concatenate. Returning empty BatchMeta.")
            return cls.empty()
        if validate:
            base = batches[0].field_names
            for i, b in enumerate(batches):
                if b.field_names != base:
                    raise InvalidExperienceError(
                        f"BatchMeta.concat: field_names mismatch at chunk[{i}]. Expected {base}, got "
                        f"{b.field_names}. Extra in chunk: {set(b.field_names) - set(base)}, "
                        f"Missing from chunk: {set(base) - set(b.field_names)}"
                    )
            for name in base:
                dtype = batches[0].field_schema[name].get("dtype")
                for i, b in enumerate(batches[1:], start=1):
                    if b.field_schema[name].get("dtype") != dtype:
                        raise InvalidExperienceError(
                            f"Field '{name}' dtype mismatch in concat: chunk[0]={dtype}, "
                            f"chunk[{i}]={b.field_schema[name].get('dtype')}"
                        )
        return cls(
            global_indexes=[g for b in batches for g in b.global_indexes],
            partition_ids=[p for b in batches for p in b.partition_ids],
            field_schema=concat_field_schema(batches),
            production_status=np.concatenate([b.production_status for b in batches]),
            extra_info=merged_extra_info([b.extra_info for b in batches], "BatchMeta"),
            custom_meta=[m for b in batches for m in b.custom_meta],
            _custom_backend_meta=[m for b in batches for m in b._custom_backend_meta],
        )

    def reorder(self, indices: Sequence[int]) -> None:
        """Put the samples in this order, in place: ``indices`` is a permutation of ``range(size)``."""
        order = positions(indices, "reorder")
        if len(order) != self.size:
            raise InvalidExperienceError(f"Indices length {len(order)} mismatch batch size {self.size}")
        if len(set(order)) != self.size:
            raise InvalidExperienceError(f"Indices contain duplicates: {order}")
        if any(i < 0 or i >= self.size for i in order):
            raise InvalidExperienceError(f"Reorder indices must be in range [0, {self.size}), got {order}")
        self.global_indexes = [self.global_indexes[i] for i in order]
        self.partition_ids = [self.partition_ids[i] for i in order]
        self.production_status = self.production_status[order]
        for meta in self.field_schema.values():
            if meta.get("per_sample_shapes") is not None:
                meta["per_sample_shapes"] = [meta["per_sample_shapes"][i] for i in order]
        self.custom_meta = [self.custom_meta[i] for i in order]
        self._custom_backend_meta = [self._custom_backend_meta[i] for i in order]

    @classmethod
    def empty(cls, extra_info: dict[str, Any] | None = None) -> BatchMeta:
        """A batch of no samples."""
        return cls(global_indexes=[], partition_ids=[], extra_info=extra_info)

    def __str__(self) -> str:
        return (f"BatchMeta(size={self.size}, field_names={self.field_names}, is_ready={self.is_ready}, "
                f"global_indexes={self.global_indexes}, extra_info={self.extra_info})")
