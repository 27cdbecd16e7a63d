"""What every base of ``PartitionedDock`` (partitioned.py) works on: the dock's name, its partitions (each a dock
of its own), which of them holds which row, its rollout settings, and its checks."""

from __future__ import annotations

from broker.api.checks import DockChecks
from broker.api.dock import TransferDock
from broker.api.partition_map import PartitionMap
from broker.control.rollout import Rollout


class PartitionedParts:
    """The state a partitioned dock's bases share (``PartitionedDock`` sets it)."""

    _name: str
    _parts: list[TransferDock]
    _pmap: PartitionMap
    _rollout: Rollout

    @property
    def _check(self) -> DockChecks:
        """Checks against the dock's schema as its partitions hold it now: ``PartitionedDock``'s."""
        raise NotImplementedError
