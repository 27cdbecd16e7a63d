"""A dock's checkpoints: every key of the dock (and of a TransferQueue system on it) copied, or replaced, in one
step; ``broker/api/snapshot.py`` reads the copies out and stages a checkpoint's keys.

- lua/snapshot.lua: every key copied in the dock's slot at one moment (``snapshot``);
- lua/restore.lua: every key replaced by the staged keys of a checkpoint in one step, the epoch moved forward
  past every delivery handed out before (``restore``).

The keys are named by the client (``DockKeys.tq_system``: the dock's from its schema, and the adapter's
partitions and the named takes' records, which the scripts check are still all of them); a plain dock has
none of the adapter's keys, and the scripts find them absent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from broker.control.scripts.base import ScriptsBase


class Copied(NamedTuple):
    """One key of a system as ``snapshot`` found it: its name, where it was copied, its type ("none": it
    did not exist, nothing was copied) and its time to live in ms (-1: none)."""

    key: str
    copy: str
    type: str
    pttl: int


class SnapshotScripts(ScriptsBase):
    """Wrappers of snapshot and restore, for the dock named by the keys they are made with."""

    def snapshot(self, run: str, partitions: Sequence[str], records: Sequence[str],
                 ttl_ms: int) -> tuple[int, list[Copied]] | None:
        """Copy every key of the system to ``DockKeys.staged(run, key)`` at one moment, the copies living
        ``ttl_ms``; the server's time then (ms) and each key's ``Copied``. None if ``partitions`` or the
        named takes' ``records`` (the members of ``named_index``) are not the system's any more.

        The keys are those of the schema bound (``bind``): a grown dock fails the script's schema check.
        """
        k, (schema, expected) = self._keys, self._pair
        keys = k.tq_system(schema.columns, schema.consumers, schema.rollout.age_buckets, partitions, records)
        copies = [k.staged(run, key) for key in keys]
        reply = self._call("snapshot", [k.meta, k.tq_partitions, k.named_index, *keys, *copies],
                           [expected, len(keys), ttl_ms, len(partitions), *partitions, len(records), *records])
        if int(reply[0]) == 0:
            return None
        kinds = reply[2:]
        found = [Copied(key, copy, kinds[2 * i].decode(), int(kinds[2 * i + 1]))
                 for i, (key, copy) in enumerate(zip(keys, copies))]
        return int(reply[1]), found

    def restore(self, run: str, partitions: Sequence[str], records: Sequence[str],
                deadlines: Mapping[str, int], meta: Mapping[str, str], consumers: Sequence[str]) -> int | None:
        """Replace every key of the system (that of the schema bound, ``partitions`` and ``records``) by
        the keys staged under ``run``: ``deadlines`` maps each key to restore to when it expires (ms of
        server time, -1 never); then write ``meta`` as the dock's meta, and move the epoch forward past
        the dock's and the saved one, the leases of ``consumers`` (those of ``meta``) to tokens no delivery
        has. The dock's epoch now; None if ``partitions`` or ``records`` are not the system's any more
        (nothing changed)."""
        k, (schema, expected) = self._keys, self._pair
        current = k.tq_system(schema.columns, schema.consumers, schema.rollout.age_buckets, partitions, records)
        targets = list(deadlines)
        staged = [k.staged(run, key) for key in targets]
        tokens = [k.tokens(c) for c in consumers]
        pairs = [x for item in meta.items() for x in item]
        reply = self._once("restore", [k.meta, k.tq_partitions, k.named_index, k.epoch, *current, *staged, *targets,
                                       *tokens],
                           [expected, len(current), len(staged), len(tokens), len(partitions), *partitions,
                            len(records), *records, *(deadlines[t] for t in targets), len(pairs), *pairs])
        return int(reply[2]) if int(reply[0]) == 1 else None
