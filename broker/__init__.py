"""A Redis-backed experience broker for LLM reinforcement-learning post-training.

``TransferDock`` keeps MindSpeed-RL's TransferDock semantics (columns of per-row tensors, ready and
consumed status, n-sample-aware sampling) in Redis, so any number of processes can share one dock.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from broker.errors import (
    BrokerConnectionError,
    BrokerError,
    BrokerTimeoutError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointRestoreError,
    ClusterError,
    DataLostError,
    DecodeError,
    DockNotFoundError,
    ExperienceTimeoutError,
    ExperienceTooLargeError,
    FencedError,
    InvalidExperienceError,
    MissingDataError,
    QuotaExceededError,
    RedisCommandError,
    ReplicationError,
    RowIndexError,
    SchemaError,
    ServerConfigError,
    StoreFullError,
    UnknownColumnError,
    UnknownConsumerError,
    VersionError,
)

if TYPE_CHECKING:
    from broker.api.delivery import HandedRows, LeasedRows
    from broker.api.dock import TransferDock
    from broker.control.rollout import Rollout

#: The public names whose modules are imported on first use (PEP 562): the dock needs torch and numpy, and
#: ``import broker.anything`` runs this file first, so importing them here would make every command (``broker
#: status``, the exporter) and every plane's module pay for torch, which an operator's tools never touch.
_LAZY = {
    "TransferDock": "broker.api.dock",
    "HandedRows": "broker.api.delivery",
    "LeasedRows": "broker.api.delivery",
    "Rollout": "broker.control.rollout",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'broker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "TransferDock",
    "HandedRows",
    "LeasedRows",
    "Rollout",
    "BrokerError",
    "BrokerConnectionError",
    "BrokerTimeoutError",
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CheckpointRestoreError",
    "DataLostError",
    "DecodeError",
    "DockNotFoundError",
    "ExperienceTimeoutError",
    "ExperienceTooLargeError",
    "FencedError",
    "InvalidExperienceError",
    "MissingDataError",
    "RedisCommandError",
    "ReplicationError",
    "RowIndexError",
    "SchemaError",
    "ServerConfigError",
    "QuotaExceededError",
    "StoreFullError",
    "ClusterError",
    "UnknownColumnError",
    "UnknownConsumerError",
    "VersionError",
]
__version__ = "0.1.0"
