"""Checks of what callers hand the dock: each names what is wrong, and runs before any Redis call.

A bad argument must fail here, whole, rather than half way through a put or after rows were marked
handed out: the dock calls these first, then Redis. Stateless checks are functions; checks against one
dock's schema (its rows, columns and consumers) are methods of :class:`DockChecks`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from . import codec
from .errors import (
    ExperienceTooLargeError,
    InvalidExperienceError,
    RowIndexError,
    UnknownColumnError,
    UnknownConsumerError,
)
from .leased_rows import LeasedRows
from .schema import Schema

#: Which qualifying rows sampling hands out: lowest group first, or a seeded random pick.
POLICIES = ("fifo", "random")

#: Longest lease: long enough for any training step, short enough that a typo in milliseconds shows.
MAX_LEASE_SECONDS = 86400 * 30


def is_int(value: Any) -> bool:
    """An int or numpy integer, but not a bool (True as a row number is a bug, not row 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_number(value: Any) -> bool:
    """A real number that is not a bool and not NaN."""
    return (is_int(value) or isinstance(value, (float, np.floating))) and value == value


def abbrev(rows: Sequence[int], limit: int = 20) -> str:
    """A row list for an error message, cut after ``limit`` entries."""
    if len(rows) <= limit:
        return str(list(rows))
    return f"{list(rows[:limit])}... ({len(rows)} in all)"


def check_policy(policy: Any) -> str:
    """A sampling policy, the dock's default or one call's."""
    if not isinstance(policy, str) or policy not in POLICIES:
        raise InvalidExperienceError(f"policy must be one of {POLICIES}, got {policy!r}")
    return policy


def check_timeout(timeout: Any) -> float | None:
    """Seconds to wait for puts: None (do not wait), a number >= 0, or ``float("inf")``."""
    if timeout is not None and not (is_number(timeout) and timeout >= 0):
        raise InvalidExperienceError(f"timeout must be None or a number >= 0, got {timeout!r}")
    return None if timeout is None else float(timeout)


def check_lease(lease: Any) -> int:
    """A lease in seconds as whole milliseconds, 0 for none."""
    if lease is None:
        return 0
    if not (is_number(lease) and 0.001 <= lease <= MAX_LEASE_SECONDS):
        raise InvalidExperienceError(f"lease must be None or seconds in [0.001, 30 days], got {lease!r}")
    return int(lease * 1000)


def check_flag(name: str, value: Any) -> bool:
    """A bool argument (numpy's too); 1 or "yes" would hide a mix-up of positional arguments."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidExperienceError(f"{name} must be a bool, got {value!r}")
    return bool(value)


def lease_token(rows: Any, consumer: str, token: Any) -> str:
    """The lease token an ``ack`` of ``rows`` by ``consumer`` names: ``token``, else the one ``rows`` carry."""
    if token is None and isinstance(rows, LeasedRows):
        if rows.consumer != consumer:
            raise InvalidExperienceError(f"these rows were leased to consumer {rows.consumer!r}, not to {consumer!r}")
        token = rows.token
    if not isinstance(token, str) or not token:
        raise InvalidExperienceError(
            "ack needs the lease token: pass the rows get_experience(..., lease=...) returned (they carry "
            "it), or token=rows.token; a plain list of rows cannot say whose lease it releases"
        )
    return token


def encode_column(column: str, value: Any, count: int) -> list[bytes]:
    """The ``count`` rows of one column of a put, encoded; errors name the column.

    ``value`` is a stacked tensor or numeric numpy array (split along dim 0), a numpy array of objects
    or strings (verl's ``non_tensor_batch``: one value per element along dim 0), or a list of rows, each
    a tensor or a plain value (see ``codec``).
    """
    if isinstance(value, np.ndarray) and value.dtype.kind in "OUS":
        if value.ndim == 0:
            raise InvalidExperienceError(f"column {column!r}: a 0-d numpy array has no rows; wrap it in a list")
        value = list(value)
    try:
        value = codec.as_tensor(value)
    except InvalidExperienceError as exc:
        raise InvalidExperienceError(f"column {column!r}: {exc}") from None
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise InvalidExperienceError(f"column {column!r}: a stacked tensor needs a row dimension, got a 0-d tensor")
        if value.shape[0] != count:
            raise InvalidExperienceError(
                f"column {column!r}: stacked tensor of shape {tuple(value.shape)} has {value.shape[0]} rows "
                f"for {count} indexes"
            )
        encode: Callable[[Any], list[bytes]] = codec.encode_stacked
    elif not isinstance(value, (list, tuple)):
        raise InvalidExperienceError(
            f"column {column!r}: expected a tensor, a numpy array or a list of rows, got {type(value).__name__}"
        )
    elif len(value) != count:
        raise InvalidExperienceError(f"column {column!r}: {len(value)} rows for {count} indexes")
    else:
        encode = codec.encode_rows
    try:
        return encode(value)
    except InvalidExperienceError as exc:
        raise InvalidExperienceError(f"column {column!r}, {exc}") from None


def check_sizes(encoded: Mapping[str, Mapping[str, bytes]], limit: int, setting: str) -> None:
    """Every encoded value of a put fits in one Redis value (``limit`` bytes, from server ``setting``)."""
    for col, values in encoded.items():
        for field, value in values.items():
            if len(value) > limit:
                raise ExperienceTooLargeError(
                    f"column {col!r}, row {field}: {len(value):,} bytes encoded, more than the {limit:,} "
                    f"the Redis server takes in one value ({setting}); nothing was written. Split the row, "
                    f"or raise {setting} on the server"
                )


class DockChecks:
    """Checks against one dock's schema: row numbers, column and consumer names, counts."""

    def __init__(self, name: str, schema: Schema):
        self._name = name
        self._schema = schema
        self._columns = frozenset(schema.columns)
        self._consumers = frozenset(schema.consumers)

    def rows(self, indexes: Any) -> list[int]:
        """Row numbers as plain ints: a non-empty list of distinct rows in ``[0, capacity)``."""
        capacity = self._schema.capacity
        if isinstance(indexes, (torch.Tensor, np.ndarray)):
            indexes = indexes.tolist()
        if isinstance(indexes, (str, bytes)) or not isinstance(indexes, Sequence):
            raise RowIndexError(f"indexes must be a list of row numbers, got {type(indexes).__name__}")
        if not indexes:
            raise RowIndexError("indexes is empty")
        rows = list(indexes)
        if not all(type(i) is int for i in rows):  # plain ints skip the per-row checks below
            bad = [i for i in rows if not is_int(i)]
            if bad:
                raise RowIndexError(f"indexes must be ints, got {bad[:5]!r}")
            rows = [int(i) for i in rows]
        if min(rows) < 0 or max(rows) >= capacity:
            out = [r for r in rows if not 0 <= r < capacity]
            raise RowIndexError(f"rows {abbrev(out)} are outside the dock's range [0, {capacity})")
        if len(set(rows)) != len(rows):
            dupes = sorted(r for r, times in Counter(rows).items() if times > 1)
            raise RowIndexError(f"rows listed more than once: {abbrev(dupes)}")
        return rows

    def columns(self, columns: Sequence[Any]) -> None:
        """Every name is one of the dock's columns."""
        unknown = [c for c in columns if not isinstance(c, str) or c not in self._columns]
        if unknown:
            raise UnknownColumnError(
                f"dock {self._name!r} has no columns {unknown}; its columns are {list(self._schema.columns)}"
            )

    def data(self, data_dict: Any) -> None:
        """The ``data_dict`` of a put: a non-empty mapping of the dock's column names to rows."""
        if not isinstance(data_dict, Mapping) or not data_dict:
            raise InvalidExperienceError("data_dict must be a non-empty dict of column -> rows")
        self.columns(list(data_dict))

    def columns_to_read(self, columns: Any) -> list[str]:
        """The ``experience_columns`` of a read: a non-empty list of distinct column names."""
        if not isinstance(columns, (list, tuple)) or not columns:
            raise InvalidExperienceError("experience_columns must be a non-empty list of column names")
        names: list[str] = list(columns)
        self.columns(names)
        if len(set(names)) != len(names):
            raise InvalidExperienceError(f"experience_columns lists a column twice: {names}")
        return names

    def consumer(self, consumer: Any) -> str:
        """One of the dock's consumers."""
        if not isinstance(consumer, str) or consumer not in self._consumers:
            raise UnknownConsumerError(
                f"dock {self._name!r} has no consumer {consumer!r}; its consumers are {list(self._schema.consumers)}"
            )
        return consumer

    def sample_count(self, count: Any, groups: bool) -> int:
        """How many units one sampling call hands out: groups when ``groups``, else rows."""
        n, capacity = self._schema.n_samples_per_prompt, self._schema.capacity
        if not is_int(count) or count < 1:
            raise InvalidExperienceError(f"experience_count must be a positive int, got {count!r}")
        rows = int(count)
        if rows > capacity:
            raise InvalidExperienceError(f"experience_count {rows} exceeds the dock's {capacity} rows")
        if not groups:
            return rows
        if rows % n:
            raise InvalidExperienceError(
                f"experience_count {rows} must be a multiple of n_samples_per_prompt={n} with get_n_samples"
            )
        return rows // n

    @staticmethod
    def take_count(count: Any, rows: list[int]) -> None:
        """``experience_count`` beside explicit rows: left out, or their number."""
        if count is not None and not (is_int(count) and count == len(rows)):
            raise InvalidExperienceError(
                f"experience_count={count!r} with {len(rows)} indexes: leave it out, or make it the number of indexes"
            )
