"""The hand-out family: scripts that hand rows, or row indexes, out so that many callers at once never
get the same ones.

- lua/sample.lua: pick rows (or whole groups) written in every column a consumer asks for (``sample``);
- lua/take.lua: hand out rows the caller chose, once written (``take``);
- lua/prefetch.lua: the next row indexes of the batch for a rollout rank to write (``prefetch``);
- lua/reserve.lua: free groups for new prompts under partial rollout (``reserve``), and lua/unreserve.lua
  to give them back (``unreserve``).
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.control.scripts.base import ScriptsBase
from broker.control.scripts.results import (
    AlreadyTaken,
    Handout,
    Reservation,
    Sampled,
    Selection,
    numbers_of,
    runs_of,
)


class HandOutScripts(ScriptsBase):
    """Wrappers of the scripts that hand rows out: sample, take, prefetch, reserve (and unreserve)."""

    def sample(
        self, consumer: str, columns: Sequence[str], *, groups: bool, count: int, policy: str, seed: int,
        lease_ms: int, request_id: str, token: str, weigh_by: Sequence[str] = (), select: Selection | None = None,
    ) -> Sampled:
        """Pick ``count`` units (groups or rows) for ``consumer`` and mark them; no handout if too few qualify.

        ``weigh_by``: the length columns the ``"seqlen"`` policy sums; ``select``: see ``Selection``.
        """
        k, (schema, expected) = self._keys, self._pair
        select = select or Selection()
        status = k.group_ready if groups else k.ready
        keys = [k.meta, k.consumed(consumer), k.group_taken(consumer), k.leases(consumer), k.tokens(consumer),
                k.redelivered(consumer), k.scratch, k.epoch, k.generations, k.group_remnant(consumer),
                *(status(c) for c in columns), *select.require, *(k.lengths(c) for c in weigh_by), *select.tiers,
                *(key for c in select.unready for key in (k.ready(c), k.group_ready(c)))]
        if select.tiers:
            keys.append(k.scratch2)
        if select.max_staleness is not None:
            keys += [k.version, k.group_versions]
        if select.batch is not None:
            keys += [k.group_batch, k.scratch3]
        units = schema.prompts_num if groups else schema.capacity
        args = [expected, "groups" if groups else "rows", count, self._n, units, policy, seed, lease_ms,
                token, len(weigh_by), len(select.tiers), int(select.fewer), select.cap,
                len(select.unready), "" if select.max_staleness is None else select.max_staleness,
                "" if select.batch is None else select.batch]
        reply = self._once("sample", keys, args, request_id)
        if not reply:
            return Sampled(None)
        stale = numbers_of(reply[3])
        if int(reply[0]) < 0:
            return Sampled(None, stale)
        runs = tuple(int(x) for x in reply[5:])
        return Sampled(Handout(runs, int(reply[0]), reply[1], numbers_of(reply[2])), stale, int(reply[4]))

    def take(
        self, consumer: str, columns: Sequence[str], runs: Sequence[int], *, lease_ms: int, token: str,
        exclusive: bool = False, name: str = "", name_ms: int = 0, order: Sequence[int] = (),
    ) -> Handout | AlreadyTaken | dict[str, list[int]]:
        """Mark rows ``runs`` handed to ``consumer`` if written in every column; else the missing cells.

        ``exclusive``: refuse (AlreadyTaken, nothing marked) if one of them was handed to it already.
        ``name`` (kept ``name_ms``): the first take under a name records its rows, later ones get those
        rows back, in the ``order`` it gave (a Handout ``recorded``, ``fresh`` empty) and hand nothing out.
        """
        k = self._keys
        keys = [k.meta, *self._consumer_keys(consumer), k.redelivered(consumer), k.epoch, k.generations,
                k.named(name), k.named_index, k.group_remnant(consumer), *(k.ready(c) for c in columns)]
        reply = self._once("take", keys, [self._expected, self._n, lease_ms, token, int(exclusive),
                                          name_ms if name else 0, ",".join(map(str, order)) if name else "",
                                          *runs])
        if reply[0] == 1:
            return Handout(tuple(runs), int(reply[1]), reply[2], fresh=numbers_of(reply[3]))
        if reply[0] == 2:
            return AlreadyTaken(numbers_of(reply[1]))
        if reply[0] == 3:
            order = numbers_of(reply[3])
            return Handout(tuple(runs_of(order)), int(reply[1]), reply[2], fresh=(), recorded=True, order=order)
        missing: dict[str, list[int]] = {}
        for pos, row in zip(reply[1::2], reply[2::2]):
            missing.setdefault(columns[int(pos) - 1], []).append(int(row))
        return missing

    def prefetch(self, count: int) -> list[int] | None:
        """The next ``count`` rows of the batch for a rollout rank (fewer at its end); None once it is
        spent, or while the staleness bound's admission control refuses (lua/prefetch.lua)."""
        k, schema = self._keys, self._bound
        rollout = schema.rollout
        batch = rollout.gbs_train * self._n if rollout.bounded else 0
        reply = self._once("prefetch", [k.meta, k.cursor, k.admitted, k.version],
                           [self._expected, count, schema.capacity, batch, rollout.max_staleness or 0])
        if not reply or int(reply[0]) < 0:
            return None
        return list(range(int(reply[0]), int(reply[1])))

    def reserve(self, count: int, column: str) -> Reservation | None:
        """Claim ``count`` free groups for new prompts of ``column`` (lua/reserve.lua); None if too few are free."""
        k = self._keys
        reply = self._once("reserve", [k.meta, k.claimed, k.group_ready(column), k.scratch, k.epoch, k.generations],
                           [self._expected, count, self._bound.prompts_num, self._n])
        if not reply:
            return None
        return Reservation(tuple(int(g) for g in reply[2:]), int(reply[0]), bytes(reply[1]))

    def unreserve(self, reservation: Reservation) -> int:
        """Give back the groups of ``reservation`` that nothing forgot since (lua/unreserve.lua); how many."""
        k = self._keys
        return int(self._once("unreserve", [k.meta, k.claimed, k.epoch, k.generations],
                              [self._expected, self._n, reservation.epoch, reservation.generations,
                               *reservation.groups]))
