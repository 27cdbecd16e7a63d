"""A run's checkpoint: what ``broker demo --resume DIR`` (and ``Pipeline.restore``) continues from.

Written by the driver at the end of every iteration, after the dock was cleared, into the run's folder:

``checkpoint/state.json``    the iteration it ends, the run's counters and every iteration's metrics so far
                             (the reward curve goes on from them), the dock's name and schema fingerprint
``checkpoint/trainers.pt``   each trainer rank's model shard and optimizer state, and the prompt
                             generator's state (``torch.save``; read back with ``weights_only=True``:
                             tensors, numbers and containers, nothing else is unpickled)

Atomic: a checkpoint is written whole into ``checkpoint.new/`` (each file flushed to disk, ``state.json``
last), then swapped in by two renames (``checkpoint`` -> ``checkpoint.old``, ``checkpoint.new`` ->
``checkpoint``) and the old one removed. A crash at any point leaves a complete checkpoint to read:
``checkpoint`` if it has its ``state.json``, else ``checkpoint.old`` (a crash between the renames).

What a checkpoint does not hold: the rows in the dock. The demo checkpoints at the end of an iteration,
when a synchronous run's dock is empty; the iteration running when the run died is redone from its start,
with the same prompts (the generator's state), by the trainers as they were when it began. A run whose dock
keeps groups across iterations (partial or asynchronous rollout) is refused for now (``workers/demo.py``).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: The checkpoint's format; a checkpoint of another format is refused with what it is.
FORMAT = 1
CURRENT, NEW, OLD = "checkpoint", "checkpoint.new", "checkpoint.old"
#: Every folder a checkpoint may leave in a run's folder.
FOLDERS = (CURRENT, NEW, OLD)
STATE, TRAINERS = "state.json", "trainers.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from, with why."""


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


def save(folder: Path, checkpoint: Checkpoint) -> None:
    """Write ``checkpoint`` into ``folder``, atomically (see the module docstring)."""
    new, current, old = folder / NEW, folder / CURRENT, folder / OLD
    shutil.rmtree(new, ignore_errors=True)  # the remains of a save that crashed
    new.mkdir(parents=True)
    with open(new / TRAINERS, "wb") as out:
        torch.save({"trainers": checkpoint.trainers, "prompt_generator": checkpoint.prompt_generator}, out)
        out.flush()
        os.fsync(out.fileno())
    state = {"format": FORMAT, "iteration": checkpoint.iteration, "dock": checkpoint.dock,
             "fingerprint": checkpoint.fingerprint, "restarts": checkpoint.restarts, "records": checkpoint.records}
    with open(new / STATE, "w", encoding="utf-8") as out:
        json.dump(state, out)
        out.flush()
        os.fsync(out.fileno())
    _sync(new)
    if current.exists():
        shutil.rmtree(old, ignore_errors=True)
        current.rename(old)
    new.rename(current)
    _sync(folder)
    shutil.rmtree(old, ignore_errors=True)


def load(folder: Path) -> Checkpoint:
    """The run's latest complete checkpoint; CheckpointError if there is none or it is unreadable."""
    for name in (CURRENT, OLD):
        where = folder / name
        if (where / STATE).is_file():
            break
    else:
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
                          trainers=saved["trainers"], prompt_generator=saved["prompt_generator"])
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - any damage: say which file, and keep the cause
        raise CheckpointError(f"{where}: unreadable checkpoint ({type(exc).__name__}: {exc})") from exc


def _sync(directory: Path) -> None:
    """Flush a directory's entries (renames, new files) to disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
