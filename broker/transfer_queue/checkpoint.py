"""``save_checkpoint`` / ``load_checkpoint``: a whole TransferQueue system (its dock and the adapter's keys) to
a directory and back, as TransferQueue's functions of those names, but consistent, atomic and without pickle.

**Consistent, atomic in Redis.** The system's dock keeps its bytes in its own slot (``shards=0``), so every
key of the system (``td:{tq.<namespace>}:*``) is on one server, in one slot: ``broker/api/snapshot.py``
copies all of them in one atomic step (lua/snapshot.lua) and reads the copies out while the system goes on,
and a load stages the checkpoint's keys beside the system and swaps them in in one step (lua/restore.lua).
A checkpoint that is corrupt, of another system, or that the server cannot read changes nothing.

**Atomic on disk.** Everything is written into ``<dir>.tmp`` and fsynced; then ``<dir>`` is renamed to
``<dir>.old``, ``<dir>.tmp`` to ``<dir>``, and ``<dir>.old`` removed, as TransferQueue does. A crash at any
point leaves a whole checkpoint: the previous one (``<dir>``, or ``<dir>.old``, which the next save or load
renames back) or the new one. A ``<dir>.tmp`` left by a crash is never read, and the next save replaces it.

**The files** (``FORMAT``, ``VERSION``): ``metadata.json`` (written last: the format and its version, the
namespace, the dock's schema (its meta hash), the conf, the server time of the snapshot, each file's size
and SHA-256, and the user's ``metadata`` under ``user_metadata``, where TransferQueue keeps it);
``redis_keys.msgpack`` (one msgpack map per key or per part of a hash: the key, its type, when it expires,
and its DUMP payload, or a hash's fields and values); ``sampler.msgpack`` (this process's sampler's
``save_checkpoint()``, msgpack with tuples kept as tuples). DUMP payloads are Redis's RDB encoding of one
key, restored with RESTORE; nothing is ever pickled, and a TransferQueue checkpoint (a pickle) is refused.

**A system cut into sub-systems** (``broker.partitions: P``, systems.py) is saved sub-system by sub-system,
each as above (one atomic copy of its slot, its puts and clears held off meanwhile) into
``redis_keys.pK.msgpack``; ``metadata.json`` names P, and per sub-system its dock, schema and file
(``systems``). Each TransferQueue partition lives whole in one sub-system, so each partition is saved at one
moment; two partitions in different sub-systems are saved at two moments, one after the other (take the
checkpoint where nothing writes to be sure of the whole, as a run does between steps). A load checks that
the system has the same P and docks, and every file's SHA-256 and every sub-system's schema, before it
restores any; a server refusing a sub-system's keys (an older Redis) part way leaves those before it
restored: load again on a server that reads them. With P = 1 the files are what they always were.

**Resuming.** Every key comes back as it was: rows consumed at checkpoint time stay consumed, the rows'
leases keep their deadlines (ms of server time), so rows leased then come back once those pass; but the
dock's epoch moves forward (``broker/api/snapshot.py``), so no metadata leased before the load puts into
its rows or acks their leases (its delivery is refused); named
takes (the DP ranks' shared choices) keep their records and expiry. Replies that calls keep for their
resends (``reply:*``, a minute) are not saved, and those of the system are left to expire.

**Puts and clears under way.** A put (rows, then fields, then tags) and a clear (the dock's rows, then the
keys) take several steps, so a save or a load waits until those under way ended and holds new ones off
while it copies or swaps the keys (``System.quiet``, lua/tq_begin.lua and lua/tq_settled.lua): a checkpoint
holds no key listed without its data and no data without its tags, and no put lands half on what a load
restored. A writer that died holds checkpoints off for twice the call timeout at most.

**Other processes.** The restored dock's schema is the checkpoint's grown by the fields and tasks the
system has at load time, so every process's dock finds its own schema inside it and adopts it at its next
call. What they must do themselves: not put by a metadata read before a load (its rows may hold other
samples once the load restored them), and forget their samplers' cached choices (``sampler._states = {}``,
or ``close()`` then ``init()``): the DP groups' shared choices come back through the named takes' records.
Only the loading process's sampler gets the checkpoint's ``_states``, as TransferQueue's one controller does.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from broker.api.snapshot import DockSnapshot, fsync_dir, saved_schema, verify_file, write_file
from broker.control.schema import Schema
from broker.errors import (
    BrokerError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from broker.transfer_queue.sampler import BaseSampler
from broker.transfer_queue.system import System
from broker.transfer_queue.systems import Systems

log = logging.getLogger(__name__)

FORMAT = "broker.transfer_queue checkpoint"
#: Version of the files' layout; a checkpoint of a later version is refused.
VERSION = 1

METADATA_FILE = "metadata.json"
KEYS_FILE = "redis_keys.msgpack"
SAMPLER_FILE = "sampler.msgpack"

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
    from broker.transfer_queue.interface import get_client

    client = get_client()
    systems = client.systems
    system = systems.parts[0]
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
        # The conf is written once, when the system is made (SET NX): read beside the snapshot, not in it.
        conf = system.read(lambda: system.client.get(systems.root.tq_conf))
        if systems.count == 1:
            info = _snapshot(system).save(tmp / KEYS_FILE)
            files = {KEYS_FILE: info.pop("file")}
        else:  # sub-system by sub-system (the module docstring)
            info, files = _save_parts(systems, tmp)
        files[SAMPLER_FILE] = write_file(tmp / SAMPLER_FILE, sampler_bytes)
        document = {"format": FORMAT, "version": VERSION, "namespace": system.namespace, "dock": systems.root.name,
                    **info, "conf": json.loads(conf) if conf else None, "storage_saved": True,
                    "sampler": type(sampler).__name__, "files": files, "saved_at": time.time(),
                    "user_metadata": user}
        write_file(tmp / METADATA_FILE, json.dumps(document, indent=1).encode())
        fsync_dir(tmp)
        if path.exists():
            if old.exists():
                shutil.rmtree(old)
            path.rename(old)
        tmp.rename(path)
        fsync_dir(path.parent)
        if old.exists():
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _recover(path, old)
        raise
    log.info("TransferQueue system %r saved to %s", system.namespace, path)


def keys_file(k: int) -> str:
    """The file of sub-system ``k``'s keys (a system cut into several)."""
    return f"redis_keys.p{k}.msgpack"


def _save_parts(systems: Systems, tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each sub-system's keys to its own file; what ``metadata.json`` keeps of them, and the files."""
    parts: list[dict[str, Any]] = []
    files: dict[str, Any] = {}
    for k, part in enumerate(systems.parts):
        saved = _snapshot(part).save(tmp / keys_file(k))
        files[keys_file(k)] = saved.pop("file")
        parts.append({"dock": part.dock.name, **saved})
    first = parts[0]
    return {"partitions": systems.count, "systems": parts, "schema": first["schema"],
            "server_time_ms": first["server_time_ms"], "keys": sum(p["keys"] for p in parts)}, files


def _snapshot(system: System) -> DockSnapshot:
    """The system's keys (its dock's and the slice's, of every partition: ``System.checkpoint_keys``); the
    copy and the swap wait for the puts and clears under way and hold new ones off (``System.quiet``), so a
    checkpoint holds no put or clear half done, and none lands half on what a load restores."""
    return DockSnapshot(system.dock, extra=system.checkpoint_keys, quiet=system.quiet)


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
    from broker.transfer_queue.interface import get_client

    client = get_client()
    systems = client.systems
    system = systems.parts[0]
    path = Path(checkpoint_dir)
    _recover(path, _siblings(path)[1])
    if not path.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory not found: {path}")
    document = _read_metadata(path)
    if document["namespace"] != system.namespace:
        raise CheckpointMismatchError(f"{path} is a checkpoint of TransferQueue system {document['namespace']!r}; "
                                      f"this process is attached to {system.namespace!r}")
    if systems.count == 1 and document.get("partitions", 1) == 1:
        parts = [(system, path / KEYS_FILE, {"schema": document["schema"], "file": document["files"][KEYS_FILE],
                                             "rdb_version": document.get("rdb_version")})]
    else:
        parts = _parts_of(path, document, systems)
    for part, file, info in parts:  # every sub-system fits, and every file is whole, before any is restored
        _check_fits(path, saved_schema(info["schema"], where=str(path / METADATA_FILE)), part.dock.refresh())
        if len(parts) > 1:  # one file: its restore verifies it first anyway
            verify_file(file, info["file"])
    state = _read_sampler(path, document)
    for part, file, info in parts:
        _snapshot(part).restore(file, info)
    sampler = _sampler_of(client)
    if document.get("sampler") not in (None, type(sampler).__name__):
        log.warning("checkpoint %s was saved with a %s; its state goes to this process's %s", path,
                    document.get("sampler"), type(sampler).__name__)
    sampler.load_checkpoint(state)
    log.info("TransferQueue system %r restored from %s", system.namespace, path)
    user = document.get("user_metadata") or {}
    return dict(user) if isinstance(user, dict) else {}


def _parts_of(path: Path, document: dict[str, Any], systems: Systems) -> list[tuple[System, Path, dict[str, Any]]]:
    """Each sub-system with its file and what its save returned; CheckpointMismatchError for a checkpoint of
    another partition count or other docks, CheckpointCorruptError for a ``metadata.json`` that lacks them."""
    count = document.get("partitions", 1)
    if count != systems.count:
        raise CheckpointMismatchError(f"{path} is a checkpoint of a system of {count} partitions (broker.partitions); "
                                      f"this one has {systems.count}: init() with the conf it was saved with")
    saved = document.get("systems")
    files = document["files"]
    if not isinstance(saved, list) or len(saved) != count or not all(
            isinstance(s, dict) and {"dock", "schema"} <= set(s) and isinstance(files.get(keys_file(k)), dict)
            for k, s in enumerate(saved)):
        raise CheckpointCorruptError(f"{path / METADATA_FILE} does not name the {count} sub-systems' files")
    docks = [s["dock"] for s in saved]
    mine = [part.dock.name for part in systems.parts]
    if docks != mine:
        raise CheckpointMismatchError(f"{path} is a checkpoint of the docks {docks}; this system's are {mine}")
    return [(part, path / keys_file(k), {"schema": s["schema"], "file": files[keys_file(k)],
                                         "rdb_version": s.get("rdb_version")})
            for k, (part, s) in enumerate(zip(systems.parts, saved))]


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
    keys = KEYS_FILE if document.get("partitions", 1) == 1 else keys_file(0)
    if missing or not isinstance(files, dict) or any(not isinstance(files.get(f), dict)
                                                      for f in (keys, SAMPLER_FILE)):
        raise CheckpointCorruptError(f"{file} lacks {missing or 'its files'}")
    return document


def _check_fits(path: Path, saved: Schema, current: Schema) -> None:
    """A checkpoint restores into a system of the same size and kind; fields and tasks may differ (they grow)."""
    differ = [f"{name}: checkpoint {getattr(saved, name)!r}, system {getattr(current, name)!r}"
              for name in ("prompts_num", "n_samples_per_prompt", "length_columns", "rollout", "shards",
                           "group_columns") if getattr(saved, name) != getattr(current, name)]
    if differ:
        raise CheckpointMismatchError(f"{path} is a checkpoint of a system of another schema ("
                                      + "; ".join(differ) + "): init() with the conf it was saved with")


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
    verify_file(file, document["files"][SAMPLER_FILE])
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
