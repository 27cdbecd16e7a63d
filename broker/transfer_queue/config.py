"""The adapter's configuration: TransferQueue's conf keys that mean something here, the broker's own, and
where Redis is.

A conf written for TransferQueue (its ``config.yaml``, an OmegaConf ``DictConfig`` or a plain dict) is
accepted as it is: keys that mean nothing here (its ZMQ ports, storage units, Mooncake and Yuanrong
settings) are ignored with one log line naming them, not refused. ``config.yaml`` beside this module shows
the defaults (``DEFAULTS``, checked equal by the tests).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from broker.errors import SchemaError

log = logging.getLogger(__name__)

#: The defaults, as config.yaml gives them.
DEFAULTS: dict[str, Any] = {
    "metrics": {"enabled": False, "port": 0},
    "controller": {"sampler": "SequentialSampler", "polling_mode": False},
    "backend": {"storage_backend": "SimpleStorage", "SimpleStorage": {"total_storage_size": None}},
    "broker": {
        "url": None,
        "namespace": "default",
        "capacity": 1 << 20,
        "get_meta_timeout": 5.0,
        "call_timeout": 30.0,
        "lease": None,
        "stack_uniform": False,
        "partitions": 1,
    },
}

#: The most sub-systems one system may be cut into (``broker.partitions``, systems.py), as a partitioned dock's.
MAX_PARTITIONS = 1024

#: Keys of TransferQueue's conf that are read: every other one is ignored (logged once per init).
_USED = {
    ("metrics", "enabled"), ("metrics", "port"), ("metrics", "endpoint"),
    ("controller", "sampler"), ("controller", "polling_mode"),
    ("backend", "storage_backend"), ("backend", "SimpleStorage", "total_storage_size"),
}


def plain(conf: Any) -> dict[str, Any]:
    """``conf`` (None, a Mapping, or an OmegaConf DictConfig) as nested plain dicts; objects kept as they are."""
    if conf is None:
        return {}
    if not isinstance(conf, Mapping):
        if not _is_mapping(conf):
            raise SchemaError(f"conf must be a dict or an OmegaConf DictConfig, got {type(conf).__name__}")
        from omegaconf import OmegaConf  # a DictConfig: only its own library turns it into plain containers

        container = OmegaConf.to_container(conf, resolve=True)
        if not isinstance(container, dict):
            raise SchemaError(f"conf must be a mapping, got a {type(container).__name__}")
        return {str(k): v for k, v in container.items()}
    return {str(k): (plain(v) if _is_mapping(v) else v) for k, v in conf.items()}


def _is_mapping(value: Any) -> bool:
    if isinstance(value, Mapping):
        return True
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return False
    return bool(OmegaConf.is_config(value))


def merged(conf: Any) -> dict[str, Any]:
    """The defaults with ``conf`` over them; keys that mean nothing here are logged and kept (ignored)."""
    out = copy.deepcopy(DEFAULTS)
    ignored: list[str] = []
    _merge(out, plain(conf), (), ignored)
    if ignored:
        log.info("broker.transfer_queue ignores conf keys that mean nothing on Redis: %s", ", ".join(ignored))
    _check(out)
    return out


def _merge(into: dict[str, Any], conf: Mapping[str, Any], path: tuple[str, ...], ignored: list[str]) -> None:
    for key, value in conf.items():
        here = (*path, key)
        if here[0] == "broker" or here in _USED:
            if isinstance(value, Mapping) and isinstance(into.get(key), dict):
                _merge(into[key], value, here, ignored)
            else:
                into[key] = value
        elif isinstance(value, Mapping) and any(u[: len(here)] == here for u in _USED):
            _merge(into.setdefault(key, {}), value, here, ignored)
        else:
            into[key] = value
            if value is not None:
                ignored.append(".".join(here))


def _check(conf: dict[str, Any]) -> None:
    b = conf["broker"]
    total = conf["backend"].get("SimpleStorage", {}).get("total_storage_size")
    for name, value, low in (("broker.capacity", b["capacity"], 1),
                             ("backend.SimpleStorage.total_storage_size", total, 1)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise SchemaError(f"{name} must be an int >= {low}, got {value!r}")
    for name in ("get_meta_timeout", "call_timeout"):
        value = b[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise SchemaError(f"broker.{name} must be a number of seconds > 0, got {value!r}")
    parts = b["partitions"]
    if isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= MAX_PARTITIONS:
        raise SchemaError(f"broker.partitions must be an int in 1..{MAX_PARTITIONS}, got {parts!r:.40}")
    if not isinstance(b["stack_uniform"], bool):
        raise SchemaError(f"broker.stack_uniform must be true or false, got {b['stack_uniform']!r}")
    lease = b["lease"]
    if lease is not None and (isinstance(lease, bool) or not isinstance(lease, (int, float)) or not lease > 0):
        raise SchemaError(f"broker.lease must be None or a number of seconds > 0, got {lease!r}")
    if conf["backend"].get("storage_backend") not in (None, "SimpleStorage"):
        log.info("broker.transfer_queue keeps every backend's data in Redis; storage_backend=%r is ignored",
                 conf["backend"]["storage_backend"])


def capacity_of(conf: Mapping[str, Any]) -> int:
    """How many samples may be alive at once."""
    total = conf["backend"].get("SimpleStorage", {}).get("total_storage_size")
    return int(total if total is not None else conf["broker"]["capacity"])
