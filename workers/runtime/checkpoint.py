"""A run's checkpoint: what ``broker demo --resume DIR`` (and ``Pipeline.restore``) continues from.

Written by the driver at the end of every iteration, after the dock was cleared, into the run's folder:

``checkpoint/state.json``    the iteration it ends, the run's counters and every iteration's metrics so far
                             (the reward curve goes on from them), the dock's name and schema fingerprint
``checkpoint/trainers.pt``   each trainer rank's model shard and optimizer state, and the prompt
                             generator's state (``torch.save``; read back with ``weights_only=True``:
                             tensors, numbers and containers, nothing else is unpickled)
``checkpoint/dock.msgpack``  the dock's keys, when its rows outlive an iteration (partial or asynchronous
                             rollout: groups kept, partial responses, ages, the version and the admission
                             count): ``broker/api/snapshot.py``, taken in one step and restored in one step

Atomic: a checkpoint is written whole into ``checkpoint.new/`` (each file flushed to disk, ``state.json``
last), then swapped in by two renames (``checkpoint`` -> ``checkpoint.old``, ``checkpoint.new`` ->
``checkpoint``) and the old one removed. A crash at any point leaves a complete checkpoint to read:
``checkpoint`` if it has its ``state.json``, else ``checkpoint.old`` (a crash between the renames).

The demo checkpoints at the end of an iteration, after the dock was cleared. A synchronous run's dock is
empty then, so its checkpoint holds no rows; a run whose dock keeps groups across iterations holds the
dock's keys as they were at that moment, and a resume puts them back in one step, whatever the dock held
when the run died. Either way the iteration running when the run died is redone from its start, with the
same prompts (the generator's state) and the same rows, by the trainers as they were when it began.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from broker.api.snapshot import DockSnapshot, fsync_dir
from broker.errors import CheckpointError

if TYPE_CHECKING:
    from broker import TransferDock

__all__ = ["Checkpoint", "CheckpointError", "save", "latest", "load", "restore_dock"]

#: The checkpoint's format; a checkpoint of another format is refused with what it is.
FORMAT = 1
CURRENT, NEW, OLD = "checkpoint", "checkpoint.new", "checkpoint.old"
#: Every folder a checkpoint may leave in a run's folder.
FOLDERS = (CURRENT, NEW, OLD)
STATE, TRAINERS, DOCK = "state.json", "trainers.pt", "dock.msgpack"


@dataclass
class Checkpoint:
    """What a run resumes from (see the module docstring)."""

    iteration: int
    records: list[dict[str, Any]]
    dock: str
    fingerprint: str
    restarts: int
    trainers: dict[str, list[dict[str, Any]]]
    prompt_generator: torch.Tensor
    #: What ``DockSnapshot.save`` said of the dock's keys (``DOCK``), or None: the checkpoint holds no rows.
    dock_keys: dict[str, Any] | None = None
    #: Where a loaded checkpoint's files are (``load``); None for one not read from disk.
    where: Path | None = None


def save(folder: Path, checkpoint: Checkpoint, dock: TransferDock | None = None) -> None:
    """Write ``checkpoint`` into ``folder``, atomically (see the module docstring), with ``dock``'s keys if
    given (taken now: call it when the dock is as the next iteration must find it)."""
    new, current, old = folder / NEW, folder / CURRENT, folder / OLD
    shutil.rmtree(new, ignore_errors=True)  # the remains of a save that crashed
    new.mkdir(parents=True)
    dock_keys = DockSnapshot(dock).save(new / DOCK) if dock is not None else None
    with open(new / TRAINERS, "wb") as out:
        torch.save({"trainers": checkpoint.trainers, "prompt_generator": checkpoint.prompt_generator}, out)
        out.flush()
        os.fsync(out.fileno())
    state = {"format": FORMAT, "iteration": checkpoint.iteration, "dock": checkpoint.dock,
             "fingerprint": checkpoint.fingerprint, "restarts": checkpoint.restarts, "records": checkpoint.records,
             "dock_keys": dock_keys}
    with open(new / STATE, "w", encoding="utf-8") as out:
        json.dump(state, out)
        out.flush()
        os.fsync(out.fileno())
    fsync_dir(new)
    if current.exists():
        shutil.rmtree(old, ignore_errors=True)
        current.rename(old)
    new.rename(current)
    fsync_dir(folder)
    shutil.rmtree(old, ignore_errors=True)


def latest(folder: Path) -> Path | None:
    """The folder of the run's latest complete checkpoint, or None if it has none."""
    for name in (CURRENT, OLD):
        if (folder / name / STATE).is_file():
            return folder / name
    return None


def load(folder: Path) -> Checkpoint:
    """The run's latest complete checkpoint; CheckpointError if there is none or it is unreadable."""
    where = latest(folder)
    if where is None:
        raise CheckpointError(f"{folder}: no checkpoint to resume from (the run ended before its first iteration "
                              "did, or this is not a run's folder)")
    try:
        state = json.loads((where / STATE).read_text(encoding="utf-8"))
        if state.get("format") != FORMAT:
            raise CheckpointError(f"{where}: a checkpoint of format {state.get('format')!r}; this version reads "
                                  f"format {FORMAT}")
        saved = torch.load(where / TRAINERS, weights_only=True)
        return Checkpoint(iteration=int(state["iteration"]), records=list(state["records"]), dock=str(state["dock"]),
                          fingerprint=str(state["fingerprint"]), restarts=int(state["restarts"]),
                          trainers=saved["trainers"], prompt_generator=saved["prompt_generator"],
                          dock_keys=state.get("dock_keys"), where=where)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any damage: say which file, and keep the cause
        raise CheckpointError(f"{where}: unreadable checkpoint ({type(exc).__name__}: {exc})") from exc


def restore_dock(checkpoint: Checkpoint, dock: TransferDock) -> None:
    """Put the dock's keys that ``checkpoint`` holds back into ``dock``, in one step; CheckpointError if it
    holds none (a synchronous run's, or a damaged one) or the server cannot take them."""
    if checkpoint.dock_keys is None or checkpoint.where is None:
        raise CheckpointError(f"the checkpoint of iteration {checkpoint.iteration} holds no rows of dock "
                              f"{checkpoint.dock!r}, which a run with --max-age or --max-staleness needs: it was "
                              "written by a synchronous run, or by a version that did not keep the dock")
    DockSnapshot(dock).restore(checkpoint.where / DOCK, checkpoint.dock_keys)
