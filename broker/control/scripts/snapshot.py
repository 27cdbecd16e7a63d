"""A dock's checkpoints: every key of the dock (and of a slice's keys beside it, such as a TransferQueue
system's) copied, or replaced, in one step; ``broker/api/snapshot.py`` reads the copies out and stages a
checkpoint's keys.

- lua/snapshot.lua: every key copied in the dock's slot at one moment (``snapshot``);
- lua/restore.lua: every key replaced by the staged keys of a checkpoint in one step, the epoch moved forward
  past every delivery handed out before (``restore``).

The keys are named by the client: the dock's from its schema and its named takes' records, and a slice's
(``SliceKeys``) as the slice lists them; the scripts check that the indexes they were listed from (``Index``:
the named takes' sorted set, a TransferQueue system's partitions hash) still list the same. The core knows
nothing of a slice's keys but these lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from broker.control.scripts.base import ScriptsBase


class Copied(NamedTuple):
    """One key of a system as ``snapshot`` found it: its name, where it was copied, its type ("none": it
    did not exist, nothing was copied) and its time to live in ms (-1: none)."""

    key: str
    copy: str
    type: str
    pttl: int


class Index(NamedTuple):
    """A key listing other keys (a hash's fields or a sorted set's members name them), and the members a
    client read of it: the scripts refuse to run (and the client reads again) once it lists other ones."""

    key: str
    members: tuple[str, ...]


class SliceKeys(NamedTuple):
    """Keys beside a dock's, in its slot, that its checkpoints take too: a slice's (a TransferQueue system's
    partitions, keys and tags), and the indexes they were listed from."""

    keys: list[str]
    indexes: list[Index]


def _indexes(indexes: Sequence[Index]) -> list[Any]:
    """The ARGV naming ``indexes``' members: their count, then per index its member count and members."""
    args: list[Any] = [len(indexes)]
    for index in indexes:
        args += [len(index.members), *index.members]
    return args


class SnapshotScripts(ScriptsBase):
    """Wrappers of snapshot and restore, for the dock named by the keys they are made with."""

    def _listed(self, extra: SliceKeys, records: Sequence[str]) -> tuple[list[str], list[Index]]:
        """Every key of the system (the dock's of the schema bound, ``extra``'s, the named takes' ``records``)
        and the indexes they were listed from."""
        k, schema = self._keys, self._pair[0]
        keys = k.every_key(schema.columns, schema.consumers, schema.rollout.age_buckets) + extra.keys + list(records)
        return keys, [Index(k.named_index, tuple(records)), *extra.indexes]

    def snapshot(self, run: str, extra: SliceKeys, records: Sequence[str],
                 ttl_ms: int) -> tuple[int, list[Copied]] | None:
        """Copy every key of the system to ``DockKeys.staged(run, key)`` at one moment, the copies living
        ``ttl_ms``; the server's time then (ms) and each key's ``Copied``. None if the indexes of ``extra`` or
        the named takes' ``records`` (the members of ``named_index``) list other keys now.

        The keys are those of the schema bound (``bind``): a grown dock fails the script's schema check.
        """
        k, expected = self._keys, self._pair[1]
        keys, indexes = self._listed(extra, records)
        copies = [k.staged(run, key) for key in keys]
        reply = self._call("snapshot", [k.meta, *(i.key for i in indexes), *keys, *copies],
                           [expected, len(keys), ttl_ms, *_indexes(indexes)])
        if int(reply[0]) == 0:
            return None
        kinds = reply[2:]
        found = [Copied(key, copy, kinds[2 * i].decode(), int(kinds[2 * i + 1]))
                 for i, (key, copy) in enumerate(zip(keys, copies))]
        return int(reply[1]), found

    def restore(self, run: str, extra: SliceKeys, records: Sequence[str],
                deadlines: Mapping[str, int], meta: Mapping[str, str], consumers: Sequence[str]) -> int | None:
        """Replace every key of the system (that of the schema bound, ``extra``'s and ``records``) by the keys
        staged under ``run``: ``deadlines`` maps each key to restore to when it expires (ms of server time, -1
        never); then write ``meta`` as the dock's meta, and move the epoch forward past the dock's and the
        saved one, the leases of ``consumers`` (those of ``meta``) to tokens no delivery has. The dock's epoch
        now; None if the indexes of ``extra`` or ``records`` list other keys now (nothing changed)."""
        k, expected = self._keys, self._pair[1]
        current, indexes = self._listed(extra, records)
        targets = list(deadlines)
        staged = [k.staged(run, key) for key in targets]
        tokens = [k.tokens(c) for c in consumers]
        pairs = [x for item in meta.items() for x in item]
        reply = self._once("restore", [k.meta, k.epoch, *(i.key for i in indexes), *current, *staged, *targets,
                                       *tokens],
                           [expected, len(current), len(staged), len(tokens), *_indexes(indexes),
                            *(deadlines[t] for t in targets), len(pairs), *pairs])
        return int(reply[2]) if int(reply[0]) == 1 else None
