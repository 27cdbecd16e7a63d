"""TensorDicts in and out of the dock's columns, as TransferQueue 0.1.11 (its default SimpleStorage) puts
and gets them: ``columns_of`` for a put, ``field_schema`` for its metadata, ``assemble`` for a get.

Over 400 lines: TransferQueue's put and get of a TensorDict are one contract (every kind of field, nested or not,
its markers and its metadata), kept in one place so the two sides cannot drift apart.

What TransferQueue gives back is a function of the rows alone, not of how they were put (found by running
``kv_batch_put`` / ``kv_batch_get`` of the wheel, and read in its ``AsyncSimpleStorageManager``: it
stores one value per row and packs each field's values again at a get, ``_pack_field_values``):

- rows that are all tensors of 0 dims: one stacked tensor ``(B,)`` (a 1-d column comes back as it went);
- rows that are all tensors of >= 1 dim: a *jagged nested tensor*, even when every row has the same shape
  (a ``(B, L)`` float tensor put comes back as ``NestedTensor(size=(B, j, ...))``); where torch cannot make
  one jagged tensor (rows differing in more than one dim, or in dtype) a strided nested tensor; where it
  cannot make that either (rows of different ranks) a ``NonTensorStack`` of the tensors. A strided nested
  tensor put whose rows differ only in one dim therefore comes back jagged;
- anything else (strings, numbers, dicts, lists, None, numpy arrays, mixes): a ``NonTensorStack`` of the
  rows, ``td[field]`` their list. Tuples come back as lists (TransferQueue's msgpack does so too). A field
  that is one numpy array of str or objects (TensorDict keeps it whole) gives each row one element of it
  along its first dim, as TransferQueue's put indexes it.

``assemble`` builds exactly that from what ``read_rows(..., stack=True)`` returns, without a copy where
the read already gave one tensor (a uniform column becomes a jagged view of it). ``stack_uniform=True``
keeps such a column one stacked tensor ``(B, ...)`` instead: what most callers would rather have, but
not what TransferQueue returns.

Values the dock's codec (msgpack, never pickle) would not give back as they went are wrapped here in a
marker dict of plain msgpack, and unwrapped by ``assemble``: numpy arrays and numpy scalars (TransferQueue
gives them back as numpy, of their dtype; an array of dtype object as its shape and its elements, each a
plain value) and tensors inside a value (a dict holding a tensor). Anything msgpack cannot hold (an
arbitrary object, a set, an int beyond 64 bits) is refused at the put, naming the
field and row: TransferQueue would pickle it, and the broker never unpickles what it reads from Redis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from broker.errors import DecodeError, InvalidExperienceError
from broker.transfer_queue.field_schema import FieldSchema, extract_field_schema

#: A column as ``put_experience`` takes it and ``read_rows(..., stack=True)`` returns it.
Column = torch.Tensor | list[Any]
#: A put's columns and the schema its partition records of them (``put_columns``).
Columns = tuple[dict[str, Column], FieldSchema]

#: Keys of the one-key dicts that stand for a numpy array or scalar, and for a tensor inside a value.
NUMPY_KEY = "__broker_tq_numpy__"
#: The dtype a numpy marker names for an array of objects: its elements follow as plain values, not bytes.
OBJECT_DTYPE = "|O"
TENSOR_KEY = "__broker_tq_tensor__"
_MARKERS = frozenset({NUMPY_KEY, TENSOR_KEY})

#: Types a value holds as they are (msgpack's own), checked by exact type first: the common case is fast.
_PLAIN = (str, bytes, bool, float, type(None))
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1  # what msgpack holds
_MAX_DEPTH = 256  # deeper is refused (as msgpack would) and catches a value that contains itself

#: Tensor dtypes a tensor inside a value may have, by name (a name read from Redis is looked up here only).
_TENSOR_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
              torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
              # torch >= 2.3 only (the uint types); older releases lack them, and their tensors too
              *(getattr(torch, n) for n in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2")
                if hasattr(torch, n)))
}

_NEVER_PICKLE = (
    "the broker never pickles (Redis is shared, and unpickling runs whatever the bytes say); pass None, bool, "
    "int, float, str, bytes, numpy arrays, tensors, or lists and dicts of those (serialize other objects "
    "yourself, e.g. to a dict or to bytes)"
)


# -- what a put hands in -------------------------------------------------------------------------------


def is_tensordict(value: Any) -> bool:
    """Whether ``value`` is a TensorDict (of any tensordict class)."""
    return isinstance(value, TensorDictBase)


def batch_size_of(fields: Any) -> int:
    """The rows of a put's TensorDict (its ``batch_size[0]``); InvalidExperienceError for anything else."""
    if not isinstance(fields, TensorDictBase):
        raise InvalidExperienceError(f"expected a TensorDict, got {_type_name(fields)}")
    return _batch_size(fields)


def field_names(fields: TensorDictBase | Mapping[str, Any]) -> list[str]:
    """The names of a put's fields, in their order."""
    return [_name(name) for name in fields.keys()]


def batch_of_one(fields: Mapping[str, Any]) -> TensorDict:
    """kv_put's dict of one sample's values as TransferQueue makes it a batch of one: a tensor gains a batch
    dim (a view), any other value becomes a ``NonTensorStack`` of one (a list is one value, not a batch)."""
    if not isinstance(fields, Mapping):
        raise InvalidExperienceError(f"fields must be a TensorDict or a dict of one sample's values, got "
                                     f"{_type_name(fields)}")
    batch: dict[str, Any] = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor):
            if value.is_nested:
                raise InvalidExperienceError(f"field {name!r}: a nested tensor is a batch; put it with kv_batch_put")
            batch[_name(name)] = value.unsqueeze(0)
        else:
            batch[_name(name)] = NonTensorStack(value)
    return TensorDict(batch, batch_size=[1])


# -- a put: TensorDict (or kv_put's dict of one sample) -> the dock's columns --------------------------


def columns_of(fields: TensorDictBase | Mapping[str, Any], rows: int) -> dict[str, Column]:
    """The columns of a put of ``rows`` rows, as ``put_experience`` takes them.

    ``fields`` is a TensorDict of batch size ``rows`` (``kv_batch_put``), or a dict of one sample's values
    (``kv_put``, ``rows`` = 1: a tensor gains a batch dim, any other value is the row). A regular tensor
    column is passed on as it is (no copy, no pass over its rows); a nested tensor (jagged or strided) as
    the list of its rows (views); a ``NonTensorStack`` / ``NonTensorData`` as the list of its values,
    checked and made storable (see the module docstring). Raises InvalidExperienceError naming the field.
    """
    if isinstance(fields, TensorDictBase):
        batch = _batch_size(fields)
        if batch != rows:
            raise InvalidExperienceError(f"the TensorDict has batch size {batch}, for {rows} keys")
        return {name: _column(name, value, rows) for name, value in fields.items()}
    if isinstance(fields, Mapping):
        if rows != 1:
            raise InvalidExperienceError(
                f"a dict holds one sample (kv_put), not {rows}: pass a TensorDict of batch size {rows}"
            )
        return {_name(name): _sample_column(name, value) for name, value in fields.items()}
    raise InvalidExperienceError(f"expected a TensorDict or a dict of fields, got {_type_name(fields)}")


def _batch_size(fields: TensorDictBase) -> int:
    if not fields.batch_size:
        raise InvalidExperienceError("the TensorDict has no batch dimension (batch_size=[]); give it one row per key")
    return int(fields.batch_size[0])


def _name(name: Any) -> str:
    if not isinstance(name, str):
        raise InvalidExperienceError(f"a field name must be a str, got {name!r:.60}")
    return name


def _column(name: str, value: Any, rows: int) -> Column:
    """One field of a TensorDict as a column of ``rows`` rows."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            unbound = list(value.unbind())
            if len(unbound) != rows:
                raise InvalidExperienceError(f"field {name!r}: a nested tensor of {len(unbound)} rows, for {rows} keys")
            return unbound
        if value.dim() == 0 or value.shape[0] != rows:
            raise InvalidExperienceError(f"field {name!r}: a tensor of shape {tuple(value.shape)}, for {rows} keys")
        return value  # as it is: the dock splits it along dim 0 without a copy
    if isinstance(value, NonTensorData) and isinstance(value.data, np.ndarray) and value.data.ndim \
            and len(value.data) == rows:
        values = list(value.data)  # a numpy array of str or objects: TransferQueue indexes it, a row an element
    elif isinstance(value, (NonTensorStack, NonTensorData)):
        values = value.tolist()
    if isinstance(value, (NonTensorStack, NonTensorData)):
        if len(values) != rows:
            raise InvalidExperienceError(f"field {name!r}: {len(values)} values, for {rows} keys")
        return _storable_rows(name, values)
    if isinstance(value, TensorDictBase):
        raise InvalidExperienceError(
            f"field {name!r}: a nested TensorDict cannot be stored as a field; flatten it first "
            "(td.flatten_keys()), one field per tensor"
        )
    raise InvalidExperienceError(f"field {name!r}: cannot store a {_type_name(value)} as a field")


def _sample_column(name: Any, value: Any) -> Column:
    """One value of kv_put's dict as a column of one row: TransferQueue's ``unsqueeze(0)`` of a tensor, or
    the value itself as the row (a list is one row holding the list)."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            raise InvalidExperienceError(f"field {name!r}: a nested tensor is a batch; put it with kv_batch_put")
        return value.unsqueeze(0)  # a view
    if isinstance(value, NonTensorData) and not value.batch_size:  # NonTensorStack(value) holds its data
        value = value.data
    elif isinstance(value, TensorDictBase):
        raise InvalidExperienceError(f"field {name!r}: a {_type_name(value)} in a dict of one sample; pass its value")
    return _storable_rows(name, [value])


def _storable_rows(name: str, values: list[Any]) -> list[Any]:
    """The values of a non-tensor field, checked, with what msgpack would not give back wrapped in markers.
    A row that is a tensor stays a tensor row (the dock stores it as one)."""
    if all(type(v) is str for v in values):  # the common case: one pass, no copy
        return values
    out = values
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            continue
        try:
            new = _storable(v, 0)
        except InvalidExperienceError as exc:
            raise InvalidExperienceError(f"field {name!r}, row {i}: {exc}") from None
        if new is not v:
            if out is values:
                out = list(values)
            out[i] = new
    return out


def _storable(value: Any, depth: int) -> Any:
    """``value`` as msgpack holds it and gives it back, numpy and tensors wrapped in markers; the value
    itself (not a copy) when nothing in it needs wrapping."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is int:
        if not _INT_MIN <= value <= _INT_MAX:
            raise InvalidExperienceError(f"int {value} is outside the 64-bit range msgpack holds; pass it as a str")
        return value
    if depth >= _MAX_DEPTH:
        raise InvalidExperienceError(f"a value nested deeper than {_MAX_DEPTH} levels (or one that contains itself)")
    if kind is list or kind is tuple:
        items = [_storable(v, depth + 1) for v in value]
        return value if kind is list and all(a is b for a, b in zip(items, value)) else items
    if kind is dict:
        return _storable_dict(value, depth)
    if isinstance(value, np.ndarray) and value.dtype == object:
        items = [_storable(v, depth + 1) for v in value.reshape(-1).tolist()]
        return {NUMPY_KEY: [OBJECT_DTYPE, list(value.shape), items]}
    if isinstance(value, (np.ndarray, np.generic)):
        return {NUMPY_KEY: _numpy_payload(value)}
    if isinstance(value, torch.Tensor):
        return {TENSOR_KEY: _tensor_payload(value)}
    if isinstance(value, (str, bytes, int, float)):  # subclasses (enums, ...): msgpack gives the base type back
        return _storable(_base_value(value), depth)
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, (set, frozenset)):
        raise InvalidExperienceError(f"a {kind.__name__} cannot be stored; pass a list (sorted(...), list(...))")
    raise InvalidExperienceError(f"a {_type_name(value)} cannot be stored: {_NEVER_PICKLE}")


def _storable_dict(value: dict[Any, Any], depth: int) -> dict[Any, Any]:
    for key in value:
        if type(key) not in (str, bytes, int):
            raise InvalidExperienceError(f"a dict key must be a str, bytes or int, got {_type_name(key)} {key!r:.40}")
    if len(value) == 1 and next(iter(value)) in _MARKERS:
        raise InvalidExperienceError(f"a dict whose only key is {next(iter(value))!r} is reserved by the broker")
    items = {k: _storable(v, depth + 1) for k, v in value.items()}
    return value if all(items[k] is v for k, v in value.items()) else items


def _base_value(value: str | bytes | int | float) -> Any:
    """A subclass's value as its base type (an enum's value), as msgpack would write it."""
    if isinstance(value, str):
        return str.__str__(value)  # not str(): a subclass may format itself otherwise
    if isinstance(value, bytes):
        return bytes(value)
    return int(value) if isinstance(value, int) else float(value)


def _numpy_payload(value: np.ndarray | np.generic) -> list[Any]:
    """[dtype, shape (None for a scalar), bytes in C order] of a numpy array or scalar."""
    dtype = value.dtype
    if dtype.hasobject or dtype.names is not None:
        raise InvalidExperienceError(
            f"a numpy {'array' if isinstance(value, np.ndarray) else 'scalar'} of dtype {dtype} cannot be stored "
            "(objects or fields in it); pass .tolist() or one array per field"
        )
    shape = None if isinstance(value, np.generic) else list(value.shape)
    return [dtype.str, shape, np.ascontiguousarray(value).tobytes()]


def _tensor_payload(value: torch.Tensor) -> list[Any]:
    """[dtype name, shape, bytes in C order] of a tensor inside a value."""
    name = str(value.dtype).removeprefix("torch.")
    if value.is_nested or value.layout != torch.strided or name not in _TENSOR_DTYPES:
        raise InvalidExperienceError(
            f"a {value.layout} tensor of {value.dtype} inside a value cannot be stored; "
            f"pass a dense tensor of {', '.join(_TENSOR_DTYPES)}"
        )
    dense = value.detach().cpu().resolve_conj().resolve_neg().contiguous()
    raw = dense.reshape(-1).view(torch.uint8).numpy().tobytes() if dense.numel() else b""
    return [name, list(dense.shape), raw]


def put_columns(fields: TensorDictBase | Mapping[str, Any], rows: int) -> Columns:
    """``columns_of`` and ``field_schema`` of one put in one pass, the schema as a partition records it
    (without ``per_sample_shapes``, which belong to the put, not to the field).

    A nested field is unbound once, for both (they would each unbind it), and a contiguous jagged one by
    splitting its values at its offsets: the same views ``unbind()`` gives, without torch's checks of every
    row, which cost more than the rest of the put's Python work on a ragged column of a thousand rows.
    """
    if not isinstance(fields, TensorDictBase):
        schema = {name: {k: v for k, v in s.items() if k != "per_sample_shapes"}
                  for name, s in field_schema(fields).items()}
        return columns_of(fields, rows), schema
    batch = _batch_size(fields)
    if batch != rows:
        raise InvalidExperienceError(f"the TensorDict has batch size {batch}, for {rows} keys")
    columns: dict[str, Column] = {}
    schema = {}
    for name, value in fields.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            unbound = nested_rows(value)
            if len(unbound) != rows:
                raise InvalidExperienceError(f"field {name!r}: a nested tensor of {len(unbound)} rows, for {rows} keys")
            columns[name] = unbound
            schema[name] = {"dtype": value.dtype, "shape": unbound[0].shape if unbound else None, "is_nested": True,
                            "is_non_tensor": False}
        else:
            columns[name] = _column(name, value, rows)  # checks the rows, as extract_field_schema does
            if isinstance(value, torch.Tensor):  # extract_field_schema's entries (the tests hold them equal)
                shape = torch.Size([1]) if value.dim() == 1 else value.shape[1:]
                schema[name] = {"dtype": value.dtype, "shape": shape, "is_nested": False, "is_non_tensor": False}
            else:
                schema[name] = {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": True}
    return columns, schema if rows else {}


def nested_rows(value: torch.Tensor) -> list[torch.Tensor]:
    """The rows of a nested tensor, as views (``value.unbind()``); a jagged one whose rows lie back to back in
    its values (no holes, ragged along dim 1) is split at its offsets, without a check per row."""
    nested: Any = value  # torch's stubs type a NestedTensor's offsets() and lengths() nowhere
    if nested.layout is torch.jagged and nested.lengths() is None and getattr(nested, "_ragged_idx", None) == 1:
        offsets: torch.Tensor = nested.offsets()
        if offsets.numel() and bool((offsets[1:] >= offsets[:-1]).all()):
            start = int(offsets[0])
            lengths: list[int] = offsets.diff().tolist()
            values: torch.Tensor = nested.values().narrow(0, start, int(offsets[-1]) - start)
            return list(torch.split_with_sizes(values, lengths))
    return list(value.unbind())


# -- the metadata of a put: TransferQueue's field schema -----------------------------------------------


def field_schema(fields: TensorDictBase | Mapping[str, Any]) -> FieldSchema:
    """Per field ``dtype``, ``shape``, ``is_nested``, ``is_non_tensor`` (and ``per_sample_shapes`` of a nested
    one): TransferQueue's ``extract_field_schema`` (``field_schema.py``) of the put's TensorDict, or of
    kv_put's dict of one sample made a batch of one as TransferQueue makes it."""
    if isinstance(fields, TensorDictBase):
        return extract_field_schema(fields)
    return extract_field_schema(batch_of_one(fields))


# -- a get: the dock's columns -> the TensorDict TransferQueue returns ---------------------------------


def assemble(
    columns: Mapping[str, Column], size: int, schema: Mapping[str, Mapping[str, Any]] | None = None, *,
    stack_uniform: bool = False,
) -> TensorDict:
    """The TensorDict of ``size`` rows TransferQueue's ``kv_batch_get`` / ``get_data`` returns, from what
    ``read_rows(columns, rows, stack=True)`` returned (see the module docstring for each kind of column).

    A read that gave one tensor of equal rows becomes a jagged nested view of it (no copy; a 1-d one stays
    as it is); a jagged read stays; a list of rows is packed as TransferQueue packs them, its values first
    unwrapped from the markers ``columns_of`` wrapped them in. ``size`` 0 gives ``TensorDict({}, [0])``,
    as ``get_data`` gives for an empty batch.

    TransferQueue's result does not depend on how the rows were put, so ``schema`` (``field_schema`` of
    the put) changes nothing by default. With ``stack_uniform=True`` a column of equal tensor rows stays
    one stacked tensor ``(size, ...)``, unless ``schema`` says the field was put nested: then it comes back
    jagged, as it went.
    """
    if size == 0:
        return TensorDict({}, batch_size=[0])
    out: dict[str, Any] = {}
    for name, column in columns.items():
        nested = bool(schema and schema.get(name, {}).get("is_nested"))
        out[name] = _field(name, column, size, stack_uniform and not nested)
    return TensorDict(out, batch_size=[size])


def _field(name: str, column: Column, size: int, keep_stacked: bool) -> Any:
    if isinstance(column, torch.Tensor):
        rows = column.size(0)
        if rows != size:
            raise InvalidExperienceError(f"field {name!r}: a column of {rows} rows, for {size} keys")
        if column.is_nested or column.dim() == 1 or keep_stacked:
            return column
        return _jagged_view(column)
    if not isinstance(column, list):
        raise InvalidExperienceError(f"field {name!r}: expected a tensor or a list of rows, got {_type_name(column)}")
    if len(column) != size:
        raise InvalidExperienceError(f"field {name!r}: {len(column)} rows, for {size} keys")
    return _pack([_restored(v, name, 0) for v in column] if _may_hold_markers(column) else column)


def take(column: Column, positions: Sequence[int]) -> Column:
    """The rows of ``column`` (as ``read_rows(stack=True)`` gives it) at ``positions``, repeats allowed: a
    stacked tensor indexed (a copy), a jagged one as its rows, a list as its items."""
    if isinstance(column, torch.Tensor):
        if column.is_nested:
            unbound = column.unbind()
            return [unbound[i] for i in positions]
        return column[torch.as_tensor(list(positions), dtype=torch.long)]
    return [column[i] for i in positions]


def rows_of(column: Column) -> list[Any]:
    """A column as ``read_rows(stack=True)`` gives it, as a list of its rows (a tensor's rows are views)."""
    return list(column.unbind(0)) if isinstance(column, torch.Tensor) else list(column)


def joined(rows: list[Any]) -> Column:
    """Rows of one field read from several docks (``rows_of`` of each), as one read of them all would have
    given the column: equal tensor rows stacked, tensor rows of one dtype and rank jagged, else the list."""
    if rows and all(isinstance(r, torch.Tensor) and not r.is_nested for r in rows):
        first = rows[0]
        if all(r.shape == first.shape and r.dtype == first.dtype for r in rows):
            return torch.stack(rows)
        if first.dim() >= 1 and all(r.dtype == first.dtype and r.dim() == first.dim() for r in rows):
            try:
                return torch.nested.as_nested_tensor(rows, layout=torch.jagged)
            except (RuntimeError, TypeError):  # rows differing in more than one dim: packed as a list is
                pass
    return rows


def _jagged_view(stacked: torch.Tensor) -> torch.Tensor:
    """A jagged nested tensor over a stacked ``(B, L, ...)`` tensor, each row ``L`` long: no copy when
    ``stacked`` is contiguous (a read's always is)."""
    rows, length = stacked.shape[0], stacked.shape[1]
    values = stacked.reshape(rows * length, *stacked.shape[2:])
    if length:
        offsets = torch.arange(0, (rows + 1) * length, length, dtype=torch.int64)
    else:
        offsets = torch.zeros(rows + 1, dtype=torch.int64)
    return torch.nested.nested_tensor_from_jagged(values, offsets, min_seqlen=length, max_seqlen=length)


def _pack(values: list[Any]) -> Any:
    """A field's values as TransferQueue's ``_pack_field_values`` packs them (same tries, same order)."""
    if values and all(isinstance(v, torch.Tensor) for v in values):
        if all(v.dim() == 0 for v in values):
            return torch.stack(values)
        for layout in (torch.jagged, torch.strided):
            try:
                return torch.nested.as_nested_tensor(values, layout=layout)
            except (RuntimeError, TypeError):  # the rows do not fit one nested tensor of that layout
                continue
    return NonTensorStack(*values)


def _may_hold_markers(values: list[Any]) -> bool:
    return any(type(v) is dict or type(v) is list for v in values)


def _restored(value: Any, name: str, depth: int) -> Any:
    """``value`` with every marker dict replaced by what it stands for; ``value`` itself if it holds none."""
    kind = type(value)
    if kind is list:
        if depth >= _MAX_DEPTH:
            return value
        items = [_restored(v, name, depth + 1) for v in value]
        return value if all(a is b for a, b in zip(items, value)) else items
    if kind is not dict or depth >= _MAX_DEPTH:
        return value
    if len(value) == 1:
        key = next(iter(value))
        if key == NUMPY_KEY:
            return _numpy_from(value[key], name, depth)
        if key == TENSOR_KEY:
            return _tensor_from(value[key], name)
    entries = {k: _restored(v, name, depth + 1) for k, v in value.items()}
    return value if all(entries[k] is v for k, v in value.items()) else entries


def _numpy_from(payload: Any, name: str, depth: int) -> np.ndarray | np.generic:
    """The numpy array (or scalar) of a marker read from Redis; DecodeError if it is malformed."""
    if isinstance(payload, list) and len(payload) == 3 and payload[0] == OBJECT_DTYPE:
        return _objects_from(payload, name, depth)
    dtype_str, shape, raw = _payload(payload, name, "numpy")
    try:
        dtype = np.dtype(dtype_str)
    except (TypeError, ValueError):
        raise DecodeError(f"field {name!r}: a numpy value of unknown dtype {dtype_str!r:.40}") from None
    if dtype.hasobject or dtype.names is not None:
        raise DecodeError(f"field {name!r}: a numpy value of dtype {dtype_str!r:.40}, which the broker never writes")
    dims = (1,) if shape is None else tuple(shape)
    if len(raw) != math.prod(dims) * dtype.itemsize:
        raise DecodeError(f"field {name!r}: a numpy value of shape {dims} and dtype {dtype} in {len(raw)} bytes")
    if not raw:  # frombuffer refuses an empty buffer, and items of size 0 (np.str_(""))
        array = np.zeros(dims, dtype=dtype)
    else:
        array = np.frombuffer(bytearray(raw), dtype=dtype).reshape(dims)  # a writable copy of the reply's bytes
    return array[0] if shape is None else array


def _objects_from(payload: list[Any], name: str, depth: int) -> np.ndarray:
    """The numpy array of dtype object of a marker: its elements are plain values (and markers), restored."""
    _, shape, items = payload
    if not (isinstance(items, list) and isinstance(shape, list) and len(shape) <= 64
            and all(type(d) is int and d >= 0 for d in shape) and math.prod(shape) == len(items)):
        raise DecodeError(f"field {name!r}: a malformed numpy object array (shape {shape!r:.40})")
    array = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):  # element by element: np.array(items) would make nested lists dims
        array[i] = _restored(item, name, depth + 1)
    return array.reshape(shape)


def _tensor_from(payload: Any, name: str) -> torch.Tensor:
    """The tensor of a marker read from Redis; DecodeError if it is malformed."""
    dtype_name, shape, raw = _payload(payload, name, "tensor")
    dtype = _TENSOR_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None or shape is None:
        raise DecodeError(f"field {name!r}: a tensor in a value of dtype {dtype_name!r:.40} and shape {shape!r:.40}")
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(raw) != size:
        raise DecodeError(f"field {name!r}: a tensor of shape {tuple(shape)} and {dtype} in {len(raw)} bytes")
    if not size:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # a writable copy of the reply's bytes
    if dtype is torch.bool and int(flat.max()) > 1:
        raise DecodeError(f"field {name!r}: a bool tensor holding bytes other than 0 and 1")
    return flat.view(dtype).reshape(shape)


def _payload(payload: Any, name: str, what: str) -> tuple[Any, list[int] | None, bytes]:
    """(dtype, shape, bytes) of a marker's payload, its shape checked: ints >= 0, at most 64 of them."""
    if not (isinstance(payload, list) and len(payload) == 3 and isinstance(payload[2], bytes)):
        raise DecodeError(f"field {name!r}: a malformed {what} value ({payload!r:.60})")
    dtype, shape, raw = payload
    if shape is not None and not (
        isinstance(shape, list) and len(shape) <= 64 and all(type(d) is int and 0 <= d < 2**62 for d in shape)
    ):
        raise DecodeError(f"field {name!r}: a {what} value of invalid shape {shape!r:.60}")
    return dtype, shape, raw


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
