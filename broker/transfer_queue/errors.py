"""The adapter's errors where TransferQueue raises a built-in the broker's hierarchy has no class for.

Each derives from :class:`broker.errors.BrokerError` and from the built-in TransferQueue raises, so code
written for TransferQueue that catches ``TypeError`` or ``RuntimeError`` keeps working. Bad values raise
the broker's own classes (``InvalidExperienceError`` is a ``ValueError``, ``RowIndexError`` an
``IndexError``, ``UnknownColumnError`` a ``KeyError``), as TransferQueue raises those built-ins.
"""

from __future__ import annotations

from broker.errors import (  # every error class lives in broker/errors.py; these are the adapter's names for them
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointRestoreError,
    MetaIndexTypeError,
    MissingKeysError,
)

__all__ = ["CheckpointCorruptError", "CheckpointError", "CheckpointMismatchError", "CheckpointNotFoundError",
           "CheckpointRestoreError", "MetaIndexTypeError", "MissingKeysError"]
