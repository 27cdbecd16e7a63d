"""The adapter's errors where TransferQueue raises a built-in the broker's hierarchy has no class for.

Each derives from :class:`broker.errors.BrokerError` and from the built-in TransferQueue raises, so code
written for TransferQueue that catches ``TypeError`` or ``RuntimeError`` keeps working. Bad values raise
the broker's own classes (``InvalidExperienceError`` is a ``ValueError``, ``RowIndexError`` an
``IndexError``, ``UnknownColumnError`` a ``KeyError``), as TransferQueue raises those built-ins.
"""

from __future__ import annotations

from broker.errors import BrokerError


class MetaIndexTypeError(BrokerError, TypeError):
    """A ``BatchMeta`` indexed with something other than an int or a slice."""


class MissingKeysError(BrokerError, RuntimeError):
    """``KVBatchMeta.select_keys`` named keys the batch does not hold (TransferQueue: ``RuntimeError``)."""


class CheckpointError(BrokerError):
    """A checkpoint could not be saved or loaded (broker.transfer_queue's ``save_checkpoint`` /
    ``load_checkpoint``); the subclasses say why."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory, or a file it must hold, does not exist (TransferQueue: FileNotFoundError)."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A checkpoint's files are not what ``save_checkpoint`` wrote: unreadable, truncated, or their checksum
    differs. Nothing in Redis was changed."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint of another system: another namespace, another dock size, or another checkpoint format.
    Nothing in Redis was changed."""


class CheckpointRestoreError(CheckpointError, RuntimeError):
    """The server refused to restore a checkpoint's keys (an older Redis than the one that saved it cannot
    read its RDB payloads), or the staged keys went away before the swap. Nothing of the system changed."""
