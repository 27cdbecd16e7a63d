"""Administration of a dock: shared metrics, status and row status masks, callers' settings, dead letters,
clearing, deleting and growing it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import redis
import torch

from broker.api import metrics
from broker.api.checks import check_flag
from broker.api.session import RACE_RETRIES, DockSession
from broker.connection import call_deadline, redis_errors
from broker.connection.replication import REPEAT_SAFE, do_not_repeat
from broker.control.keys import DockKeys
from broker.control.schema import CHECKED_FIELDS, Schema
from broker.control.status import DockRef, read_statuses
from broker.errors import BrokerError, DecodeError, InvalidExperienceError, SchemaError

#: Fields of the meta hash the dock itself writes (the schema, and what create.lua and version.lua add):
#: a caller's setting may not take their names.
OWN_META_FIELDS = frozenset((*CHECKED_FIELDS, "dead_letter_after", "versioned"))


class Admin:
    """Metrics, status, settings, dead letters, clear, delete, grow: a part of ``TransferDock``, on its session."""

    def __init__(self, session: DockSession):
        self._s = session

    def update_metrics(self, key: str | Mapping[str, Any] = "", value: Any = None, cumulate: bool = False) -> None:
        """Set or append to shared metrics."""
        values = metric_values(key, value, cumulate)
        repeat = do_not_repeat("a repeat appends the values again") if cumulate else REPEAT_SAFE
        self._s.write("update_metrics", lambda: self._s.scripts.metrics(values, cumulate), repeat=repeat, returns=False)

    def get_metrics(self) -> dict[str, Any]:
        """Every shared metric."""
        raw = cast("dict[bytes, bytes]", self._s.run(lambda: self._s.client.hgetall(self._s.keys.metrics)))
        out = {}
        for name, text in raw.items():
            try:
                out[name.decode()] = json.loads(text)
            except (ValueError, RecursionError):  # RecursionError: nested past the limit, by another client
                raise DecodeError(f"{self._s.keys.metrics} field {name!r}: not a JSON number or list") from None
        return out

    def status(self) -> dict[str, Any]:
        """A consistent snapshot of the dock's counts."""
        ref = DockRef(self._s.keys, *self._s.binding)
        (result,) = self._s.run(lambda: read_statuses(self._s.client, [ref]))
        if isinstance(result, BrokerError):
            raise result
        return result

    def dead_letters(self, consumer: str | None = None) -> dict[str, dict[int, str]]:
        """The dead letters, per consumer: row -> why."""
        consumers = list(self._s.schema.consumers) if consumer is None else [self._s.check.consumer(consumer)]

        def reads(pipe: redis.client.Pipeline) -> None:
            for c in consumers:
                pipe.hgetall(self._s.keys.dead(c))

        out: dict[str, dict[int, str]] = {}
        for c, raw in zip(consumers, self._s.reads(reads)):
            try:
                letters = {int(row): why.decode(errors="replace") for row, why in raw.items()}
            except ValueError:
                raise DecodeError(f"{self._s.keys.dead(c)}: a field is not a row number") from None
            out[c] = dict(sorted(letters.items()))
        return out

    def drop_dead_letters(self, consumer: str | None = None) -> list[int]:
        """Forget the rows that are dead letters; returns them."""
        rows = sorted({row for letters in self.dead_letters(consumer).values() for row in letters})
        if rows:
            self.clear(rows)
        return rows

    def clear(self, indexes: Sequence[int] | None = None, *, consumer: str | None = None, age: bool = True,
              trained_elsewhere: bool = False) -> None:
        """Forget rows, or end an iteration of ``consumer`` (``trained_elsewhere``: see ``ForgetScripts.clear``;
        a partitioned dock's)."""
        with metrics.observe(self._s.name, "clear") as call:
            if consumer is not None:
                if indexes is not None:
                    raise InvalidExperienceError("clear takes indexes or consumer, not both")
                self._s.check.consumer(consumer)
                check_flag("age", age)
                self._s.forget(
                    f"clear(consumer={consumer!r})", lambda: self._s.scripts.clear(
                        iteration_of=consumer, age=age, trained_elsewhere=trained_elsewhere),
                    returns=False, repeat=do_not_repeat("a repeat would age the groups kept again and start "
                    "the cursor and the metrics again"),
                )
                return
            rows = [] if indexes is None else self._s.check.rows(indexes)
            self._s.forget("clear", lambda: self._s.scripts.clear(rows), whole=not rows, returns=False)
            call.rows = len(rows) if rows else self._s.schema.capacity

    def set_quota(self, nbytes: int | None) -> int:
        """Set or remove the dock's byte quota (see ``TransferDock.set_quota``); the bytes it holds."""
        if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0):
            raise InvalidExperienceError(f"a quota is None or a number of bytes >= 0, got {nbytes!r:.40}")
        if self._s.schema.shards:
            raise InvalidExperienceError(
                f"dock {self._s.name!r} keeps its rows on data shards, which its scripts cannot count: a byte quota "
                "needs a dock on one slot"
            )
        return self._s.write("set_quota", lambda: self._s.scripts.quota(nbytes))

    def delete(self) -> None:
        """Remove the dock from Redis entirely."""
        schema = self._s.schema
        keys = self._s.keys.every_key(schema.columns, schema.consumers, schema.rollout.age_buckets)
        keys += self._s.run(self._s.store.data_keys)
        # The wait's counters are deleted again after it (drop): a deleted dock leaves no key.
        shards = [DockKeys.shard_replicated(tag) for tag in schema.shards]
        self._s.write("delete", lambda: self._s.client.delete(*dict.fromkeys(keys)), shards=shards, returns=False,
                    drop=True)

    def grow(
        self, columns: Sequence[str] = (), consumers: Sequence[str] = (), group_columns: Sequence[str] = (),
    ) -> Schema:
        """Add columns, consumers and group columns; the grown schema."""
        wrote = False
        for _ in range(RACE_RETRIES):
            self._s.refresh()
            grown = self._s.schema.grown(columns, consumers, group_columns)
            if grown == self._s.schema:
                if wrote:
                    self._s.replicated("grow", grown, [self._s.keys.replicated])
                return grown
            try:
                # not _run: a changed schema here means retry, not adopt
                with call_deadline(self._s.call_timeout), redis_errors(self._s.where):
                    self._s.scripts.grow(grown)
                wrote = True
            except SchemaError:
                pass  # another process grew it between our read and our write
            # Either way the next refresh reads what is stored now, and returns once it holds our names.
        raise BrokerError(f"dock {self._s.name!r}: other processes kept growing it; {RACE_RETRIES} tries failed")

    # -- row status masks and callers' settings (what adapters read and keep beside rows) ----------

    def ready_rows(self, columns: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Per column, a bool tensor of the rows written."""
        names = list(self._s.schema.columns) if columns is None else self._s.check.columns_to_read(columns)
        return dict(zip(names, self._row_masks([self._s.keys.ready(c) for c in names])))

    def consumed_rows(self, consumers: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Per consumer, a bool tensor of the rows handed to it."""
        if consumers is not None and not isinstance(consumers, (list, tuple)):
            raise InvalidExperienceError(f"consumers must be a list of consumer names, got {consumers!r:.60}")
        names = list(self._s.schema.consumers) if consumers is None else [self._s.check.consumer(c) for c in consumers]
        return dict(zip(names, self._row_masks([self._s.keys.consumed(c) for c in names])))

    def finished_rows(self) -> torch.Tensor:
        """A bool tensor of the rows of finished groups (partial rollout)."""
        self._s.partial_rollout("finished_rows")
        (mask,) = self._row_masks([self._s.keys.rows_finished])
        return mask

    def set_setting(self, name: str, value: str) -> None:
        """Keep a caller's setting in the dock's meta hash."""
        field = _setting_field(name)
        if not isinstance(value, str):
            raise InvalidExperienceError(f"a setting's value is a str, got {type(value).__name__}")
        self._s.write("set_setting", lambda: self._s.client.hset(self._s.keys.meta, field, value), returns=False)

    def setting(self, name: str) -> str | None:
        """The setting ``name``; None if there is none."""
        field = _setting_field(name)
        raw = cast("bytes | None", self._s.run(lambda: self._s.client.hget(self._s.keys.meta, field)))
        try:
            return None if raw is None else raw.decode()
        except UnicodeDecodeError:
            raise DecodeError(f"{self._s.keys.meta} field {field!r}: not UTF-8 text") from None

    def _row_masks(self, keys: Sequence[str]) -> list[torch.Tensor]:
        """The row bitmaps ``keys`` as bool tensors of ``capacity`` rows, read in one MULTI/EXEC."""
        def reads(pipe: redis.client.Pipeline) -> None:
            for key in keys:
                pipe.get(key)

        capacity = self._s.schema.capacity
        masks = []
        for raw in self._s.reads(reads, transaction=True):
            # Not unpackbits(count=capacity): it leaves the padding of an empty bitmap uninitialised.
            bits = np.unpackbits(np.frombuffer(raw or b"", dtype=np.uint8))[:capacity]
            mask = np.zeros(capacity, dtype=bool)  # a bitmap ends at its last row ever set
            mask[: len(bits)] = bits
            masks.append(torch.from_numpy(mask))
        return masks


def _setting_field(name: Any) -> str:
    if not isinstance(name, str) or not name or name in OWN_META_FIELDS:
        raise InvalidExperienceError(
            f"a setting's name is a non-empty str other than the dock's own fields {sorted(OWN_META_FIELDS)}, "
            f"got {name!r:.60}"
        )
    return name


def metric_values(key: Any, value: Any, cumulate: bool) -> dict[str, str]:
    """Metric name -> JSON text of its value, for lua/metrics.lua; with ``cumulate`` every value a list."""
    check_flag("cumulate", cumulate)
    if not isinstance(key, (str, Mapping)):
        raise InvalidExperienceError(f"a metric name must be a non-empty str (or a dict of them), got {key!r}")
    pairs = dict(key) if isinstance(key, Mapping) else {key: value}
    if not pairs:
        raise InvalidExperienceError("update_metrics: no metrics given")
    out = {}
    for name, v in pairs.items():
        if not isinstance(name, str) or not name:
            raise InvalidExperienceError(f"a metric name must be a non-empty str, got {name!r}")
        number = _metric_number(name, v)
        if number is not None:
            out[name] = json.dumps([number] if cumulate else number)
            continue
        if isinstance(v, (torch.Tensor, np.ndarray)):
            v = v.tolist()
        if not isinstance(v, (list, tuple)):
            raise InvalidExperienceError(f"metric {name!r}: a number or a list of numbers, got {type(v).__name__}")
        numbers = [_metric_number(name, x) for x in v]
        if any(x is None for x in numbers):
            raise InvalidExperienceError(f"metric {name!r}: every item must be a number, got {list(v)[:5]!r}")
        out[name] = json.dumps(numbers)
    return out


def _metric_number(name: str, v: Any) -> float | int | None:
    """``v`` as a plain number (also from a one-element tensor or a numpy scalar), or None if it is no number."""
    if isinstance(v, torch.Tensor) and v.numel() == 1 and v.dim() == 0:
        v = v.item()
    elif isinstance(v, np.generic) or (isinstance(v, np.ndarray) and v.ndim == 0):
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return v
