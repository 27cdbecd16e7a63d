"""``SlotStore``: a dock's row bytes in the dock's own slot (``td:{NAME}:data:COLUMN``, field = row), as on
one Redis server (``store.py`` holds the interface both stores have; ``sharded_store.py`` the other one).

A put is one MULTI holding a bar on the HSETs (plain commands), the checking and marking script
(lua/put.lua) that lifts it, the HSETs, and the bar's undoing where it stayed (also when the script
could not run: lost scripts or function library), so nothing is ever ready without
its bytes, a put that must not land (a resend of one that did, a delivery no longer current) writes
nothing, and a clear deletes bytes inside its own script. A put of more than ``SLICE_BYTES`` is one
such MULTI per slice of whole groups, sent back to back (``slices.py``): each slice lands whole or
not at all, checked, marked (and acked) on its own. So a put that fails part way
(its delivery taken over explicitly, the server gone) may leave earlier slices' rows written and
ready, and says which; a clear landing between two slices clears the rows of those before it only.
With a lease, claim.lua first holds it for the put's time bound, so it cannot run out between slices.
The slices' request ids follow from the put's (``PutRequest.request_id``; ``resend_id`` for a leased
put that acks, the same in every sending of the same put), so a put run again (the session adopting a
schema another process grew between two slices) or sent again (cut short) finds the slices that
landed by their kept replies (claim.lua for a leased one; put.lua's kept reply otherwise): they are
not written again, and the rest is.
A row just past one of the server allocator's size classes is cut in two, its tail kept in
``td:{NAME}:tail:COLUMN`` and read in one transaction with its head (``fit.py`` says why and how).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import redis
import torch
from redis.client import Pipeline
from redis.cluster import RedisCluster

from broker.connection import Client, frames
from broker.connection.replies import RespReader, exchange, transaction
from broker.connection.translate import script_error
from broker.control.keys import DockKeys
from broker.control.scripts import (
    DockScripts,
    Forgot,
    Handout,
    read_pipeline,
    resent_once,
    rows_of,
    run_pipeline,
    runs_of,
    scripts_lost,
)
from broker.data import fit, groups, stacking
from broker.data.lanes import Lanes
from broker.data.requests import PutRequest, step_id
from broker.data.slices import UNKNOWN, UNSENT, Outcome, said_landed, slices
from broker.data.store import few, unhold
from broker.errors import FencedError


class SlotStore:
    """The bytes in the dock's own slot; a put is one MULTI per slice (see the module docstring). Group
    columns hold one field per group (see data/groups.py): a put hands their fields ready-made, a read asks
    for each group's once and hands every row its group's bytes."""

    def __init__(
        self, client: Client, keys: DockKeys, scripts: DockScripts, columns: Sequence[str],
        group_columns: Sequence[str] = (), n_samples_per_prompt: int = 1, cuts: bool = True,
    ):
        self._client, self._keys, self._scripts, self._columns = client, keys, scripts, tuple(columns)
        self._groups, self._n = frozenset(group_columns), n_samples_per_prompt
        #: Whether reads may receive rows straight into tensors (connection/replies.py): one server, and
        #: connections opened by broker.connection.
        self._receives = isinstance(client, redis.Redis) and frames(client)
        #: Whether a put cuts rows to the server allocator's size classes (data/fit.py): when asked to (not
        #: on a server that says it allocates otherwise, see DockSession.cuts), on connections opened by
        #: broker.connection, which send both halves from the rows' own memory. fakeredis stores rows whole.
        self._cuts = cuts and frames(client)
        #: Columns known to hold cut rows (cut by a put here, or a head seen in a read): their reads fetch
        #: heads and tails in one transaction. Only ever grows; a set's add is atomic under the GIL.
        self._cut: set[str] = set()
        self._lanes = Lanes(client, scripts, keys.name, self._queue, self._receives)

    def _hmgets(self, pipe: Pipeline, columns: Sequence[str], rows: Sequence[int]) -> list[list[int] | None]:
        """Queue one HMGET per column; per column, the positions to expand a group column's reply by."""
        fields = [str(r) for r in rows]
        expansions: list[list[int] | None] = []
        for col in columns:
            if col in self._groups:
                group_fields, positions = groups.read_fields(rows, self._n)
                pipe.hmget(self._keys.data(col), group_fields)
                expansions.append(positions)
            else:
                pipe.hmget(self._keys.data(col), fields)
                expansions.append(None)
        return expansions

    def put(self, put: PutRequest) -> None:
        if self._cuts:
            put = fit.cut_put(put, skip=self._groups)
        parts = slices(put, self._n)
        if len(parts) == 1:
            error = self._put_one(put, put.request_id)
            if error is not None:
                raise error
            return
        # Each slice's request id follows from the put's, so a put run again (the session adopting a schema
        # another process grew between two slices) or a leased put sent again (cut short by its time bound:
        # resend_id) finds the slices that landed by their kept replies: they are not written twice, and the
        # rest is written.
        request_ids = [step_id(put.resend_id or put.request_id, part.runs) for part in parts]
        hold = None
        landed: frozenset[int] = frozenset()
        if put.fence is not None and put.fence.token:
            # The lease must not run out between slices and go to another worker, who would write the
            # same rows (claim.lua holds it for the put's time bound; each slice acks its own rows; the
            # rows not acked get their lease's own deadline back when the put ends: lua/unhold.lua). It
            # also says which slices of a put sent again landed before: their rows were acked by them.
            steps = [(rid, len(rows_of(part.runs))) for rid, part in zip(request_ids, parts)]
            hold = self._scripts.claim(put.runs, put.fence, put.hold_ms, steps)
            landed = hold.landed
            if len(landed) == len(parts):  # as for a put of one step sent again: its rows are acked, and stand
                unhold(self._scripts, hold, self._keys.name)
                raise FencedError(
                    f"dock {self._keys.name!r}: rows {few(rows_of(put.runs))} were written and acked by this delivery "
                    "already (an earlier sending of this same put landed whole); nothing was written")
        try:
            self._put_sliced(parts, request_ids, landed)
        finally:
            if hold is not None:
                unhold(self._scripts, hold, self._keys.name)

    def _put_sliced(self, parts: Sequence[PutRequest], request_ids: Sequence[str], landed: frozenset[int]) -> None:
        """The slices of a put but those ``landed`` before: the first alone, the others back to back; raises
        naming the rows that landed where one did not, or where the put was cut short."""
        todo = [i for i in range(len(parts)) if i not in landed]
        outcomes: list[Outcome] = [None if i in landed else UNSENT for i in range(len(parts))]
        try:
            if not todo:
                return
            # The first slice alone: a server that lost the scripts (NOSCRIPT, see run_pipeline) costs one slice
            # sent twice, not the batch; it is checked against the dock's quota for the whole put (lua/put.lua),
            # so a put past it writes nothing at all. The others back to back, so the server writes one while
            # the next travels.
            first, rest = todo[0], todo[1:]
            ahead = [r for i in rest for r in rows_of(parts[i].runs)]
            outcomes[first] = UNKNOWN
            try:
                outcomes[first] = self._put_one(parts[first], request_ids[first],
                                                ahead=(sum(parts[i].nbytes for i in rest), runs_of(ahead)))
            except redis.ResponseError as exc:  # refused as it was queued (OOM): a reply, the slice not run
                outcomes[first] = exc
            if outcomes[first] is None and rest:  # refused, the others would be too (fenced, the dock gone, ...)
                self._put_slices(parts, request_ids, rest, outcomes)
        except redis.RedisError as exc:  # cut short (the call's time bound, the connection): say what is known
            if any(o is None or o is UNKNOWN for o in outcomes):
                exc.outcome = said_landed(parts, outcomes, cut=True)  # type: ignore[attr-defined]  # see translate.py
            raise
        failed = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
        if not failed:
            return
        i, error = failed[0]
        said = said_landed(parts, outcomes, cut=False)
        if isinstance(error, redis.ResponseError) and script_error(error) is not None:  # refused: it says why
            if not any(o is None for o in outcomes):
                raise type(error)(f"{error}; no slice of this put landed") from error
            raise type(error)(f"{error} (so said one slice of this put, of rows {few(rows_of(parts[i].runs))}, and "
                              f"of that slice only: {said})") from error
        if any(o is None for o in outcomes):  # the server's own error (OOM, ...): translate.py says it with this
            error.outcome = said  # type: ignore[attr-defined]
        raise error

    def _put_slices(
        self, parts: Sequence[PutRequest], request_ids: Sequence[str], todo: Sequence[int],
        outcomes: list[Outcome],
    ) -> None:
        """Slices ``todo`` of ``parts``, each as its own MULTI, over ``PUT_LANES`` connections at once (``lanes.py``);
        sets the outcome of each (its error if it did not land, else None) in ``outcomes`` as its reply comes."""
        if isinstance(self._client, RedisCluster):  # no pipeline of several transactions there: one by one
            for i in todo:
                outcomes[i] = UNKNOWN
                outcomes[i] = self._put_one(parts[i], request_ids[i])
            return
        for i in todo:
            outcomes[i] = UNKNOWN  # sent, by the time a lane could fail
        self._lanes.put(parts, request_ids, todo, outcomes)

    def _put_one(
        self, put: PutRequest, request_id: str, ahead: tuple[int, Sequence[int]] = (0, ()),
    ) -> BaseException | None:
        """``put`` as one MULTI (``request_id`` the same in the client's resends of it); its error, if it did
        not land (see ``_outcome``). ``ahead``: see ``PutScripts.put``."""
        def build(pipe: Pipeline) -> None:
            self._queue(pipe, put, request_id, ahead)

        replies = run_pipeline(self._client, self._scripts.load_all, build, transaction=True)
        return self._scripts.outcome(replies, len(put.encoded))

    def _queue(
        self, pipe: Pipeline, put: PutRequest, request_id: str, ahead: tuple[int, Sequence[int]] = (0, ()),
    ) -> int:
        """Queue one put on one slot: the bar, put.lua, the TYPE that says whether it lifted the bar, the HSETs,
        the bar undone where it stayed (see lua/put.lua); returns how many commands. A column's rows cut to
        the allocator's size classes (data/fit.py) are two HSETs, of the heads and of the tails, in the same
        MULTI: a reader never finds one without the other."""
        columns = list(put.encoded)
        barred = self._scripts.bar(pipe, columns)
        self._scripts.put(pipe, columns, put.runs, put.lengths, put.finish, request_id, put.fence, put.ack,
                          put.nbytes, ahead, groups.partial_values(put, self._groups, self._n))
        self._scripts.lands(pipe, columns)
        queued = barred + 2
        for col, mapping in put.encoded.items():
            pipe.hset(self._keys.data(col), mapping=mapping)  # type: ignore[arg-type]  # str keys are fine
            queued += 1
            tails = put.tails.get(col)
            if tails:
                self._cut.add(col)
                pipe.hset(self._keys.tail(col), mapping=tails)  # type: ignore[arg-type]
                queued += 1
        return queued + self._scripts.unbar(pipe, columns)

    def read(self, columns: Sequence[str], rows: Sequence[int], handout: Handout) -> list[list[bytes | None]] | None:
        # One round trip: the HMGETs, then the fence script in the same pipeline, after them (see
        # DockScripts.fence and lua/include/generations.lua). A group's field is deleted only by a clear
        # that forgot each ready row of the group (lua/include/forget.lua), so the fence vouches for it too.
        return self._fetch(columns, rows, handout)

    def read_now(self, columns: Sequence[str], rows: Sequence[int]) -> list[list[bytes | None]]:
        got = self._fetch(columns, rows, None)
        assert got is not None  # no fence to fail
        return got

    def _fetch(
        self, columns: Sequence[str], rows: Sequence[int], handout: Handout | None,
    ) -> list[list[bytes | None]] | None:
        """``read`` (with ``handout``) or ``read_now``. The HMGETs of the tails of columns known to hold cut
        rows go with the heads' in one MULTI (data/fit.py: a put rewriting a row between two HMGETs would
        join one put's head to another's tail). A head found in another column teaches the store that it
        holds cut rows, and the read is made again, with its tails: once per column and process."""
        fields = [str(r) for r in rows]
        shared = [c for c in columns if c in self._groups] if handout is None else []
        while True:
            tails = [c for c in columns if c in self._cut]
            expansions: list[list[int] | None] = []

            def reads(pipe: Pipeline, tails: list[str] = tails, expansions: list[Any] = expansions) -> None:
                expansions[:] = self._hmgets(pipe, columns, rows)
                for col in tails:
                    pipe.hmget(self._keys.tail(col), fields)
                if handout is not None:
                    self._scripts.fence(pipe, handout.runs)  # after the HMGETs: it vouches for what they read
                for col in shared:  # a row not ready has no value, though its group's field may be there for others
                    bits = (x for r in rows for x in ("GET", "u1", r))
                    pipe.execute_command("BITFIELD", self._keys.ready(col), *bits)

            replies = read_pipeline(self._client, self._scripts.load_all, reads, transaction=bool(tails))
            values, rest = replies[: len(columns)], replies[len(columns) :]
            tail_values, rest = dict(zip(tails, rest[: len(tails)])), rest[len(tails) :]
            if handout is not None:
                if not self._scripts.fence_holds(rest[0], handout):
                    return None
                rest = rest[1:]
            if self._learned(columns, values, tails):
                continue
            ready = dict(zip(shared, rest))
            out: list[list[bytes | None]] = []
            for col, v, at in zip(columns, values, expansions):
                if col in tail_values:
                    v = fit.joined(v, tail_values[col])
                elif at is not None:
                    v = groups.expand(v, at)
                    if handout is None:
                        v = [b if bit else None for b, bit in zip(v, ready[col])]
                out.append(v)
            return out

    def _learned(self, columns: Sequence[str], values: Sequence[Any], tails: Sequence[str]) -> bool:
        """Whether the values read of ``columns`` (bytes, or tensors received whole) hold a head whose tail
        was not asked for: the column is then known to hold cut rows (and the caller reads again)."""
        found = [c for c, v in zip(columns, values)
                 if c not in tails and c not in self._groups and isinstance(v, list) and fit.any_heads(v)]
        self._cut.update(found)
        return bool(found)

    def received(
        self, columns: Sequence[str], rows: Sequence[int], handout: Handout | None,
    ) -> list[torch.Tensor | Sequence[bytes | bytearray | None]] | None:
        """As ``read`` (with ``handout``) or ``read_now`` (without), but each column whose rows stack comes as
        one tensor, received straight off the socket into it (``stacking.receive_column``, a cut row's head
        and tail each into its part of the row); the rest as ``bytes``. On a client that cannot (not opened
        here) or for a group column, the same as those."""
        if not self._receives or any(c in self._groups for c in columns):
            return self._read_either(columns, rows, handout)
        fields = [str(r) for r in rows]
        assert isinstance(self._client, redis.Redis)  # _receives
        while True:
            tails = {c for c in columns if c in self._cut}
            # One unit per column, sent one ahead of the replies read (``exchange``): the server makes the
            # next column's reply while this one is received. A column holding cut rows reads its heads and
            # tails in one MULTI, as in _fetch; each row's two halves are then of the same put.
            units: list[list[tuple[Any, ...]]] = []
            for col in columns:
                unit: list[tuple[Any, ...]] = [("HMGET", self._keys.data(col), *fields)]
                if col in tails:
                    unit = [("MULTI",), *unit, ("HMGET", self._keys.tail(col), *fields), ("EXEC",)]
                units.append(unit)
            if handout is not None:
                units.append([self._scripts.fence_command(handout.runs)])  # after the HMGETs: it vouches for them

            def read(reader: RespReader, tails: set[str] = tails) -> _Received:
                values: list[torch.Tensor | Sequence[bytes | bytearray | None]] = []
                for col in columns:
                    reader.advance()
                    if col in tails:
                        transaction(reader, 2)
                    values.append(stacking.receive_column(reader, where=self._keys.data(col), fields=fields,
                                                          tails=col in tails))
                reader.advance()
                return values, reader.reply() if handout is not None else None

            def send(units: list[list[tuple[Any, ...]]] = units, read: Callable[..., _Received] = read) -> _Received:
                assert isinstance(self._client, redis.Redis)  # _receives
                return exchange(self._client, units, read)

            # Where the server lost the fence script (it did not run), it is loaded and the reads sent again.
            values, fence = resent_once(send, lambda: self._scripts.load_all(self._client),
                                        lost=lambda got: scripts_lost(got[1]))
            if handout is not None:
                if isinstance(fence, Exception):
                    raise fence
                if not self._scripts.fence_holds(fence, handout):
                    return None
            if not self._learned(columns, values, list(tails)):
                return values

    def _read_either(
        self, columns: Sequence[str], rows: Sequence[int], handout: Handout | None,
    ) -> list[torch.Tensor | Sequence[bytes | bytearray | None]] | None:
        got = self.read(columns, rows, handout) if handout is not None else self.read_now(columns, rows)
        return None if got is None else list(got)

    def forget(self, forgot: Forgot, *, whole: bool = False) -> tuple[int, list[str]]:
        return forgot.value, []

    def data_keys(self) -> list[str]:
        return [kind(c) for kind in (self._keys.data, self._keys.tail) for c in self._columns]


#: What a read received straight into tensors gives: per column a tensor or the bytes, and the fence's reply.
_Received = tuple[list[torch.Tensor | Sequence[bytes | bytearray | None]], Any]
