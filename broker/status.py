"""Counts of docks, read for any number of docks in one round trip.

``TransferDock.status()`` reads one dock this way and ``broker status`` every dock on a server: two
round trips (the meta hashes, then the counts) however many docks there are, instead of a client
and a handful of round trips per dock. Each dock's counts come from one MULTI/EXEC, with its meta
hash, so they are a consistent snapshot of a dock whose schema is the one the caller expects.
Anything a broker could not have written (a bitmap with more bits or bytes than its dock has rows, a
counter that is not a number, a key of the wrong type) is reported as that dock's DecodeError.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from .errors import BrokerError, DecodeError, DockNotFoundError, SchemaError
from .keys import DockKeys
from .schema import Schema, fingerprint


@dataclass(frozen=True)
class DockRef:
    """A dock to report on: its keys, its schema, and the fingerprint of the meta that schema came from."""

    keys: DockKeys
    schema: Schema
    fingerprint: str


def read_metas(client: redis.Redis, names: Sequence[str]) -> list[DockRef | BrokerError]:
    """The schema of each named dock, in one round trip; a missing or broken meta is that dock's error."""
    pipe = client.pipeline(transaction=False)
    keys = [DockKeys(name) for name in names]
    for k in keys:
        pipe.hgetall(k.meta)
    out: list[DockRef | BrokerError] = []
    for k, meta in zip(keys, pipe.execute(raise_on_error=False)):
        if isinstance(meta, redis.ResponseError):
            out.append(DecodeError(f"{k.meta}: not a dock meta hash ({meta})"))
        elif not meta:
            out.append(DockNotFoundError(f"no dock named {k.name!r}"))
        else:
            try:
                out.append(DockRef(k, Schema.from_meta(meta, where=k.meta), fingerprint(meta)))
            except DecodeError as exc:
                out.append(exc)
    return out


def read_statuses(client: redis.Redis, docks: Sequence[DockRef]) -> list[dict[str, Any] | BrokerError]:
    """The status of each dock (see ``TransferDock.status``), in one round trip: one MULTI/EXEC for all."""
    pipe = client.pipeline(transaction=True)
    for dock in docks:
        k = dock.keys
        pipe.hgetall(k.meta)
        for key, _ in _bitmaps(dock):
            pipe.bitcount(key)
            pipe.strlen(key)
        for consumer in dock.schema.consumers:
            pipe.zcard(k.leases(consumer))
            pipe.get(k.redelivered(consumer))
    replies = pipe.execute(raise_on_error=False)
    out: list[dict[str, Any] | BrokerError] = []
    at = 0
    for dock in docks:
        size = 1 + 2 * len(_bitmaps(dock)) + 2 * len(dock.schema.consumers)
        try:
            out.append(_parse(dock, replies[at : at + size]))
        except BrokerError as exc:
            out.append(exc)
        at += size
    return out


def _bitmaps(dock: DockRef) -> list[tuple[str, int]]:
    """Every status bitmap of the dock with the number of bits it may have: rows or groups."""
    s, k = dock.schema, dock.keys
    out = []
    for col in s.columns:
        out += [(k.ready(col), s.capacity), (k.group_ready(col), s.prompts_num)]
    for consumer in s.consumers:
        out += [(k.consumed(consumer), s.capacity), (k.group_taken(consumer), s.prompts_num)]
    return out


def _parse(dock: DockRef, replies: list[Any]) -> dict[str, Any]:
    s, k = dock.schema, dock.keys
    meta, *rest = replies
    if not isinstance(meta, Exception) and not meta:
        raise DockNotFoundError(f"dock {k.name!r} is gone: its meta key {k.meta} was deleted (or the server lost it)")
    if isinstance(meta, Exception) or fingerprint(meta) != dock.fingerprint:
        raise SchemaError(f"{k.meta} no longer holds the schema this dock was opened with; open the dock again")
    counts: dict[str, int] = {}
    for i, (key, bits) in enumerate(_bitmaps(dock)):
        count, size = rest[2 * i], rest[2 * i + 1]
        for reply in (count, size):
            if isinstance(reply, Exception):
                raise DecodeError(f"{key}: not a bitmap ({reply})")
        if count > bits or size > -(-bits // 8):
            raise DecodeError(f"{key}: {count} bits set in {size} bytes, more than its dock's {bits} bits")
        counts[key] = count
    tail = rest[2 * len(_bitmaps(dock)) :]
    consumers = {}
    for i, consumer in enumerate(s.consumers):
        leased, redelivered = tail[2 * i], tail[2 * i + 1]
        if isinstance(leased, Exception) or leased > s.capacity:
            raise DecodeError(f"{k.leases(consumer)}: not a lease set of this dock ({leased})")
        consumers[consumer] = {
            "consumed": counts[k.consumed(consumer)],
            "leased": leased,
            "redelivered": _counter(redelivered, k.redelivered(consumer)),
        }
    return {
        "name": k.name,
        "prompts_num": s.prompts_num,
        "n_samples_per_prompt": s.n_samples_per_prompt,
        "capacity": s.capacity,
        "columns": {
            col: {"ready": counts[k.ready(col)], "groups_ready": counts[k.group_ready(col)]} for col in s.columns
        },
        "consumers": consumers,
    }


def _counter(raw: Any, key: str) -> int:
    """A counter as read from Redis; garbage in it is reported, not crashed on."""
    if isinstance(raw, Exception):
        raise DecodeError(f"{key}: not a counter ({raw})")
    try:
        value = int(raw or 0)
    except ValueError:
        raise DecodeError(f"{key}: not a counter: {raw!r:.40}") from None
    if value < 0:
        raise DecodeError(f"{key}: not a counter: {value}")
    return value
