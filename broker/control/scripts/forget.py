"""The forget family: the scripts that forget rows, on every key of the dock (lua/include/forget.lua).

- lua/clear.lua: forget rows, the whole dock, or end a partial-rollout iteration (``clear``);
- lua/discard.lua: drop or regenerate whole groups, counted: rejected or stale (``discard``).

Both take the dock's keys in one layout (``_forget_layout``) and answer with ``Forgot``: on a sharded
dock, what the client must delete from the data shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from broker.control.schema import Schema
from broker.control.scripts.base import ScriptsBase
from broker.control.scripts.results import Fence, Forgot


class ForgetScripts(ScriptsBase):
    """Wrappers of the scripts that forget rows: clear, discard."""

    def _forget_layout(self, schema: Schema) -> tuple[list[str], list[Any]]:
        """The KEYS and ARGV[2..6] of the scripts that forget rows (lua/include/forget.lua), for ``schema``."""
        k = self._keys
        keys = [k.meta, k.epoch, k.generations]
        per_column: tuple[Callable[[str], str], ...] = (k.data, k.tail, k.ready, k.group_ready)
        per_consumer: tuple[Callable[[str], str], ...] = (k.consumed, k.group_taken, k.leases, k.tokens, k.redelivered,
                                                          k.failures, k.dead, k.group_remnant)
        keys += [kind(c) for kind in per_column for c in schema.columns]
        keys += [kind(c) for kind in per_consumer for c in schema.consumers]
        keys += [k.lengths(c) for c in schema.length_columns] + k.batch_keys
        keys += k.rollout_keys(schema.rollout.age_buckets)
        args = [len(schema.columns), len(schema.consumers), self._n, len(schema.length_columns),
                schema.rollout.age_buckets]
        return keys, args

    def clear(self, rows: Sequence[int] = (), *, iteration_of: str | None = None, age: bool = True,
              trained_elsewhere: bool = False) -> Forgot:
        """Forget ``rows`` (all rows when empty), or end the iteration of consumer ``iteration_of``
        (ageing the groups kept unless not ``age``; with ``trained_elsewhere``, a partition's share of an
        iteration that trained in some partition, even if the consumer trained nothing here), or with
        ``iteration_of=""`` only age them (lua/clear.lua); returns the cells removed from data hashes, and
        what to delete from shards."""
        schema, expected = self._pair
        keys, layout = self._forget_layout(schema)
        responses = schema.rollout.response_columns
        first_response = schema.columns.index(responses[0]) + 1 if responses else 0
        if iteration_of == "":
            mode: list[Any] = ["age", 0, first_response]
        elif iteration_of is not None:
            name = ("share" if trained_elsewhere else "iteration") if age else "trained"
            mode = [name, schema.consumers.index(iteration_of) + 1, first_response]
        else:
            mode = ["rows", *rows] if rows else ["all"]
        keys += [self._keys.scratch, self._keys.scratch2]
        return Forgot.parse(self._once("clear", keys, [expected, *layout, *mode]))

    def discard(
        self, groups: Sequence[int], *, regenerate: bool, field: str, max_staleness: int | None,
        placeholders: dict[str, bytes] | None = None, fence: Fence | None = None,
    ) -> Forgot:
        """Drop or regenerate ``groups``, counted under ``field`` (lua/discard.lua); returns how many were,
        and what to delete from the data shards.

        ``max_staleness``: discard only groups still older than the current version minus it.
        ``placeholders``: the encoded placeholder of each response column, written by "regenerate".
        ``fence``: the delivery the groups' rows came in (its generations of the groups' rows, ascending):
        the drop is refused (FencedError) unless it still holds them.
        """
        schema, expected = self._pair
        keys, layout = self._forget_layout(schema)
        keep = [schema.columns.index(c) + 1 for c in schema.rollout.prompt_columns] if regenerate else []
        pairs = [x for c, b in (placeholders or {}).items() for x in (schema.columns.index(c) + 1, b)]
        fenced: list[Any] = [0, 0, b"", ""]
        if fence:  # without a lease only the generations fence the drop: any consumer's position will do
            fenced = [schema.consumers.index(fence.consumer) + 1 if fence.token else 1, fence.epoch,
                      fence.generations, fence.token]
        args = [expected, *layout, "regenerate" if regenerate else "drop", field,
                "" if max_staleness is None else max_staleness, *fenced, len(keep), *keep, len(pairs) // 2, *pairs,
                *groups]
        return Forgot.parse(self._once("discard", keys + [self._keys.admitted, self._keys.version], args))
