"""Checks of what callers hand the dock: each names what is wrong, and runs before any Redis call.

A bad argument must fail here, whole, rather than half way through a put or after rows were marked
handed out: the dock calls these first, then Redis. Stateless checks are functions; checks against one
dock's schema (its rows, columns and consumers) are methods of :class:`DockChecks`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from broker.api.delivery import LeasedRows
from broker.control.schema import Schema
from broker.errors import (
    InvalidExperienceError,
    RowIndexError,
    UnknownColumnError,
    UnknownConsumerError,
)

#: Which qualifying rows sampling hands out: lowest group first, a seeded random pick, or a batch of
#: average total length by the dock's length columns (MindSpeed's use_batch_seqlen_balance).
POLICIES = ("fifo", "random", "seqlen")

#: Longest lease: long enough for any training step, short enough that a typo in milliseconds shows.
MAX_LEASE_SECONDS = 86400 * 30

#: The one type whose rows need no per-row check (``bool`` is not it: see ``is_int``).
_INT = frozenset({int})


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


def check_durability(replicas: Any, timeout: Any) -> tuple[int, float]:
    """``wait_replicas`` (an int >= 0) and ``wait_timeout`` (seconds > 0), checked."""
    if not is_int(replicas) or replicas < 0:
        raise InvalidExperienceError(f"wait_replicas must be an int >= 0, got {replicas!r:.40}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 3600:
        raise InvalidExperienceError(f"wait_timeout must be seconds in (0, 3600), got {timeout!r:.40}")
    return int(replicas), float(timeout)


def check_call_timeout(seconds: Any, durability: tuple[int, float]) -> float:
    """``call_timeout``: seconds in (0, 1 day], above ``wait_timeout`` when waiting for replicas.

    A call's waits for replicas run within its call_timeout, after its writes: a WAIT is cut to the time
    the call has left, and a wait cut short is a shortfall (ReplicationError, or a log line for a
    hand-out), never a timeout error that would hide that the call was applied. A call_timeout at or
    below wait_timeout would cut a healthy wait for a slow replica short on every call."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 86400:
        raise InvalidExperienceError(f"call_timeout must be seconds in (0, 86400], got {seconds!r:.40}")
    replicas, wait_timeout = durability
    if replicas and seconds <= wait_timeout:
        raise InvalidExperienceError(
            f"call_timeout ({seconds:g} s) must exceed wait_timeout ({wait_timeout:g} s): a put's wait for "
            "replicas runs within it"
        )
    return float(seconds)


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


def length_values(column: str, value: Any, count: int) -> list[int]:
    """The integer of each row of a length column (one number per row, as ``prompt_length`` holds)."""
    rows = list(value) if isinstance(value, (list, tuple)) else None
    try:
        if rows is None:
            flat = torch.as_tensor(value).reshape(count, -1)
            if flat.shape[1] != 1:
                raise ValueError(f"rows of {flat.shape[1]} values")
            numbers = flat[:, 0].tolist()
        elif rows and all(isinstance(row, torch.Tensor) and row.shape == (1,) and row.is_cpu
                          and row.dtype is rows[0].dtype for row in rows):  # one dtype: cat promotes none
            numbers = torch.cat(rows).tolist()  # one call for the column: a tenth of the cost of one per row
        else:
            numbers = []
            for row in rows:
                t = torch.as_tensor(row).reshape(-1)
                if t.numel() != 1:
                    raise ValueError(f"a row of {t.numel()} values")
                numbers.append(t.item())
    except (ValueError, TypeError, RuntimeError) as exc:
        raise InvalidExperienceError(f"length column {column!r}: each row must be one integer ({exc})") from None
    bad = [x for x in numbers if not (isinstance(x, int) or (isinstance(x, float) and x.is_integer()))
           or not 0 <= x < 2**32]
    if bad:
        raise InvalidExperienceError(f"length column {column!r}: rows must be integers in [0, 2**32), got {bad[:5]}")
    return [int(x) for x in numbers]


class DockChecks:
    """Checks against one dock's schema: row numbers, column and consumer names, counts."""

    def __init__(self, name: str, schema: Schema):
        self._name = name
        self._schema = schema
        self._columns = frozenset(schema.columns)
        self._consumers = frozenset(schema.consumers)

    def groups(self, groups: Any) -> list[int]:
        """Group numbers as plain ints: a non-empty list of distinct groups in ``[0, prompts_num)``."""
        count = self._schema.prompts_num
        if isinstance(groups, (torch.Tensor, np.ndarray)):
            groups = groups.tolist()
        if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
            raise RowIndexError(f"groups must be a non-empty list of group numbers, got {groups!r:.60}")
        bad = [g for g in groups if not is_int(g)]
        if bad:
            raise RowIndexError(f"groups must be ints, got {bad[:5]!r}")
        out = [int(g) for g in groups]
        outside = [g for g in out if not 0 <= g < count]
        if outside:
            raise RowIndexError(f"groups {abbrev(outside)} are outside the dock's range [0, {count})")
        if len(set(out)) != len(out):
            raise RowIndexError(f"groups listed more than once: {abbrev(sorted(out))}")
        return out

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
        if not _INT.issuperset(map(type, rows)):  # plain ints (asked in C) skip the per-row checks below
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
    def dp_size(value: Any) -> int:
        """How many data-parallel ranks a batch is cut for."""
        if not is_int(value) or value < 1:
            raise InvalidExperienceError(f"dp_size must be a positive int, got {value!r}")
        return int(value)

    def balance(self, value: Any) -> list[str]:
        """The length columns a batch is balanced by: all of them for True, none for False."""
        if value is False or value is None:
            return []
        if value is True:
            if not self._schema.length_columns:
                raise InvalidExperienceError(
                    f"dock {self._name!r} has no length columns to balance by; create it with length_columns=[...]"
                )
            return list(self._schema.length_columns)
        if isinstance(value, str) or not isinstance(value, Sequence) or not value:
            raise InvalidExperienceError(f"balance must be True, False or a list of length columns, got {value!r}")
        bad = [c for c in value if c not in self._schema.length_columns]
        if bad:
            raise InvalidExperienceError(
                f"balance names {bad}, which are not length columns of dock {self._name!r} "
                f"({list(self._schema.length_columns)})"
            )
        return list(value)

    @staticmethod
    def take_count(count: Any, rows: list[int]) -> None:
        """``experience_count`` beside explicit rows: left out, or their number."""
        if count is not None and not (is_int(count) and count == len(rows)):
            raise InvalidExperienceError(
                f"experience_count={count!r} with {len(rows)} indexes: leave it out, or make it the number of indexes"
            )


def completion_flags(value: Any, count: int) -> list[bool]:
    """``rollout_completed`` of a put: one flag per row (bool, 0/1, or a one-element tensor or array
    as MindSpeed's ``tensor([1])``), as a list of bools."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        value = value.reshape(len(value), -1).tolist() if value.ndim else None
    if not isinstance(value, (list, tuple)) or len(value) != count:
        raise InvalidExperienceError(
            f"rollout_completed must hold one flag per row ({count}), got {abbrev_value(value)}"
        )
    out = []
    for i, flag in enumerate(value):
        if isinstance(flag, (torch.Tensor, np.ndarray)):
            flag = flag.reshape(-1).tolist()
        if isinstance(flag, (list, tuple)) and len(flag) == 1:
            flag = flag[0]
        if isinstance(flag, (bool, np.bool_)) or (is_int(flag) and flag in (0, 1)) or flag in (0.0, 1.0):
            out.append(bool(flag))
        else:
            raise InvalidExperienceError(f"rollout_completed[{i}] must be 0 or 1 (or True/False), got {flag!r:.40}")
    return out


#: Versions and staleness bounds stay below this: a group's version is a sorted-set score (a double),
#: which holds integers exactly only up to 2**53. A microsecond timestamp (16 digits) fits.
MAX_VERSION = 2**53 - 1


def check_version(version: Any, what: str = "version") -> int:
    """A policy version (or a staleness bound): an int in [0, 2**53) (numpy ints too)."""
    if not is_int(version) or not 0 <= version <= MAX_VERSION:
        raise InvalidExperienceError(
            f"{what} must be an int >= 0 and below 2**53 (Redis keeps it as a double), got {version!r:.40}"
        )
    return int(version)


def abbrev_value(value: Any) -> str:
    """A short description of a value for an error message."""
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    return f"{type(value).__name__}"
