"""The TransferQueue adapter's scripts (broker/adapters/transfer_queue): samples as rows of a dock.

- lua/tq_rows.lua: rows for new samples of a partition, or for user keys (``rows``);
- lua/tq_release.lua: the rows of ended samples back to the free list (``release``).

They touch only the adapter's keys (``DockKeys.tq_*``) and the dock's status bitmaps, all in the dock's
slot; the dock's own scripts never read the adapter's keys. A checkpoint of the system is the dock's
(``snapshot.py``), which names the adapter's keys too.
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.control.schema import Schema
from broker.control.scripts.base import ScriptsBase


class TransferQueueScripts(ScriptsBase):
    """Wrappers of tq_rows and tq_release, for the dock named by the keys they are made with."""

    def rows(
        self, partition: str, schema: Schema, fingerprint: str, *, count: int = 0, keys: Sequence[str] = (),
    ) -> list[int]:
        """Rows for ``count`` new samples, or for ``keys`` (their rows, new ones for new keys), in order.

        Every column and consumer of ``schema`` is a status bitmap a reused row loses; the script checks that
        the dock holds that schema (``fingerprint``, as stored), so none is missed. Both are arguments, not
        bound state: threads sharing these wrappers may hold different schemas while one follows a growth.
        """
        k = self._keys
        status = [*(k.ready(c) for c in schema.columns), *(k.consumed(c) for c in schema.consumers)]
        reply = self._once("tq_rows", [k.tq_next, k.tq_free, k.tq_partitions, k.tq_rows(partition),
                                       k.tq_keys(partition), k.tq_rkeys(partition), k.meta, *status],
                           [partition, schema.capacity, count, fingerprint, *keys])
        return [int(r) for r in reply]

    def release(self, partition: str, rows: Sequence[int] = (), *, whole: bool = False) -> list[int]:
        """Release ``rows`` of ``partition`` (or, ``whole``, all of them and the partition); those released."""
        k = self._keys
        reply = self._once("tq_release", [k.tq_free, k.tq_rows(partition), k.tq_keys(partition),
                                          k.tq_rkeys(partition), k.tq_tags(partition), k.tq_partitions,
                                          k.tq_fields(partition)],
                           [partition, int(whole), *rows])
        return [int(r) for r in reply]
