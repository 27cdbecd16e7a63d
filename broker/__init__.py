"""A Redis-backed experience broker for LLM reinforcement-learning post-training.

``TransferDock`` keeps MindSpeed-RL's TransferDock semantics (columns of per-row tensors, ready and
consumed status, n-sample-aware sampling) in Redis, so any number of processes can share one dock.
"""

from broker.api.delivery import HandedRows, LeasedRows
from broker.api.dock import TransferDock
from broker.connection.replication import ReplicationError
from broker.control.rollout import Rollout
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
    RowIndexError,
    SchemaError,
    ServerConfigError,
    StoreFullError,
    UnknownColumnError,
    UnknownConsumerError,
    VersionError,
)

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
