"""TransferQueue's samplers (``transfer_queue.sampler``): the same constructors, choices and ``_states`` cache.

On the broker a sampler runs in the caller's process over the candidates read from Redis; the client
claims the chosen rows atomically. ``BaseSampler``'s ``cached``/``remember``/``forget``/``cached_results``
let the client mirror the ``_states`` cache across processes (see ``base.py``).
"""

from broker.transfer_queue.sampler.base import BaseSampler, CachedResult
from broker.transfer_queue.sampler.grpo_group_n_sampler import GRPOGroupNSampler
from broker.transfer_queue.sampler.rank_aware_sampler import RankAwareSampler
from broker.transfer_queue.sampler.seqlen_balanced_sampler import CustomMetaSource, SeqlenBalancedSampler
from broker.transfer_queue.sampler.sequential_sampler import SequentialSampler

__all__ = ["BaseSampler", "SequentialSampler", "GRPOGroupNSampler", "RankAwareSampler", "SeqlenBalancedSampler",
           "CachedResult", "CustomMetaSource"]
