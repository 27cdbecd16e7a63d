"""One TransferQueue system on Redis: its samples are rows of one dock, its partitions and keys the slice's
own keys beside the dock's (``SystemKeys``, keys.py, all in the dock's slot).

Over 400 lines: ``System`` is one class (a system's rows, writes, checkpoints and claims, each method a few
lines against the session); its tags and schemas (partition_data.py), partition state (partition_state.py)
and stored values (values.py) are apart.

Every call to Redis goes through the dock's session (``DockSession``, broker/api/session.py): ``read`` runs
one bounded, its errors the broker's, a grown schema adopted; ``write`` does that and then waits for the
replicas, as the dock's own writes do. There is no other path to Redis.

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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from broker import ExperienceTimeoutError, TransferDock
from broker.api.delivery import HandedRows, fenced_handout
from broker.connection import call_deadline
from broker.control.keys import check_name
from broker.control.scripts import Handout
from broker.control.scripts.snapshot import Index, SliceKeys
from broker.errors import (
    BrokerError,
    BrokerTimeoutError,
    CheckpointError,
    DockNotFoundError,
    InvalidExperienceError,
    SampleNotFoundError,
    SchemaError,
)
from broker.transfer_queue.keys import SystemKeys
from broker.transfer_queue.names import dock_name_of
from broker.transfer_queue.partition_data import CLAIM_RETRIES, PLACEHOLDER, PartitionData
from broker.transfer_queue.scripts import SampleRows, TransferQueueScripts
from broker.transfer_queue.values import bitmap_bits

log = logging.getLogger(__name__)


#: A sampler's choice among the ready rows: ``(sampled, consumed)``.
Chooser = Callable[[list[int]], tuple[list[int], list[int]]]



def dock_name(namespace: str) -> str:
    return f"tq.{check_name('namespace', namespace)}"


class System(PartitionData):
    """The system's dock and the adapter's keys beside it, on one Redis (or Redis Cluster)."""

    def __init__(self, url: str, namespace: str, capacity: int, call_timeout: float, *, dock: str | None = None,
                 place: Callable[[], int] | None = None):
        self.url, self.namespace = url, namespace
        #: A sub-system of a system cut in several (systems.py): where the place in creation order of a partition
        #: the next call may make comes from (the system's own counter); None: this dock's counter.
        self._place = place
        #: Partitions this process saw made (a sub-system of a system cut in several): its calls giving rows in
        #: them take no place of the system's counter unless another process cleared them since (``_rows``).
        self._known: set[str] = set()
        self.dock = _open(url, dock or dock_name(namespace), capacity, call_timeout)
        #: The dock's session (``TransferDock.session``): the one door to Redis of the dock's parts, and of
        #: this system (``read``, ``write``).
        self.session = self.dock.session
        self.keys = SystemKeys(self.dock.name)
        self.client = self.dock.client
        self.call_timeout = call_timeout
        self.scripts = TransferQueueScripts(self.client, self.keys, allow_oom=False)
        self._grow_lock = threading.Lock()

    def close(self) -> None:
        self.dock.close()

    # -- running -------------------------------------------------------------------------------------------

    def read(self, call: Callable[[], Any]) -> Any:  # Any: redis-py's replies are typed loosely
        """``call``, which only reads, through the dock's session: bounded by the call timeout, its Redis
        errors the broker's."""
        return self.session.run(call)

    def write(self, what: str, call: Callable[[], Any]) -> Any:
        """``call``, which writes, through the dock's session: as ``read``, then the wait for the replicas of
        the dock's slot (where every key of the system is) if the dock has ``wait_replicas``; ``what`` names
        the call in a ReplicationError."""
        return self.session.write(f"TransferQueue: {what}", call)

    # -- writes of several steps, and checkpoints (lua/tq_begin.lua, lua/tq_settled.lua) ----------------------

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Announce a put or clear of several steps for its duration, so that no checkpoint copies or replaces
        the system's keys while it is half done; while a checkpoint is under way it waits (within the call
        timeout) before it begins. Registered for twice the call timeout: a writer that dies holds
        checkpoints off no longer than that."""
        write = uuid.uuid4().hex
        with call_deadline(self.call_timeout):
            self.wait_ready(time.monotonic() + self.call_timeout, lambda: bool(self.write(
                "begin a write", lambda: self.scripts.begin(write, self._writing_ms))), raising=True)
        try:
            yield
        finally:
            try:
                self.write("end a write", lambda: self.client.zrem(self.keys.tq_writing, write))
            except BrokerError as exc:  # the registration ends at its deadline anyway
                log.debug("could not unregister write %s: %s", write, exc)

    @contextmanager
    def quiet(self) -> Iterator[None]:
        """Hold new puts and clears off and wait until those under way ended (a checkpoint's copy or swap runs
        inside this). CheckpointError if writes are still under way after twice the call timeout."""
        checkpoint, hold = uuid.uuid4().hex, self._writing_ms + int(self.call_timeout * 1000)
        try:
            settled = self.wait_ready(time.monotonic() + 2 * self.call_timeout, lambda: not self.write(
                "wait for writes", lambda: self.scripts.settled(checkpoint, hold)))
            if not settled:
                raise CheckpointError(f"TransferQueue system {self.namespace!r}: puts or clears still under way "
                                      f"after {2 * self.call_timeout:g} s; try the checkpoint again")
            yield
        finally:
            try:
                self.write("end a checkpoint", lambda: self.client.zrem(self.keys.tq_saving, checkpoint))
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
        # The schema and its fingerprint are read together as the script goes out: when another process added
        # a field or a task (a normal event here: each new field or task name grows the dock), the session
        # adopts the grown schema and runs the call again, as long as it keeps growing; a dock recreated with
        # another schema stays a SchemaError.
        if self._place is None:
            given: SampleRows | None = self.write(what, lambda: self.scripts.rows(
                partition, *self.dock.binding, count=count, keys=keys))
            assert given is not None  # only a place "-" answers None
            return given
        # A system cut in several: a place of the system's counter (systems.py's "Order"), taken before the call
        # that may make the partition; "-" for a partition this process saw made, unless it is gone since.
        for place in ("-", None) if partition in self._known else (None,):
            taken = place if place is not None else self._place()
            got: SampleRows | None = self.write(what, lambda: self.scripts.rows(  # noqa: B023 (run at once)
                partition, *self.dock.binding, count=count, keys=keys, place=taken))  # noqa: B023
            if got is not None:
                self._known.add(partition)
                return got
        raise AssertionError("unreachable: a call with a place always gives rows")

    def rows_of_keys(self, partition: str, keys: Sequence[str]) -> list[int]:
        """The rows of existing ``keys``; SampleNotFoundError names those the partition lacks."""
        if not keys:
            return []
        got = self.read(lambda: self.client.hmget(self.keys.tq_keys(partition), list(keys)))
        missing = [k for k, r in zip(keys, got) if r is None]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise SampleNotFoundError(f"partition {partition!r} holds no key {missing[:5]!r}{more}")
        return [int(r) for r in got]

    def keys_of_rows(self, partition: str, rows: Sequence[int]) -> list[str | None]:
        if not rows:
            return []
        got = self.read(lambda: self.client.hmget(self.keys.tq_rkeys(partition), list(rows)))
        return [None if k is None else k.decode() for k in got]

    def partition_rows(self, partition: str) -> list[int]:
        """Every row of ``partition``, ascending."""
        raw = self.read(lambda: self.client.get(self.keys.tq_rows(partition)))
        return [int(r) for r in np.flatnonzero(bitmap_bits(raw))]

    def release(self, partition: str, rows: Sequence[int] | None) -> list[int]:
        """End the samples on ``rows`` (None: the whole partition): clear them in the dock, then free them (two
        steps: announced, so no checkpoint copies the rows cleared but still listed)."""
        with self.writing():
            return self.release_announced(partition, rows)

    def release_announced(self, partition: str, rows: Sequence[int] | None) -> list[int]:
        """``release`` inside a write already announced (``writing``)."""
        whole = rows is None
        if whole:
            self._known.discard(partition)  # made again, it takes a new place
        todo = self.partition_rows(partition) if rows is None else list(rows)
        if todo:  # an empty list would clear the whole dock
            self.dock.clear(todo)
        return list(self.write("release", lambda: self.scripts.release(partition, [] if whole else todo,
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

        epoch, *parts = self.read(read)
        padded = [bytes(p or b"").ljust(4 * n, b"\0") for p, n in zip(parts, runs[1::2])]
        return int(epoch or 0), b"".join(padded)

    def partitions(self) -> list[str]:
        """The partitions, in the order they were made (as TransferQueue lists them)."""
        # places are small numbers; a partition stamped in ms (before places were kept) comes after them
        return [p for p, _ in sorted(self.partition_places().items(), key=lambda item: (item[1], item[0]))]

    def partition_places(self) -> dict[str, int]:
        """Each partition's place in creation order (of this dock's counter, or of the system's when it is cut
        in several: systems.py)."""
        got = self.read(lambda: self.client.hgetall(self.keys.tq_partitions))
        return {p.decode(): int(place) for p, place in got.items()}

    def checkpoint_keys(self) -> SliceKeys:
        """The slice's keys of every partition now, and the index they were listed from (the partitions hash):
        what a checkpoint of the dock takes beside the dock's own (``DockSnapshot``'s ``extra``)."""
        partitions = self.partitions()
        return SliceKeys(self.keys.tq_system(partitions), [Index(self.keys.tq_partitions, tuple(partitions))])

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

        raw = iter(self.read(read))
        members = bitmap_bits(next(raw))
        ready = [bitmap_bits(next(raw)) if c is not None else np.zeros(0, dtype=bool) for c in known]
        bits = [members, *ready, *(bitmap_bits(r) for r in raw)]
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
        raw = self.read(lambda: self.client.hget(self.keys.tq_partitions, partition))
        return "0" if raw is None else raw.decode()

    def recorded(self, label: str) -> list[int] | None:
        """The rows the named take ``label`` handed out (lua/take.lua's record), in its caller's order; None
        if no take under that name happened (or its record expired)."""
        raw = self.read(lambda: self.client.get(self.keys.named(label)))
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

        self.write("delete", drop)
        self.dock.delete()


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
