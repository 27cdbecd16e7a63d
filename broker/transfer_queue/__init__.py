"""TransferQueue's API (the ``transferqueue`` package, 0.1.11) on the broker: code written for it runs after
``import transfer_queue as tq`` becomes ``import broker.transfer_queue as tq`` (docs/transfer_queue.md).

Samples are rows of one dock in Redis (``system.py``); every call goes from the caller's process to Redis:
no controller actor, no storage units, no Ray needed. Beyond TransferQueue: leases on ``get_meta`` and the
data loader (a reader that dies loses nothing), checkpoints that are consistent and atomic, and never a
pickle of anything read from Redis.
"""

from broker.errors import SampleNotFoundError
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
