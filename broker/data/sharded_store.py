"""``ShardedStore``: a dock's row bytes spread over data shards ``{NAME~S}`` chosen to land on distinct cluster
primaries (``Schema.shards``, ``choose_shards``), group g on shard ``g % S``, so that a batch of consecutive
groups reads from every primary at once. One pipeline per node, every request sent before any reply is read
(see ``store.py`` for the interface and the other store).

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

import struct
from collections.abc import Sequence

import redis
import torch
from redis.cluster import RedisCluster

from broker.connection import Client, fanout, spread_tags
from broker.connection.replication import Replication
from broker.control.keys import DockKeys, partition_of_name, shard_pattern, shard_tag
from broker.control.scripts import DockScripts, Forgot, Handout, rows_of, runs_of
from broker.data.requests import Encoded, PutRequest
from broker.data.store import few, unhold
from broker.errors import BrokerError, DecodeError, FencedError

#: How many times a sharded put writes again after clears moved its rows between its two steps. Each
#: retry means a clear of these rows landed within one round trip; running out takes a clearer in a
#: tight loop, and the put then fails with a BrokerError saying so.
PUT_RETRIES = 16


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
        #: between costs a retry, never a wrong mark. This object's whole clear moves them to the epoch it
        #: starts (``forget``). At most one entry per row of the dock.
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
                        f"dock {self._keys.name!r}: rows {few(moved)} were cleared or dropped since this delivery "
                        "handed them out: they may hold other prompts now; nothing was written"
                    )
            raise BrokerError(
                f"dock {self._keys.name!r}: rows {few(rows)} were cleared during each of {PUT_RETRIES} puts of them; "
                "nothing was marked"
            )
        finally:
            if hold is not None:
                unhold(self._scripts, hold, self._keys.name)

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
        # What this object saw of the rows forgotten is over: a guess from it would only cost a refused put. A
        # whole clear ends the epoch and leaves every row's generation as it was (lua/clear.lua), so a row seen
        # in the epoch it ended is at the next one now, under the same generation: the next put of it (a run's
        # prompts loaded after its clear) writes without asking, and mark.lua still checks the guess.
        if whole:
            self._seen = {row: (epoch + 1, gen) for row, (epoch, gen) in self._seen.items() if epoch == forgot.epoch}
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
    wanted = len(client.get_primaries()) if count is None else count  # type: ignore[union-attr]  # a cluster
    tags = spread_tags(client, lambda i: shard_tag(dock, i), wanted)
    if partition_of_name(dock) is None or not isinstance(client, RedisCluster):
        return tags
    # A partition k's group j is the dock's group j*P + k (api/partition_map.py), and the partitions' slots are
    # dealt round robin over the primaries as shards are. A partition's shards start on its own slot's primary:
    # the dock's consecutive groups (a batch) then land on different primaries, as their control slots do.
    # Without it every partition's first shard was on the same primary, and a batch was read from one.
    def node(tag: str) -> str:
        return str(client.nodes_manager.get_node_from_slot(client.keyslot("{" + tag + "}")).name)

    own = node(dock)
    turn = next((i for i, tag in enumerate(tags) if node(tag) == own), 0)
    return tags[turn:] + tags[:turn]


def _in_order(rows: Sequence[int], runs: Sequence[int], generations: bytes) -> bytes:
    """``generations`` (of the rows of ``runs``, ascending) rearranged in the order of ``rows``."""
    by_row = dict(zip(rows_of(runs), _u32s(generations)))
    return b"".join(struct.pack(">I", by_row[r]) for r in rows)


def _u32s(packed: bytes) -> list[int]:
    """Big-endian u32s (the generations the fence scripts return)."""
    return list(struct.unpack(f">{len(packed) // 4}I", packed))

