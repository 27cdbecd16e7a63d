"""Counts of docks, read for any number of docks in one round trip.

``TransferDock.status()`` reads one dock this way, and ``broker status``, its live view and the
exporter every dock on a server: the meta hashes once, then the counts, one round trip however many
docks there are. Each dock's counts come from one call of lua/status.lua, which checks the dock's
schema first, so they are a consistent snapshot of a dock whose schema is the one the caller
expects. Anything a broker could not have written (a bitmap with more bits or bytes than its dock
has rows, a counter that is not a number, a key of the wrong type) is reported as that dock's
DecodeError; the other docks are read as usual.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from redis.client import Pipeline

from broker.connection import Client, script_error
from broker.control.keys import META_PATTERN, DockKeys, dock_name_from_meta_key, partition_of_name
from broker.control.schema import Schema, fingerprint
from broker.control.scripts import StatusScript, run_pipeline
from broker.control.scripts.functions import uses_functions
from broker.errors import BrokerError, DecodeError, DockNotFoundError, SchemaError


@dataclass(frozen=True)
class DockRef:
    """A dock to report on: its keys, its schema, and the fingerprint of the meta that schema came from."""

    keys: DockKeys
    schema: Schema
    fingerprint: str


def read_metas(client: Client, names: Sequence[str]) -> list[DockRef | BrokerError]:
    """The schema of each named dock, in one round trip; a missing or broken meta is that dock's error, and so
    is a name no dock may have (a meta key another client wrote, ``td:{a b}:meta``): the others are read."""
    pipe = client.pipeline(transaction=False)
    keys: list[DockKeys | BrokerError] = []
    for name in names:
        try:
            keys.append(DockKeys(name))
        except SchemaError as exc:
            keys.append(DecodeError(f"{META_PATTERN.replace('*', name)}: not a dock's meta key ({exc})"))
    for k in keys:
        if isinstance(k, DockKeys):
            pipe.hgetall(k.meta)
    replies = iter(pipe.execute(raise_on_error=False))
    out: list[DockRef | BrokerError] = []
    for k in keys:
        if isinstance(k, BrokerError):
            out.append(k)
            continue
        meta = next(replies)
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


def read_statuses(client: Client, docks: Sequence[DockRef]) -> list[dict[str, Any] | BrokerError]:
    """The status of each dock (see ``TransferDock.status``), in one round trip."""
    return _read_statuses(client, docks)[0]


def _read_statuses(
    client: Client, docks: Sequence[DockRef], also: Callable[[Pipeline], None] | None = None
) -> tuple[list[dict[str, Any] | BrokerError], list[Any]]:
    """Each dock's status, and the replies of what ``also`` queued after them in the same pipeline."""
    parse: list[Callable[[list[Any]], list[dict[str, Any] | BrokerError]]] = []

    functions = uses_functions(client) if docks else False

    def build(pipe: Pipeline) -> None:  # run again, whole, if the server lost the script
        parse[:] = [queue_statuses(pipe, docks, functions)]
        if also is not None:
            also(pipe)

    replies = run_pipeline(client, StatusScript.load, build, transaction=False)
    return parse[0](replies[: len(docks)]), replies[len(docks) :]


def queue_statuses(
    pipe: Pipeline, docks: Sequence[DockRef], functions: bool = False
) -> Callable[[list[Any]], list[dict[str, Any] | BrokerError]]:
    """Queue one status script per dock on ``pipe``; returns what turns the pipe's replies into statuses.

    The statuses' commands come first on ``pipe``; the returned parser reads only their replies, so a
    caller may queue more commands after them (the exporter queues its memory samples) in the same round
    trip. Each dock's counts are one atomic read, checked against the schema the caller knows.
    """
    for dock in docks:
        StatusScript.queue(pipe, dock.keys, dock.schema, dock.fingerprint, functions)

    def parse(replies: list[Any]) -> list[dict[str, Any] | BrokerError]:
        out: list[dict[str, Any] | BrokerError] = []
        for dock, reply in zip(docks, replies):
            if isinstance(reply, redis.ResponseError):
                error = script_error(reply)
                if error is None:  # not about this dock (permissions, a server error): the reading fails
                    raise reply
                out.append(error)
                continue
            try:
                out.append(_parse(dock, reply))
            except BrokerError as exc:
                out.append(exc)
        return out

    return parse


def _parse(dock: DockRef, reply: list[Any]) -> dict[str, Any]:
    """A dock's status from its status script's reply; counts no broker could have written raise DecodeError."""
    s, k = dock.schema, dock.keys
    bitmaps, consumers_raw, (version, discarded_text, stale, held), (quota, stored) = StatusScript.parse(reply, k, s)
    counts: dict[str, int] = {}
    for (key, bits), (count, size) in zip(StatusScript.bitmaps(k, s), bitmaps):
        if count > bits or size > -(-bits // 8):
            raise DecodeError(f"{key}: {count} bits set in {size} bytes, more than its dock's {bits} bits")
        counts[key] = count
    consumers = {}
    for consumer, (leased, redelivered, dead) in zip(s.consumers, consumers_raw):
        if leased > s.capacity:
            raise DecodeError(f"{k.leases(consumer)}: {leased} rows leased, more than its dock's {s.capacity}")
        if dead > s.capacity:
            raise DecodeError(f"{k.dead(consumer)}: {dead} dead letters, more than its dock's {s.capacity} rows")
        consumers[consumer] = {
            "consumed": counts[k.consumed(consumer)],
            "leased": leased,
            "redelivered": _counter(redelivered, k.redelivered(consumer)),
            "dead": dead,
        }
    discarded = {}
    for part in filter(None, discarded_text.split(",")):
        reason, _, times = part.rpartition("=")
        discarded[reason] = _counter(times, k.discarded)
    out = {
        "name": k.name,
        "prompts_num": s.prompts_num,
        "n_samples_per_prompt": s.n_samples_per_prompt,
        "capacity": s.capacity,
        "columns": {
            col: {"ready": counts[k.ready(col)], "groups_ready": counts[k.group_ready(col)]} for col in s.columns
        },
        "consumers": consumers,
        "version": _counter(version, k.version),
        "discarded": discarded,
    }
    if quota not in (b"", ""):  # see TransferDock.set_quota
        out["quota"] = {"bytes": _counter(quota, k.meta), "stored_bytes": _counter(stored or 0, k.meta)}
    r = s.rollout
    if r.partial:
        finished = counts[k.finished]
        out["rollout"] = {
            "finished_rows": finished,
            "finished_groups": counts[k.group_finished],
            "unfinished_rows": max(0, held - finished),
            "groups_by_age": {a: counts[k.group_age(a)] for a in range(r.age_buckets)},
            "groups_waiting": {w: counts[k.group_wait(w)] for w in range(1, r.age_buckets)},
        }
    if r.bounded:
        out["stale_groups"] = stale
    return out


def _counter(raw: Any, key: str) -> int:
    """A counter as read from Redis; garbage in it is reported, not crashed on."""
    try:
        value = int(raw or 0)
    except ValueError:
        raise DecodeError(f"{key}: not a counter: {raw!r:.40}") from None
    if value < 0:
        raise DecodeError(f"{key}: not a counter: {value}")
    return value


def dock_names(client: Client) -> list[str]:
    """Names of every dock on the server, sorted (a SCAN of the whole keyspace: one round trip per 1,000 keys).

    On a Redis Cluster, of every primary: a cluster client's SCAN goes to each of them in turn."""
    found = {dock_name_from_meta_key(k) for k in client.scan_iter(match=META_PATTERN, count=1000)}
    return sorted(n for n in found if n)


@dataclass
class SurveyReading:
    """One reading of a :class:`Survey`: each dock's status or error, and the replies of the extra commands."""

    docks: list[tuple[str, dict[str, Any] | BrokerError]]
    extra: list[Any]


class Survey:
    """The status of every dock on a server (or of the named ones), read again and again.

    For ``broker status --watch`` and the exporter, which read every few seconds. The schemas found
    once are kept, so a reading is one round trip (a status script call per dock, in one pipeline),
whatever the number of docks.
    The server is scanned for new docks at most every ``rescan_seconds`` (a SCAN costs a round trip
    per 1,000 keys); with None, at every reading, unless scans grow slow: then as often as keeps
    scanning to 1/``SCAN_SHARE`` of the time (``broker status --watch`` shows a new dock at its next
    frame on any keyspace a scan reads in a few milliseconds). A dock whose meta vanished or changed
    since is read afresh within the same reading, so a dock deleted and created again with another
    schema shows its new counts at once. Not thread-safe: one reader at a time.
    """

    #: With ``rescan_seconds=None``, a scan again once ``SCAN_SHARE`` times the last scan's duration passed.
    SCAN_SHARE = 20

    def __init__(self, client: Client, names: Sequence[str] = (), *, rescan_seconds: float | None = 60.0):
        self._client = client
        self._fixed = list(names)
        self._rescan_seconds = rescan_seconds
        self._scanned_at: float | None = None
        self._scan_took = 0.0
        self._found: list[str] = []
        self._refs: dict[str, DockRef] = {}
        self._expanded: list[str] | None = None

    @property
    def refs(self) -> dict[str, DockRef]:
        """The docks whose schemas this survey knows, by name (current during ``also``)."""
        return self._refs

    def read(self, also: Callable[[Pipeline], None] | None = None) -> SurveyReading:
        """Every dock's status, by name; ``also`` may queue more commands in the same pipeline, after the statuses."""
        names = self._names()
        results: dict[str, dict[str, Any] | BrokerError] = self._learn([n for n in names if n not in self._refs])
        known = [n for n in names if n in self._refs]
        statuses, extra = _read_statuses(self._client, [self._refs[n] for n in known], also)
        results.update(zip(known, statuses))
        # Deleted, or created again with another schema, since its meta was read: read it afresh now,
        # which costs round trips only when a dock changed.
        changed = [n for n in known if isinstance(results[n], (DockNotFoundError, SchemaError))]
        for name in changed:
            del self._refs[name]
        results.update(self._learn(changed))
        again = [n for n in changed if n in self._refs]
        if again:
            results.update(zip(again, read_statuses(self._client, [self._refs[n] for n in again])))
        docks = [(n, results[n]) for n in names if not self._gone(results[n])]
        return SurveyReading(folded(docks), extra)

    def _names(self) -> list[str]:
        """The docks to read: the ones named (a partitioned dock's name stands for its partitions), or all found."""
        if not self._fixed:
            return self._discover()
        if self._expanded is None:
            self._expanded = partitions_of(self._client, self._fixed)
        return self._expanded

    def _discover(self) -> list[str]:
        now = time.monotonic()
        every = self.SCAN_SHARE * self._scan_took if self._rescan_seconds is None else self._rescan_seconds
        if self._scanned_at is None or now - self._scanned_at >= every:
            self._found = dock_names(self._client)
            self._scanned_at, self._scan_took = now, time.monotonic() - now
            for name in set(self._refs) - set(self._found):
                del self._refs[name]
        return self._found

    def _learn(self, names: list[str]) -> dict[str, dict[str, Any] | BrokerError]:
        """Read the schemas of ``names`` and keep them; returns the errors of those that have none."""
        if not names:
            return {}
        errors: dict[str, dict[str, Any] | BrokerError] = {}
        for name, ref in zip(names, read_metas(self._client, names)):
            if isinstance(ref, DockRef):
                self._refs[name] = ref
            else:
                errors[name] = ref
        return errors

    def _gone(self, result: dict[str, Any] | BrokerError) -> bool:
        """A dock found by a scan and deleted since is left out; a named one is reported missing."""
        return isinstance(result, DockNotFoundError) and not self._fixed


def partitions_of(client: Client, names: Sequence[str]) -> list[str]:
    """``names`` with each partitioned dock's name replaced by its partitions' (its record, one round trip)."""
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.get(DockKeys(name).partitions)
    out: list[str] = []
    for name, raw in zip(names, pipe.execute()):
        try:
            parts = json.loads(raw)["partitions"] if raw is not None else None
        except (ValueError, TypeError, KeyError, RecursionError):
            parts = None  # not a record the broker wrote: the name stands for itself, and is reported so
        if isinstance(parts, list) and all(isinstance(p, str) and partition_of_name(p) == name for p in parts):
            out.extend(parts)
        else:
            out.append(name)
    return out


def folded(docks: list[tuple[str, dict[str, Any] | BrokerError]]) -> list[tuple[str, dict[str, Any] | BrokerError]]:
    """A survey's docks with the partitions of each partitioned dock (``NAME~pK``) summed into one entry, NAME, in
    the place of its first partition; a partition that could not be read makes the dock's entry its error."""
    out: list[tuple[str, dict[str, Any] | BrokerError]] = []
    parts: dict[str, list[dict[str, Any] | BrokerError]] = {}
    for name, result in docks:
        dock = partition_of_name(name)
        if dock is None:
            out.append((name, result))
            continue
        if dock not in parts:
            parts[dock] = []
            out.append((dock, {}))
        parts[dock].append(result)
    for i, (name, _) in enumerate(out):
        if name in parts:
            found = parts[name]
            error = next((r for r in found if isinstance(r, BrokerError)), None)
            if error is not None:
                out[i] = (name, error)
                continue
            out[i] = (name, joined(name, [r for r in found if not isinstance(r, BrokerError)]))
    return out


def joined(name: str, statuses: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The statuses of partitioned dock ``name``'s partitions as the dock's (``summed``), with what is not a
    count said once: its name, its partitions, ``n_samples_per_prompt`` (every partition's), and ``version``,
    the lowest of theirs (they differ only while ``set_version`` goes round them)."""
    total = summed(statuses)
    total.update(name=name, partitions=len(statuses), n_samples_per_prompt=statuses[0]["n_samples_per_prompt"],
                 version=min(s.get("version", 0) for s in statuses))
    return total


def summed(statuses: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Statuses of partitions as one: numbers added key by key through nested dicts (counts of rows, groups,
    consumers' rows); anything else as the first has it (``joined`` corrects what is not a count)."""
    def add(a: Any, b: Any) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            return {k: add(a[k], b[k]) if k in b else a[k] for k in a} | {k: v for k, v in b.items() if k not in a}
        if isinstance(a, (int, float)) and not isinstance(a, bool) and isinstance(b, (int, float)):
            return a + b
        return a
    out: dict[str, Any] = dict(statuses[0])
    for s in statuses[1:]:
        out = add(out, s)
    return out
