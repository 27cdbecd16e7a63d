"""Every error the broker raises, under one base class.

Each class also derives from the closest built-in exception, so callers that already catch
``KeyError`` or ``TimeoutError`` keep working; catching :class:`BrokerError` catches them all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "BrokerError",
    "SchemaError",
    "DockNotFoundError",
    "UnknownColumnError",
    "UnknownConsumerError",
    "RowIndexError",
    "InvalidExperienceError",
    "ExperienceTooLargeError",
    "DecodeError",
    "MissingDataError",
    "ExperienceTimeoutError",
    "InvalidArgumentTypeError",
    "GetMetaError",
    "GetMetaTimeoutError",
    "BrokerConnectionError",
    "BrokerTimeoutError",
    "RedisCommandError",
    "ClusterError",
    "StoreFullError",
    "QuotaExceededError",
    "ServerConfigError",
    "DataLostError",
    "FencedError",
    "VersionError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointRestoreError",
    "ReplicationError",
    "SampleNotFoundError",
    "MetaIndexTypeError",
    "MissingKeysError",
]


class BrokerError(Exception):
    """Base class of every error raised by the broker."""


class SchemaError(BrokerError, ValueError):
    """A dock's schema is invalid, or differs from the one already stored under its name."""


class DockNotFoundError(BrokerError, LookupError):
    """No dock of that name exists on the server."""


class UnknownColumnError(BrokerError, KeyError):
    """A column name that is not part of the dock's schema."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class UnknownConsumerError(BrokerError, KeyError):
    """A consumer name that is not part of the dock's schema."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class RowIndexError(BrokerError, IndexError):
    """A row index outside ``[0, capacity)``, a duplicate, or an empty list of rows."""


class InvalidExperienceError(BrokerError, ValueError):
    """Data handed to the dock has the wrong type, shape, dtype or row count, or an argument of a call
    (count, timeout, lease, policy, flag) is outside what it may be."""


class ExperienceTooLargeError(InvalidExperienceError):
    """A row's encoded bytes exceed what the Redis server accepts as one value; nothing was sent."""


class DecodeError(BrokerError, ValueError):
    """Bytes read from Redis are not a valid encoded tensor (or not valid dock metadata)."""


class MissingDataError(BrokerError):
    """A row is marked ready but its bytes are not in Redis (the dock was altered outside the broker)."""


class ExperienceTimeoutError(BrokerError, TimeoutError):
    """Explicitly requested rows were not all written before the timeout.

    ``missing`` maps each column to the rows still unwritten in it.
    """

    def __init__(self, message: str, missing: Mapping[str, Sequence[int]]):
        super().__init__(message)
        self.missing = {col: list(rows) for col, rows in missing.items()}


class InvalidArgumentTypeError(InvalidExperienceError, TypeError):
    """An argument of the wrong type where TransferQueue raises TypeError (a key that is not a str)."""


class GetMetaError(InvalidExperienceError, RuntimeError):
    """``broker.transfer_queue``'s ``get_meta`` refused its arguments: an unknown partition or field, a bad mode,
    no task name. TransferQueue raises RuntimeError for each (its controller's reply), so it is one too."""


class GetMetaTimeoutError(ExperienceTimeoutError, RuntimeError):
    """``get_meta`` found too few rows ready within ``broker.get_meta_timeout`` (TransferQueue: RuntimeError)."""


class BrokerConnectionError(BrokerError, ConnectionError):
    """The Redis server could not be reached, or the connection dropped mid-call."""


class BrokerTimeoutError(BrokerConnectionError, TimeoutError):
    """Redis did not answer within the call's bound: the dock's ``call_timeout``, or for
    ``get_experience(timeout=T)`` T (see docs/reliability.md, "Lost replies and reconnects").

    The call was given up and not retried; it may or may not have been applied. The message names the
    server and the bound.
    """


class RedisCommandError(BrokerError):
    """Redis refused a command (permissions, wrong server state, ...)."""


class ClusterError(RedisCommandError):
    """A Redis Cluster refused or redirected a call and did not settle: a slot moved, a primary is down,
    or keys of several slots met in one command. The message names the slot, node or keys."""


class StoreFullError(RedisCommandError):
    """Redis reached its ``maxmemory`` and refused a write; the call that got this applied nothing."""


class QuotaExceededError(BrokerError):
    """A put would take the dock past its byte quota (``TransferDock.set_quota``); nothing was written."""


class ServerConfigError(RedisCommandError):
    """The Redis server is set up in a way a dock cannot keep its word on, found when the dock opens: it
    evicts keys (``maxmemory-policy`` other than ``noeviction``), or a command the broker needs is renamed,
    disabled or denied to the user. The message names the server, the setting or command, and the fix."""


class DataLostError(BrokerError):
    """Redis no longer holds a key of the dock that the broker wrote and never removed (evicted under a
    ``maxmemory-policy``, deleted by hand, or lost in a failover): what it held cannot be trusted. The
    message names the key."""


class FencedError(BrokerError):
    """A write named rows of a delivery that is no longer current, and wrote nothing.

    Since ``get_experience`` handed the rows out, a clear or a drop took them (they may hold other
    prompts now), or their lease ran out and they were given back to be redone by another worker, or
    they were acked. Like Kafka's fenced producer, the late writer should drop its result and go on.
    """


class VersionError(InvalidExperienceError):
    """A policy version that would move the dock's version backwards."""


class CheckpointError(BrokerError):
    """A checkpoint could not be saved or loaded (a dock's keys: ``broker/api/snapshot.py``; a run's:
    ``workers/runtime/checkpoint.py``; broker.transfer_queue's ``save_checkpoint`` / ``load_checkpoint``);
    the subclasses say why."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory, or a file it must hold, does not exist (TransferQueue: FileNotFoundError)."""


class CheckpointCorruptError(CheckpointError, ValueError):
    """A checkpoint's files are not what its save wrote: unreadable, truncated, or their checksum differs.
    Nothing in Redis was changed."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint of something else: another namespace or dock, another dock size, or another checkpoint
    format. Nothing in Redis was changed."""


class CheckpointRestoreError(CheckpointError, RuntimeError):
    """The server refused to restore a checkpoint's keys (an older Redis than the one that saved it cannot
    read its RDB payloads), or the staged keys went away before the swap. Nothing of the dock changed."""


class ReplicationError(ClusterError):
    """Fewer replicas than asked acknowledged a call's writes in time, although that many are attached, or
    the wait for them failed (``wait_replicas``, broker/connection/replication.py). The call's writes were
    made on the primaries first: ``applied`` says whether its effect is in place (False only for a sharded
    put whose bytes, but no marks, were written), ``result`` holds what the call returns, and
    ``repeat_safe`` (and the message) whether repeating the call at once is safe."""

    def __init__(self, message: str, result: Any = None, applied: bool = True, repeat_safe: bool = True):
        super().__init__(message)
        self.result = result
        self.applied = applied
        #: Whether the call may be repeated at once with no other effect (the message says why not).
        self.repeat_safe = repeat_safe

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:  # keeps its attributes across processes (Ray)
        return type(self), (str(self), self.result, self.applied, self.repeat_safe)


# broker.transfer_queue's errors where TransferQueue raises a built-in the hierarchy above has no class for: each
# is a BrokerError and that built-in, so code written for TransferQueue that catches the built-in keeps working.


class SampleNotFoundError(BrokerError, KeyError, ValueError):
    """A key (or global index) that its partition does not hold; TransferQueue's StorageKeyNotFoundError (a
    KeyError), and a ValueError as TransferQueue's kv_batch_get raises for keys, partitions or fields it lacks."""


class MetaIndexTypeError(BrokerError, TypeError):
    """A ``BatchMeta`` indexed with something other than an int or a slice."""


class MissingKeysError(BrokerError, RuntimeError):
    """``KVBatchMeta.select_keys`` named keys the batch does not hold (TransferQueue: ``RuntimeError``)."""
