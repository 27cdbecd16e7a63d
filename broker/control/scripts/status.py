"""The status family: lua/status.lua, the one script run for many docks at once, outside any dock object."""

from __future__ import annotations

import hashlib
from typing import Any

from redis.client import Pipeline

from broker.connection import Client
from broker.control.keys import DockKeys
from broker.control.schema import Schema
from broker.control.scripts.functions import function_name
from broker.control.scripts.loader import script_text
from broker.control.scripts.runner import load_scripts


class StatusScript:
    """lua/status.lua: one dock's counts. Not a ``DockScripts`` method: callers queue it for many docks
    in one pipeline (``broker.control.status``), and it writes nothing, so it needs no Redis 7 flag."""

    text = script_text("status")
    sha = hashlib.sha1(text.encode()).hexdigest()

    @staticmethod
    def bitmaps(keys: DockKeys, schema: Schema) -> list[tuple[str, int]]:
        """Every bitmap the script counts, in its order, with the number of bits it may have."""
        rows, groups = schema.capacity, schema.prompts_num
        out = []
        for col in schema.columns:
            out += [(keys.ready(col), rows), (keys.group_ready(col), groups)]
        for consumer in schema.consumers:
            out += [(keys.consumed(consumer), rows), (keys.group_taken(consumer), groups)]
        out += [(keys.finished, rows), (keys.group_finished, groups)]
        out += [(keys.group_age(a), groups) for a in range(schema.rollout.age_buckets)]
        out += [(keys.group_wait(w), groups) for w in range(1, schema.rollout.age_buckets)]
        return out

    @classmethod
    def queue(cls, pipe: Pipeline, keys: DockKeys, schema: Schema, fingerprint: str, functions: bool = False) -> None:
        """Queue the read of the dock's counts; ``fingerprint`` is the schema the caller expects; ``functions``:
        as the loaded function (FCALL_RO, see ``functions.py``), else by EVALSHA."""
        rollout = schema.rollout
        bitmaps = [key for key, _ in cls.bitmaps(keys, schema)]
        rest = [kind(c) for c in schema.consumers for kind in (keys.leases, keys.redelivered, keys.dead)]
        responses = keys.data(rollout.response_columns[0]) if rollout.response_columns else keys.meta
        rest += [keys.version, keys.discarded, keys.group_versions, responses]
        staleness = "" if rollout.max_staleness is None else rollout.max_staleness
        run = ("FCALL_RO", function_name("status")) if functions else ("EVALSHA", cls.sha)
        pipe.execute_command(*run, 1 + len(bitmaps) + len(rest), keys.meta, *bitmaps, *rest, fingerprint,
                             len(bitmaps), staleness)

    @classmethod
    def parse(
        cls, reply: list[Any], keys: DockKeys, schema: Schema
    ) -> tuple[list[tuple[int, int]], list[tuple[int, Any, int]], tuple[Any, str, int, int], tuple[Any, Any]]:
        """(bits set, bytes) per bitmap, in ``bitmaps``' order; (leased rows, raw counter, dead letters) per
        consumer; (raw version, "field=count,..." discarded, stale groups, rows holding a response); (raw byte
        quota, raw bytes counted against it), empty without a quota."""
        bitmaps = 2 * len(cls.bitmaps(keys, schema))
        head, per_consumer, tail = reply[:bitmaps], reply[bitmaps:-6], reply[-6:]
        pairs = list(zip(head[0::2], head[1::2]))
        triples = list(zip(per_consumer[0::3], per_consumer[1::3], per_consumer[2::3]))
        text = tail[1].decode() if isinstance(tail[1], bytes) else str(tail[1])
        return pairs, triples, (tail[0], text, int(tail[2]), int(tail[3])), (tail[4], tail[5])

    @classmethod
    def load(cls, client: Client) -> None:
        """Load the script where the server lost it, or the library (``functions.py``) where it has none: the
        ``load`` of the status pipelines (``runner.run_pipeline``)."""
        load_scripts(client, [cls.text])
