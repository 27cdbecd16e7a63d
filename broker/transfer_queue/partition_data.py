"""A TransferQueue system's per-partition data beside the dock's rows: each sample's tags (custom meta), each
field's schema, and the partition's state read in one transaction (``snapshot``). A part of ``System``
(system.py), which runs every call it makes through the dock's session.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from redis.client import Pipeline

from broker.api.delivery import HandedRows, fenced_handout
from broker.api.dock import TransferDock
from broker.connection import MIN_VALUE_LIMIT, Client, call_deadline, value_limit
from broker.control.scripts import Handout
from broker.control.scripts.runner import read_pipeline
from broker.errors import BrokerError, ExperienceTooLargeError
from broker.transfer_queue.keys import SystemKeys
from broker.transfer_queue.names import dock_name_of
from broker.transfer_queue.partition_state import Snapshot
from broker.transfer_queue.scripts import TransferQueueScripts
from broker.transfer_queue.values import bitmap_bits, pack, schema_in, schema_out, unpack

#: The dock's first column and consumer: a dock needs one of each before any field or task exists.
PLACEHOLDER = "tq.sample"

#: How many times a tags write reads and merges again after another put changed them (and ``claim`` reads and
#: chooses again after another caller took one of its rows first).
CLAIM_RETRIES = 64


class PartitionData:
    """Tags, field schemas and partition state of a system (``System`` sets what is declared here)."""

    dock: TransferDock
    keys: SystemKeys
    client: Client
    scripts: TransferQueueScripts
    call_timeout: float

    def read(self, call: Callable[[], Any]) -> Any:
        raise NotImplementedError  # System's: through the dock's session

    def write(self, what: str, call: Callable[[], Any]) -> Any:
        raise NotImplementedError  # System's: through the dock's session, then the replica wait

    def set_tags(self, partition: str, rows: Sequence[int], tags: Sequence[Mapping[str, Any] | None],
                 merge: bool = True, delivery: HandedRows | None = None) -> None:
        """Store each row's tags (msgpack), merged over what it had when ``merge``; fenced by ``delivery`` (the
        rows as their keys were looked up) when given: FencedError, nothing written, once a clear took any.

        The merge is the client's, so the write compares (lua/tq_tags.lua): a put of the same key that wrote
        tags between this one's read and its write makes this one read and merge again, and neither loses
        the other's tags."""
        pairs: dict[int, dict[str, Any]] = {}
        for r, t in zip(rows, tags):
            if t is not None:
                pairs[int(r)] = {**pairs.get(int(r), {}), **dict(t)}  # a row twice in one call: both merged
        if not pairs:
            return
        fence = None if delivery is None else fenced_handout(delivery, sorted(pairs))
        order = sorted(pairs)
        with call_deadline(self.call_timeout):
            for _ in range(CLAIM_RETRIES):
                before = self._raw_tags(partition, order) if merge else [None] * len(order)
                after = [pack({**(unpack(old, "tags") if old else {}), **pairs[r]}, "tags")
                         for r, old in zip(order, before)]
                self._check_sizes(partition, order, after)
                if self.write("set tags", lambda: self.scripts.tags(  # noqa: B023 (run at once)
                        partition, order, before, after, fence, compare=merge)):  # noqa: B023
                    return
        raise BrokerError(f"partition {partition!r}: other puts kept changing the tags of rows {order[:8]} "
                          f"between this put's read and its write, {CLAIM_RETRIES} times in a row")

    def check_tags(self, partition: str, keys: Sequence[str], tags: Sequence[Mapping[str, Any] | None]) -> None:
        """Refuse tags that are not plain values, or whose msgpack is longer than the server takes in one value
        (ExperienceTooLargeError naming the key): a put checks them before it writes anything."""
        packed = [b"" if t is None else pack(dict(t), "tags") for t in tags]
        self._check_sizes(partition, keys, packed)

    def _check_sizes(self, partition: str, names: Sequence[Any], packed: Sequence[bytes]) -> None:
        """ExperienceTooLargeError if a row's packed tags (``names``: its keys or rows) pass the server's limit on
        one value: the server would close the connection mid-send (and the client send it again)."""
        largest = max(range(len(packed)), key=lambda i: len(packed[i]), default=None)
        if largest is None or len(packed[largest]) <= MIN_VALUE_LIMIT:
            return  # fits on any server: no need to ask this one
        limit = self.read(lambda: value_limit(self.client))
        if len(packed[largest]) > limit.bytes:
            raise ExperienceTooLargeError(
                f"partition {partition!r}, {names[largest]!r}: tags of {len(packed[largest]):,} bytes (msgpack) are "
                f"over the server's {limit.setting} ({limit.bytes:,} bytes); nothing was written. Keep large "
                "values in fields, not tags")

    def _raw_tags(self, partition: str, rows: Sequence[int]) -> list[bytes | None]:
        got = self.read(lambda: self.client.hmget(self.keys.tq_tags(partition), [str(r) for r in rows]))
        return list(got)

    def tags(self, partition: str, rows: Sequence[int]) -> list[dict[str, Any]]:
        if not rows:
            return []
        got = self.read(lambda: self.client.hmget(self.keys.tq_tags(partition), [str(r) for r in rows]))
        return [{} if raw is None else unpack(raw, "tags") for raw in got]

    def listing(self, partition: str) -> dict[str, dict[str, Any]]:
        """``{key: tags}`` of every key of ``partition``, in the order the keys were first given rows (as
        TransferQueue lists them: verl's replay buffers take batches in this order).

        The keys, their places and their tags are read in one transaction, so a key cleared meanwhile is
        either listed with its tags or not at all. A key without a place (written before places were kept)
        comes after those with one, by row."""
        def read() -> list[Any]:
            pipe = self.client.pipeline(transaction=True)
            pipe.hgetall(self.keys.tq_keys(partition))
            pipe.zrange(self.keys.tq_order(partition), 0, -1)
            pipe.hgetall(self.keys.tq_tags(partition))
            return list(pipe.execute())

        rows, order, tags = self.read(read)
        place = {k: i for i, k in enumerate(order)}
        keys = sorted(rows, key=lambda k: (place.get(k, len(place)), int(rows[k])))
        return {k.decode(): unpack(tags[rows[k]], "tags") if rows[k] in tags else {} for k in keys}

    def record_schema(self, partition: str, schema: Mapping[str, Mapping[str, Any]]) -> None:
        """Record each field's schema for ``partition`` (what reads rebuild the TensorDict from)."""
        if schema:
            mapping = {f: pack(schema_out(s), "field schema") for f, s in schema.items()}
            self.write("field schema", lambda: self.client.hset(self.keys.tq_fields(partition), mapping=mapping))  # type: ignore[arg-type]

    def field_schema(self, partition: str, fields: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
        key = self.keys.tq_fields(partition)
        if fields is None:
            got = self.read(lambda: self.client.hgetall(key))
            return {f.decode(): schema_in(unpack(v, "field schema")) for f, v in sorted(got.items())}
        if not fields:
            return {}
        values = self.read(lambda: self.client.hmget(key, list(fields)))
        return {f: schema_in(unpack(v, "field schema")) for f, v in zip(fields, values) if v is not None}

    def snapshot(self, partition: str, *, keys: Sequence[str] = (), tag_rows: Sequence[int] = ()) -> Snapshot:
        """The partition's field schemas and their ready bits, with the rows of ``keys`` and the tags of
        ``tag_rows`` if asked, in one transaction (one round trip): what a get checks before it reads, and
        what a put's KVBatchMeta reports after it wrote. The ready bits of every column of the dock are read,
        since which are the partition's is in the same reply."""
        for attempt in range(2):
            columns = [c for c in self.dock.columns if c != PLACEHOLDER]

            def build(pipe: Pipeline) -> None:
                pipe.hgetall(self.keys.tq_fields(partition))
                for column in columns:  # noqa: B023 (run at once)
                    pipe.get(self.keys.ready(column))
                if keys:  # the rows with the epoch and generations that fence their read (lua/tq_lookup.lua)
                    self.scripts.queue_lookup(pipe, partition, keys)
                if tag_rows:
                    pipe.hmget(self.keys.tq_tags(partition), [str(r) for r in tag_rows])

            raw = self.read(lambda: read_pipeline(  # noqa: B023 (run at once)
                self.client, self.scripts.load_all, build, transaction=True))
            schema = {f.decode(): schema_in(unpack(v, "field schema")) for f, v in sorted(raw[0].items())}
            if attempt == 0 and any(dock_name_of(f) not in columns for f in schema):
                self.dock.refresh()  # another process added a field since this one looked: read its bits too
                continue
            ready = {c: bitmap_bits(r) for c, r in zip(columns, raw[1 : 1 + len(columns)])}
            rest = raw[1 + len(columns):]
            found: list[int | None] | None = None
            fence: Handout | None = None
            if keys:
                found, fence = self.scripts.looked_up(rest.pop(0))
            tags = [{} if t is None else unpack(t, "tags") for t in rest.pop(0)] if tag_rows else []
            return Snapshot(partition, schema, ready, list(keys), found, tags, fence)
        raise AssertionError("unreachable")
