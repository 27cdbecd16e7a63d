"""A dock's keys at one moment, to a file and back: what a checkpoint holds of a dock (a run's checkpoint in
``workers/runtime/checkpoint.py``, and ``broker.transfer_queue``'s ``save_checkpoint``).

**Consistent.** A dock that keeps its bytes in its own slot (``shards=0``: every dock with partial rollout
or a staleness bound, every TransferQueue system, every dock on one server unless asked otherwise) has
every key in one slot. lua/snapshot.lua copies all of them (COPY, in the same slot) in one atomic step: the
copies are the dock at one moment, with no row half put, half cleared or half handed out, however many
writers and readers run. The saver then reads the copies in parts of bounded size (a DUMP per key, a hash
in HMGETs of about ``PART_BYTES``) while the dock goes on, and deletes them. The price is memory: the
server holds the dock twice while a snapshot is read out. Copies of a saver that dies expire within the
hour (``STAGING_TTL_MS``).

**Atomic in Redis.** ``restore`` writes the file's keys beside the dock (``DockKeys.staged``, expiring if
the loader dies), then lua/restore.lua deletes every key of the dock and renames the staged ones into
place in one step. A file that is corrupt, of another dock, or that the server cannot read changes nothing.

**Forward, never back.** The rows come back as saved, but not the epoch: the same step moves it past the
epoch the dock had and the saved one. Put back, it would let a delivery handed out before the restore
(before the save or after it) match the rows again, at once or once the next clears counted up to its
epoch, and land its late put on the next prompts' rows; so every such delivery's put, read and give-back
is refused (``FencedError`` for a put). The bytes stay where they are: only a dock with ``shards=0`` is
saved or restored into, whose bytes are named by row, not by epoch. The checkpoint's leases keep their
deadlines, under tokens no delivery holds: an ack from before the restore releases nothing, and the rows
come back when the lease runs out, to be redone.

**The file**: one msgpack map per key, or per part of a hash: the key, its type, when it expires (ms of
server time, -1 never), and its DUMP payload, or a hash's fields and values. DUMP payloads are Redis's RDB
encoding of one key, restored with RESTORE (a server older than the one that dumped them refuses them:
``CheckpointRestoreError``); nothing is ever pickled. Replies that calls keep for their resends
(``reply:*``, a minute) are not saved.

**Which keys.** The client names them: the dock's from its schema and its named takes' records, and those a
slice keeps beside the dock (a TransferQueue system's partitions, keys and tags) as the slice lists them
(``extra``: a ``SliceKeys``, with the indexes they were listed from); the scripts check that the indexes
still list what the client read, and it reads again on a mismatch. The core knows no slice's keys.

**Other processes** must not write while a restore runs (a put naming a plain list of rows, which nothing
fences, lands on the restored rows); the restored meta is the saved one grown by the columns and consumers the dock
has at restore time, so every process's dock finds its schema inside it and adopts it at its next call.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import msgpack

from broker.control.schema import Schema
from broker.control.scripts.snapshot import Copied, SliceKeys, SnapshotScripts
from broker.errors import (
    BrokerError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointRestoreError,
    DecodeError,
    RedisCommandError,
    SchemaError,
)

if TYPE_CHECKING:
    from broker.api.dock import TransferDock

log = logging.getLogger(__name__)

#: How long the snapshot's copies and a restore's staged keys live if their process dies (ms).
STAGING_TTL_MS = 3_600_000
#: About how many bytes one read or write of a snapshot's keys moves (a hash's HMGET, a pipeline of RESTOREs).
PART_BYTES = 8 << 20
#: A dock without a slice's keys beside it.
NO_SLICE_KEYS = SliceKeys([], [])

#: How often the snapshot or the swap reads the keys again when an index of them (the named takes', a
#: slice's) changed under it.
RETRIES = 64


class DockSnapshot:
    """Save a dock's keys to a file at one moment, and restore them from it (see the module docstring).

    ``extra``: the hook through which a slice keeping keys beside the dock (a TransferQueue system) names
    them, as they are now, and the indexes it listed them from (their keys are saved and restored too);
    ``quiet``: a context the copy and the swap run in, holding off writers whose several steps a copy must
    not cut (the TransferQueue system's puts and clears: ``System.quiet``).
    """

    def __new__(cls, dock: Any, **kwargs: Any) -> Any:
        """A dock's snapshot; a partitioned dock's is a ``PartitionedSnapshot`` (``partitioned_snapshot.py``)."""
        from broker.api.partitioned import PartitionedDock  # it builds on the dock, which this module need not load

        if isinstance(dock, PartitionedDock) and cls is DockSnapshot:
            if kwargs:
                raise CheckpointError(f"dock {dock.name!r} is partitioned: a slice's keys beside it (extra=, quiet=) "
                                      "are not saved with its partitions")
            from broker.api.partitioned_snapshot import PartitionedSnapshot  # it builds on this module

            return PartitionedSnapshot(dock)
        return super().__new__(cls)

    def __init__(self, dock: TransferDock, *, extra: Callable[[], SliceKeys] = lambda: NO_SLICE_KEYS,
                 quiet: Callable[[], AbstractContextManager[Any]] = nullcontext):
        self.dock = dock
        self.keys = dock.keys
        self.client = dock.client
        self.scripts = SnapshotScripts(dock.client, dock.keys, allow_oom=False)
        self._extra = extra
        self._quiet = quiet

    def run(self, what: str, call: Callable[[], Any]) -> Any:
        """``call`` through the dock's session: bounded, its errors the broker's (``what`` says what it does)."""
        return self.dock.session.run(call)

    # -- saving ------------------------------------------------------------------------------------------------

    def save(self, file: Path) -> dict[str, Any]:
        """Snapshot the dock and write its keys to ``file`` (flushed to disk); returns what a checkpoint keeps
        of them: ``schema`` (the meta hash), ``server_time_ms``, ``rdb_version``, ``keys`` and ``file`` (its
        size, records and SHA-256, for ``verify_file``)."""
        run = uuid.uuid4().hex
        with self._quiet():
            now, copied = self._snapshot(run)
        try:
            kept = [c for c in copied if c.type != "none" and c.key != self.keys.meta]
            meta_copy = next(c.copy for c in copied if c.key == self.keys.meta)
            meta = self.run("checkpoint meta", lambda: self.client.hgetall(meta_copy))
            with open(file, "wb") as out:
                writer = _Writer(out)
                for c in kept:
                    deadline = -1 if c.pttl < 0 else now + c.pttl
                    if c.type == "hash":
                        for fields in self._hash_parts(c):
                            writer.write({"k": c.key, "t": "hash", "at": deadline, "f": fields})
                    else:
                        payload = self.run("checkpoint dump", lambda: self.client.dump(c.copy))  # noqa: B023
                        if payload is None:
                            raise CheckpointError(f"the snapshot's copy {c.copy!r} vanished while it was read; "
                                                  f"save again (did it outlive {STAGING_TTL_MS // 1000} s?)")
                        writer.rdb = writer.rdb or rdb_version(payload)
                        writer.write({"k": c.key, "t": c.type, "at": deadline, "dump": payload})
                file_info = writer.close()
        finally:
            self._drop([c.copy for c in copied if c.type != "none"])
        return {"schema": {k.decode(): v.decode() for k, v in meta.items()}, "server_time_ms": now,
                "rdb_version": writer.rdb, "keys": len(kept), "file": file_info}

    def _snapshot(self, run: str) -> tuple[int, list[Copied]]:
        """Copy the dock's keys at one moment (lua/snapshot.lua), reading again what changed under it."""
        if self.dock.schema.shards:
            raise CheckpointError(f"dock {self.dock.name!r} keeps its bytes on data shards: a checkpoint needs them "
                                  "in the dock's slot (a dock made with shards=0)")
        for _ in range(RETRIES):
            extra, records = self._enumerate()
            try:
                got: tuple[int, list[Copied]] | None = self.run("checkpoint snapshot", lambda: self.scripts.snapshot(
                    run, extra, records, STAGING_TTL_MS))  # noqa: B023 (run at once)
            except SchemaError:
                self.dock.refresh()  # a column or consumer was added: its keys too
                continue
            if got is not None:
                return got
        raise CheckpointError(f"the keys of dock {self.dock.name!r} (its named takes, or a slice's beside "
                              f"it) changed under {RETRIES} snapshots in a row; save again")

    def _enumerate(self) -> tuple[SliceKeys, list[str]]:
        """What the scripts need to name every key: a slice's keys beside the dock and the named takes'
        records, with the scripts bound to the dock's schema as this process knows it."""
        self.scripts.bind(*self.dock.binding)
        extra = self._extra()
        records = self.run("named takes", lambda: self.client.zrange(self.keys.named_index, 0, -1))
        return extra, [r.decode() for r in records]

    def _hash_parts(self, c: Copied) -> Iterator[list[bytes]]:
        """A hash copy's fields and values, flat, in parts of about PART_BYTES (a part's size is guessed from
        the values read so far: a data hash's rows may be bytes or megabytes)."""
        fields = self.run("checkpoint fields", lambda: self.client.hkeys(c.copy))
        at, count, seen_fields, seen_bytes = 0, 1, 0, 0
        while at < len(fields):
            chunk = fields[at: at + count]
            values = self.run("checkpoint values", lambda: self.client.hmget(c.copy, chunk))  # noqa: B023
            if any(v is None for v in values):
                raise CheckpointError(f"the snapshot's copy {c.copy!r} changed while it was read; save again")
            yield [x for pair in zip(chunk, values) for x in pair]
            at += len(chunk)
            seen_fields += len(chunk)
            seen_bytes += sum(len(f) + len(v) for f, v in zip(chunk, values))
            count = int(min(65536, max(1, PART_BYTES * seen_fields // max(seen_bytes, 1))))

    # -- restoring ---------------------------------------------------------------------------------------------

    def restore(self, file: Path, info: Mapping[str, Any]) -> None:
        """Replace every key of the dock by those ``save`` wrote to ``file``, in one step; ``info`` is what the
        save returned (its ``schema``, ``rdb_version`` and ``file``, checked first). Raises
        CheckpointNotFoundError or CheckpointCorruptError for a file that is not what the save wrote,
        CheckpointRestoreError when the server refuses its keys, CheckpointError for a dock with data shards;
        either way the dock is left as it was."""
        verify_file(file, info["file"])
        if self.dock.schema.shards:
            # The swap would delete the keys of the dock's slot only: the bytes on its data shards, in hashes
            # named by an epoch the restore moves forward, would stay behind, read by nobody.
            raise CheckpointError(f"dock {self.dock.name!r} keeps its bytes on data shards: a checkpoint restores "
                                  "only into a dock that keeps them in its slot (a dock made with shards=0)")
        saved_meta = info["schema"]
        saved = saved_schema(saved_meta, where=str(file))
        run = uuid.uuid4().hex
        deadlines: dict[str, int] = {}
        try:
            self._stage(file, run, info.get("rdb_version"), deadlines)
            with self._quiet():
                self._swap(run, deadlines, saved_meta, saved)
        except BaseException:
            self._drop([self.keys.staged(run, k) for k in deadlines])
            raise
        self.dock.refresh()

    def _stage(self, file: Path, run: str, rdb: int | None, deadlines: dict[str, int]) -> None:
        """Write the file's keys beside the dock (``DockKeys.staged``), in pipelines of about PART_BYTES, each
        expiring in STAGING_TTL_MS; ``deadlines`` gets each key and when it expires once it may be staged (so
        that a failure deletes it)."""
        keys, size = self.keys, 0
        pending: list[tuple[Any, ...]] = []
        hashes: dict[str, int] = {}

        def flush() -> None:
            if not pending:
                return

            def send() -> list[Any]:
                pipe = self.client.pipeline(transaction=False)
                for command in pending:
                    pipe.execute_command(*command)
                return list(pipe.execute())

            try:
                self.run("checkpoint restore", send)
            except RedisCommandError as exc:
                if "payload version" in str(exc) or "checksum" in str(exc):
                    raise CheckpointRestoreError(
                        f"the server cannot restore the checkpoint's keys: they were dumped in RDB format {rdb} "
                        f"(a newer Redis than this server, which answered: {exc})") from exc
                raise
            pending.clear()

        with open(file, "rb") as f:
            unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False, max_buffer_size=2**31 - 1)
            whole = 0  # where the last whole record ends
            try:
                for record in unpacker:
                    whole = unpacker.tell()
                    key, kind, deadline = _record(record, keys.base, file)
                    staged = keys.staged(run, key)
                    deadlines[key] = deadline
                    if kind == "hash":
                        hashes[staged] = hashes.get(staged, 0) + len(record["f"]) // 2
                        pending += [("HSET", staged, *record["f"]), ("PEXPIRE", staged, STAGING_TTL_MS)]
                        size += sum(len(x) for x in record["f"])
                    else:
                        pending.append(("RESTORE", staged, STAGING_TTL_MS, record["dump"]))
                        size += len(record["dump"])
                    if size >= PART_BYTES:
                        flush()
                        size = 0
            except (msgpack.UnpackException, ValueError) as exc:
                raise CheckpointCorruptError(f"{file} is not what the save wrote: {exc}") from exc
            # The unpacker stops quietly at a record cut short: a file that ends in one lost its last keys,
            # which the swap would delete from the dock. Its tell() then counts the bytes of the cut record it
            # had begun to parse (a map's header and first fields), so the end of the last whole record is what
            # must be the file's end.
            if whole != os.fstat(f.fileno()).st_size:
                raise CheckpointCorruptError(f"{file} ends in the middle of a record, after byte {whole}: "
                                             "it is not what the save wrote")
        flush()
        for staged, count in hashes.items():
            got = self.run("checkpoint check", lambda: self.client.hlen(staged))  # noqa: B023
            if got != count:
                raise CheckpointCorruptError(f"{file} holds {count} fields of {staged!r} but {got} were staged: "
                                             "a field is there twice")

    def _swap(self, run: str, deadlines: Mapping[str, int], saved_meta: Mapping[str, str], saved: Schema) -> None:
        """Replace the dock's keys by the staged ones, in one step (lua/restore.lua); the meta written is the
        saved one grown by the columns and consumers the dock has now, so every process's schema is inside it,
        and the epoch moves forward past every delivery handed out before."""
        for _ in range(RETRIES):
            extra, records = self._enumerate()
            current = self.dock.schema
            grown = saved.grown(columns=[c for c in current.columns if c not in saved.columns],
                                consumers=[c for c in current.consumers if c not in saved.consumers])
            meta = {**{str(k): str(v) for k, v in saved_meta.items()}, **grown.to_meta()}
            try:
                epoch = self.run("checkpoint swap", lambda: self.scripts.restore(
                    run, extra, records, deadlines, meta, grown.consumers))  # noqa: B023 (run at once)
            except SchemaError:
                self.dock.refresh()
                continue
            except RedisCommandError as exc:
                raise CheckpointRestoreError(f"restoring the checkpoint's keys failed, the dock is unchanged: {exc}") \
                    from exc
            if epoch is not None:
                return
        raise CheckpointError(f"the keys of dock {self.dock.name!r} (its named takes, or a slice's beside "
                              f"it) changed under {RETRIES} restores in a row; stop the other processes and load again")

    def _drop(self, keys: list[str]) -> None:
        """Delete a snapshot's copies or a restore's staged keys; what is left expires anyway."""
        for at in range(0, len(keys), 512):
            part = keys[at: at + 512]
            try:
                self.run("checkpoint cleanup", lambda: self.client.unlink(*part))  # noqa: B023
            except BrokerError as exc:
                log.warning("could not delete %d checkpoint keys (they expire within %d s): %s", len(part),
                            STAGING_TTL_MS // 1000, exc)
                return


def saved_schema(meta: Mapping[str, Any], where: str) -> Schema:
    """The schema of a saved meta hash; CheckpointCorruptError naming ``where`` if it is not one."""
    try:
        return Schema.from_meta({str(k).encode(): str(v).encode() for k, v in dict(meta).items()},
                                where=f"{where} schema")
    except (DecodeError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(str(exc)) from exc


def _record(record: Any, base: str, file: Path) -> tuple[str, str, int]:
    """A record's key, type and deadline, checked."""
    if not isinstance(record, dict) or not isinstance(record.get("k"), str) or not isinstance(record.get("at"), int):
        raise CheckpointCorruptError(f"{file} holds a record that is not a key's: {str(record)[:80]}")
    key, kind = record["k"], record.get("t")
    if not key.startswith(base):
        raise CheckpointCorruptError(f"{file} holds key {key!r}, which is not one of the dock's ({base}*)")
    if kind == "hash":
        fields = record.get("f")
        if not isinstance(fields, list) or not fields or len(fields) % 2 or \
                not all(isinstance(x, bytes) for x in fields):
            raise CheckpointCorruptError(f"{file}: the fields of hash {key!r} are not pairs of bytes")
    elif not isinstance(record.get("dump"), bytes):
        raise CheckpointCorruptError(f"{file}: key {key!r} has no DUMP payload")
    return key, str(kind), int(record["at"])


def rdb_version(payload: bytes) -> int | None:
    """The RDB format of a DUMP payload: its last 10 bytes are the version (2, little-endian) and a CRC64."""
    return int.from_bytes(payload[-10:-8], "little") if len(payload) >= 10 else None


# -- files ---------------------------------------------------------------------------------------------------


class _Writer:
    """msgpack records to a file, hashed and counted as they go."""

    def __init__(self, out: IO[bytes]):
        self.out, self.sha, self.records, self.bytes = out, hashlib.sha256(), 0, 0
        self.rdb: int | None = None

    def write(self, record: dict[str, Any]) -> None:
        data = msgpack.packb(record, use_bin_type=True)
        self.out.write(data)
        self.sha.update(data)
        self.records += 1
        self.bytes += len(data)

    def close(self) -> dict[str, Any]:
        self.out.flush()
        os.fsync(self.out.fileno())
        return {"sha256": self.sha.hexdigest(), "bytes": self.bytes, "records": self.records}


def write_file(file: Path, data: bytes) -> dict[str, Any]:
    """``data`` into ``file``, flushed to disk; its size and SHA-256 (for ``verify_file``)."""
    with open(file, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def verify_file(file: Path, expected: Mapping[str, Any]) -> None:
    """The file is whole and unchanged: its size and SHA-256 are those ``expected`` gives (``write_file``'s or
    ``save``'s ``file``); CheckpointNotFoundError or CheckpointCorruptError if not."""
    if not file.is_file():
        raise CheckpointNotFoundError(f"{file.name} not found in {file.parent}")
    sha, size = hashlib.sha256(), 0
    with open(file, "rb") as f:
        while block := f.read(1 << 20):
            sha.update(block)
            size += len(block)
    if size != expected.get("bytes") or sha.hexdigest() != expected.get("sha256"):
        raise CheckpointCorruptError(f"{file} is not the file the save wrote: {size} bytes, SHA-256 "
                                     f"{sha.hexdigest()[:16]}..., expected {expected.get('bytes')} bytes, "
                                     f"{str(expected.get('sha256'))[:16]}...")


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (renames, new files) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
