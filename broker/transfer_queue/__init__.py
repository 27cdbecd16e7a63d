"""TransferQueue's API (the ``transferqueue`` package, 0.1.11) on the broker: code written for it runs after
``import transfer_queue as tq`` becomes ``import broker.transfer_queue as tq`` (docs/transfer_queue.md).

Samples are rows of one dock in Redis (``system.py``); every call goes from the caller's process to Redis:
no controller actor, no storage units, no Ray needed. Beyond TransferQueue: leases on ``get_meta`` and the
data loader (a reader that dies loses nothing), checkpoints that are consistent and atomic, and never a
pickle of anything read from Redis.

The names below load on first use (PEP 562), as ``broker``'s do: the slice's scripts and keys
(``scripts.py``, ``keys.py``) are imported by ``broker functions`` and ``broker acl`` to load its function
library, which must not pay for torch; ``import broker.transfer_queue as tq`` then ``tq.init(...)`` works
as before, and so does ``tq.metadata`` or any other submodule.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from broker.errors import SampleNotFoundError

if TYPE_CHECKING:
    from broker.transfer_queue.checkpoint import load_checkpoint, save_checkpoint
    from broker.transfer_queue.client import AsyncTransferQueueClient, TransferQueueClient
    from broker.transfer_queue.dataloader import StreamingDataLoader, StreamingDataset
    from broker.transfer_queue.interface import (
        async_kv_batch_get,
        async_kv_batch_get_by_meta,
        async_kv_batch_put,
        async_kv_clear,
        async_kv_list,
        async_kv_put,
        close,
        get_client,
        get_metrics_endpoint,
        init,
        kv_batch_get,
        kv_batch_get_by_meta,
        kv_batch_put,
        kv_clear,
        kv_list,
        kv_put,
    )
    from broker.transfer_queue.metadata import BatchMeta, KVBatchMeta
    from broker.transfer_queue.sampler import (
        BaseSampler,
        GRPOGroupNSampler,
        RankAwareSampler,
        SeqlenBalancedSampler,
        SequentialSampler,
    )

#: TransferQueue's name for a key or index its storage does not hold.
StorageKeyNotFoundError = SampleNotFoundError

__version__ = "0.1.11"  # the TransferQueue release whose API this answers

#: The public names and the modules they load from on first use.
_LAZY = {
    "load_checkpoint": "broker.transfer_queue.checkpoint",
    "save_checkpoint": "broker.transfer_queue.checkpoint",
    "AsyncTransferQueueClient": "broker.transfer_queue.client",
    "TransferQueueClient": "broker.transfer_queue.client",
    "StreamingDataLoader": "broker.transfer_queue.dataloader",
    "StreamingDataset": "broker.transfer_queue.dataloader",
    "async_kv_batch_get": "broker.transfer_queue.interface",
    "async_kv_batch_get_by_meta": "broker.transfer_queue.interface",
    "async_kv_batch_put": "broker.transfer_queue.interface",
    "async_kv_clear": "broker.transfer_queue.interface",
    "async_kv_list": "broker.transfer_queue.interface",
    "async_kv_put": "broker.transfer_queue.interface",
    "close": "broker.transfer_queue.interface",
    "get_client": "broker.transfer_queue.interface",
    "get_metrics_endpoint": "broker.transfer_queue.interface",
    "init": "broker.transfer_queue.interface",
    "kv_batch_get": "broker.transfer_queue.interface",
    "kv_batch_get_by_meta": "broker.transfer_queue.interface",
    "kv_batch_put": "broker.transfer_queue.interface",
    "kv_clear": "broker.transfer_queue.interface",
    "kv_list": "broker.transfer_queue.interface",
    "kv_put": "broker.transfer_queue.interface",
    "BatchMeta": "broker.transfer_queue.metadata",
    "KVBatchMeta": "broker.transfer_queue.metadata",
    "BaseSampler": "broker.transfer_queue.sampler",
    "GRPOGroupNSampler": "broker.transfer_queue.sampler",
    "RankAwareSampler": "broker.transfer_queue.sampler",
    "SeqlenBalancedSampler": "broker.transfer_queue.sampler",
    "SequentialSampler": "broker.transfer_queue.sampler",
}

#: The submodules, loaded on first use as attributes (``tq.metadata``), as an eager package's are.
_SUBMODULES = frozenset({"checkpoint", "client", "config", "dataloader", "errors", "field_schema", "interface", "keys",
                         "metadata", "names", "sample_views", "sampler", "scripts", "system", "tensors"})


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        if name in _SUBMODULES:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups find it without this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, *_SUBMODULES})


__all__ = [
    # High-level KV interface
    "init",
    "close",
    "get_metrics_endpoint",
    "kv_put",
    "kv_batch_put",
    "kv_batch_get",
    "kv_batch_get_by_meta",
    "kv_list",
    "kv_clear",
    "async_kv_put",
    "async_kv_batch_put",
    "async_kv_batch_get",
    "async_kv_batch_get_by_meta",
    "async_kv_list",
    "async_kv_clear",
    "KVBatchMeta",
    # Checkpoints
    "save_checkpoint",
    "load_checkpoint",
    # Streaming data loader
    "StreamingDataset",
    "StreamingDataLoader",
    # Low-level interface
    "get_client",
    "BatchMeta",
    "TransferQueueClient",
    "AsyncTransferQueueClient",
    "StorageKeyNotFoundError",
    # Samplers
    "BaseSampler",
    "GRPOGroupNSampler",
    "SequentialSampler",
    "RankAwareSampler",
    "SeqlenBalancedSampler",
]
