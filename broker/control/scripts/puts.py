"""The puts family: the steps of a put that mark rows written (its bytes go through ``broker.data.slot_store`` or
``broker.data.sharded_store``).

- on one slot, one MULTI: a bar on the HSETs (plain commands), lua/put.lua (check, lift the bar, mark), the
  HSETs, then the bar undone where it stayed (``bar``, ``put``, ``unbar``; see lua/put.lua);
- on a sharded dock: lua/claim.lua when the put names a delivery (``claim``), the bytes to the data shards,
  then lua/mark.lua (``mark``);
- a leased put of several steps (sharded, or in slices) holds its lease with claim.lua and gives it back
  its own deadline with lua/unhold.lua when it ends (``unhold``).

``claim`` is here rather than with the leases: it is the first step of a sharded put, and it reads the
lease of the delivery a put names the way put.lua and mark.lua do (``_lease_keys``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.client import Pipeline

from broker.control.scripts.base import ScriptsBase
from broker.control.scripts.results import NO_FINISH, Fence, Finish, Hold, Marked, numbers_of

#: What the bar leaves in place of a hash a put writes until put.lua lifts it (see ``PutScripts.bar``).
BAR = "barred until lua/put.lua lets the put land"


class PutScripts(ScriptsBase):
    """Wrappers of the scripts of a put (put, claim, mark) and the plain commands around put.lua (bar, unbar)."""

    def bar(self, pipe: Pipeline, columns: Sequence[str]) -> int:
        """Queue the first step of a put on one slot, before put.lua: each hash its HSETs write set aside and a
        string left in its place, on which HSET fails (lua/put.lua lifts the bar when the put lands). Plain
        commands: nothing the server can lose (cached scripts, the function library) keeps the bytes of a put
        that was not checked from landing. A RENAME of a hash that does not exist is an error, and harmless.
        Returns how many commands."""
        for plain, aside in self._barred(columns):
            pipe.execute_command("RENAME", plain, aside)
            pipe.execute_command("SET", plain, BAR)
        return self.barred_commands(len(columns))

    @staticmethod
    def barred_commands(columns: int) -> int:
        """How many commands ``bar`` (and ``unbar``) queue for a put of ``columns`` columns."""
        return 4 * columns

    def lands(self, pipe: Pipeline, columns: Sequence[str]) -> None:
        """Queue, after put.lua, the TYPE of the put's first data key: "string" while the bar stands (the put
        does not land, and its HSETs fail by design), a hash or none once put.lua lifted it (``landed``)."""
        pipe.execute_command("TYPE", self._keys.data(columns[0]))

    @staticmethod
    def landed(reply: object) -> bool:
        """Whether ``lands``'s reply says the bar was lifted."""
        return reply not in (b"string", "string")

    @classmethod
    def verdict(cls, replies: list[Any], columns: int) -> Any:
        """put.lua's reply among the EXEC replies of a put on one slot of ``columns`` columns (after ``bar``'s)."""
        return replies[cls.barred_commands(columns)]

    @classmethod
    def outcome(cls, replies: list[Any], columns: int) -> BaseException | None:
        """The error of a put on one slot of ``columns`` columns from its EXEC replies (``bar``, put.lua,
        ``lands``, the HSETs, ``unbar``: see lua/put.lua), or None if it landed.

        put.lua's reply is the verdict: an error (refused, fenced, or the script not run: NOSCRIPT, a lost
        function library) or the put's counts, kept ones for a resend. Only where it lifted the bar did the
        HSETs write, and can have failed of their own; where the bar stayed they fail by design. The bar's
        RENAMEs and GETDELs answer errors where there is nothing to move, which change nothing.
        """
        barred = cls.barred_commands(columns)
        verdict, lands = cls.verdict(replies, columns), replies[barred + 1]
        if isinstance(verdict, Exception):
            return verdict
        if cls.landed(lands):
            for reply in replies[barred + 2 : len(replies) - barred]:
                if isinstance(reply, Exception):
                    return reply
        return None

    def put(
        self, pipe: Pipeline, columns: Sequence[str], runs: Sequence[int], lengths: dict[str, list[int]],
        finish: Finish | None, request_id: str, fence: Fence | None = None, ack: bool = False, nbytes: int = 0,
        ahead: tuple[int, Sequence[int]] = (0, ()), group_values: Sequence[tuple[int, int, Any]] = (),
    ) -> None:
        """Queue lua/put.lua, which checks a put on one slot and marks rows ``runs`` of ``columns`` written,
        with what a rollout put records beside them (``finish``), and lifts the bar (``bar``) off the HSETs
        that follow it where the put lands. With ``fence``, the put lands only while that delivery is
        current; with ``ack`` too, it ends the delivery's lease of its rows. ``unbar`` follows the HSETs.

        ``lengths`` holds, per length column written, its rows' values in the order of ``runs``; ``nbytes``,
        the bytes of the values the HSETs write, counted against the dock's quota (lua/include/quota.lua);
        ``ahead``, for the first slice of a put in slices, the bytes and the runs of the rest of the put,
        checked against the quota with it (none counted); ``group_values``, for each group of which the put
        writes some rows only, in a group column: (the column's position in ``columns``, the group, the value
        written), which must equal what the group's other ready rows read (data/groups.py).
        """
        k = self._keys
        leased = fence is not None and bool(fence.token)
        keys = [k.meta, k.epoch, k.generations, *self._lease_keys(fence)]
        keys += [kind(c) for c in columns for kind in (k.data, k.tail, k.ready, k.group_ready, k.aside, k.tail_aside)]
        keys += [k.lengths(c) for c in lengths] + (self._finish_keys() if finish else [])
        fenced = ["1", fence.epoch, fence.generations, fence.token] if fence else ["0", 0, b"", ""]
        args = [self._expected, self._n, k.events, self.publish, len(lengths),
                *(finish.args() if finish else NO_FINISH), *fenced, "1" if ack and leased else "0", len(runs),
                *runs, *(v for values in lengths.values() for v in values), *(finish.flag_args() if finish else []),
                nbytes, ahead[0], ",".join(map(str, ahead[1])), *(x for given in group_values for x in given),
                len(group_values)]
        self._queue_once(pipe, "put", keys, args, request_id)

    def unbar(self, pipe: Pipeline, columns: Sequence[str]) -> int:
        """Queue the last step of a put on one slot, after its HSETs: where the bar stayed, a GETDEL deletes its
        string, then each key set aside goes back in its place (RENAME; whatever it held, a corrupt string
        too). Where put.lua lifted the bar the key is a hash or absent (put.lua checked what was set aside),
        so the GETDEL is a WRONGTYPE error or nothing, and nothing is left aside to RENAME: errors that change
        nothing. Returns how many commands."""
        for plain, aside in self._barred(columns):
            pipe.execute_command("GETDEL", plain)
            pipe.execute_command("RENAME", aside, plain)
        return self.barred_commands(len(columns))

    def _barred(self, columns: Sequence[str]) -> list[tuple[str, str]]:
        """Every hash a put's HSETs may write (data/fit.py: a cut row's tail too), with where the bar sets it
        aside."""
        k = self._keys
        return [pair for c in columns for pair in ((k.data(c), k.aside(c)), (k.tail(c), k.tail_aside(c)))]

    def _lease_keys(self, fence: Fence | None) -> list[str]:
        """td:{NAME}:tokens:CONSUMER and td:{NAME}:leases:CONSUMER of the lease ``fence`` names; the meta key
        twice without one (the scripts then leave them alone)."""
        k = self._keys
        if fence is None or not fence.token:
            return [k.meta, k.meta]
        return [k.tokens(fence.consumer), k.leases(fence.consumer)]

    def _finish_keys(self) -> list[str]:
        """The keys of lua/include/finish.lua, in its order."""
        k = self._keys
        return [k.finished, k.group_finished, k.rows_finished, k.group_rolled, k.age(0), k.group_age(0),
                k.group_versions, *self._consumer_keys(self._bound.rollout.consumer)]

    def mark(
        self, columns: Sequence[str], runs: Sequence[int], lengths: dict[str, list[int]], epoch: int,
        generations: bytes, finish: Finish | None = None, fence: Fence | None = None, request_id: str | None = None,
        ack: bool = False,
    ) -> Marked:
        """Mark rows ``runs`` of ``columns`` ready after their bytes went to the data shards under
        ``epoch`` and ``generations``, with what ``finish`` records (lua/mark.lua): unless a clear moved
        them meanwhile, or the lease of the delivery ``fence`` names is no longer its own (FencedError).
        With ``ack``, the put ends that lease of its rows."""
        k = self._keys
        token = fence.token if fence else ""
        keys = [k.meta, k.epoch, k.generations, *self._lease_keys(fence)]
        keys += [key for c in columns for key in (k.ready(c), k.group_ready(c))]
        keys += [k.lengths(c) for c in lengths] + (self._finish_keys() if finish else [])
        args = [self._expected, self._n, k.events, self.publish, len(lengths), epoch, generations, token,
                "1" if ack and token else "0", *(finish.args() if finish else NO_FINISH), len(runs), *runs,
                *(v for values in lengths.values() for v in values), *(finish.flag_args() if finish else [])]
        reply = self._once("mark", keys, args, request_id)
        if int(reply[0]) >= 0:
            return Marked(int(reply[0]))
        return Marked(0, numbers_of(reply[2]), epoch_moved=int(reply[1]) != epoch)

    def claim(
        self, runs: Sequence[int], fence: Fence, hold_ms: int, steps: Sequence[tuple[str, int]] = (),
    ) -> Hold:
        """Check, before a put of several steps sends its bytes, that the delivery ``fence`` names still holds
        the rows, and hold its lease for ``hold_ms`` (lua/claim.lua); FencedError if it does not. ``steps``:
        the request id of each of the put's steps and how many of the rows (in run order) it writes; a step
        whose reply is kept landed already (the put is resumed), and its rows are left out. Returns what
        ``unhold`` gives back when the put ends, and the steps that landed."""
        k = self._keys
        keys = [k.meta, k.epoch, k.generations, *self._lease_keys(fence), *(k.reply(rid) for rid, _ in steps)]
        reply = self._call("claim", keys, [self._expected, fence.epoch, fence.generations, fence.token, hold_ms,
                                           len(steps), *(count for _, count in steps), *runs])
        landed = int(reply[1])
        return Hold(fence, int(reply[0]), [bytes(x) if isinstance(x, (bytes, bytearray)) else str(x).encode()
                                           for x in reply[2 + landed :]],
                    frozenset(int(x) for x in reply[2 : 2 + landed]))

    def unhold(self, hold: Hold) -> int:
        """Give each row ``claim`` held its lease's own deadline back (lua/unhold.lua); how many got it."""
        if not hold.moved:
            return 0
        k = self._keys
        keys = [k.meta, *self._lease_keys(hold.fence)]
        return int(self._call("unhold", keys, [self._expected, hold.fence.token, hold.until_ms, *hold.moved]))
