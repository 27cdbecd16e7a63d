"""TransferQueue's batch metadata: ``BatchMeta`` (sampled rows, columnar) and ``KVBatchMeta`` (rows by key).

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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from broker.errors import InvalidExperienceError, RowIndexError, UnknownColumnError
from broker.transfer_queue.errors import MetaIndexTypeError, MissingKeysError
from broker.transfer_queue.field_schema import (
    FieldSchema,
    batch_rows,
    concat_field_schema,
    extract_field_schema,
)
from broker.transfer_queue.sample_views import SampleView, SampleViews

__all__ = ["BatchMeta", "KVBatchMeta", "SampleView", "SampleViews", "extract_field_schema"]

logger = logging.getLogger(__name__)

#: ``production_status`` of a sample whose fields are all written (TransferQueue's READY_FOR_CONSUME).
READY = 1


def _values_equal(a: Any, b: Any) -> bool:
    """Whether two extra_info values agree: tensors and arrays by content, anything else by ``==``."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # an == that raises or gives something without a truth value: not equal
        return False


#: Where a leased ``get_meta`` keeps its delivery (the broker's, beyond TransferQueue): one delivery, or after
#: ``concat`` of batches from several takes, the tuple of theirs (client.py's ``deliveries_of`` reads either).
DELIVERY = "broker_delivery"


def _merged_extra_info(infos: Sequence[dict[str, Any] | None], what: str) -> dict[str, Any]:
    """The union of batch-level infos; a key whose values differ between chunks cannot be merged, but for the
    broker's deliveries: each batch's lease stays its own, so the concatenation keeps them all."""
    keys = [set(info or ()) for info in infos]
    if any(k != keys[0] for k in keys[1:]):
        logger.warning(f"{what}.concat: extra_info key sets differ across chunks, performing union of keys.")
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for info in infos for k in info or ()):  # first seen first
        values = [info[key] for info in infos if info and key in info]
        if key == DELIVERY:
            merged[key] = _deliveries(values)
            continue
        for i, v in enumerate(values[1:], start=1):
            if not _values_equal(values[0], v):
                raise InvalidExperienceError(
                    f"{what}.concat: extra_info key '{key}' has conflicting values across chunks and cannot be "
                    f"merged. chunk[0]={values[0]!r}, chunk[{i}]={v!r}"
                )
        merged[key] = values[0]
    return merged


def _deliveries(values: Sequence[Any]) -> Any:
    """The deliveries of concatenated batches, each once, in order: one stays one (not a tuple of one)."""
    flat: list[Any] = []
    for value in values:
        for delivery in value if isinstance(value, tuple) else (value,):
            if not any(d is delivery or (type(d) is type(delivery) and d == delivery
                                         and getattr(d, "token", None) == getattr(delivery, "token", None))
                       for d in flat):
                flat.append(delivery)
    return flat[0] if len(flat) == 1 else tuple(flat)


def _chunk_bounds(size: int, chunks: int, what: str) -> list[tuple[int, int]]:
    """``chunks`` consecutive ranges covering ``range(size)``, the first ``size % chunks`` one longer."""
    try:
        chunks = operator.index(chunks)
    except TypeError:
        raise MetaIndexTypeError(f"{what}.chunk: chunks must be an int, got {chunks!r}") from None
    if chunks < 1:
        raise InvalidExperienceError(f"{what}.chunk: chunks must be at least 1, got {chunks}")
    if size < chunks:
        logger.warning(f"Chunk size {chunks} > number of samples in {what} {size}, this will return some "
                       f"empty {what} chunks.")
    base, extra = divmod(size, chunks)
    bounds, start = [], 0
    for i in range(chunks):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def _positions(indices: Iterable[Any], what: str) -> list[int]:
    """Row positions as ints (numpy ints too); anything else is refused by name."""
    try:
        return [operator.index(i) for i in indices]
    except TypeError:
        raise MetaIndexTypeError(f"{what} takes a list of int positions, got {indices!r}") from None


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
        rows = _positions(sample_indices, "select_samples")
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
        return [self.select_samples(list(range(a, b))) for a, b in _chunk_bounds(self.size, chunks, "BatchMeta")]

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
            extra_info=_merged_extra_info([b.extra_info for b in batches], "BatchMeta"),
            custom_meta=[m for b in batches for m in b.custom_meta],
            _custom_backend_meta=[m for b in batches for m in b._custom_backend_meta],
        )

    def reorder(self, indices: Sequence[int]) -> None:
        """Put the samples in this order, in place: ``indices`` is a permutation of ``range(size)``."""
        order = _positions(indices, "reorder")
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
            raise InvalidExperienceError(f"Got duplicated keys: {_repeated(self.keys)}")
        if self.fields is not None and len(self.fields) != len(set(self.fields)):
            raise InvalidExperienceError(f"Got duplicated fields: {_repeated(self.fields)}")
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
            raise InvalidExperienceError(f"Contain duplicate keys: {_repeated(keys_to_select)}")
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
        order = _positions(indexes, "reorder")
        if len(order) != self.size:
            raise InvalidExperienceError(
                f"Attempted to reorder with indexes length {len(order)} that does not match the batch size "
                f"{self.size}."
            )
        if len(set(order)) != len(order):
            raise InvalidExperienceError(f"Contain duplicate indexes: {_repeated(order)}")
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
            for a, b in _chunk_bounds(self.size, chunks, "KVBatchMeta")
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
        extra = _merged_extra_info([b.extra_info for b in batches], "KVBatchMeta")
        return cls(
            keys=[k for b in batches for k in b.keys],
            tags=[t for b in batches for t in b.tags],
            partition_id=first.partition_id,
            fields=first.fields,
            extra_info=extra or None,  # as TransferQueue: no info at all is None, not {}
        )


def _repeated(values: Iterable[Any]) -> list[Any]:
    """The values that occur more than once, each once, in first-seen order."""
    seen: set[Any] = set()
    repeated: dict[Any, None] = {}
    for v in values:
        if v in seen:
            repeated[v] = None
        seen.add(v)
    return list(repeated)
