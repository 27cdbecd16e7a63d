"""A partitioned dock's record, ``td:{NAME}:partitions``: what it holds, how it is read and checked.

The record is JSON: ``format`` (``RECORD_FORMAT``), ``prompts_num``, ``n_samples_per_prompt``, ``block`` (the
groups dealt to a partition at a time, ``partition_map.py``) and ``partitions``, the names of the P partitions
(``NAME~pK``, docks of their own). lua/partition.lua stores it once every partition exists, unless a dock of one
partition has the name; lua/create.lua refuses to make a dock of one partition where it is. It sits in the slot
of NAME, read only when the dock is opened.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from broker.api.checks import is_int
from broker.api.dock import TransferDock
from broker.api.partition_map import PartitionMap
from broker.api.session import DockSession
from broker.connection import Client
from broker.control.keys import partition_of_name
from broker.control.schema import Schema
from broker.errors import DecodeError, SchemaError

#: Version of the record's JSON.
RECORD_FORMAT = 1


def root_session(target: str | Client, name: str, opening: dict[str, Any]) -> DockSession:
    """A session on the dock's own name: where its record is (and where a dock of one partition would be)."""
    durability = (opening["wait_replicas"], opening["wait_timeout"])
    return DockSession(target, name, opening["policy"], opening["seed"], durability, opening["call_timeout"],
                       opening["allow_volatile_eviction"])


def read_record(root: DockSession) -> dict[str, Any] | None:
    raw = root.run(lambda: root.client.get(root.keys.partitions))
    return None if raw is None else parse_record(root, raw)


def parse_record(root: DockSession, raw: bytes | str) -> dict[str, Any]:
    try:
        record = json.loads(raw)
        names = record["partitions"]
        ok = (record["format"] == RECORD_FORMAT and isinstance(names, list) and len(names) > 1
              and all(isinstance(n, str) and partition_of_name(n) == root.name for n in names)
              and is_int(record["prompts_num"]) and is_int(record["n_samples_per_prompt"])
              and is_int(record.setdefault("block", 1)) and record["block"] >= 1)  # records before blocks: 1
    except (ValueError, TypeError, KeyError, RecursionError):
        ok = False
    if not ok:
        raise DecodeError(f"{root.keys.partitions}: not a partitioned dock's record ({str(raw)[:120]})")
    return dict(record)


def first_differences(target: str | Client, record: dict[str, Any], wanted: Schema,
                       opening: dict[str, Any]) -> list[str]:
    """How partition 0's schema differs from ``wanted`` beside the dock's shape (columns, consumers, ...)."""
    with TransferDock.attach(target, record["partitions"][0], **opening) as first:
        mine = dataclasses.replace(wanted, prompts_num=first.prompts_num)
        return mine.differences(first.schema)


def check_shape(name: str, record: dict[str, Any], pmap: PartitionMap,
                 more: Callable[[], list[str]] = list) -> None:
    stored = {"prompts_num": record["prompts_num"], "n_samples_per_prompt": record["n_samples_per_prompt"],
              "partitions": len(record["partitions"])}
    wanted = {"prompts_num": pmap.prompts_num, "n_samples_per_prompt": pmap.n, "partitions": pmap.count}
    diff = [f"{k}: stored {stored[k]}, requested {wanted[k]}" for k in stored if stored[k] != wanted[k]]
    if diff:
        diff += more()
        raise SchemaError(f"dock {name!r} exists with a different schema: " + "; ".join(diff))
