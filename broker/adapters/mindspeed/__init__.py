"""MindSpeed-RL's data APIs on the broker: swap one import, keep the workers.

``GRPOTransferDock`` takes MindSpeed-RL's constructor and has every public method of its
``mindspeed_rl.trainer.utils.transfer_dock.GRPOTransferDock``, with the same parameters, return
values (padded batches as its ``padding_dict_to_tensor_dict`` builds them, a TensorDict where
``tensordict`` is installed, ``(None, None)`` when nothing is ready, indexes as lists of ints) and
error classes (``ValueError`` for bad input). ``TransferQueueClient`` has the methods of its
TransferQueue client (``mindspeed_rl/utils/transfer_queue/tq_client.py``); a topic is a dock on the
same server. Both keep everything in Redis, so any number of processes on any number of machines
may hold one, all attached to the same dock::

    from broker.adapters.mindspeed import GRPOTransferDock, Metric     # was: from mindspeed_rl.trainer.utils import ...
    td = GRPOTransferDock(prompts_num, n_samples_per_prompt, metrics=Metric(), url="redis://host:6379/0")

Recommended: create one in each worker process (no actor hop: each call goes straight to Redis).
Wrapped as a Ray actor, ``ray.remote(GRPOTransferDock).remote(...)``, it also runs existing
``ray.get(td.get_experience.remote(...))`` code unchanged, with every call through that one actor.

Keywords of both classes that MindSpeed lacks: ``lease=S`` (rows handed out at least once; the object
acks for the workers, as Kafka's auto-commit), ``wait_replicas`` and ``wait_timeout`` (the native dock's
durability); the attribute ``empty_wait`` bounds how long a sampling call that finds too few rows waits
for a put (default 0.05 s). Where MindSpeed's behaviour is a defect, ours differs deliberately: each
difference and its reason is in docs/mindspeed.md ("Deliberate differences from MindSpeed-RL").

Modules: ``metric`` (``Metric``), ``padding`` (MindSpeed's padded batches: ``padding_dict_to_tensor_dict``,
``remove_padding_tensor_dict_to_dict``, ``trans_input_to_experience``, also exported here), ``helpers`` (batch
format, indexes, errors), ``docked`` (what the two classes share), ``grpo_transfer_dock``,
``transfer_queue_client`` and ``defaults`` (MindSpeed's names).
Every call goes through the native dock's public API (``broker.TransferDock``).
"""

from broker.adapters.mindspeed.defaults import DEFAULT_COLUMNS, DEFAULT_CONSUMERS, DEFAULT_TOPIC
from broker.adapters.mindspeed.grpo_transfer_dock import GRPOTransferDock
from broker.adapters.mindspeed.metric import Metric
from broker.adapters.mindspeed.padding import (
    padding_dict_to_tensor_dict,
    remove_padding_tensor_dict_to_dict,
    trans_input_to_experience,
)
from broker.adapters.mindspeed.transfer_queue_client import TransferQueueClient, get_transfer_queue_client

__all__ = [
    "DEFAULT_COLUMNS",
    "DEFAULT_CONSUMERS",
    "DEFAULT_TOPIC",
    "GRPOTransferDock",
    "Metric",
    "TransferQueueClient",
    "get_transfer_queue_client",
    "padding_dict_to_tensor_dict",
    "remove_padding_tensor_dict_to_dict",
    "trans_input_to_experience",
]
