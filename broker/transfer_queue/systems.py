"""One TransferQueue system cut into P sub-systems (``broker.partitions: P``), so that its control plane spreads
over a Redis Cluster's primaries instead of sitting on the one that owns ``{tq.<namespace>}``.

Every script of a dock runs on the primary of the dock's slot, so a system on one dock (system.py) is one
primary's CPU however large the cluster. TransferQueue's own partitions (``partition_id``, "train_0", ...)
are independent sets of samples: nothing TransferQueue does reads two of them in one step (a sampler chooses
within one partition, a put or a clear names one, a status is one partition's). So a TransferQueue partition
lives whole in one sub-system, and each sub-system is a ``System`` as it always was, on a dock of its own,
unchanged: its scripts, its fences, its interleavings (system.py's docstring) hold as they are.

**The layout.** P = 1 is the system as it always was: one dock ``tq.<namespace>``, the same keys. P > 1: P docks
``tq.<namespace>~pK`` (the core's partition names, so ``broker status`` shows them as one dock ``tq.<namespace>``
and ``broker acl``'s rules for it cover them), chosen when the system is made so that their slots fall on
different primaries (``spread_tags``; a later resharding moves slots and the clients follow). Their names are
stored with the conf (``td:{tq.<namespace>}:tq:conf``, written once by the first ``init``, SET NX), beside a
counter of the system's own (``td:{tq.<namespace>}:tq:seq``) that orders partitions over every sub-system.
Each sub-system has the whole ``broker.capacity`` (a TransferQueue partition may grow to it wherever it
lives): the system as a whole holds up to P times as many samples. Once the docks exist, the core's record of a
partitioned dock names them (``td:{tq.<namespace>}:partitions``: P * capacity groups of one row, dealt in
blocks of ``capacity``), so ``broker status tq.<namespace>``, the exporter and ``TransferDock.attach`` see the
system as one dock whose row indexes are the global indexes below.

**Which sub-system holds a partition.** ``index_of``: the CRC-32 of the partition id's UTF-8 bytes, modulo P.
A stable hash, the same in every process and every run, needing no lookup; a record in Redis would balance a
few partitions better, but would cost a round trip per call, and verl names a partition per step
("train_0", "train_1", ...), which a hash spreads well. A partition cleared and made again lands where it was.

**Global indexes** stay unique over the whole system: row r of sub-system k is ``k * capacity + r``
(``Route``), so with P = 1 they are the rows as before, and a partition's consecutive rows are consecutive
indexes (TransferQueue's groups are runs of consecutive indexes its samplers find). A sampler sees and chooses
global indexes, as it does in TransferQueue. Calls carrying indexes carry their partition too (a
``BatchMeta``'s ``partition_ids``), which routes them; an index outside its partition's sub-system is one the
partition does not hold. A meta joining partitions of several sub-systems (``BatchMeta.concat``) is cleared,
tagged or read sub-system by sub-system (``get_data`` joins the fields in the meta's order). A delivery (the
rows of a leased ``get_meta``, in a meta's ``extra_info``) is kept in global indexes too, and turned back into
the sub-system's rows where it fences a put or an ack.

**The order of partitions** (``get_partition_list``, ``kv_list()``) is their creation order over the whole
system, as TransferQueue lists them: with P > 1 each call that may make a partition first takes a number of the
system's counter (one INCR in the root's slot), which lua/tq_rows.lua stamps on the partition if it makes it. A
process's calls in a partition it saw made take none (``System._known``): they tell the script the partition
must exist, and only if another process cleared it since does the call take a number and run again.

Interleavings, beside each sub-system's own (system.py):

- **Two processes opening the system at once, with the same P**: both find no conf, both choose the same
  names (the same candidates on the same cluster), both SET NX the conf; one wins, and both open the docks
  the stored conf names (system.py's ``_open``: two processes making one dock at once both succeed).
- **With different P** (or one asking for P where a system of another count exists): the conf is stored
  before any dock is made, and every process opens the docks the stored conf names. A process whose conf names
  ``broker.partitions`` explicitly and differs from the stored count raises ``SchemaError`` (a BrokerError)
  naming both, having made nothing; one whose conf does not name it attaches with the stored count.
- **A clear of one partition while another is read**: they are in different sub-systems, or in one, where
  they were already independent (a clear touches its partition's rows only); nothing of one partition is in
  another's keys, so a read of one never sees the other's clear.
- **A partition made in two sub-systems at once** cannot happen: it lives where its id hashes to.
- **Order**: a partition's place is taken before the script that makes it, so two partitions made at once by
  two processes are listed in the order their places were taken (either order is one of the two possible).
  A listing (``partitions``) reads the sub-systems one after another: a partition made or cleared while it
  runs is listed or not, as a listing just before or just after it would have.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from broker.api.delivery import HandedRows
from broker.api.partition_record import RECORD_FORMAT
from broker.connection import spread_tags
from broker.control.keys import DockKeys, partition_name
from broker.errors import BrokerError, SampleNotFoundError
from broker.transfer_queue.keys import SystemKeys
from broker.transfer_queue.system import System, dock_name


def dock_names(client: object, namespace: str, partitions: int) -> tuple[str, ...]:
    """The docks of a system of ``partitions`` sub-systems on ``client``'s Redis: ``tq.<namespace>`` alone for
    one; else ``tq.<namespace>~pK`` candidates whose slots fall on different primaries (``spread_tags``)."""
    root = dock_name(namespace)
    if partitions == 1:
        return (root,)
    return spread_tags(client, lambda i: partition_name(root, i), partitions)


def index_of(partition: str, count: int) -> int:
    """The sub-system of ``partition`` among ``count``: a stable hash (see the module docstring)."""
    if count == 1:
        return 0
    return zlib.crc32(partition.encode("utf-8", "surrogatepass")) % count


@dataclass(frozen=True)
class Route:
    """One sub-system, and how its rows are the system's global indexes: ``base + row``."""

    system: System
    base: int
    capacity: int

    def glob(self, rows: Iterable[int]) -> list[int]:
        """Rows of this sub-system as global indexes."""
        return [int(r) + self.base for r in rows] if self.base else [int(r) for r in rows]

    def rows(self, indexes: Iterable[int]) -> list[int]:
        """Global indexes this sub-system handed out (``glob``'s), as its rows again: unchecked, unlike ``local``,
        which names indexes a caller gave that are not here."""
        return [int(g) - self.base for g in indexes]

    def local(self, indexes: Iterable[int], partition: str) -> list[int]:
        """Global indexes as this sub-system's rows; SampleNotFoundError names those that are not here (they
        are not the partition's either: it lives whole in this sub-system)."""
        out = self.rows(indexes)
        wrong = [r + self.base for r in out if not 0 <= r < self.capacity]
        if wrong:
            raise SampleNotFoundError(f"partition {partition!r} holds no global index {wrong[:8]}")
        return out

    def local_or_none(self, indexes: Iterable[int]) -> list[int]:
        """Global indexes as this sub-system's rows, -1 (a row no partition holds) for those not here."""
        return [g - self.base if 0 <= g - self.base < self.capacity else -1 for g in map(int, indexes)]

    def global_delivery(self, delivery: HandedRows | None) -> HandedRows | None:
        """A delivery of this sub-system's rows as one of global indexes (what a meta carries)."""
        return _shifted(delivery, self.base)

    def local_delivery(self, delivery: HandedRows | None) -> HandedRows | None:
        """A delivery a meta carries as one of this sub-system's rows (what a put or an ack names)."""
        return _shifted(delivery, -self.base)


def _shifted(delivery: HandedRows | None, by: int) -> HandedRows | None:
    return delivery if delivery is None or not by else delivery.shifted(by)


class Systems:
    """A TransferQueue system's sub-systems (one, or ``broker.partitions``): which holds a partition, global
    indexes, and what goes to all of them."""

    def __init__(self, url: str, namespace: str, capacity: int, call_timeout: float, docks: Sequence[str]):
        self.url, self.namespace, self.capacity = url, namespace, capacity
        self.root = SystemKeys(dock_name(namespace))
        place = None if len(docks) == 1 else self._place
        self.parts: list[System] = []
        try:
            for name in docks:
                self.parts.append(System(url, namespace, capacity, call_timeout, dock=name, place=place))
            if len(docks) > 1:
                self._record(docks)
        except BaseException:
            self.close()
            raise

    def _record(self, docks: Sequence[str]) -> None:
        """The core's record of a partitioned dock naming the docks (SET NX: every process writes the same), so
        that the tools that open a dock by name see the system as one (see the module docstring)."""
        text = json.dumps({"format": RECORD_FORMAT, "prompts_num": len(docks) * self.capacity,
                           "n_samples_per_prompt": 1, "block": self.capacity, "partitions": list(docks)})
        first, record = self.parts[0], DockKeys(self.root.name).partitions
        first.session.run(lambda: first.client.set(record, text, nx=True))

    @classmethod
    def of(cls, system: System) -> Systems:
        """The one system given, as a system of one sub-system."""
        made = cls.__new__(cls)
        made.url, made.namespace, made.capacity = system.url, system.namespace, system.dock.capacity
        made.root, made.parts = system.keys, [system]
        return made

    @property
    def count(self) -> int:
        return len(self.parts)

    @property
    def system(self) -> System:
        """The one sub-system of a system that is not cut (P = 1): ``System`` as it always was."""
        if len(self.parts) != 1:
            raise BrokerError(f"TransferQueue system {self.namespace!r} has {len(self.parts)} partitions "
                              "(broker.partitions), each a System of its own: use client.systems")
        return self.parts[0]

    def route(self, partition: str) -> Route:
        """The sub-system holding ``partition``."""
        k = index_of(partition, len(self.parts))
        return Route(self.parts[k], k * self.capacity, self.capacity)

    def route_of_index(self, index: int) -> Route:
        """The sub-system holding global index ``index``."""
        k = int(index) // self.capacity
        if not 0 <= k < len(self.parts):
            raise SampleNotFoundError(f"TransferQueue system {self.namespace!r} holds no global index {index}")
        return Route(self.parts[k], k * self.capacity, self.capacity)

    def _place(self) -> int:
        """The next number of the system's own counter: the place in creation order of a partition the next
        call making rows may make (P > 1)."""
        first = self.parts[0]
        return int(first.session.run(lambda: first.client.incr(self.root.tq_seq)))

    def partitions(self) -> list[str]:
        """Every partition, in the order they were made over the whole system (as TransferQueue lists them)."""
        places: list[tuple[int, str]] = []
        for part in self.parts:
            places += [(place, name) for name, place in part.partition_places().items()]
        return [name for _, name in sorted(places)]

    def reclaim(self, task: str) -> None:
        for part in self.parts:
            part.reclaim(task)

    def close(self) -> None:
        for part in self.parts:
            part.close()

    def delete(self) -> None:
        """Remove the system from Redis (P > 1: the record naming its docks first, so no tool opens it after that;
        then every sub-system; then the conf and the counter)."""
        first, record = self.parts[0], DockKeys(self.root.name).partitions
        if len(self.parts) > 1:
            first.write("delete", lambda: first.client.delete(record))
        for part in self.parts:
            part.delete()
        if len(self.parts) > 1:
            first.write("delete", lambda: first.client.delete(self.root.tq_conf, self.root.tq_seq))
