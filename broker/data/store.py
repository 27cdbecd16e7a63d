"""The data plane: where a dock's row bytes live, and how a put writes them and a read fetches them.

The control plane is the Lua scripts (``control/scripts/``, ``lua/``): status bitmaps, leases, sampling, all
in the dock's own slot ``{NAME}`` so that each operation is one atomic script. The bytes are kept
apart from it by one of two stores with one small interface:

``SlotStore``
    the bytes in the dock's slot (``td:{NAME}:data:COLUMN``, field = row), as on one Redis server: a
    put is one MULTI holding a bar on the HSETs (plain commands), the checking and marking script
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

``ShardedStore``
    the bytes spread over data shards ``{NAME~S}`` chosen to land on distinct cluster primaries
    (``Schema.shards``), group g on shard ``g % S``, so that a batch of consecutive groups reads from
    every primary at once. One pipeline per node, every request sent before any reply is read.

A sharded put cannot be one MULTI (its keys are on several nodes), so it is two steps: write bytes,
then mark ready (lua/mark.lua). The interleavings that matter, and why each is safe:

- *clear between the two steps.* Bytes are written under the rows' generation (field ``ROW:GEN``) in
  a hash per epoch (``...:data:COLUMN:EPOCH``); a clear bumps the generation of the rows it forgets (a
  whole clear the epoch). mark.lua marks nothing if any row's generation or the epoch moved since the
  put read them: the put deletes the bytes it wrote for the rows that moved and puts again under the
  new ones. So no row is ever marked ready whose bytes a clear deleted.
- *clear deleting bytes.* A clear deletes only the bytes of the generations it ended (the reply of
  clear.lua / discard.lua names them; a whole clear drops the hashes of the ended epoch): a put under
  the new generation writes other fields or other keys, so a clear never deletes a newer put's bytes.
- *a put refused for some rows.* It deletes only the fields of the rows whose generation moved: the
  others may be the same fields another, successful, put of the same rows wrote meanwhile.
- *a reader.* Sampling hands rows out with their epoch and generations, so the reader knows the fields
  to read; it then checks the fence (the epoch and generations unchanged) in a second round trip,
  after the bytes came back: the check must follow the reads, and requests to different nodes have no
  order. A clear landing in between fails the fence and the rows are handed out afresh, as on one node.
- *a put that dies between the steps* leaves bytes that no reader asks for (nothing marked them). A
  later put of the same rows in the same generation overwrites them; a clear of the rows deletes the
  fields of the generation it ends and of the one before (the one a put that was refused once had
  read); a whole clear drops the hashes of the ended epoch and of the one before. So no orphan bytes
  outlive the next whole clear.
- *a full shard* (maxmemory) fails the HSET on that node: the put deletes what it wrote elsewhere and
  raises StoreFullError having marked nothing.
- *a put naming a delivery* (a stage's results for the rows it was handed) must not land once the
  delivery is no longer current (lua/include/delivery.lua). mark.lua checks it with the generations;
  a clear in between refuses the put, and the bytes it wrote under the old generations are deleted as
  above (no retry under new ones: the rows are no longer this worker's). Under a lease, claim.lua
  checks it before any byte is sent and holds the lease for the put's time bound, so the rows cannot be
  given back to another worker, who would write the same fields, while this put's bytes travel. Only
  an explicit take-over (``get_experience(indexes=...)`` of the rows, ``reset_consumer``) ignores the
  hold: mark.lua then refuses the put, but its bytes may already have replaced the taker's.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import redis
import torch
from redis.client import Pipeline
from redis.cluster import RedisCluster

from broker.connection import Client, Framed, fanout, frames
from broker.connection.deadlines import in_thread
from broker.connection.replication import Replication
from broker.connection.replies import RespReader, exchange, transaction
from broker.connection.translate import script_error
from broker.control.keys import DockKeys, group_field, shard_pattern, shard_tag
from broker.control.scripts import (
    DockScripts,
    Forgot,
    Handout,
    Hold,
    read_pipeline,
    rows_of,
    run_pipeline,
    runs_of,
    scripts_lost,
)
from broker.data import fit, groups, stacking
from broker.data.requests import Encoded, PutRequest, step_id
from broker.data.slices import slices
from broker.errors import BrokerError, DecodeError, FencedError

log = logging.getLogger(__name__)

#: Connections a put on one slot sends its slices over at once (see ``SlotStore._put_slices``). The server
#: takes a large put in faster from two connections than from one, even on one thread (docs/operations.md
#: has the figures); more gained nothing on 2 cores.
PUT_LANES = 2

#: How many times a sharded put writes again after clears moved its rows between its two steps. Each
#: retry means a clear of these rows landed within one round trip; running out takes a clearer in a
#: tight loop, and the put then fails with a BrokerError saying so.
PUT_RETRIES = 16

class DataStore(Protocol):
    """Where a dock's row bytes live (see the module docstring)."""

    def put(self, put: PutRequest) -> None:
        """Write the rows' bytes and mark them ready in their columns, with what ``finish`` records; all
        or nothing, and once however often it is resent. With ``fence``, only while that delivery still
        holds the rows (else FencedError, nothing written), and with ``ack`` too, ending its lease of
        them in the same step. On data shards with ``wait_replicas``, the bytes reach the shards'
        replicas before they are marked (in one slot bytes and marks are one MULTI); the caller waits
        for the marks' replicas, as for every call that writes."""

    def read(self, columns: Sequence[str], rows: Sequence[int], handout: Handout) -> list[list[bytes | None]] | None:
        """The bytes of the handout's ``rows`` (in that order) per column, or None if a clear took any of
        them between the handout and the read."""

    def read_now(self, columns: Sequence[str], rows: Sequence[int]) -> list[list[bytes | None]]:
        """The bytes of ``rows`` per column as stored now, None where there are none; checks nothing."""

    def received(
        self, columns: Sequence[str], rows: Sequence[int], handout: Handout | None,
    ) -> list[torch.Tensor | Sequence[bytes | bytearray | None]] | None:
        """As ``read`` (with ``handout``) or ``read_now``, a column whose rows stack as one tensor where the
        store can receive them straight into it (see ``SlotStore.received``)."""

    def forget(self, forgot: Forgot, *, whole: bool = False) -> tuple[int, list[str]]:
        """Delete from the data shards what a script forgot (nothing to do in one slot): its value, and the
        ``replicated`` counters of the shards it deleted bytes on (the call that forgot waits for their
        replicas too)."""

    def data_keys(self) -> list[str]:
        """Every key holding the dock's row bytes now (for ``delete``)."""


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
            put = self._cut_rows(put)
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
                _unhold(self._scripts, hold, self._keys.name)
                raise FencedError(
                    f"dock {self._keys.name!r}: rows {_few(rows_of(put.runs))} were written and acked by this delivery "
                    "already (an earlier sending of this same put landed whole); nothing was written")
        try:
            self._put_sliced(parts, request_ids, landed)
        finally:
            if hold is not None:
                _unhold(self._scripts, hold, self._keys.name)

    def _put_sliced(self, parts: Sequence[PutRequest], request_ids: Sequence[str], landed: frozenset[int]) -> None:
        """The slices of a put but those ``landed`` before: the first alone, the others back to back; raises
        naming the rows that landed where one did not, or where the put was cut short."""
        todo = [i for i in range(len(parts)) if i not in landed]
        outcomes: list[BaseException | None | _Unknown] = [None if i in landed else _UNSENT for i in range(len(parts))]
        try:
            if not todo:
                return
            # The first slice alone: a server that lost the scripts (NOSCRIPT, see run_pipeline) costs one slice
            # sent twice, not the batch; it is checked against the dock's quota for the whole put (lua/put.lua),
            # so a put past it writes nothing at all. The others back to back, so the server writes one while
            # the next travels.
            first, rest = todo[0], todo[1:]
            ahead = [r for i in rest for r in rows_of(parts[i].runs)]
            outcomes[first] = _UNKNOWN
            try:
                outcomes[first] = self._put_one(parts[first], request_ids[first],
                                                ahead=(sum(_nbytes(parts[i]) for i in rest), runs_of(ahead)))
            except redis.ResponseError as exc:  # refused as it was queued (OOM): a reply, the slice not run
                outcomes[first] = exc
            if outcomes[first] is None and rest:  # refused, the others would be too (fenced, the dock gone, ...)
                self._put_slices(parts, request_ids, rest, outcomes)
        except redis.RedisError as exc:  # cut short (the call's time bound, the connection): say what is known
            if any(o is None or o is _UNKNOWN for o in outcomes):
                exc.outcome = _landed(parts, outcomes, cut=True)  # type: ignore[attr-defined]  # see translate.py
            raise
        failed = [(i, o) for i, o in enumerate(outcomes) if isinstance(o, BaseException)]
        if not failed:
            return
        i, error = failed[0]
        said = _landed(parts, outcomes, cut=False)
        if isinstance(error, redis.ResponseError) and script_error(error) is not None:  # refused: it says why
            if not any(o is None for o in outcomes):
                raise type(error)(f"{error}; no slice of this put landed") from error
            raise type(error)(f"{error} (so said one slice of this put, of rows {_few(rows_of(parts[i].runs))}, and "
                              f"of that slice only: {said})") from error
        if any(o is None for o in outcomes):  # the server's own error (OOM, ...): translate.py says it with this
            error.outcome = said  # type: ignore[attr-defined]
        raise error

    def _put_slices(
        self, parts: Sequence[PutRequest], request_ids: Sequence[str], todo: Sequence[int],
        outcomes: list[BaseException | None | _Unknown],
    ) -> None:
        """Slices ``todo`` of ``parts``, each as its own MULTI, over ``PUT_LANES`` connections at once; sets the
        outcome of each (its error if it did not land, else None) in ``outcomes`` as its reply comes. Slices
        hold disjoint rows, so their order between lanes does not matter."""
        if isinstance(self._client, RedisCluster):  # no pipeline of several transactions there: one by one
            for i in todo:
                outcomes[i] = _UNKNOWN
                outcomes[i] = self._put_one(parts[i], request_ids[i])
            return
        for i in todo:
            outcomes[i] = _UNKNOWN  # sent, by the time a lane could fail
        lanes = [list(todo[first::PUT_LANES]) for first in range(min(PUT_LANES, len(todo)))]
        failures: list[BaseException] = []

        def lane(mine: list[int]) -> Callable[[], None]:
            def run() -> None:
                try:
                    self._lane(parts, request_ids, mine, outcomes)
                except BaseException as exc:  # raised in the caller's thread below
                    failures.append(exc)
            return run

        others = [threading.Thread(target=in_thread(lane(mine)), daemon=True) for mine in lanes[1:]]
        for thread in others:
            thread.start()
        try:
            self._lane(parts, request_ids, lanes[0], outcomes)
        finally:
            for thread in others:
                thread.join()  # each bounded by the call's deadline, as this thread is
        if failures:
            raise failures[0]

    def _lane(
        self, parts: Sequence[PutRequest], request_ids: Sequence[str], todo: list[int],
        outcomes: list[BaseException | None | _Unknown],
    ) -> None:
        """The slices ``todo`` back to back on one connection: one pipeline of MULTI ... EXEC per slice."""
        for attempt in range(2):
            sizes: dict[int, int] = {}

            def build(pipe: Pipeline, todo: list[int] = todo, sizes: dict[int, int] = sizes) -> None:
                for i in todo:
                    pipe.execute_command("MULTI")
                    sizes[i] = self._queue(pipe, parts[i], request_ids[i])
                    pipe.execute_command("EXEC")

            replies = run_pipeline(self._client, self._scripts.load_all, build, transaction=False)
            lost: list[int] = []
            for i in todo:  # per slice: MULTI's OK, a QUEUED per command, EXEC's array
                size = sizes[i]
                queued, replies = replies[: size + 2], replies[size + 2 :]
                executed = queued[-1]
                if isinstance(executed, Exception) or not isinstance(executed, list):
                    # EXECABORT names no cause: the command refused as it was queued does (OOM on a full
                    # server, which the caller's translation makes a StoreFullError).
                    cause = next((r for r in queued[1:-1] if isinstance(r, Exception)), executed)
                    outcomes[i] = cause if isinstance(cause, Exception) else BrokerError(
                        f"dock {self._keys.name!r}: a put's transaction was not run (EXEC answered {executed!r})")
                elif attempt == 0 and scripts_lost(_verdict(executed, len(parts[i].encoded))):
                    lost.append(i)  # the server lost the scripts since the first slice: the bar kept the bytes out
                else:
                    outcomes[i] = _outcome(executed, len(parts[i].encoded))
            if not lost:
                return
            self._scripts.load_all(self._client)
            todo = lost

    def _put_one(
        self, put: PutRequest, request_id: str, ahead: tuple[int, Sequence[int]] = (0, ()),
    ) -> BaseException | None:
        """``put`` as one MULTI (``request_id`` the same in the client's resends of it); its error, if it did
        not land (see ``_outcome``). ``ahead``: see ``PutScripts.put``."""
        def build(pipe: Pipeline) -> None:
            self._queue(pipe, put, request_id, ahead)

        return _outcome(run_pipeline(self._client, self._scripts.load_all, build, transaction=True), len(put.encoded))

    def _cut_rows(self, put: PutRequest) -> PutRequest:
        """``put`` with its rows that waste too much whole cut to the allocator's size classes (data/fit.py):
        their heads in ``encoded``, their tails in ``tails``. Once per put, before it is sliced; the request
        itself is left as it is (a call resent after a lost connection cuts it again, the same way)."""
        encoded, tails = dict(put.encoded), {}
        for col, rows in put.encoded.items():
            if col not in self._groups:
                heads, cut = fit.cut(rows)
                if cut:
                    encoded[col], tails[col] = heads, cut
        return dataclasses.replace(put, encoded=encoded, tails=tails) if tails else put

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
                          _nbytes(put), ahead, self._group_values(put))
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

    def _group_values(self, put: PutRequest) -> list[tuple[int, int, bytes | Framed]]:
        """For each group of which ``put`` writes some rows only, in each group column it writes: the column's
        position, the group and its value, which lua/put.lua compares with what the group's other rows read."""
        if not self._groups.intersection(put.encoded):
            return []
        count = collections.Counter(row // self._n for row in rows_of(put.runs))
        partial = sorted(g for g, k in count.items() if k < self._n)
        return [(i, g, mapping[group_field(g)]) for i, (col, mapping) in enumerate(put.encoded.items())
                if col in self._groups for g in partial]

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

            def read(
                reader: RespReader, tails: set[str] = tails,
            ) -> tuple[list[torch.Tensor | Sequence[bytes | bytearray | None]], Any]:
                values: list[torch.Tensor | Sequence[bytes | bytearray | None]] = []
                for col in columns:
                    reader.advance()
                    if col in tails:
                        transaction(reader, 2)
                    values.append(stacking.receive_column(reader, where=self._keys.data(col), fields=fields,
                                                          tails=col in tails))
                reader.advance()
                return values, reader.reply() if handout is not None else None

            values, fence = exchange(self._client, units, read)
            if handout is not None:
                if isinstance(fence, redis.exceptions.NoScriptError):  # the server lost the scripts: the usual path
                    self._scripts.load_all(self._client)
                    return self._read_either(columns, rows, handout)
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


class ShardedStore:
    """The bytes over data shards on several nodes; a put is two steps (see the module docstring)."""

    def __init__(
        self, client: Client, keys: DockKeys, scripts: DockScripts, columns: Sequence[str],
        shards: Sequence[str], n_samples_per_prompt: int, replication: Replication,
    ):
        self._client, self._keys, self._scripts, self._columns = client, keys, scripts, tuple(columns)
        self._replication = replication
        self._shards = tuple(shards)
        self._n = n_samples_per_prompt
        #: Row -> (epoch, generation) of rows this object read last, each kept until the next put of the row.
        #: A stage reads rows and then writes its results into the same rows: its put can then write its
        #: bytes under what the read saw, without asking first; mark.lua still checks, so a clear in
        #: between costs a retry, never a wrong mark. At most one entry per row of the dock.
        self._seen: dict[int, tuple[int, int]] = {}

    def _shard(self, row: int) -> str:
        """The data shard of ``row``: groups are striped over the shards."""
        return self._shards[(row // self._n) % len(self._shards)]

    def _fields(self, rows: Sequence[int], generations: bytes) -> dict[str, list[tuple[int, str]]]:
        """Per shard, ``(position in rows, field)`` of each row, with its generation."""
        out: dict[str, list[tuple[int, str]]] = {}
        for i, (row, gen) in enumerate(zip(rows, _u32s(generations))):
            out.setdefault(self._shard(row), []).append((i, f"{row}:{gen}"))
        return out

    def put(self, put: PutRequest) -> None:
        encoded, runs, lengths, finish, fence, ack = put.encoded, put.runs, put.lengths, put.finish, put.fence, put.ack
        rows = rows_of(runs)  # ascending, the order of the generations the fence returns
        columns = list(encoded)
        request_id = put.request_id  # one for the whole put: mark.lua keeps only a reply that marked
        hold = None
        if fence is not None:
            if fence.token:
                hold = self._scripts.claim(runs, fence, put.hold_ms)
            for row in rows:
                self._seen.pop(row, None)
            guess: tuple[int, bytes] | None = (fence.epoch, fence.generations)
        else:
            guess = self._guess(rows)
        try:
            for _ in range(PUT_RETRIES):
                epoch, generations = guess or self._scripts.fence_now(runs)
                guess = None
                written = self._write(encoded, rows, epoch, generations)
                if self._replication.replicas:
                    # The bytes reach the shards' replicas before any reader may be handed them: a shard
                    # failing over afterwards cannot leave rows ready whose bytes it lost.
                    shards = sorted({DockKeys.shard_replicated(self._shard(r)) for r in rows})
                    self._replication.wait(
                        shards, f"dock {self._keys.name!r}: put", applied=False,
                        outcome="its bytes were written to the data shards' primaries, but no row was marked ready")
                # FencedError here: the lease was taken over. The fields are the rows' current ones, maybe
                # holding the taker's bytes by now, so they stay (see the module docstring).
                marked = self._scripts.mark(columns, runs, lengths, epoch, generations, finish, fence, request_id, ack)
                if not marked.stale and not marked.epoch_moved:
                    return
                # A clear moved some rows between the two steps: their bytes under the old generation are
                # nobody's. The other rows' fields are left: a concurrent put of them may own them now.
                stale = set(rows) if marked.epoch_moved else set(marked.stale)
                self._delete_fields(written, {i for i, r in enumerate(rows) if r in stale})
                if fence is not None:
                    moved = sorted(stale)
                    raise FencedError(
                        f"dock {self._keys.name!r}: rows {_few(moved)} were cleared or dropped since this delivery "
                        "handed them out: they may hold other prompts now; nothing was written"
                    )
            raise BrokerError(
                f"dock {self._keys.name!r}: rows {_few(rows)} were cleared during each of {PUT_RETRIES} puts of them; "
                "nothing was marked"
            )
        finally:
            if hold is not None:
                _unhold(self._scripts, hold, self._keys.name)

    def _guess(self, rows: list[int]) -> tuple[int, bytes] | None:
        """The epoch and generations this object last read ``rows`` under, if it read them all in one
        epoch (forgotten either way: a guess is good for one put)."""
        known = [seen for seen in (self._seen.pop(r, None) for r in rows) if seen is not None]
        if not rows or len(known) != len(rows) or len({epoch for epoch, _ in known}) != 1:
            return None
        return known[0][0], b"".join(struct.pack(">I", gen) for _, gen in known)

    def _write(
        self, encoded: Encoded, rows: list[int], epoch: int, generations: bytes
    ) -> list[tuple[str, list[tuple[int, str]]]]:
        """HSET the rows' bytes on every shard in one pipeline; returns (key, [(position, field)]) written.

        If a shard refuses (full, wrong type), what the others took is deleted again before raising.
        """
        by_shard = self._fields(rows, generations)
        written: list[tuple[str, list[tuple[int, str]]]] = []
        commands: list[fanout.Command] = []
        for col, mapping in encoded.items():  # mapping: field = the row in decimal
            for tag, fields in by_shard.items():
                key = DockKeys.shard_data(tag, col, epoch)
                commands.append(("HSET", key, *(x for i, field in fields for x in (field, mapping[str(rows[i])]))))
                written.append((key, fields))
        replies = fanout.send(self._client, commands)
        errors = [(key, r) for (key, _), r in zip(written, replies) if isinstance(r, Exception)]
        if errors:
            self._delete_fields(written, None)
            raise self._foreign(*errors[0])
        return written

    def _delete_fields(self, written: list[tuple[str, list[tuple[int, str]]]], positions: set[int] | None) -> None:
        """HDEL the fields ``written`` (only those of rows at ``positions`` unless None), in one pipeline."""
        commands: list[fanout.Command] = []
        for key, fields in written:
            chosen = [f for i, f in fields if positions is None or i in positions]
            if chosen:
                commands.append(("HDEL", key, *chosen))
        if commands:
            fanout.send(self._client, commands)  # best effort: what stays is an orphan the next clear removes

    def read(self, columns: Sequence[str], rows: Sequence[int], handout: Handout) -> list[list[bytes | None]] | None:
        values = self._read(columns, list(rows), handout.epoch, _in_order(rows, handout.runs, handout.generations))
        # Second round trip, after the bytes are in: the fence must follow the reads (see module docstring).
        fence = self._scripts.fence_now(handout.runs)
        if fence != (handout.epoch, handout.generations):
            return None
        for row, gen in zip(rows_of(handout.runs), _u32s(handout.generations)):
            self._seen[row] = (handout.epoch, gen)
        return values

    def received(
        self, columns: Sequence[str], rows: Sequence[int], handout: Handout | None,
    ) -> list[torch.Tensor | Sequence[bytes | bytearray | None]] | None:
        got = self.read(columns, rows, handout) if handout is not None else self.read_now(columns, rows)
        return None if got is None else list(got)  # bytes: the shards' replies come through fanout

    def read_now(self, columns: Sequence[str], rows: Sequence[int]) -> list[list[bytes | None]]:
        runs = runs_of(rows)
        epoch, generations = self._scripts.fence_now(runs)
        return self._read(columns, list(rows), epoch, _in_order(rows, runs, generations))

    def _read(
        self, columns: Sequence[str], rows: list[int], epoch: int, generations: bytes
    ) -> list[list[bytes | None]]:
        """HMGET the rows' fields from every shard in one pipeline; per column, the values in row order."""
        by_shard = self._fields(rows, generations)
        commands: list[fanout.Command] = []
        order: list[tuple[int, list[tuple[int, str]]]] = []
        keys: list[str] = []
        for c, col in enumerate(columns):
            for tag, fields in by_shard.items():
                keys.append(DockKeys.shard_data(tag, col, epoch))
                commands.append(("HMGET", keys[-1], *(f for _, f in fields)))
                order.append((c, fields))
        out: list[list[bytes | None]] = [[None] * len(rows) for _ in columns]
        for (c, fields), reply, key in zip(order, fanout.send(self._client, commands), keys):
            if isinstance(reply, Exception):
                raise self._foreign(key, reply)
            for (i, _), value in zip(fields, reply):
                out[c][i] = value
        return out

    def _foreign(self, key: str, error: Exception) -> Exception:
        """``error`` of a command on data key ``key``: a DecodeError naming the key if it holds something
        no broker writes (as the scripts report the dock's own keys), else the error itself."""
        if isinstance(error, redis.ResponseError) and str(error).startswith("WRONGTYPE"):
            kind = self._client.type(key)
            kind = kind.decode() if isinstance(kind, bytes) else str(kind)
            return DecodeError(f"{key} holds a {kind}, expected a hash; nothing of this call was marked")
        return error

    def forget(self, forgot: Forgot, *, whole: bool = False) -> tuple[int, list[str]]:
        if forgot.epoch is None:  # the dock is not sharded after all (cannot happen: the schema says so)
            return forgot.value, []
        # What this object saw of the rows is over: a guess from it would only cost a refused put.
        if whole:
            self._seen.clear()
        for row in forgot.rows:
            self._seen.pop(row, None)
        commands: list[fanout.Command] = []
        columns = self._columns
        if whole:
            # The ended epoch's hashes, and the one before's: orphans of a put that read it and died.
            for tag in self._shards:
                for col in columns:
                    for epoch in (forgot.epoch, forgot.epoch - 1):
                        if epoch >= 0:
                            commands.append(("UNLINK", DockKeys.shard_data(tag, col, epoch)))
        by_shard: dict[str, list[str]] = {}
        if not whole and forgot.rows:
            for row, gen in zip(forgot.rows, _u32s(forgot.generations)):
                # The ended generation, and the one before: a put refused once had read it.
                by_shard.setdefault(self._shard(row), []).extend([f"{row}:{gen}", f"{row}:{(gen - 1) % 2**32}"])
            for tag, fields in by_shard.items():
                for col in columns:
                    commands.append(("HDEL", DockKeys.shard_data(tag, col, forgot.epoch), *fields))
        for reply in fanout.send(self._client, commands) if commands else ():
            if isinstance(reply, Exception):
                raise reply
        tags = self._shards if whole else sorted(by_shard)
        return forgot.value, [DockKeys.shard_replicated(tag) for tag in tags]

    def data_keys(self) -> list[str]:
        return [key.decode() if isinstance(key, bytes) else key
                for key in self._client.scan_iter(match=shard_pattern(self._keys.name), count=1000)]


def choose_shards(client: Client, dock: str, count: int | None) -> tuple[str, ...]:
    """Hash tags of ``count`` data shards for ``dock`` (None: one per primary of a cluster, none on one
    server), each on a different primary as far as there are primaries, in round-robin order over them."""
    if count == 0 or (count is None and not isinstance(client, RedisCluster)):
        return ()
    if not isinstance(client, RedisCluster):
        return tuple(shard_tag(dock, i) for i in range(count or 0))
    primaries = sorted(node.name for node in client.get_primaries())
    wanted = len(primaries) if count is None else count
    free: dict[str, list[str]] = {p: [] for p in primaries}  # per primary, candidate tags landing there
    index = 0
    while sum(min(len(t), -(-wanted // len(primaries))) for t in free.values()) < wanted and index < 100_000:
        tag = shard_tag(dock, index)
        node = client.nodes_manager.get_node_from_slot(client.keyslot("{" + tag + "}"))
        free.setdefault(node.name, []).append(tag)
        index += 1
    # Round robin over the primaries: consecutive shards (consecutive groups) on different nodes.
    out: list[str] = []
    while len(out) < wanted:
        for p in primaries:
            if free.get(p) and len(out) < wanted:
                out.append(free[p].pop(0))
    return tuple(out)


def _in_order(rows: Sequence[int], runs: Sequence[int], generations: bytes) -> bytes:
    """``generations`` (of the rows of ``runs``, ascending) rearranged in the order of ``rows``."""
    by_row = dict(zip(rows_of(runs), _u32s(generations)))
    return b"".join(struct.pack(">I", by_row[r]) for r in rows)


def _u32s(packed: bytes) -> list[int]:
    """Big-endian u32s (the generations the fence scripts return)."""
    return list(struct.unpack(f">{len(packed) // 4}I", packed))


def _unhold(scripts: DockScripts, hold: Hold, dock: str) -> None:
    """Give the rows of a put that ended the deadline their lease had before claim.lua held it (see
    lua/unhold.lua). Where that cannot reach the server, the hold runs out by itself at the put's time
    bound, as before: worth a warning, not the put's error."""
    try:
        scripts.unhold(hold)
    except redis.RedisError as exc:
        log.warning("dock %r: the lease a put held (to its time bound) could not be given its own deadline back: %s",
                    dock, exc)


def _nbytes(put: PutRequest) -> int:
    """The bytes of the values ``put``'s HSETs write, tails included (what the dock's quota counts)."""
    return (sum(len(v) for values in put.encoded.values() for v in values.values())
            + sum(len(v) for values in put.tails.values() for v in values.values()))


def _verdict(replies: list[Any], columns: int) -> Any:
    """put.lua's reply among those of a put on one slot of ``columns`` columns (after the bar's commands)."""
    return replies[DockScripts.barred_commands(columns)]


def _outcome(replies: list[Any], columns: int) -> BaseException | None:
    """The error of a put on one slot of ``columns`` columns from its replies (the bar, put.lua, TYPE, the
    HSETs, the bar's undoing: see lua/put.lua), or None if it landed.

    put.lua's reply is the verdict: an error (refused, fenced, or the script not run: NOSCRIPT, a lost
    function library) or the put's counts, kept ones for a resend. Only where it lifted the bar did the
    HSETs write, and can have failed of their own; where the bar stayed they fail by design. The bar's
    RENAMEs and GETDELs answer errors where there is nothing to move, which change nothing.
    """
    barred = DockScripts.barred_commands(columns)
    verdict, lands = _verdict(replies, columns), replies[barred + 1]
    if isinstance(verdict, Exception):
        return verdict
    if DockScripts.landed(lands):
        for reply in replies[barred + 2 : len(replies) - barred]:
            if isinstance(reply, Exception):
                return reply
    return None


class _Unknown:
    """The outcome of a slice not sent yet (``_UNSENT``), or sent and whose reply has not come (``_UNKNOWN``)."""


_UNSENT, _UNKNOWN = _Unknown(), _Unknown()


def _landed(parts: Sequence[PutRequest], outcomes: Sequence[BaseException | None | _Unknown], *, cut: bool) -> str:
    """What of a put in slices ``parts`` landed, by their ``outcomes``: the rows that did, whole, and (``cut``: the
    put was cut short) those whose slices' replies did not come."""
    landed = sorted(r for part, o in zip(parts, outcomes) if o is None for r in rows_of(part.runs))
    unknown = sorted(r for part, o in zip(parts, outcomes) if o is _UNKNOWN for r in rows_of(part.runs))
    said = f"rows {_few(landed)} of this put landed, whole, in its slices" if landed else "no slice of this put landed"
    if cut and unknown:
        said += f"; whether rows {_few(unknown)} did is not known (their slices' replies did not come)"
    return said


def _few(rows: Sequence[int]) -> str:
    return f"{list(rows[:8])}{'...' if len(rows) > 8 else ''}"
