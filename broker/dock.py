"""TransferDock: MindSpeed-RL's experience dock, kept in Redis so any process on any machine can share it."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np
import redis
import torch

from . import codec
from .connection import connect, redact, redis_errors
from .errors import (
    BrokerError,
    DecodeError,
    DockNotFoundError,
    ExperienceTimeoutError,
    InvalidExperienceError,
    MissingDataError,
    RowIndexError,
    SchemaError,
    UnknownColumnError,
    UnknownConsumerError,
)
from .keys import DockKeys
from .schema import Schema
from .scripts import Scripts, supports_flags

Batch = dict[str, list[torch.Tensor]]
T = TypeVar("T")

POLICIES = ("fifo", "random")

#: Longest a waiting reader sleeps between checks even without a notification. Pub/sub delivers at
#: most once (a reconnect can drop a message), so this bounds the cost of a lost one; it is not polling.
_RECHECK_SECONDS = 1.0

#: How long a sampling call's reply is kept for a retry after a lost reply.
_REPLY_TTL_MS = 60_000


class TransferDock:
    """Columns of per-row tensors with ready and consumed status, shared through Redis.

    Rows are grouped by prompt: group g is rows ``[g*n, (g+1)*n)``, the n responses of one prompt.
    See the README for the key layout; every method is safe to call from many threads and processes.
    """

    def __init__(
        self,
        url_or_client: str | redis.Redis,
        name: str,
        prompts_num: int,
        n_samples_per_prompt: int,
        columns: Sequence[str],
        consumers: Sequence[str],
        *,
        policy: str = "fifo",
        seed: int | None = None,
    ):
        """Create dock ``name``, or attach to it if it exists with the same schema.

        ``url_or_client`` is a URL (``redis://``, ``rediss://``, ``unix://``) or a client made with
        ``decode_responses=False`` (``fakeredis.FakeRedis()`` works). ``policy`` picks which qualifying
        rows sampling hands out: ``"fifo"`` (lowest group first) or ``"random"`` (reproducible with ``seed``).
        """
        self._open(url_or_client, name, policy, seed)
        wanted = Schema.build(prompts_num, n_samples_per_prompt, columns, consumers)
        fields = [x for pair in wanted.to_meta().items() for x in pair]
        reply = self._run(lambda: self._scripts.create([self._keys.meta], fields))
        if reply[0] == 1:
            self._set_schema(wanted)
            return
        stored = Schema.from_meta(dict(zip(reply[1::2], reply[2::2])), where=self._keys.meta)
        diff = wanted.differences(stored)
        if diff:
            raise SchemaError(f"dock {name!r} exists with a different schema: " + "; ".join(diff))
        self._set_schema(stored)

    @classmethod
    def attach(
        cls, url_or_client: str | redis.Redis, name: str, *, policy: str = "fifo", seed: int | None = None
    ) -> TransferDock:
        """Open the existing dock ``name`` from the schema stored in Redis."""
        dock = cls.__new__(cls)
        dock._open(url_or_client, name, policy, seed)
        meta = dock._run(lambda: dock._client.hgetall(dock._keys.meta))
        if not meta:
            raise DockNotFoundError(f"no dock named {name!r} at {dock._server}")
        dock._set_schema(Schema.from_meta(meta, where=dock._keys.meta))
        return dock

    def _open(self, target: str | redis.Redis, name: str, policy: str, seed: int | None) -> None:
        if not isinstance(policy, str) or policy not in POLICIES:
            raise SchemaError(f"policy must be one of {POLICIES}, got {policy!r}")
        self._keys = DockKeys(name)
        self._client, self._url = connect(target)
        self._server = redact(self._url) if self._url else repr(self._client)
        self._where = f"{self._server} (dock {name!r})"  # names the dock in every Redis error
        self._scripts = Scripts(self._client, allow_oom=self._run(lambda: supports_flags(self._client)))
        self._policy = policy
        self._seed = seed
        self._rng = random.Random(seed)

    def _set_schema(self, schema: Schema) -> None:
        self._schema = schema
        self._column_set = frozenset(schema.columns)
        self._consumer_set = frozenset(schema.consumers)

    # Pickles as (URL, name) so a dock can be handed to Ray actors and subprocesses.
    def __reduce__(self) -> tuple[Callable[..., TransferDock], tuple[Any, ...]]:
        if self._url is None:
            raise BrokerError(
                f"dock {self.name!r} was opened from a client with no URL ({type(self._client).__name__}); "
                "open it from a URL to pickle it"
            )
        return _reattach, (self._url, self.name, self._policy, self._seed)

    def __repr__(self) -> str:
        s = self._schema
        return (
            f"TransferDock({self.name!r} at {self._server}, prompts_num={s.prompts_num}, "
            f"n_samples_per_prompt={s.n_samples_per_prompt}, columns={list(s.columns)}, "
            f"consumers={list(s.consumers)})"
        )

    # -- schema -------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._keys.name

    @property
    def schema(self) -> Schema:
        return self._schema

    @property
    def prompts_num(self) -> int:
        return self._schema.prompts_num

    @property
    def n_samples_per_prompt(self) -> int:
        return self._schema.n_samples_per_prompt

    @property
    def capacity(self) -> int:
        """Rows in the dock: prompts_num × n_samples_per_prompt."""
        return self._schema.capacity

    @property
    def columns(self) -> tuple[str, ...]:
        return self._schema.columns

    @property
    def consumers(self) -> tuple[str, ...]:
        return self._schema.consumers

    @property
    def client(self) -> redis.Redis:
        """The Redis client the dock talks through."""
        return self._client

    # -- writing ------------------------------------------------------------------------------

    def put_experience(self, data_dict: Mapping[str, Any], indexes: Sequence[int]) -> None:
        """Write rows ``indexes`` of some columns and mark them ready, atomically.

        Each value of ``data_dict`` is a stacked tensor (split along dim 0 into rows) or a list of
        per-row tensors, with one row per index. Writing a row again replaces it.
        """
        rows = self._check_rows(indexes)
        if not isinstance(data_dict, Mapping) or not data_dict:
            raise InvalidExperienceError("data_dict must be a non-empty dict of column -> rows")
        self._check_columns(list(data_dict))
        fields = [str(r) for r in rows]
        # Encode everything before the first Redis call: a bad tensor must not leave a half put.
        encoded = {col: dict(zip(fields, self._encode_rows(col, value, len(rows)))) for col, value in data_dict.items()}
        keys = []
        for col in encoded:
            keys += [self._keys.data(col), self._keys.ready(col), self._keys.group_ready(col)]

        script = self._scripts.put
        args = [self.n_samples_per_prompt, self._keys.events, *_runs(rows)]

        def put() -> None:
            # EVALSHA sent as is rather than through Script(client=pipe), which costs a SCRIPT EXISTS
            # round trip per put; a server that lost the script fails only that command (the HSETs
            # applied mark nothing), and the whole idempotent transaction is sent again once loaded.
            for attempt in range(2):
                pipe = self._client.pipeline(transaction=True)
                for col, mapping in encoded.items():
                    pipe.hset(self._keys.data(col), mapping=mapping)
                pipe.evalsha(script.sha, len(keys), *keys, *args)
                replies = pipe.execute(raise_on_error=False)
                if attempt == 0 and isinstance(replies[-1], redis.exceptions.NoScriptError):
                    self._client.script_load(script.script)
                    continue
                # The script's own error names the bad key; a failed HSET alone would only say WRONGTYPE.
                for reply in replies[::-1]:
                    if isinstance(reply, Exception):
                        raise reply
                return

        self._run(put)

    def _encode_rows(self, column: str, value: Any, count: int) -> list[bytes]:
        try:
            value = codec.as_tensor(value)
        except InvalidExperienceError as exc:
            raise InvalidExperienceError(f"column {column!r}: {exc}") from None
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                raise InvalidExperienceError(
                    f"column {column!r}: a stacked tensor needs a row dimension, got a 0-d tensor"
                )
            if value.shape[0] != count:
                raise InvalidExperienceError(
                    f"column {column!r}: stacked tensor of shape {tuple(value.shape)} has {value.shape[0]} rows "
                    f"for {count} indexes"
                )
            encode = codec.encode_stacked
        elif not isinstance(value, (list, tuple)):
            raise InvalidExperienceError(
                f"column {column!r}: expected a tensor or a list of tensors, got {type(value).__name__}"
            )
        elif len(value) != count:
            raise InvalidExperienceError(f"column {column!r}: {len(value)} rows for {count} indexes")
        else:
            encode = codec.encode_rows
        try:
            return encode(value)
        except InvalidExperienceError as exc:
            raise InvalidExperienceError(f"column {column!r}, {exc}") from None

    # -- reading ------------------------------------------------------------------------------

    def get_experience(
        self,
        consumer: str,
        experience_columns: Sequence[str],
        experience_count: int | None = None,
        indexes: Sequence[int] | None = None,
        get_n_samples: bool = True,
        timeout: float | None = None,
        policy: str | None = None,
        lease: float | None = None,
    ) -> tuple[Batch, list[int]] | tuple[None, None]:
        """Hand rows to ``consumer`` and return ``({column: [tensor per row]}, rows)``.

        Without ``indexes``: atomically pick ``experience_count`` rows written in every requested
        column and not yet handed to this consumer (whole groups when ``get_n_samples``), mark them
        consumed and return them. If too few qualify, return ``(None, None)`` — at once when
        ``timeout`` is None, else after waiting up to ``timeout`` seconds for puts.

        With ``indexes``: wait up to ``timeout`` seconds (None: do not wait) until those rows are
        written in every requested column, then mark and return them; if they are not, raise
        ExperienceTimeoutError naming the missing cells, having marked nothing.

        With ``lease`` (seconds), rows handed out must be confirmed with :meth:`ack` within that time;
        rows not acked in time are offered to this consumer again by a later call (at-least-once
        delivery, for workers that may die). ``lease=None`` hands rows out for good.
        """
        self._check_consumer(consumer)
        if not isinstance(experience_columns, (list, tuple)) or not experience_columns:
            raise InvalidExperienceError("experience_columns must be a non-empty list of column names")
        columns = list(experience_columns)
        self._check_columns(columns)
        if len(set(columns)) != len(columns):
            raise InvalidExperienceError(f"experience_columns lists a column twice: {columns}")
        if timeout is not None and not (_is_number(timeout) and timeout >= 0):
            raise InvalidExperienceError(f"timeout must be None or a number >= 0, got {timeout!r}")
        if lease is not None and not (_is_number(lease) and 0.001 <= lease <= 86400 * 30):
            raise InvalidExperienceError(f"lease must be None or seconds in [0.001, 30 days], got {lease!r}")
        if not isinstance(get_n_samples, (bool, np.bool_)):
            raise InvalidExperienceError(f"get_n_samples must be a bool, got {get_n_samples!r}")
        lease_ms = 0 if lease is None else int(lease * 1000)
        if indexes is not None:
            rows = self._check_rows(indexes)
            missing: dict[str, list[int]] = {}

            def take() -> list[int] | None:
                missing.clear()
                missing.update(self._take(consumer, columns, rows, lease_ms))
                return None if missing else rows

            if self._wait(take, timeout) is None:
                detail = "; ".join(f"{col}: rows {_abbrev(r)}" for col, r in missing.items())
                raise ExperienceTimeoutError(
                    f"dock {self.name!r}, consumer {consumer!r}: rows not written within timeout={timeout}: {detail}",
                    missing,
                )
        else:
            sample = self._sampler(
                consumer, columns, experience_count, get_n_samples, policy or self._policy, lease_ms
            )
            rows = self._wait(sample, timeout)
            if rows is None:
                return None, None
        return self._read(columns, rows), rows

    def _sampler(
        self, consumer: str, columns: list[str], count: int | None, get_n_samples: bool, policy: str, lease_ms: int
    ) -> Callable[[], list[int] | None]:
        n = self.n_samples_per_prompt
        if not _is_int(count) or count < 1:
            raise InvalidExperienceError(f"experience_count must be a positive int, got {count!r}")
        count = int(count)
        if count > self.capacity:
            raise InvalidExperienceError(f"experience_count {count} exceeds the dock's {self.capacity} rows")
        if not isinstance(policy, str) or policy not in POLICIES:
            raise InvalidExperienceError(f"policy must be one of {POLICIES}, got {policy!r}")
        if get_n_samples:
            if count % n:
                raise InvalidExperienceError(
                    f"experience_count {count} must be a multiple of n_samples_per_prompt={n} with get_n_samples"
                )
            mode, units, status = "groups", self.prompts_num, self._keys.group_ready
            count //= n
        else:
            mode, units, status = "rows", self.capacity, self._keys.ready
        k = self._keys
        consumer_keys = [k.consumed(consumer), k.group_taken(consumer), k.leases(consumer), k.redelivered(consumer)]
        status_keys = [status(c) for c in columns]

        def sample() -> list[int] | None:
            # A fresh id per attempt; the client's own retries of this one call resend the same id,
            # so a reply lost on a dropped connection is answered again, not sampled twice.
            keys = [*consumer_keys, k.reply(uuid.uuid4().hex), k.scratch, *status_keys]
            seed = self._rng.getrandbits(31) if policy == "random" else 0
            runs = self._scripts.sample(keys, [mode, count, n, units, policy, seed, lease_ms, _REPLY_TTL_MS])
            rows = [r for start, length in zip(runs[::2], runs[1::2]) for r in range(start, start + length)]
            return rows or None

        return sample

    def _take(self, consumer: str, columns: list[str], rows: list[int], lease_ms: int) -> dict[str, list[int]]:
        """Mark explicit rows consumed if all are written; else mark nothing and return the missing cells."""
        keys = [self._keys.consumed(consumer), self._keys.group_taken(consumer), self._keys.leases(consumer)]
        keys += [self._keys.ready(c) for c in columns]
        missing_flat = self._scripts.take(keys, [self.n_samples_per_prompt, lease_ms, *rows])
        missing: dict[str, list[int]] = {}
        for pos, row in zip(missing_flat[::2], missing_flat[1::2]):
            missing.setdefault(columns[int(pos) - 1], []).append(int(row))
        return missing

    def _read(self, columns: list[str], rows: list[int]) -> Batch:
        fields = [str(r) for r in rows]

        def fetch() -> list[list[bytes | None]]:
            pipe = self._client.pipeline(transaction=False)
            for col in columns:
                pipe.hmget(self._keys.data(col), fields)
            return pipe.execute()

        replies = self._run(fetch)
        batch: Batch = {}
        for col, values in zip(columns, replies):
            key = self._keys.data(col)
            gone = [r for r, v in zip(rows, values) if v is None]
            if gone:
                raise MissingDataError(f"{key}: rows {_abbrev(gone)} are marked ready but hold no bytes")
            batch[col] = codec.decode_rows(values, where=key, fields=fields)
        return batch

    def _wait(self, attempt: Callable[[], T | None], timeout: float | None) -> T | None:
        """Run ``attempt`` until it returns a value or ``timeout`` seconds pass, waking on puts."""
        result = self._run(attempt)
        if result is not None or not timeout:
            return result
        deadline = time.monotonic() + timeout
        with self._subscription() as wait_for_put:
            while True:
                # Retry after subscribing: a put between the first attempt and SUBSCRIBE is not missed.
                result = self._run(attempt)
                remaining = deadline - time.monotonic()
                if result is not None or remaining <= 0:
                    return result
                wait_for_put(min(remaining, _RECHECK_SECONDS))

    @contextmanager
    def _subscription(self) -> Iterator[Callable[[float], None]]:
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        try:
            self._run(lambda: pubsub.subscribe(self._keys.events))

            def wait_for_put(seconds: float) -> None:
                self._run(lambda: pubsub.get_message(timeout=seconds))
                while self._run(lambda: pubsub.get_message(timeout=0)) is not None:
                    pass  # drain: one retry answers every put that arrived meanwhile

            yield wait_for_put
        finally:
            pubsub.close()

    # -- status and clearing ------------------------------------------------------------------

    def all_consumed(self, consumer: str) -> bool:
        """True when every row has been handed to ``consumer`` and none is still out on a lease."""
        self._check_consumer(consumer)

        def counts() -> list[int]:
            pipe = self._client.pipeline(transaction=True)
            pipe.bitcount(self._keys.consumed(consumer))
            pipe.zcard(self._keys.leases(consumer))
            return pipe.execute()

        consumed, leased = self._run(counts)
        return consumed == self.capacity and leased == 0

    def ack(self, consumer: str, indexes: Sequence[int]) -> int:
        """Confirm that ``consumer`` is done with leased rows; returns how many were still leased.

        An ack after the lease expired and the rows were given back changes nothing: they are redone
        (at-least-once). Acking twice, or rows taken without a lease, is harmless.
        """
        self._check_consumer(consumer)
        rows = self._check_rows(indexes)
        return int(self._run(lambda: self._scripts.ack([self._keys.leases(consumer)], rows)))

    def status(self) -> dict[str, Any]:
        """A consistent snapshot of the dock's counts.

        ``columns``: rows and whole groups written, per column. ``consumers``: rows handed out
        (``consumed``), of which ``leased`` still await an ack, and rows given back after their lease
        expired (``redelivered``, since the last whole clear).
        """
        s, k = self._schema, self._keys

        def snapshot() -> list[Any]:
            pipe = self._client.pipeline(transaction=True)
            for col in s.columns:
                pipe.bitcount(k.ready(col))
                pipe.bitcount(k.group_ready(col))
            for consumer in s.consumers:
                pipe.bitcount(k.consumed(consumer))
                pipe.zcard(k.leases(consumer))
                pipe.get(k.redelivered(consumer))
            return pipe.execute()

        counts = self._run(snapshot)
        cols, cons = counts[: 2 * len(s.columns)], counts[2 * len(s.columns) :]
        return {
            "name": self.name,
            "prompts_num": s.prompts_num,
            "n_samples_per_prompt": s.n_samples_per_prompt,
            "capacity": s.capacity,
            "columns": {
                col: {"ready": cols[2 * i], "groups_ready": cols[2 * i + 1]} for i, col in enumerate(s.columns)
            },
            "consumers": {
                c: {
                    "consumed": cons[3 * i],
                    "leased": cons[3 * i + 1],
                    "redelivered": _counter(cons[3 * i + 2], k.redelivered(c)),
                }
                for i, c in enumerate(s.consumers)
            },
        }

    def clear(self, indexes: Sequence[int] | None = None) -> None:
        """Forget every row (``indexes=None``) or some rows: their bytes, status bits and leases."""
        rows = [] if indexes is None else self._check_rows(indexes)
        s = self._schema
        keys = self._keys.clear_keys(s.columns, s.consumers)
        args = [len(s.columns), len(s.consumers), s.n_samples_per_prompt, *rows]
        self._run(lambda: self._scripts.clear(keys, args))

    def delete(self) -> None:
        """Remove the dock from Redis entirely, schema included.

        Replies that sampling calls keep for retries (``td:{NAME}:reply:*``) are left to expire within a
        minute: finding them would need a SCAN of the whole server.
        """
        keys = self._keys.clear_keys(self.columns, self.consumers) + [self._keys.scratch, self._keys.meta]
        self._run(lambda: self._client.delete(*keys))

    # -- checks -------------------------------------------------------------------------------

    def _check_rows(self, indexes: Any) -> list[int]:
        if isinstance(indexes, (torch.Tensor, np.ndarray)):
            indexes = indexes.tolist()
        if isinstance(indexes, (str, bytes)) or not isinstance(indexes, Sequence):
            raise RowIndexError(f"indexes must be a list of row numbers, got {type(indexes).__name__}")
        if not indexes:
            raise RowIndexError("indexes is empty")
        rows = list(indexes)
        if not all(type(i) is int for i in rows):  # plain ints skip the per-row checks below
            bad = [i for i in rows if not _is_int(i)]
            if bad:
                raise RowIndexError(f"indexes must be ints, got {bad[:5]!r}")
            rows = [int(i) for i in rows]
        if min(rows) < 0 or max(rows) >= self.capacity:
            out = [r for r in rows if not 0 <= r < self.capacity]
            raise RowIndexError(f"rows {_abbrev(out)} are outside the dock's range [0, {self.capacity})")
        if len(set(rows)) != len(rows):
            dupes = sorted({r for r in rows if rows.count(r) > 1})
            raise RowIndexError(f"rows listed more than once: {_abbrev(dupes)}")
        return rows

    def _check_columns(self, columns: list[Any]) -> None:
        unknown = [c for c in columns if not isinstance(c, str) or c not in self._column_set]
        if unknown:
            raise UnknownColumnError(
                f"dock {self.name!r} has no columns {unknown}; its columns are {list(self.columns)}"
            )

    def _check_consumer(self, consumer: Any) -> None:
        if not isinstance(consumer, str) or consumer not in self._consumer_set:
            raise UnknownConsumerError(
                f"dock {self.name!r} has no consumer {consumer!r}; its consumers are {list(self.consumers)}"
            )

    def _run(self, call: Callable[[], T]) -> T:
        with redis_errors(self._where):
            return call()



def _runs(rows: list[int]) -> list[int]:
    """Distinct rows as runs of consecutive rows, flattened: [start, length, start, length, ...]."""
    out: list[int] = []
    for row in sorted(set(rows)):
        if out and row == out[-2] + out[-1]:
            out[-1] += 1
        else:
            out += [row, 1]
    return out


def _is_int(value: Any) -> bool:
    """An int or numpy integer, but not a bool (True as a row number is a bug, not row 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_number(value: Any) -> bool:
    """A real number that is not a bool and not NaN."""
    return (_is_int(value) or isinstance(value, (float, np.floating))) and value == value


def _counter(raw: bytes | None, key: str) -> int:
    """A counter as read from Redis; garbage in it is reported, not crashed on."""
    try:
        return int(raw or 0)
    except ValueError:
        raise DecodeError(f"{key}: not a counter: {raw!r:.40}") from None


def _reattach(url: str, name: str, policy: str, seed: int | None) -> TransferDock:
    """Unpickle a dock: reconnect to its server and read its schema there."""
    return TransferDock.attach(url, name, policy=policy, seed=seed)


def _abbrev(rows: list[int], limit: int = 20) -> str:
    """A row list for an error message, cut after ``limit`` entries."""
    if len(rows) <= limit:
        return str(rows)
    return f"{rows[:limit]}... ({len(rows)} in all)"
