"""The TransferQueue slice's scripts (``lua/`` beside this module): samples as rows of a dock.

Registered with the core's script loader at import (``register_scripts``): the core runs them as it runs its
own (EVALSHA, or on Redis 7 FCALL of the slice's function library ``broker_tq_...``) without importing this
slice.

- lua/tq_rows.lua: rows for new samples of a partition, or for user keys (``rows``);
- lua/tq_release.lua: the rows of ended samples back to the free list (``release``);
- lua/tq_lookup.lua: the rows of keys, with the epoch and generations a read of them checks (``queue_lookup``,
  queued in the transaction that reads a partition's state);
- lua/tq_tags.lua: samples' tags written, fenced against clears and compared against other writers (``tags``);
- lua/tq_begin.lua and lua/tq_settled.lua: a put or clear of several steps announces itself unless a checkpoint
  is under way (``begin``), and a checkpoint holds new ones off and counts those under way (``settled``).

They touch only the slice's keys (``SystemKeys``, ``keys.py``) and the dock's status bitmaps, all in the
dock's slot; the dock's own scripts never read the slice's keys. A checkpoint of the system is the dock's
(``broker/api/snapshot.py``), given the slice's keys too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.client import Pipeline

from broker.control.schema import Schema
from broker.control.scripts.base import ScriptsBase
from broker.control.scripts.loader import register_scripts
from broker.control.scripts.results import Handout, runs_of
from broker.transfer_queue.keys import SystemKeys

#: The slice's scripts: name -> file in lua/ beside this module.
FILES = {name: f"{name}.lua" for name in ("tq_rows", "tq_release", "tq_lookup", "tq_tags", "tq_begin", "tq_settled")}

register_scripts("tq", Path(__file__).resolve().parent / "lua", FILES, read_only=("tq_lookup",))


@dataclass(frozen=True)
class SampleRows:
    """Rows lua/tq_rows.lua gave: one per key or new sample, in the order asked; the ``handout`` (the dock's
    epoch and the rows' generations then) that fences writes into them and reads of them; and per key
    whether this call gave it its row (``fresh``: a put that fails may give those back)."""

    rows: list[int]
    handout: Handout
    fresh: list[bool]


class TransferQueueScripts(ScriptsBase):
    """Wrappers of the slice's scripts, for the system whose dock is named by the keys they are made with."""

    _keys: SystemKeys

    def rows(
        self, partition: str, schema: Schema, fingerprint: str, *, count: int = 0, keys: Sequence[str] = (),
        place: int | str | None = None,
    ) -> SampleRows | None:
        """Rows for ``count`` new samples, or for ``keys`` (their rows, new ones for new keys), in order, with
        the handout that fences writes into them (and reads of them) against the adapter's clears.

        Every column and consumer of ``schema`` is a status bitmap a reused row loses; the script checks that
        the dock holds that schema (``fingerprint``, as stored), so none is missed. Both are arguments, not
        bound state: threads sharing these wrappers may hold different schemas while one follows a growth.
        ``place``: the place in creation order the partition takes if this call makes it (a sub-system of a
        system cut in several, systems.py); None: the next of this system's counter; ``"-"``: the partition
        must exist, else nothing is done and None is returned (take a place and call again).
        """
        k = self._keys
        status = [*(k.ready(c) for c in schema.columns), *(k.consumed(c) for c in schema.consumers)]
        reply = self._once("tq_rows", [k.tq_next, k.tq_free, k.tq_partitions, k.tq_rows(partition),
                                       k.tq_keys(partition), k.tq_rkeys(partition), k.meta, k.epoch, k.generations,
                                       k.tq_seq, k.tq_order(partition), *status],
                           [partition, schema.capacity, count, fingerprint, "" if place is None else place, *keys])
        if int(reply[0]) < 0:  # place "-", and the partition is gone: nothing done
            return None
        rows = [int(r) for r in reply[3:]]
        fresh = bytes(reply[2]).decode()
        return SampleRows(rows, Handout(tuple(runs_of(rows)), int(reply[0]), bytes(reply[1])),
                          [c == "1" for c in fresh])

    def release(self, partition: str, rows: Sequence[int] = (), *, whole: bool = False) -> list[int]:
        """Release ``rows`` of ``partition`` (or, ``whole``, all of them and the partition); those released."""
        k = self._keys
        reply = self._once("tq_release", [k.tq_free, k.tq_rows(partition), k.tq_keys(partition),
                                          k.tq_rkeys(partition), k.tq_tags(partition), k.tq_partitions,
                                          k.tq_fields(partition), k.tq_order(partition)],
                           [partition, int(whole), *rows])
        return [int(r) for r in reply]

    def queue_lookup(self, pipe: Pipeline, partition: str, keys: Sequence[str]) -> None:
        """Queue the lookup of ``keys`` in ``partition``; ``looked_up`` reads its reply."""
        k = self._keys
        self._queue(pipe, "tq_lookup", [k.tq_keys(partition), k.epoch, k.generations], list(keys))

    @staticmethod
    def looked_up(reply: Any) -> tuple[list[int | None], Handout]:
        """The rows of the keys looked up (None for a key the partition lacks), and the handout of the rows
        found: what a read of their bytes checks (``store.read``), as if they had been handed out then."""
        rows = [None if int(r) < 0 else int(r) for r in reply[2:]]
        return rows, Handout(tuple(runs_of([r for r in rows if r is not None])), int(reply[0]), bytes(reply[1]))

    def tags(self, partition: str, rows: Sequence[int], before: Sequence[bytes | None], after: Sequence[bytes],
             fence: Handout | None, *, compare: bool) -> bool:
        """Store ``after`` as the tags of ``rows`` (distinct), unless a clear took any of them since ``fence``
        (the handout of exactly these rows; FENCED: nothing written) or, with ``compare``, a row's tags are no
        longer ``before`` (False: nothing written; read and merge again). True once written."""
        k = self._keys
        runs = runs_of(rows)
        fenced: list[Any] = ["", b""] if fence is None else [fence.epoch, fence.generations]
        per_row: list[Any] = []
        for row, old, new in zip(rows, before, after):
            per_row += [row, old or b"", new]
        reply = self._call("tq_tags", [k.tq_tags(partition), k.epoch, k.generations],
                           [*fenced, int(compare), len(runs) // 2, *runs, *per_row])
        return bool(int(reply))

    def begin(self, write: str, ms: int) -> bool:
        """Register write ``write`` for ``ms`` milliseconds; False (nothing registered) while a checkpoint is
        under way."""
        k = self._keys
        return bool(int(self._call("tq_begin", [k.tq_saving, k.tq_writing], [write, ms])))

    def settled(self, checkpoint: str, ms: int) -> int:
        """Register (or renew) checkpoint ``checkpoint``, holding new writes off for ``ms`` milliseconds from
        now; how many writes are still under way."""
        k = self._keys
        return int(self._call("tq_settled", [k.tq_saving, k.tq_writing], [checkpoint, ms]))
