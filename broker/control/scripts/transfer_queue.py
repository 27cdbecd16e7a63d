"""The TransferQueue adapter's scripts (broker/adapters/transfer_queue): samples as rows of a dock.

- lua/tq_rows.lua: rows for new samples of a partition, or for user keys (``rows``);
- lua/tq_release.lua: the rows of ended samples back to the free list (``release``);
- lua/tq_snapshot.lua: every key of the system copied in one step, for a checkpoint (``snapshot``);
- lua/tq_restore.lua: every key of the system replaced by a checkpoint's in one step (``restore``).

They touch only the adapter's keys (``DockKeys.tq_*``) and the dock's status bitmaps, all in the dock's
slot (the last two every key of the dock); the dock's own scripts never read the adapter's keys.
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


class TransferQueueScripts(ScriptsBase):
    """Wrappers of tq_rows and tq_release, for the dock named by the keys they are made with."""

    def rows(
        self, partition: str, capacity: int, *, count: int = 0, keys: Sequence[str] = (),
        columns: Sequence[str] = (), consumers: Sequence[str] = (),
    ) -> list[int]:
        """Rows for ``count`` new samples, or for ``keys`` (their rows, new ones for new keys), in order.

        ``columns`` and ``consumers``: every column and consumer of the dock, whose bits a reused row loses;
        the script checks that the dock holds the schema bound (``bind``), so none is missed.
        """
        k = self._keys
        status = [*(k.ready(c) for c in columns), *(k.consumed(c) for c in consumers)]
        reply = self._once("tq_rows", [k.tq_next, k.tq_free, k.tq_partitions, k.tq_rows(partition),
                                       k.tq_keys(partition), k.tq_rkeys(partition), k.meta, *status],
                           [partition, capacity, count, self._expected, *keys])
        return [int(r) for r in reply]

    def release(self, partition: str, rows: Sequence[int] = (), *, whole: bool = False) -> list[int]:
        """Release ``rows`` of ``partition`` (or, ``whole``, all of them and the partition); those released."""
        k = self._keys
        reply = self._once("tq_release", [k.tq_free, k.tq_rows(partition), k.tq_keys(partition),
                                          k.tq_rkeys(partition), k.tq_tags(partition), k.tq_partitions,
                                          k.tq_fields(partition)],
                           [partition, int(whole), *rows])
        return [int(r) for r in reply]

    def snapshot(self, run: str, partitions: Sequence[str], records: Sequence[str],
                 ttl_ms: int) -> tuple[int, list[Copied]] | None:
        """Copy every key of the system to ``DockKeys.staged(run, key)`` at one moment, the copies living
        ``ttl_ms``; the server's time then (ms) and each key's ``Copied``. None if ``partitions`` or the
        named takes' ``records`` (the members of ``named_index``) are not the system's any more.

        The keys are those of the schema bound (``bind``): a grown dock fails the script's schema check.
        """
        k, schema = self._keys, self._bound
        keys = k.tq_system(schema.columns, schema.consumers, schema.rollout.age_buckets, partitions, records)
        copies = [k.staged(run, key) for key in keys]
        reply = self._call("tq_snapshot", [k.meta, k.tq_partitions, k.named_index, *keys, *copies],
                           [self._expected, len(keys), ttl_ms, len(partitions), *partitions, len(records), *records])
        if int(reply[0]) == 0:
            return None
        kinds = reply[2:]
        found = [Copied(key, copy, kinds[2 * i].decode(), int(kinds[2 * i + 1]))
                 for i, (key, copy) in enumerate(zip(keys, copies))]
        return int(reply[1]), found

    def restore(self, run: str, partitions: Sequence[str], records: Sequence[str],
                deadlines: Mapping[str, int], meta: Mapping[str, str]) -> bool:
        """Replace every key of the system (that of the schema bound, ``partitions`` and ``records``) by
        the keys staged under ``run``: ``deadlines`` maps each key to restore to when it expires (ms of
        server time, -1 never); then write ``meta`` as the dock's meta. False if ``partitions`` or
        ``records`` are not the system's any more (nothing changed)."""
        k, schema = self._keys, self._bound
        current = k.tq_system(schema.columns, schema.consumers, schema.rollout.age_buckets, partitions, records)
        targets = list(deadlines)
        staged = [k.staged(run, key) for key in targets]
        pairs = [x for item in meta.items() for x in item]
        reply = self._once("tq_restore", [k.meta, k.tq_partitions, k.named_index, *current, *staged, *targets],
                           [self._expected, len(current), len(staged), len(partitions), *partitions, len(records),
                            *records, *(deadlines[t] for t in targets), len(pairs), *pairs])
        return int(reply[0]) == 1
