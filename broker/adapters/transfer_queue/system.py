"""One TransferQueue system on Redis: its samples are rows of one dock, its partitions and keys the adapter's
own keys beside the dock's (``DockKeys.tq_*``, all in the dock's slot).

How TransferQueue's model maps onto the dock:

- a *global index* is a row of the dock ``tq.<namespace>`` (one sample per row, groups of one: TransferQueue's
  groups are runs of consecutive indexes that its samplers find, not the dock's fixed groups);
- a *field* is a column, added (``grow``) the first time a put carries it; its *production status* is the
  column's ready bitmap;
- a *task* is a consumer, added the first time ``get_meta`` names it; *consumption status* is its consumed
  bitmap; ``get_meta`` marks rows with the dock's ``take`` (exclusive: two callers never get one row);
- a *partition* is a bitmap of the rows it holds, a key -> row hash, tags per row, and its fields' schema;
- rows of cleared samples go to a free list and are given to new samples first (lua/tq_rows.lua).

Interleavings, and why each is safe:

- two puts of the same new key at once: tq_rows.lua gives the key one row, whichever runs first;
- a put of a key vs ``kv_clear`` of it: the clear empties the row in the dock (bumping its generation), then
  tq_release.lua frees it, and tq_rows.lua bumps it again when it gives the row to a new sample. The put's
  writes (its fields, then its tags, lua/tq_tags.lua) name the row as its key was looked up, epoch and
  generation (a delivery, lua/include/delivery.lua), so a put that looked the key up before the clear is
  refused whole (FencedError) instead of landing on the new sample; it looks its keys up again, and the
  cleared key gets a new row, as if the put came after the clear (``interface._put_by_keys``);
- two puts of tags of one key: each merges over the tags it read, and the write compares (lua/tq_tags.lua):
  the second to write reads and merges again, so neither loses the other's tags;
- ``kv_batch_get`` vs ``kv_clear`` (and the puts after it): the keys' rows come with their generations from
  one script (lua/tq_lookup.lua), and the read of their bytes is fenced by them (``read_rows(delivery=)``).
  A clear in between, after which the row may hold another key's bytes or none, fails the read, and the keys
  are looked up again: a get returns the keys' own bytes or raises, never another key's;
- ``get_meta`` vs ``get_meta``: the sampler runs on what each caller read; the take is a compare-and-set, and
  the loser reads again (``claim``);
- ``get_meta`` vs a clear: a row cleared after it was read is not ready any more, and the take refuses it
  (ExperienceTimeoutError inside ``claim``, which reads again);
- a reader that dies after ``get_meta``: without a lease its rows stay consumed (as in TransferQueue); with one
  (``lease=``) they are handed out again once it runs out, and ``ack`` ends it.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import msgpack
import numpy as np
import torch
from redis.client import Pipeline

from broker import ExperienceTimeoutError, TransferDock
from broker.adapters.transfer_queue.names import dock_name_of
from broker.api.delivery import HandedRows, fenced_handout
from broker.connection import MIN_VALUE_LIMIT, bounded, call_deadline, redact, script_error, value_limit
from broker.control.keys import check_name
from broker.control.scripts import Handout
from broker.control.scripts.runner import read_pipeline
from broker.control.scripts.transfer_queue import SampleRows, TransferQueueScripts
from broker.errors import (
    BrokerError,
    BrokerTimeoutError,
    CheckpointError,
    DockNotFoundError,
    ExperienceTooLargeError,
    InvalidExperienceError,
    SampleNotFoundError,
    SchemaError,
)

log = logging.getLogger(__name__)

#: The dock's first column and consumer: a dock needs one of each before any field or task exists.
PLACEHOLDER = "tq.sample"

#: A sampler's choice among the ready rows: ``(sampled, consumed)``.
Chooser = Callable[[list[int]], tuple[list[int], list[int]]]

#: How many times ``claim`` reads and chooses again after another caller took one of its rows first.
CLAIM_RETRIES = 64


def dock_name(namespace: str) -> str:
    return f"tq.{check_name('namespace', namespace)}"


class System:
    """The system's dock and the adapter's keys beside it, on one Redis (or Redis Cluster)."""

    def __init__(self, url: str, namespace: str, capacity: int, call_timeout: float):
        self.url, self.namespace = url, namespace
        self.dock = _open(url, dock_name(namespace), capacity, call_timeout)
        self.keys = self.dock.keys
        self.client = self.dock.client
        self.call_timeout = call_timeout
        self.scripts = TransferQueueScripts(self.client, self.keys, allow_oom=False)
        self._grow_lock = threading.Lock()

    def close(self) -> None:
        self.dock.close()

    # -- running -------------------------------------------------------------------------------------------

    def run(self, what: str, call: Callable[[], Any]) -> Any:
        """``call`` bounded by the call timeout, with Redis errors as broker errors naming ``what``."""
        import redis

        try:
            with bounded(f"{redact(self.url)} ({what})", self.call_timeout):
                return call()
        except redis.ResponseError as exc:
            known = script_error(exc)
            if known is not None:
                raise known from exc
            if "rows free" in str(exc):  # tq_rows.lua: the dock is full
                raise InvalidExperienceError(str(exc).removeprefix("ERR ")) from exc
            raise

    # -- writes of several steps, and checkpoints (lua/tq_begin.lua, lua/tq_settled.lua) ----------------------

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Announce a put or clear of several steps for its duration, so that no checkpoint copies or replaces
        the system's keys while it is half done; while a checkpoint is under way it waits (within the call
        timeout) before it begins. Registered for twice the call timeout: a writer that dies holds
        checkpoints off no longer than that."""
        write = uuid.uuid4().hex
        with call_deadline(self.call_timeout):
            self.wait_ready(time.monotonic() + self.call_timeout, lambda: bool(self.run(
                "begin a write", lambda: self.scripts.begin(write, self._writing_ms))), raising=True)
        try:
            yield
        finally:
            try:
                self.run("end a write", lambda: self.client.zrem(self.keys.tq_writing, write))
            except BrokerError as exc:  # the registration ends at its deadline anyway
                log.debug("could not unregister write %s: %s", write, exc)

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Hold new puts and clears off and wait until those under way ended (a checkpoint's copy or swap runs
        inside this). CheckpointError if writes are still under way after twice the call timeout."""
        checkpoint, hold = uuid.uuid4().hex, self._writing_ms + int(self.call_timeout * 1000)
        try:
            settled = self.wait_ready(time.monotonic() + 2 * self.call_timeout, lambda: not self.run(
                "wait for writes", lambda: self.scripts.settled(checkpoint, hold)))
            if not settled:
                raise CheckpointError(f"TransferQueue system {self.namespace!r}: puts or clears still under way "
                                      f"after {2 * self.call_timeout:g} s; try the checkpoint again")
            yield
        finally:
            try:
                self.run("end a checkpoint", lambda: self.client.zrem(self.keys.tq_saving, checkpoint))
            except BrokerError as exc:  # it expires by itself
                log.warning("could not unregister checkpoint %s (writes wait until it expires): %s", checkpoint, exc)

    @property
    def _writing_ms(self) -> int:
        return int(2 * self.call_timeout * 1000)

    # -- fields and tasks ------------------------------------------------------------------------------------

    def ensure_fields(self, fields: Sequence[str]) -> None:
        """Add the columns of ``fields`` the dock lacks (many writers may add the same ones at once)."""
        new = [c for c in dict.fromkeys(map(dock_name_of, fields)) if c not in self.dock.columns]
        if new:
            with self._grow_lock:
                self.dock.grow(columns=new)

    def ensure_task(self, task: str) -> None:
        consumer = dock_name_of(task)
        if consumer not in self.dock.consumers:
            with self._grow_lock:
                self.dock.grow(consumers=[consumer])

    def has_field(self, field: str) -> bool:
        """Whether the dock has the column of ``field`` (as this process last saw the dock)."""
        return dock_name_of(field) in self.dock.columns

    def in_put_order(self, fields: Sequence[str]) -> list[str]:
        """``fields`` (each of which the dock has) in the order their columns were added to the dock."""
        if not all(map(self.has_field, fields)):
            self.dock.refresh()
        at = {c: i for i, c in enumerate(self.dock.columns)}
        return sorted(fields, key=lambda f: at.get(dock_name_of(f), len(at)))

    def has_task(self, task: str) -> bool:
        """Whether the dock has the consumer of ``task`` (as this process last saw the dock)."""
        return dock_name_of(task) in self.dock.consumers

    def reclaim(self, task: str) -> None:
        """Offer ``task`` again the rows whose readers' lease ran out (nothing for a task the dock lacks)."""
        if self.has_task(task):
            self.dock.reclaim(dock_name_of(task))

    # -- rows ------------------------------------------------------------------------------------------------

    def rows_for_keys(self, partition: str, keys: Sequence[str]) -> SampleRows:
        """The rows of ``keys`` in ``partition``, new rows for new keys, with the fence of writes into them."""
        return self._rows("rows for keys", partition, keys=keys)

    def new_rows(self, partition: str, count: int) -> SampleRows:
        """Rows for ``count`` new samples of ``partition``, with the fence of writes into them."""
        if count <= 0:
            return SampleRows([], Handout((), 0, b""), [])
        return self._rows("new rows", partition, count=count)

    def _rows(self, what: str, partition: str, *, count: int = 0, keys: Sequence[str] = ()) -> SampleRows:
        with call_deadline(self.call_timeout):  # every try below, and the refreshes between them
            while True:
                schema, fingerprint = self.dock.binding  # together: another thread may adopt a growth
                try:
                    got: SampleRows = self.run(what, lambda: self.scripts.rows(
                        partition, schema, fingerprint, count=count, keys=keys))  # noqa: B023 (run at once)
                    return got
                except SchemaError:
                    # Another process added a field or a task (a normal event here: each new field or task
                    # name grows the dock): adopt it and try again, as long as it keeps growing. A dock
                    # recreated with another schema makes refresh raise.
                    self.dock.refresh()
                    if self.dock.fingerprint == fingerprint:
                        raise

    def rows_of_keys(self, partition: str, keys: Sequence[str]) -> list[int]:
        """The rows of existing ``keys``; SampleNotFoundError names those the partition lacks."""
        if not keys:
            return []
        got = self.run("rows of keys", lambda: self.client.hmget(self.keys.tq_keys(partition), list(keys)))
        missing = [k for k, r in zip(keys, got) if r is None]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise SampleNotFoundError(f"partition {partition!r} holds no key {missing[:5]!r}{more}")
        return [int(r) for r in got]

    def keys_of_rows(self, partition: str, rows: Sequence[int]) -> list[str | None]:
        if not rows:
            return []
        got = self.run("keys of rows", lambda: self.client.hmget(self.keys.tq_rkeys(partition), list(rows)))
        return [None if k is None else k.decode() for k in got]

    def partition_rows(self, partition: str) -> list[int]:
        """Every row of ``partition``, ascending."""
        raw = self.run("partition rows", lambda: self.client.get(self.keys.tq_rows(partition)))
        return [int(r) for r in np.flatnonzero(_bits(raw))]

    def release(self, partition: str, rows: Sequence[int] | None) -> list[int]:
        """End the samples on ``rows`` (None: the whole partition): clear them in the dock, then free them (two
        steps: announced, so no checkpoint copies the rows cleared but still listed)."""
        with self.writing():
            return self.release_announced(partition, rows)

    def release_announced(self, partition: str, rows: Sequence[int] | None) -> list[int]:
        """``release`` inside a write already announced (``writing``)."""
        whole = rows is None
        todo = self.partition_rows(partition) if rows is None else list(rows)
        if todo:  # an empty list would clear the whole dock
            self.dock.clear(todo)
        return list(self.run("release", lambda: self.scripts.release(partition, [] if whole else todo,
                                                                      whole=whole)))

    def give_back(self, partition: str, given: SampleRows) -> None:
        """After a put into ``given`` failed: end the samples it made for new keys, so none stays listed without
        its data, unless a clear took their rows since (they may be another sample's now). Best effort: the
        put's own error is what its caller sees, whatever this one meets. Called inside the put's announced
        write (``writing``)."""
        fresh = sorted({r for r, f in zip(given.rows, given.fresh) if f})
        if not fresh:
            return
        try:
            expected = fenced_handout(delivery_of(given), fresh)
            epoch, generations = self._generations(expected.runs)
            if epoch != expected.epoch:
                return
            same = [r for i, r in enumerate(fresh)
                    if generations[4 * i:4 * i + 4] == expected.generations[4 * i:4 * i + 4]]
            if same:
                self.release_announced(partition, same)
        except BrokerError as exc:
            log.warning("partition %r: could not give back the rows of a failed put: %s", partition, exc)

    def _generations(self, runs: Sequence[int]) -> tuple[int, bytes]:
        """The dock's epoch and the generations of the rows of ``runs`` now (4 bytes per row, in run order)."""
        def read() -> list[Any]:
            pipe = self.client.pipeline(transaction=True)
            pipe.get(self.keys.epoch)
            for start, length in zip(runs[::2], runs[1::2]):
                pipe.getrange(self.keys.generations, 4 * start, 4 * (start + length) - 1)
            return list(pipe.execute())

        epoch, *parts = self.run("generations", read)
        padded = [bytes(p or b"").ljust(4 * n, b"\0") for p, n in zip(parts, runs[1::2])]
        return int(epoch or 0), b"".join(padded)

    def partitions(self) -> list[str]:
        """The partitions, in the order they were made (as TransferQueue lists them)."""
        got = self.run("partitions", lambda: self.client.hgetall(self.keys.tq_partitions))
        # places are small numbers; a partition stamped in ms (before places were kept) comes after them
        return [p.decode() for p, _ in sorted(got.items(), key=lambda item: (int(item[1]), item[0]))]

    # -- tags and schemas -------------------------------------------------------------------------------------

    def set_tags(self, partition: str, rows: Sequence[int], tags: Sequence[Mapping[str, Any] | None],
                 merge: bool = True, delivery: HandedRows | None = None) -> None:
        """Store each row's tags (msgpack), merged over what it had when ``merge``; fenced by ``delivery`` (the
        rows as their keys were looked up) when given: FencedError, nothing written, once a clear took any.

        The merge is the client's, so the write compares (lua/tq_tags.lua): a put of the same key that wrote
        tags between this one's read and its write makes this one read and merge again, and neither loses
        the other's tags."""
        pairs: dict[int, dict[str, Any]] = {}
        for r, t in zip(rows, tags):
            if t is not None:
                pairs[int(r)] = {**pairs.get(int(r), {}), **dict(t)}  # a row twice in one call: both merged
        if not pairs:
            return
        fence = None if delivery is None else fenced_handout(delivery, sorted(pairs))
        order = sorted(pairs)
        with call_deadline(self.call_timeout):
            for _ in range(CLAIM_RETRIES):
                before = self._raw_tags(partition, order) if merge else [None] * len(order)
                after = [_pack({**(_unpack(old, "tags") if old else {}), **pairs[r]}, "tags")
                         for r, old in zip(order, before)]
                self._check_sizes(partition, order, after)
                if self.run("set tags", lambda: self.scripts.tags(  # noqa: B023 (run at once)
                        partition, order, before, after, fence, compare=merge)):  # noqa: B023
                    return
        raise BrokerError(f"partition {partition!r}: other puts kept changing the tags of rows {order[:8]} "
                          f"between this put's read and its write, {CLAIM_RETRIES} times in a row")

    def check_tags(self, partition: str, keys: Sequence[str], tags: Sequence[Mapping[str, Any] | None]) -> None:
        """Refuse tags that are not plain values, or whose msgpack is longer than the server takes in one value
        (ExperienceTooLargeError naming the key): a put checks them before it writes anything."""
        packed = [b"" if t is None else _pack(dict(t), "tags") for t in tags]
        self._check_sizes(partition, keys, packed)

    def _check_sizes(self, partition: str, names: Sequence[Any], packed: Sequence[bytes]) -> None:
        """ExperienceTooLargeError if a row's packed tags (``names``: its keys or rows) pass the server's limit on
        one value: the server would close the connection mid-send (and the client send it again)."""
        largest = max(range(len(packed)), key=lambda i: len(packed[i]), default=None)
        if largest is None or len(packed[largest]) <= MIN_VALUE_LIMIT:
            return  # fits on any server: no need to ask this one
        limit = self.run("server limits", lambda: value_limit(self.client))
        if len(packed[largest]) > limit.bytes:
            raise ExperienceTooLargeError(
                f"partition {partition!r}, {names[largest]!r}: tags of {len(packed[largest]):,} bytes (msgpack) are "
                f"over the server's {limit.setting} ({limit.bytes:,} bytes); nothing was written. Keep large "
                "values in fields, not tags")

    def _raw_tags(self, partition: str, rows: Sequence[int]) -> list[bytes | None]:
        got = self.run("tags", lambda: self.client.hmget(self.keys.tq_tags(partition), [str(r) for r in rows]))
        return list(got)

    def tags(self, partition: str, rows: Sequence[int]) -> list[dict[str, Any]]:
        if not rows:
            return []
        got = self.run("tags", lambda: self.client.hmget(self.keys.tq_tags(partition), [str(r) for r in rows]))
        return [{} if raw is None else _unpack(raw, "tags") for raw in got]

    def listing(self, partition: str) -> dict[str, dict[str, Any]]:
        """``{key: tags}`` of every key of ``partition``, in the order the keys were first given rows (as
        TransferQueue lists them: verl's replay buffers take batches in this order).

        The keys, their places and their tags are read in one transaction, so a key cleared meanwhile is
        either listed with its tags or not at all. A key without a place (written before places were kept)
        comes after those with one, by row."""
        def read() -> list[Any]:
            pipe = self.client.pipeline(transaction=True)
            pipe.hgetall(self.keys.tq_keys(partition))
            pipe.zrange(self.keys.tq_order(partition), 0, -1)
            pipe.hgetall(self.keys.tq_tags(partition))
            return list(pipe.execute())

        rows, order, tags = self.run("kv_list", read)
        place = {k: i for i, k in enumerate(order)}
        keys = sorted(rows, key=lambda k: (place.get(k, len(place)), int(rows[k])))
        return {k.decode(): _unpack(tags[rows[k]], "tags") if rows[k] in tags else {} for k in keys}

    def record_schema(self, partition: str, schema: Mapping[str, Mapping[str, Any]]) -> None:
        """Record each field's schema for ``partition`` (what reads rebuild the TensorDict from)."""
        if schema:
            mapping = {f: _pack(_schema_out(s), "field schema") for f, s in schema.items()}
            self.run("field schema", lambda: self.client.hset(self.keys.tq_fields(partition), mapping=mapping))  # type: ignore[arg-type]

    def field_schema(self, partition: str, fields: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
        key = self.keys.tq_fields(partition)
        if fields is None:
            got = self.run("field schema", lambda: self.client.hgetall(key))
            return {f.decode(): _schema_in(_unpack(v, "field schema")) for f, v in sorted(got.items())}
        if not fields:
            return {}
        values = self.run("field schema", lambda: self.client.hmget(key, list(fields)))
        return {f: _schema_in(_unpack(v, "field schema")) for f, v in zip(fields, values) if v is not None}

    def snapshot(self, partition: str, *, keys: Sequence[str] = (), tag_rows: Sequence[int] = ()) -> Snapshot:
        """The partition's field schemas and their ready bits, with the rows of ``keys`` and the tags of
        ``tag_rows`` if asked, in one transaction (one round trip): what a get checks before it reads, and
        what a put's KVBatchMeta reports after it wrote. The ready bits of every column of the dock are read,
        since which are the partition's is in the same reply."""
        for attempt in range(2):
            columns = [c for c in self.dock.columns if c != PLACEHOLDER]

            def build(pipe: Pipeline) -> None:
                pipe.hgetall(self.keys.tq_fields(partition))
                for column in columns:  # noqa: B023 (run at once)
                    pipe.get(self.keys.ready(column))
                if keys:  # the rows with the epoch and generations that fence their read (lua/tq_lookup.lua)
                    self.scripts.queue_lookup(pipe, partition, keys)
                if tag_rows:
                    pipe.hmget(self.keys.tq_tags(partition), [str(r) for r in tag_rows])

            raw = self.run("partition state", lambda: read_pipeline(  # noqa: B023 (run at once)
                self.client, self.scripts.load_all, build, transaction=True))
            schema = {f.decode(): _schema_in(_unpack(v, "field schema")) for f, v in sorted(raw[0].items())}
            if attempt == 0 and any(dock_name_of(f) not in columns for f in schema):
                self.dock.refresh()  # another process added a field since this one looked: read its bits too
                continue
            ready = {c: _bits(r) for c, r in zip(columns, raw[1 : 1 + len(columns)])}
            rest = raw[1 + len(columns):]
            found: list[int | None] | None = None
            fence: Handout | None = None
            if keys:
                found, fence = self.scripts.looked_up(rest.pop(0))
            tags = [{} if t is None else _unpack(t, "tags") for t in rest.pop(0)] if tag_rows else []
            return Snapshot(partition, schema, ready, list(keys), found, tags, fence)
        raise AssertionError("unreachable")

    # -- status ------------------------------------------------------------------------------------------------

    def status(self, partition: str, fields: Sequence[str], task: str | None) -> tuple[np.ndarray, ...]:
        """The partition's rows as bits, each field's ready bits, and the task's consumed bits, of one moment
        (one transaction): numpy bool arrays, as long as the longest."""
        if not all(map(self.has_field, fields)):
            self.dock.refresh()  # another process may have added the field since this one looked
        known = [dock_name_of(f) if self.has_field(f) else None for f in fields]  # None: never put, nothing ready
        keys = [self.keys.tq_rows(partition), *(self.keys.ready(c) for c in known if c is not None)]
        if task is not None:
            keys.append(self.keys.consumed(dock_name_of(task)))

        def read() -> list[bytes | None]:
            pipe = self.client.pipeline(transaction=True)
            for key in keys:
                pipe.get(key)
            return list(pipe.execute())

        raw = iter(self.run("status", read))
        members = _bits(next(raw))
        ready = [_bits(next(raw)) if c is not None else np.zeros(0, dtype=bool) for c in known]
        bits = [members, *ready, *(_bits(r) for r in raw)]
        width = max((len(b) for b in bits), default=0)
        return tuple(np.pad(b, (0, width - len(b))) for b in bits)

    def ready_unconsumed(self, partition: str, fields: Sequence[str], task: str) -> list[int]:
        """Rows of ``partition`` produced in every field and not consumed by ``task``, ascending."""
        members, *rest = self.status(partition, fields, task)
        ready = members.copy()
        for field_bits in rest[:-1]:
            ready &= field_bits
        ready &= ~rest[-1]
        return [int(r) for r in np.flatnonzero(ready)]

    def claim(
        self, partition: str, fields: Sequence[str], task: str, choose: Chooser, *, lease: float | None = None,
        name: Callable[[], str | None] = lambda: None, refused: Callable[[], None] = lambda: None,
    ) -> tuple[list[int], HandedRows | None]:
        """Read the rows ready for ``task``, let ``choose`` (a sampler) pick ``(sampled, consumed)``, and take
        ``consumed`` atomically; read and choose again if another caller took one first. Returns ``sampled``
        and the delivery of ``consumed`` (None when nothing was consumed). When ``name()``, asked after each
        choice, gives a name, the choice is shared under it (the ranks of one DP group): the first caller's
        is returned to every later one. ``refused`` runs
        before each new choice (a sampler forgets the choice it cached)."""
        self.ensure_task(task)
        for _ in range(CLAIM_RETRIES):
            self.reclaim(task)  # rows whose readers' lease ran out are ready for it again
            ready = self.ready_unconsumed(partition, fields, task)
            sampled, consumed = choose(ready)
            if not consumed:
                return list(sampled), None
            label = name()
            try:
                handed = self.dock.take(dock_name_of(task), consumed, [dock_name_of(f) for f in fields], lease=lease,
                                        exclusive=True, name=label)
            except ExperienceTimeoutError:
                refused()  # a clear took a row after it was read
                continue
            if handed is None:
                refused()  # another caller took one of the rows first
                continue
            if label is not None and list(handed) != list(consumed):
                return list(handed), handed  # an earlier rank's choice under this name
            return list(sampled), handed
        raise InvalidExperienceError(
            f"partition {partition!r}, task {task!r}: other callers took the rows this one chose "
            f"{CLAIM_RETRIES} times in a row; is a sampler returning rows it was not offered?")

    def created(self, partition: str) -> str:
        """Which creation of ``partition`` this is (its place in creation order, as tq_rows.lua stamps it: new
        each time the partition is made again after a clear_partition); "0" if it does not exist."""
        raw = self.run("partition", lambda: self.client.hget(self.keys.tq_partitions, partition))
        return "0" if raw is None else raw.decode()

    def recorded(self, label: str) -> list[int] | None:
        """The rows the named take ``label`` handed out (lua/take.lua's record), in its caller's order; None
        if no take under that name happened (or its record expired)."""
        raw = self.run("named take", lambda: self.client.get(self.keys.named(label)))
        if raw is None:
            return None
        _, _, order = raw.decode().partition("|")
        return [int(r) for r in order.split(",") if r]

    def produced_each(self, partition: str, rows: Sequence[int], fields: Sequence[str]) -> list[np.ndarray]:
        """Per field, per row: whether it is produced (bool arrays)."""
        _, *ready = self.status(partition, fields, None)
        index = np.asarray(rows, dtype=np.int64)
        out = []
        for bits in ready:
            has = np.zeros(len(index), dtype=bool)
            inside = index < len(bits)
            has[inside] = bits[index[inside]]
            out.append(has)
        return out

    def common_fields(self, partition: str, rows: Sequence[int]) -> list[str]:
        """The partition's fields produced for every one of ``rows`` (none for no rows)."""
        if not rows:
            return []
        fields = list(self.field_schema(partition))
        return [f for f, ok in zip(fields, self.produced_each(partition, rows, fields)) if ok.all()]

    def produced(self, partition: str, rows: Sequence[int], fields: Sequence[str]) -> np.ndarray:
        """Per row, 1 if every one of ``fields`` is produced (TransferQueue's production status), as int8."""
        out = np.ones(len(rows), dtype=bool)
        for has in self.produced_each(partition, rows, fields) if rows else []:
            out &= has
        return out.astype(np.int8)

    def wait_ready(self, deadline: float, check: Callable[[], bool], *, raising: bool = False) -> bool:
        """Call ``check`` until it is true or ``deadline`` (monotonic) passes, sleeping a little between; with
        ``raising``, BrokerTimeoutError instead of False."""
        pause = 0.005
        while True:
            if check():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                if raising:
                    raise BrokerTimeoutError(f"TransferQueue system {self.namespace!r}: a checkpoint held this put "
                                             "or clear off past the call timeout")
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.1)

    def delete(self) -> None:
        """Remove the system from Redis: the dock and every key of the adapter."""
        pattern = self.keys.base + "tq:*"

        def drop() -> None:
            for key in list(self.client.scan_iter(match=pattern, count=1000)):
                self.client.delete(key)

        self.run("delete", drop)
        self.dock.delete()


class Snapshot:
    """A partition's state read in one transaction (``System.snapshot``): its fields' schemas, their ready
    bits, and the rows of the keys (with the delivery that fences their read) and the tags (of ``tag_rows``;
    none if not asked) asked for."""

    def __init__(self, partition: str, schema: dict[str, dict[str, Any]], ready: dict[str, np.ndarray],
                 keys: list[str], found: list[int | None] | None, tags: list[dict[str, Any]],
                 fence: Handout | None = None):
        self.partition, self.schema, self.tags = partition, schema, tags
        self._ready, self._keys, self._found = ready, keys, found
        #: The rows of the keys asked for as a delivery of that moment: a read naming it fails once a clear
        #: took any of them (their bytes may be another key's by then). None when no keys were asked for.
        self.delivery = None if fence is None or found is None else HandedRows(
            [r for r in found if r is not None], fence.epoch, fence.runs, fence.generations)

    def found_rows(self) -> list[int | None]:
        """The rows of the keys asked for, in their order, None for a key the partition lacks."""
        return list(self._found or [])

    def rows_of_keys(self) -> list[int]:
        """The rows of the keys asked for; SampleNotFoundError names those the partition lacks (as
        ``System.rows_of_keys``)."""
        found = self._found or []
        missing = [k for k, r in zip(self._keys, found) if r is None]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise SampleNotFoundError(f"partition {self.partition!r} holds no key {missing[:5]!r}{more}")
        return [r for r in found if r is not None]

    def produced_each(self, rows: Sequence[int], fields: Sequence[str]) -> list[np.ndarray]:
        """Per field, per row: whether it is produced (as ``System.produced_each``)."""
        index = np.asarray(rows, dtype=np.int64)
        out = []
        for field in fields:
            bits = self._ready.get(dock_name_of(field), np.zeros(0, dtype=bool))
            has = np.zeros(len(index), dtype=bool)
            inside = index < len(bits)
            has[inside] = bits[index[inside]]
            out.append(has)
        return out

    def common_fields(self, rows: Sequence[int]) -> list[str]:
        """The partition's fields produced for every one of ``rows`` (as ``System.common_fields``)."""
        if not rows:
            return []
        fields = list(self.schema)
        return [f for f, ok in zip(fields, self.produced_each(rows, fields)) if ok.all()]


def delivery_of(given: SampleRows) -> HandedRows:
    """Rows tq_rows.lua gave, as the delivery that fences a write into them (``put_experience(delivery=)``):
    refused once a clear took any of them (their key ended, and the row may be another sample's)."""
    h = given.handout
    return HandedRows(given.rows, h.epoch, h.runs, h.generations)


def _open(url: str, name: str, capacity: int, call_timeout: float) -> TransferDock:
    """The system's dock: attached as it is (grown by fields and tasks), or made with one placeholder column
    and consumer. Two processes making it at once both succeed (same schema); one that finds it grown already
    attaches. ``shards=0``: every byte in the dock's slot, so a checkpoint reads the whole system in one step."""
    for _ in range(3):
        try:
            return TransferDock.attach(url, name, call_timeout=call_timeout)
        except DockNotFoundError:
            pass
        try:
            return TransferDock(url, name, prompts_num=capacity, n_samples_per_prompt=1, columns=[PLACEHOLDER],
                                consumers=[PLACEHOLDER], call_timeout=call_timeout, shards=0)
        except SchemaError:
            continue  # grown between our attach and our create: attach again
    raise SchemaError(f"dock {name!r} could neither be attached nor made; is it a TransferQueue system's dock?")


def _bits(raw: bytes | None) -> np.ndarray:
    """A Redis bitmap as a bool array (bit 0 is the most significant bit of byte 0, as SETBIT numbers them)."""
    if not raw:
        return np.zeros(0, dtype=bool)
    return np.unpackbits(np.frombuffer(raw, dtype=np.uint8)).astype(bool)


def _schema_out(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A field's schema as plain values: the dtype by name, the shape a list. Shapes of single rows
    (``per_sample_shapes``) belong to one put, not to the partition's field: they are not kept."""
    out = {k: v for k, v in schema.items() if k != "per_sample_shapes"}
    dtype = out.get("dtype")
    if dtype is not None:
        out["dtype"] = str(dtype)
    if out.get("shape") is not None:
        out["shape"] = [int(d) for d in out["shape"]]
    return out


def _schema_in(stored: Any) -> dict[str, Any]:
    """The inverse of ``_schema_out``: torch dtypes and sizes again."""
    if not isinstance(stored, dict):
        raise SchemaError(f"stored field schema is not a map: {stored!r:.80}")
    out = dict(stored)
    dtype = out.get("dtype")
    if isinstance(dtype, str):
        found = getattr(torch, dtype.removeprefix("torch."), None)
        out["dtype"] = found if isinstance(found, torch.dtype) else dtype
    if isinstance(out.get("shape"), list):
        out["shape"] = torch.Size(out["shape"])
    return out


def _pack(value: Any, what: str) -> bytes:
    try:
        packed: bytes = msgpack.packb(value, use_bin_type=True)
        return packed
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidExperienceError(
            f"{what} must hold plain values (str, int, float, bool, None, bytes, lists and dicts of them): {exc}; "
            "the broker never pickles what it stores") from exc


def _unpack(raw: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise SchemaError(f"stored {what} is not msgpack: {exc}") from exc
