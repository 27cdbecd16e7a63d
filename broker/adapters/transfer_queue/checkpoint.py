"""``save_checkpoint`` / ``load_checkpoint``: a whole TransferQueue system (its dock and the adapter's keys) to
a directory and back, as TransferQueue's functions of those names, but consistent, atomic and without pickle.

**Consistent.** The system's dock keeps its bytes in its own slot (``shards=0``), so every key of the system
(``td:{tq.<namespace>}:*``) is on one server, in one slot. lua/tq_snapshot.lua copies all of them (COPY, in
the same slot) in one atomic step: the copies are the system at one moment, with no row half put, half
cleared or half handed out, however many writers and readers run. The saver then reads the copies in parts
of bounded size (a DUMP per key, a hash in HMGETs of about 8 MiB) while the system goes on, and deletes them.
The price is memory: the server holds the system twice while a checkpoint is read out. Copies of a saver
that dies expire within the hour (``STAGING_TTL_MS``).

**Atomic on disk.** Everything is written into ``<dir>.tmp`` and fsynced; then ``<dir>`` is renamed to
``<dir>.old``, ``<dir>.tmp`` to ``<dir>``, and ``<dir>.old`` removed, as TransferQueue does. A crash at any
point leaves a whole checkpoint: the previous one (``<dir>``, or ``<dir>.old``, which the next save or load
renames back) or the new one. A ``<dir>.tmp`` left by a crash is never read, and the next save replaces it.

**Atomic in Redis.** ``load_checkpoint`` writes the checkpoint's keys beside the system (``DockKeys.staged``,
expiring if the loader dies), then lua/tq_restore.lua deletes every key of the system and renames the staged
ones into place in one step. A checkpoint that is corrupt, of another system, or that the server cannot read
changes nothing.

**The files** (``FORMAT``, ``VERSION``): ``metadata.json`` (written last: the format and its version, the
namespace, the dock's schema (its meta hash), the conf, the server time of the snapshot, each file's size
and SHA-256, and the user's ``metadata`` under ``user_metadata``, where TransferQueue keeps it);
``redis_keys.msgpack`` (one msgpack map per key or per part of a hash: the key, its type, when it expires,
and its DUMP payload, or a hash's fields and values); ``sampler.msgpack`` (this process's sampler's
``save_checkpoint()``, msgpack with tuples kept as tuples). DUMP payloads are Redis's RDB encoding of one
key, restored with RESTORE; nothing is ever pickled, and a TransferQueue checkpoint (a pickle) is refused.

**Resuming.** Every key comes back as it was: rows consumed at checkpoint time stay consumed, the rows'
leases keep their deadlines (ms of server time), so rows leased then come back once those pass; named
takes (the DP ranks' shared choices) keep their records and expiry. Replies that calls keep for their
resends (``reply:*``, a minute) are not saved, and those of the system are left to expire.

**Other processes.** The restored dock's schema is the checkpoint's grown by the fields and tasks the
system has at load time, so every process's dock finds its own schema inside it and adopts it at its next
call. What they must do themselves: not write while a load runs (a put that looked its rows up before the
swap lands on the restored rows), and forget their samplers' cached choices (``sampler._states = {}``,
or ``close()`` then ``init()``): the DP groups' shared choices come back through the named takes' records.
Only the loading process's sampler gets the checkpoint's ``_states``, as TransferQueue's one controller does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import msgpack
import numpy as np

from broker.adapters.transfer_queue.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointRestoreError,
)
from broker.adapters.transfer_queue.sampler import BaseSampler
from broker.adapters.transfer_queue.system import System
from broker.control.schema import Schema
from broker.control.scripts.transfer_queue import Copied
from broker.errors import BrokerError, DecodeError, RedisCommandError, SchemaError

log = logging.getLogger(__name__)

FORMAT = "broker.transfer_queue checkpoint"
#: Version of the files' layout; a checkpoint of a later version is refused.
VERSION = 1

METADATA_FILE = "metadata.json"
KEYS_FILE = "redis_keys.msgpack"
SAMPLER_FILE = "sampler.msgpack"

#: How long the snapshot's copies and a load's staged keys live if their process dies (ms).
STAGING_TTL_MS = 3_600_000
#: About how many bytes one read or write of a checkpoint's keys moves (a hash's HMGET, a pipeline of RESTOREs).
PART_BYTES = 8 << 20
#: How often the snapshot or the swap reads the system's keys again when partitions or named takes changed.
RETRIES = 64

#: msgpack extension type of a tuple inside a sampler's state (JSON and plain msgpack make lists of them).
_TUPLE = 1


# -- saving ----------------------------------------------------------------------------------------------------


def save_checkpoint(checkpoint_dir: str | os.PathLike[str], *, include_storage: bool = True,
                    metadata: Mapping[str, Any] | None = None) -> None:
    """Save the whole system (data, status, partitions, keys, tags, this process's sampler) to
    ``checkpoint_dir``, consistent and atomically (see the module docstring).

    ``metadata``: JSON values kept with it (``metadata.json``'s ``user_metadata``), such as each process's
    progress. ``include_storage=False`` is ignored, as TransferQueue ignores it for its SimpleStorage: the
    data lives beside the status, and a checkpoint without it would lose rows.
    """
    from broker.adapters.transfer_queue.interface import get_client

    client = get_client()
    system = client.system
    if not include_storage:
        log.warning("include_storage=False has no effect: the data is part of the system's state and is "
                    "always saved (a checkpoint without it would lose rows)")
    user = _user_metadata(metadata)
    sampler = _sampler_of(client)
    sampler_bytes = _pack_sampler(sampler)  # before anything is written: an unpackable state fails first
    path = Path(checkpoint_dir)
    tmp, old = _siblings(path)
    _recover(path, old)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        info = _save_keys(system, tmp / KEYS_FILE)
        files = {KEYS_FILE: info.pop("file"), SAMPLER_FILE: _write_file(tmp / SAMPLER_FILE, sampler_bytes)}
        document = {"format": FORMAT, "version": VERSION, "namespace": system.namespace, "dock": system.dock.name,
                    **info, "storage_saved": True, "sampler": type(sampler).__name__, "files": files,
                    "saved_at": time.time(), "user_metadata": user}
        _write_file(tmp / METADATA_FILE, json.dumps(document, indent=1).encode())
        _fsync_dir(tmp)
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            path.rename(old)
        tmp.rename(path)
        _fsync_dir(path.parent)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _recover(path, old)
        raise
    log.info("TransferQueue system %r saved to %s", system.namespace, path)


def _save_keys(system: System, file: Path) -> dict[str, Any]:
    """Snapshot the system and write its keys to ``file``; what metadata.json says of them."""
    run = uuid.uuid4().hex
    now, copied = _snapshot(system, run)
    try:
        kept = [c for c in copied if c.type != "none" and c.key != system.keys.meta]
        meta = system.run("checkpoint meta", lambda: system.client.hgetall(_copy_of(copied, system.keys.meta)))
        conf = system.run("checkpoint conf", lambda: system.client.get(_copy_of(copied, system.keys.tq_conf)))
        with open(file, "wb") as out:
            writer = _Writer(out)
            for c in kept:
                deadline = -1 if c.pttl < 0 else now + c.pttl
                if c.type == "hash":
                    for fields in _hash_parts(system, c):
                        writer.write({"k": c.key, "t": "hash", "at": deadline, "f": fields})
                else:
                    payload = system.run("checkpoint dump", lambda: system.client.dump(c.copy))  # noqa: B023
                    if payload is None:
                        raise CheckpointError(f"the snapshot's copy {c.copy!r} vanished while it was read; "
                                              f"save again (did it outlive {STAGING_TTL_MS // 1000} s?)")
                    writer.rdb = writer.rdb or _rdb_version(payload)
                    writer.write({"k": c.key, "t": c.type, "at": deadline, "dump": payload})
            file_info = writer.close()
    finally:
        _drop(system, [c.copy for c in copied if c.type != "none"])
    return {"schema": {k.decode(): v.decode() for k, v in meta.items()},
            "conf": json.loads(conf) if conf else None, "server_time_ms": now, "rdb_version": writer.rdb,
            "keys": len(kept), "file": file_info}


def _snapshot(system: System, run: str) -> tuple[int, list[Copied]]:
    """Copy the system's keys at one moment (lua/tq_snapshot.lua), reading again what changed under it."""
    if system.dock.schema.shards:
        raise CheckpointError(f"dock {system.dock.name!r} keeps its bytes on data shards: a checkpoint needs them "
                              "in the dock's slot (TransferQueue systems are made with shards=0)")
    for _ in range(RETRIES):
        partitions, records = _enumerate(system)
        try:
            got: tuple[int, list[Copied]] | None = system.run("checkpoint snapshot", lambda: system.scripts.snapshot(
                run, partitions, records, STAGING_TTL_MS))  # noqa: B023 (run at once)
        except SchemaError:
            system.dock.refresh()  # a field or task was added: its keys too
            continue
        if got is not None:
            return got
    raise CheckpointError(f"the partitions or named takes of system {system.namespace!r} changed under "
                          f"{RETRIES} snapshots in a row; save again")


def _enumerate(system: System) -> tuple[list[str], list[str]]:
    """What the scripts need to name every key: the partitions and the named takes' records, with the
    scripts bound to the dock's schema as this process knows it."""
    system.scripts.bind(system.dock.schema, system.dock.fingerprint)
    partitions = system.partitions()
    records = system.run("named takes", lambda: system.client.zrange(system.keys.named_index, 0, -1))
    return partitions, [r.decode() for r in records]


def _hash_parts(system: System, c: Copied) -> Iterator[list[bytes]]:
    """A hash copy's fields and values, flat, in parts of about PART_BYTES (a part's size is guessed from
    the values read so far: a data hash's rows may be bytes or megabytes)."""
    fields = system.run("checkpoint fields", lambda: system.client.hkeys(c.copy))
    at, count, seen_fields, seen_bytes = 0, 1, 0, 0
    while at < len(fields):
        chunk = fields[at: at + count]
        values = system.run("checkpoint values", lambda: system.client.hmget(c.copy, chunk))  # noqa: B023
        if any(v is None for v in values):
            raise CheckpointError(f"the snapshot's copy {c.copy!r} changed while it was read; save again")
        yield [x for pair in zip(chunk, values) for x in pair]
        at += len(chunk)
        seen_fields += len(chunk)
        seen_bytes += sum(len(f) + len(v) for f, v in zip(chunk, values))
        count = int(min(65536, max(1, PART_BYTES * seen_fields // max(seen_bytes, 1))))


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


def _write_file(file: Path, data: bytes) -> dict[str, Any]:
    with open(file, "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _user_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise CheckpointError(f"metadata must be a dict of JSON values, got {type(metadata).__name__}")
    try:
        return dict(json.loads(json.dumps(dict(metadata))))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"metadata must hold JSON values only (it is written to {METADATA_FILE}): {exc}") \
            from exc


# -- loading ---------------------------------------------------------------------------------------------------


def load_checkpoint(checkpoint_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Replace the system in Redis by the one saved in ``checkpoint_dir``, at once, and give this process's
    sampler the saved state; returns the ``metadata`` given to ``save_checkpoint`` (TransferQueue returns
    None and keeps it in metadata.json's ``user_metadata``, which this writes too).

    Raises CheckpointNotFoundError (a FileNotFoundError) for a missing directory or file,
    CheckpointCorruptError for files that are not what the save wrote, CheckpointMismatchError for a
    checkpoint of another namespace or dock size, CheckpointRestoreError when the server cannot restore
    its keys (an older Redis than the one that saved it); in each case the system is left as it was.
    """
    from broker.adapters.transfer_queue.interface import get_client

    client = get_client()
    system = client.system
    path = Path(checkpoint_dir)
    _recover(path, _siblings(path)[1])
    if not path.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory not found: {path}")
    document = _read_metadata(path)
    if document["namespace"] != system.namespace:
        raise CheckpointMismatchError(f"{path} is a checkpoint of TransferQueue system {document['namespace']!r}; "
                                      f"this process is attached to {system.namespace!r}")
    saved = _saved_schema(path, document)
    current = system.dock.refresh()
    _check_fits(path, saved, current)
    state = _read_sampler(path, document)
    _verify(path / KEYS_FILE, document["files"][KEYS_FILE])
    run = uuid.uuid4().hex
    deadlines: dict[str, int] = {}
    try:
        _stage(system, path / KEYS_FILE, run, document, deadlines)
        _swap(system, run, deadlines, document["schema"], saved)
    except BaseException:
        _drop(system, [system.keys.staged(run, k) for k in deadlines])
        raise
    system.dock.refresh()
    sampler = _sampler_of(client)
    if document.get("sampler") not in (None, type(sampler).__name__):
        log.warning("checkpoint %s was saved with a %s; its state goes to this process's %s", path,
                    document.get("sampler"), type(sampler).__name__)
    sampler.load_checkpoint(state)
    log.info("TransferQueue system %r restored from %s", system.namespace, path)
    user = document.get("user_metadata") or {}
    return dict(user) if isinstance(user, dict) else {}


def _read_metadata(path: Path) -> dict[str, Any]:
    file = path / METADATA_FILE
    if not file.is_file():
        if (path / "controller_state.pkl").exists():
            raise CheckpointMismatchError(f"{path} is a checkpoint of TransferQueue itself (a pickle); the broker "
                                          "never unpickles: save the run again with broker.transfer_queue")
        raise CheckpointNotFoundError(f"{METADATA_FILE} not found in {path}")
    try:
        document = json.loads(file.read_bytes())
    except ValueError as exc:
        raise CheckpointCorruptError(f"{file} is not JSON: {exc}") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CheckpointMismatchError(f"{file} does not describe a {FORMAT}")
    version = document.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CheckpointMismatchError(f"{path} has checkpoint format version {version!r}; this broker reads "
                                      f"up to {VERSION}")
    missing = [k for k in ("namespace", "schema", "files", "server_time_ms") if k not in document]
    files = document.get("files")
    if missing or not isinstance(files, dict) or any(not isinstance(files.get(f), dict)
                                                      for f in (KEYS_FILE, SAMPLER_FILE)):
        raise CheckpointCorruptError(f"{file} lacks {missing or 'its files'}")
    return document


def _saved_schema(path: Path, document: dict[str, Any]) -> Schema:
    meta = document["schema"]
    try:
        return Schema.from_meta({str(k).encode(): str(v).encode() for k, v in dict(meta).items()},
                                where=f"{path / METADATA_FILE} schema")
    except (DecodeError, TypeError, ValueError) as exc:
        raise CheckpointCorruptError(str(exc)) from exc


def _check_fits(path: Path, saved: Schema, current: Schema) -> None:
    """A checkpoint restores into a system of the same size and kind; fields and tasks may differ (they grow)."""
    differ = [f"{name}: checkpoint {getattr(saved, name)!r}, system {getattr(current, name)!r}"
              for name in ("prompts_num", "n_samples_per_prompt", "length_columns", "rollout", "shards",
                           "group_columns") if getattr(saved, name) != getattr(current, name)]
    if differ:
        raise CheckpointMismatchError(f"{path} is a checkpoint of a system of another schema ("
                                      + "; ".join(differ) + "): init() with the conf it was saved with")


def _verify(file: Path, expected: Mapping[str, Any]) -> None:
    """The file is whole and unchanged: its size and SHA-256 are those metadata.json gives."""
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


def _stage(system: System, file: Path, run: str, document: dict[str, Any], deadlines: dict[str, int]) -> None:
    """Write the checkpoint's keys beside the system (``DockKeys.staged``), in pipelines of about PART_BYTES,
    each expiring in STAGING_TTL_MS; ``deadlines`` gets each key and when it expires once it may be staged
    (so that a failure deletes it)."""
    keys, size = system.keys, 0
    pending: list[tuple[Any, ...]] = []
    hashes: dict[str, int] = {}
    rdb = document.get("rdb_version")

    def flush() -> None:
        if not pending:
            return

        def send() -> list[Any]:
            pipe = system.client.pipeline(transaction=False)
            for command in pending:
                pipe.execute_command(*command)
            return list(pipe.execute())

        try:
            system.run("checkpoint restore", send)
        except RedisCommandError as exc:
            if "payload version" in str(exc) or "checksum" in str(exc):
                raise CheckpointRestoreError(
                    f"the server cannot restore the checkpoint's keys: they were dumped in RDB format {rdb} "
                    f"(a newer Redis than this server, which answered: {exc})") from exc
            raise
        pending.clear()

    with open(file, "rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False, max_buffer_size=2**31 - 1)
        try:
            for record in unpacker:
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
    flush()
    for staged, count in hashes.items():
        got = system.run("checkpoint check", lambda: system.client.hlen(staged))  # noqa: B023
        if got != count:
            raise CheckpointCorruptError(f"{file} holds {count} fields of {staged!r} but {got} were staged: "
                                         "a field is there twice")


def _record(record: Any, base: str, file: Path) -> tuple[str, str, int]:
    """A record's key, type and deadline, checked."""
    if not isinstance(record, dict) or not isinstance(record.get("k"), str) or not isinstance(record.get("at"), int):
        raise CheckpointCorruptError(f"{file} holds a record that is not a key's: {str(record)[:80]}")
    key, kind = record["k"], record.get("t")
    if not key.startswith(base):
        raise CheckpointCorruptError(f"{file} holds key {key!r}, which is not one of the system's ({base}*)")
    if kind == "hash":
        fields = record.get("f")
        if not isinstance(fields, list) or not fields or len(fields) % 2 or \
                not all(isinstance(x, bytes) for x in fields):
            raise CheckpointCorruptError(f"{file}: the fields of hash {key!r} are not pairs of bytes")
    elif not isinstance(record.get("dump"), bytes):
        raise CheckpointCorruptError(f"{file}: key {key!r} has no DUMP payload")
    return key, str(kind), int(record["at"])


def _swap(system: System, run: str, deadlines: Mapping[str, int], saved_meta: Mapping[str, str],
          saved: Schema) -> None:
    """Replace the system's keys by the staged ones, in one step (lua/tq_restore.lua); the meta written is the
    checkpoint's grown by the fields and tasks the system has now, so every process's schema is inside it."""
    for _ in range(RETRIES):
        partitions, records = _enumerate(system)
        current = system.dock.schema
        grown = saved.grown(columns=[c for c in current.columns if c not in saved.columns],
                            consumers=[c for c in current.consumers if c not in saved.consumers])
        meta = {**{str(k): str(v) for k, v in saved_meta.items()}, **grown.to_meta()}
        try:
            done = system.run("checkpoint swap", lambda: system.scripts.restore(
                run, partitions, records, deadlines, meta))  # noqa: B023 (run at once)
        except SchemaError:
            system.dock.refresh()
            continue
        except RedisCommandError as exc:
            raise CheckpointRestoreError(f"restoring the checkpoint's keys failed, the system is unchanged: {exc}") \
                from exc
        if done:
            return
    raise CheckpointError(f"the partitions or named takes of system {system.namespace!r} changed under "
                          f"{RETRIES} restores in a row; stop the other processes and load again")


# -- the sampler's state ------------------------------------------------------------------------------------


def _sampler_of(client: Any) -> BaseSampler:
    sampler = getattr(client, "_sampler", None)
    if not isinstance(sampler, BaseSampler):
        raise BrokerError("this process's TransferQueue client has no sampler")
    return sampler


def _pack_sampler(sampler: BaseSampler) -> bytes:
    """``sampler.save_checkpoint()`` as msgpack, tuples kept as tuples (a cached ``(sampled, consumed)``)."""
    def default(value: Any) -> Any:
        if isinstance(value, tuple):
            return msgpack.ExtType(_TUPLE, msgpack.packb(list(value), use_bin_type=True, strict_types=True,
                                                         default=default))
        if isinstance(value, dict):
            return dict(value)
        if isinstance(value, (list, set, frozenset)):
            return list(value)
        if isinstance(value, (np.integer, np.floating, np.bool_)):
            return value.item()
        plains: tuple[Any, ...] = (bool, int, float, str, bytes)
        for plain in plains:  # subclasses of them (an IntEnum, say)
            if isinstance(value, plain):
                return plain(value)
        raise CheckpointError(f"{type(sampler).__name__}'s state holds a {type(value).__name__} ({value!r:.60}); "
                              "a checkpoint keeps plain values only (the broker never pickles)")

    state = sampler.save_checkpoint()
    packed: bytes = msgpack.packb(state, use_bin_type=True, strict_types=True, default=default)
    return packed


def _unpack_sampler(data: bytes) -> Any:
    def ext(code: int, raw: bytes) -> Any:
        if code != _TUPLE:
            raise CheckpointCorruptError(f"sampler state holds an unknown msgpack extension {code}")
        return tuple(msgpack.unpackb(raw, raw=False, strict_map_key=False, ext_hook=ext))

    return msgpack.unpackb(data, raw=False, strict_map_key=False, ext_hook=ext)


def _read_sampler(path: Path, document: dict[str, Any]) -> Any:
    file = path / SAMPLER_FILE
    if not file.is_file():
        raise CheckpointNotFoundError(f"{SAMPLER_FILE} not found in {path}")
    _verify(file, document["files"][SAMPLER_FILE])
    try:
        state = _unpack_sampler(file.read_bytes())
    except (msgpack.UnpackException, ValueError) as exc:
        raise CheckpointCorruptError(f"{file} is not msgpack: {exc}") from exc
    if not isinstance(state, dict):
        raise CheckpointCorruptError(f"{file} holds no sampler state")
    return state


# -- files and keys -----------------------------------------------------------------------------------------


def _siblings(path: Path) -> tuple[Path, Path]:
    """Where a save writes (``<dir>.tmp``) and where it moves the previous checkpoint (``<dir>.old``)."""
    return path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")


def _recover(path: Path, old: Path) -> None:
    """A save that died between its two renames left the previous checkpoint as ``<dir>.old``: put it back."""
    if old.exists() and not path.exists():
        log.warning("found %s without %s (a save died between its renames); restoring it", old, path)
        old.rename(path)
    elif old.exists():
        shutil.rmtree(old, ignore_errors=True)  # a save died after installing the new one


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_of(copied: list[Copied], key: str) -> str:
    return next(c.copy for c in copied if c.key == key)


def _drop(system: System, keys: list[str]) -> None:
    """Delete a snapshot's copies or a load's staged keys; what is left expires anyway."""
    for at in range(0, len(keys), 512):
        part = keys[at: at + 512]
        try:
            system.run("checkpoint cleanup", lambda: system.client.unlink(*part))  # noqa: B023
        except BrokerError as exc:
            log.warning("could not delete %d checkpoint keys (they expire within %d s): %s", len(part),
                        STAGING_TTL_MS // 1000, exc)
            return


def _rdb_version(payload: bytes) -> int | None:
    """The RDB format of a DUMP payload: its last 10 bytes are the version (2, little-endian) and a CRC64."""
    return int.from_bytes(payload[-10:-8], "little") if len(payload) >= 10 else None
