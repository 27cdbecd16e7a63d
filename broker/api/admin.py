"""Administration of a dock: shared metrics, status, dead letters, clearing, deleting and growing it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, cast

import redis

from broker.api import metrics
from broker.api.checks import check_flag, metric_values
from broker.api.session import RACE_RETRIES, DockSession
from broker.connection import call_deadline, redis_errors
from broker.connection.replication import REPEAT_SAFE
from broker.control.keys import DockKeys
from broker.control.schema import Schema
from broker.control.status import DockRef, read_statuses
from broker.errors import BrokerError, DecodeError, InvalidExperienceError, SchemaError


class Admin:
    """Metrics, status, dead letters, clear, delete, grow: a part of ``TransferDock``, on its session."""

    def __init__(self, session: DockSession):
        self._s = session

    def update_metrics(self, key: str | Mapping[str, Any] = "", value: Any = None, cumulate: bool = False) -> None:
        """Set or append to shared metrics."""
        values = metric_values(key, value, cumulate)
        repeat = "do not repeat it: a repeat appends the values again" if cumulate else REPEAT_SAFE
        self._s.write("update_metrics", lambda: self._s.scripts.metrics(values, cumulate), repeat=repeat, returns=False)

    def get_metrics(self) -> dict[str, Any]:
        """Every shared metric."""
        raw = cast("dict[bytes, bytes]", self._s.run(lambda: self._s.client.hgetall(self._s.keys.metrics)))
        out = {}
        for name, text in raw.items():
            try:
                out[name.decode()] = json.loads(text)
            except ValueError:
                raise DecodeError(f"{self._s.keys.metrics} field {name!r}: not a JSON number or list") from None
        return out

    def status(self) -> dict[str, Any]:
        """A consistent snapshot of the dock's counts."""
        ref = DockRef(self._s.keys, self._s.schema, self._s.fingerprint)
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

    def clear(self, indexes: Sequence[int] | None = None, *, consumer: str | None = None, age: bool = True) -> None:
        """Forget rows, or end an iteration of ``consumer``."""
        with metrics.observe(self._s.name, "clear") as call:
            if consumer is not None:
                if indexes is not None:
                    raise InvalidExperienceError("clear takes indexes or consumer, not both")
                self._s.check.consumer(consumer)
                check_flag("age", age)
                self._s.forget(
                    f"clear(consumer={consumer!r})", lambda: self._s.scripts.clear(iteration_of=consumer, age=age),
                    returns=False, repeat="do not repeat it: a repeat would age the groups kept again and start "
                    "the cursor and the metrics again",
                )
                return
            rows = [] if indexes is None else self._s.check.rows(indexes)
            self._s.forget("clear", lambda: self._s.scripts.clear(rows), whole=not rows, returns=False)
            call.rows = len(rows) if rows else self._s.schema.capacity

    def delete(self) -> None:
        """Remove the dock from Redis entirely."""
        schema = self._s.schema
        keys = self._s.keys.every_key(schema.columns, schema.consumers, schema.rollout.age_buckets)
        keys += self._s.run(self._s.store.data_keys)
        # The wait's counters are deleted again after it (drop): a deleted dock leaves no key.
        shards = [DockKeys.shard_replicated(tag) for tag in schema.shards]
        self._s.write("delete", lambda: self._s.client.delete(*dict.fromkeys(keys)), shards=shards, returns=False,
                    drop=True)

    def grow(self, columns: Sequence[str] = (), consumers: Sequence[str] = ()) -> Schema:
        """Add columns and consumers; the grown schema."""
        wrote = False
        for _ in range(RACE_RETRIES):
            self._s.refresh()
            grown = self._s.schema.grown(columns, consumers)
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
