"""The adapter's errors where TransferQueue raises a built-in the broker's hierarchy has no class for.

Each derives from :class:`broker.errors.BrokerError` and from the built-in TransferQueue raises, so code
written for TransferQueue that catches ``TypeError`` or ``RuntimeError`` keeps working. Bad values raise
the broker's own classes (``InvalidExperienceError`` is a ``ValueError``, ``RowIndexError`` an
``IndexError``, ``UnknownColumnError`` a ``KeyError``), as TransferQueue raises those built-ins.
"""

from __future__ import annotations

from broker.errors import (  # TransferQueue's checkpoint errors are the broker's own
    BrokerError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointRestoreError,
)

__all__ = ["CheckpointCorruptError", "CheckpointError", "CheckpointMismatchError", "CheckpointNotFoundError",
           "CheckpointRestoreError", "MetaIndexTypeError", "MissingKeysError"]


class MetaIndexTypeError(BrokerError, TypeError):
    """A ``BatchMeta`` indexed with something other than an int or a slice."""


class MissingKeysError(BrokerError, RuntimeError):
    """``KVBatchMeta.select_keys`` named keys the batch does not hold (TransferQueue: ``RuntimeError``)."""
