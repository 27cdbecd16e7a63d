"""A partitioned dock's checkpoint: each partition's keys at one moment, to a file of its own and back.

``DockSnapshot(dock)`` of a ``PartitionedDock`` is a ``PartitionedSnapshot``, with the same ``save`` and
``restore``. Each partition is saved as a dock of its own is (``snapshot.py``: one atomic copy of its slot) into
``FILE.pK`` beside ``FILE`` (which holds nothing: the checkpoint's ``info`` names the partitions' files and what
each save returned). The partitions are copied one after another, so the checkpoint is each partition at one
moment, not the dock at one moment: take it where nothing writes (a run's checkpoint is taken between
iterations). ``restore`` checks every partition's file before it restores any; a restore that fails part way
(the server refusing a partition's keys) leaves the partitions before it restored: restore again.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from broker.api.partitioned import PartitionedDock
from broker.api.snapshot import DockSnapshot, verify_file
from broker.errors import CheckpointCorruptError

__all__ = ["PartitionedSnapshot"]


class PartitionedSnapshot:
    """Save and restore a partitioned dock's partitions (see the module docstring)."""

    def __init__(self, dock: PartitionedDock):
        self.dock = dock
        self._parts = [DockSnapshot(part) for part in dock.partitions]

    @staticmethod
    def part_file(file: Path, k: int) -> Path:
        return file.with_name(f"{file.name}.p{k}")

    def save(self, file: Path) -> dict[str, Any]:
        """Save every partition to ``FILE.pK``; returns what a checkpoint keeps: ``partitions``, the list of what
        each partition's save returned, and ``keys`` (their sum)."""
        file.write_bytes(b"")  # the checkpoint's own name exists, as a dock's does
        saved = [part.save(self.part_file(file, k)) for k, part in enumerate(self._parts)]
        return {"partitions": saved, "keys": sum(s["keys"] for s in saved), "dock": self.dock.name}

    def restore(self, file: Path, info: Mapping[str, Any]) -> None:
        """Put every partition back as ``save`` wrote it (see the module docstring)."""
        saved = info.get("partitions")
        if not isinstance(saved, list) or len(saved) != len(self._parts):
            raise CheckpointCorruptError(f"{file}: a checkpoint of {len(saved) if isinstance(saved, list) else 'no'} "
                                         f"partitions, not of dock {self.dock.name!r}'s {len(self._parts)}")
        for k, part_info in enumerate(saved):
            verify_file(self.part_file(file, k), part_info["file"])
        for k, (part, part_info) in enumerate(zip(self._parts, saved)):
            part.restore(self.part_file(file, k), part_info)
