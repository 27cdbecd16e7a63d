"""The one place that builds the TransferQueue slice's key names: a system's partitions, user keys, tags and
field schemas, beside its dock's keys and in the dock's slot (``td:{NAME}:tq:...``).

``SystemKeys`` is the dock's ``DockKeys`` with the slice's builders added; ``layout`` gives the rows of the
key layout (``broker.control.keys.key_layout``, docs/operations.md), registered with the core at import.
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.control.keys import DockKeys, KeyRow, register_layout


class SystemKeys(DockKeys):
    """The keys of a TransferQueue system's dock NAME: the dock's, and the slice's own."""

    @property
    def tq_next(self) -> str:
        return self.base + "tq:next"

    @property
    def tq_free(self) -> str:
        return self.base + "tq:free"

    @property
    def tq_partitions(self) -> str:
        return self.base + "tq:partitions"

    @property
    def tq_seq(self) -> str:
        return self.base + "tq:seq"

    @property
    def tq_conf(self) -> str:
        return self.base + "tq:conf"

    @property
    def tq_writing(self) -> str:
        return self.base + "tq:writing"

    @property
    def tq_saving(self) -> str:
        return self.base + "tq:saving"

    def tq_rows(self, partition: str) -> str:
        return f"{self.base}tq:rows:{partition}"

    def tq_keys(self, partition: str) -> str:
        return f"{self.base}tq:keys:{partition}"

    def tq_rkeys(self, partition: str) -> str:
        return f"{self.base}tq:rkeys:{partition}"

    def tq_order(self, partition: str) -> str:
        return f"{self.base}tq:order:{partition}"

    def tq_tags(self, partition: str) -> str:
        return f"{self.base}tq:tags:{partition}"

    def tq_fields(self, partition: str) -> str:
        return f"{self.base}tq:fields:{partition}"

    def tq_system(self, partitions: Sequence[str]) -> list[str]:
        """Every key of the slice for ``partitions`` (but those living only inside one script): what a
        checkpoint of the system copies and what restoring one replaces, beside the dock's own."""
        keys = [self.tq_next, self.tq_free, self.tq_partitions, self.tq_seq, self.tq_conf]
        for p in partitions:
            keys += [self.tq_rows(p), self.tq_keys(p), self.tq_rkeys(p), self.tq_order(p), self.tq_tags(p),
                     self.tq_fields(p)]
        return keys


def layout() -> list[KeyRow]:
    """The rows of the slice's keys in the key layout (P standing for a partition)."""
    k = SystemKeys("NAME")
    return [
        KeyRow(k.tq_next, "string", "TransferQueue: rows below it have held samples"),
        KeyRow(k.tq_free, "list", "TransferQueue: rows released by clears, oldest first; new samples take "
               "them first"),
        KeyRow(k.tq_partitions, "hash", "TransferQueue: partition → its place in creation order (a number "
               "from td:{NAME}:tq:seq, new with each creation of the partition)"),
        KeyRow(k.tq_seq, "string", "TransferQueue: a counter giving partitions and keys their place in "
               "creation order (`kv_list`'s order, as TransferQueue's); of a system cut into sub-systems "
               "(`broker.partitions`), the one in the system's own name orders partitions over all of them"),
        KeyRow(k.tq_conf, "string", "TransferQueue: the system's configuration (JSON), written by the first "
               "`init`; of a system cut into sub-systems, in the system's own name, with their docks"),
        KeyRow(k.tq_writing, "sorted set", "TransferQueue: member = a put or clear of several steps under "
               "way, score = when it is given up (ms of server time); a checkpoint waits until none is left"),
        KeyRow(k.tq_saving, "sorted set", "TransferQueue: member = a checkpoint being taken or loaded, score = "
               "when it is given up (ms); puts and clears wait while one is"),
        KeyRow(k.tq_rows("P"), "bitmap", "TransferQueue: bit i set when row i holds a sample of partition P"),
        KeyRow(k.tq_keys("P"), "hash", "TransferQueue: user key → row, in partition P"),
        KeyRow(k.tq_rkeys("P"), "hash", "TransferQueue: row → user key, in partition P"),
        KeyRow(k.tq_order("P"), "sorted set", "TransferQueue: member = a user key of partition P, score = "
               "its place in the order keys were first given rows (`kv_list`'s order)"),
        KeyRow(k.tq_tags("P"), "hash", "TransferQueue: row → the sample's tags / custom meta (msgpack)"),
        KeyRow(k.tq_fields("P"), "hash", "TransferQueue: field → its schema in partition P (msgpack: dtype, "
               "shape, nested, non-tensor)"),
    ]


register_layout(layout)
