"""A partitioned dock: one dock whose control plane is P docks, each in its own slot, on a cluster on its own primary.

Every script of a dock runs on the one primary that owns its slot, so one dock's control plane is one primary's
CPU however many primaries hold its bytes (docs/cluster.md). ``TransferDock(..., partitions=P)`` makes P
partitions instead, each a dock of its own (``NAME~pK``, keys ``td:{NAME~pK}:*``) whose names are chosen so that
their slots fall on different primaries (``spread_tags``), and a record, ``td:{NAME}:partitions``
(lua/partition.lua), that names them. Groups are dealt to them in blocks, round robin (``partition_map.py``):
a group never spans partitions, so everything a dock promises per group (whole groups handed out, fenced puts,
leases, dead letters, group columns) is each partition's own promise, kept by its own scripts, unchanged.

What becomes per partition, said plainly:

- **FIFO** holds within a partition: a sampled get takes the lowest ready groups of the partition it takes from.
- **A sampled get** runs its script on one partition at a time, from where this object's rotation stands (it
  starts at a random partition and moves on each call), so consumers spread and none is starved; it takes
  what qualifies there, then asks the next partition for the rest. Partitions its takes found drained for that
  consumer and those columns are asked last (``drained.py``). If the partitions together fall short, every
  take is given back and the call waits or returns ``(None, None)`` (``partitioned_gets.py`` has the
  interleavings).
- **Explicit rows** (``indexes=``, ``take``) are cut by partition and taken partition by partition, each atomic;
  a part that fails (rows not written in time, already taken by an exclusive take) gives back the parts taken.
- **A put** is cut by partition, each part one atomic put there fenced by that partition's delivery, every
  part prepared before any is sent (bad input writes nothing); one failing in a later partition may leave the
  earlier ones written, and sending it again is safe (a leased put's landed parts are skipped by request id).
- **clear** and **set_version** reach every partition, in order 0..P-1. Between two of them a reader may see
  some partitions cleared (or at the new version) and others not: what it reads from a partition not yet
  cleared is what it would have read just before the clear; nothing it reads is another batch's bytes under
  an old row's marks (each partition's read fence holds). A ReplicationError in one partition is raised once
  every partition had the call (``_every``), so "applied" holds for the whole dock.
- ``status``, ``all_consumed``, ``get_cur_index``, dead letters and the counts sum or join the partitions;
  ``version`` is the lowest of the partitions' versions (they differ only while ``set_version`` is between them,
  or after it failed part way: repeat it); metrics (``update_metrics``) are kept in partition 0;
  ``set_quota(nbytes)`` gives each partition an equal share.

Partial rollout and the staleness bound (``rollout=``) are each partition's, an iteration's batch cut into
shares: ``partitioned_generation.py`` says how. ``grow`` grows every partition in order. Not on a partitioned
dock (it raises BrokerError naming it): the hooks that expose one dock's session (the TransferQueue slice's).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from broker.api.checks import DockChecks, is_int
from broker.api.dock import DEAD_LETTER_AFTER, TransferDock
from broker.api.drained import DRAINED_SECONDS, Drained
from broker.api.partition_map import PartitionMap, default_block
from broker.api.partition_record import (
    RECORD_FORMAT,
    check_shape,
    first_differences,
    parse_record,
    read_record,
    root_session,
)
from broker.api.partitioned_generation import PartitionedGeneration, dock_rollout, partition_rollouts
from broker.api.partitioned_gets import PartitionedGets
from broker.api.partitioned_moves import every
from broker.api.partitioned_status import PartitionedRowStatus
from broker.api.session import DockSession
from broker.connection import DEFAULT_CALL_TIMEOUT, Client, spread_tags
from broker.control.keys import DockKeys, check_name, partition_name, partition_of_name
from broker.control.put_listener import PutListener
from broker.control.rollout import Rollout
from broker.control.schema import Schema
from broker.control.status import joined
from broker.errors import BrokerError, DockNotFoundError, SchemaError

__all__ = ["PartitionedDock"]

T = TypeVar("T")



class PartitionedDock(PartitionedGets, PartitionedGeneration, PartitionedRowStatus):
    """A dock of P partitions (see the module docstring); made by ``TransferDock(..., partitions=P)`` with P > 1
    and opened by ``TransferDock.attach``, with the dock's methods and the dock's row indexes."""

    def __init__(
        self, url_or_client: str | Client, name: str, prompts_num: int, n_samples_per_prompt: int,
        columns: Sequence[str], consumers: Sequence[str], *, partitions: int, policy: str = "fifo",
        seed: int | None = None, length_columns: Sequence[str] = (), group_columns: Sequence[str] = (),
        rollout: Rollout | None = None, shards: int | None = None, wait_replicas: int = 0, wait_timeout: float = 1.0,
        call_timeout: float = DEFAULT_CALL_TIMEOUT, dead_letter_after: int = DEAD_LETTER_AFTER,
        allow_volatile_eviction: bool = False,
    ):
        if partition_of_name(check_name("dock", name)) is not None:
            raise SchemaError(f"dock name {name!r} is a partition's; a partitioned dock's name has no '~'")
        if not is_int(partitions) or not 1 < partitions <= 1024:
            raise SchemaError(f"partitions must be an int in 1..1024, got {partitions!r:.40}")
        wanted = Schema.build(prompts_num, n_samples_per_prompt, columns, consumers, length_columns, rollout,
                              group_columns)
        if partitions > prompts_num:
            raise SchemaError(f"dock {name!r}: partitions={partitions} exceeds prompts_num={prompts_num} (a group "
                              "never spans partitions: each holds at least one)")
        opening: dict[str, Any] = dict(policy=policy, seed=seed, wait_replicas=wait_replicas, wait_timeout=wait_timeout,
                       call_timeout=call_timeout, allow_volatile_eviction=allow_volatile_eviction)
        making: dict[str, Any] = dict(length_columns=length_columns, group_columns=group_columns, shards=shards,
                      dead_letter_after=dead_letter_after)
        pmap = PartitionMap(int(partitions), prompts_num, n_samples_per_prompt,
                            default_block(int(partitions), prompts_num))
        rollouts = partition_rollouts(name, wanted.rollout, pmap)
        root = root_session(url_or_client, name, opening)
        made: list[TransferDock] = []
        try:
            record = read_record(root)
            if record is None:
                names = root.run(lambda: spread_tags(root.client, lambda i: partition_name(name, i), pmap.count))
                made = [TransferDock(url_or_client, part, pmap.prompts_of(p), n_samples_per_prompt, columns,
                                     consumers, rollout=rollouts[p], **opening, **making)
                        for p, part in enumerate(names)]
                text = json.dumps({"format": RECORD_FORMAT, "prompts_num": prompts_num,
                                   "n_samples_per_prompt": n_samples_per_prompt, "block": pmap.block,
                                   "partitions": list(names)})
                stored = root.run(lambda: root.scripts.partition(text))
                if stored == b"":
                    raise SchemaError(f"dock {name!r} exists with one partition: open it without partitions=")
                self.created = stored is None and any(d.created for d in made)
                record = parse_record(root, text if stored is None else stored)
                if list(names) != record["partitions"]:  # another process made it first, on other partitions
                    for dock in made:
                        if dock.created:
                            dock.delete()
                        dock.close()
                    made = []
            else:
                self.created = False
            first_wanted = dataclasses.replace(wanted, rollout=rollouts[0])  # partition 0 holds its share
            check_shape(name, record, pmap, lambda: first_differences(url_or_client, record, first_wanted, opening))
            if record["block"] != pmap.block:  # as the dock was made; the shares follow the groups held
                pmap = dataclasses.replace(pmap, block=record["block"])
                rollouts = partition_rollouts(name, wanted.rollout, pmap)
            if not made:
                made = [TransferDock(url_or_client, part, pmap.prompts_of(p), n_samples_per_prompt, columns,
                                     consumers, rollout=rollouts[p], **opening, **making)
                        for p, part in enumerate(record["partitions"])]
        except BaseException:
            for dock in made:
                dock.close()
            raise
        finally:
            root.close()
        self._assemble(name, made, pmap, opening, wanted)

    @classmethod
    def attach(cls, url_or_client: str | Client, name: str, *, policy: str = "fifo", seed: int | None = None,
               wait_replicas: int = 0, wait_timeout: float = 1.0, call_timeout: float = DEFAULT_CALL_TIMEOUT,
               allow_volatile_eviction: bool = False) -> PartitionedDock:
        """Open the partitioned dock ``name`` from its record (DockNotFoundError if there is none)."""
        opening: dict[str, Any] = dict(policy=policy, seed=seed, wait_replicas=wait_replicas, wait_timeout=wait_timeout,
                       call_timeout=call_timeout, allow_volatile_eviction=allow_volatile_eviction)
        root = root_session(url_or_client, name, opening)
        try:
            record = read_record(root)
            if record is None:
                raise DockNotFoundError(f"no dock named {name!r} at {root.server}")
            names = record["partitions"]
        finally:
            root.close()
        parts: list[TransferDock] = []
        try:
            for part in names:
                parts.append(TransferDock.attach(url_or_client, part, **opening))
        except BaseException:
            for opened in parts:
                opened.close()
            raise
        pmap = PartitionMap(len(parts), int(record["prompts_num"]), int(record["n_samples_per_prompt"]),
                            record["block"])
        check_shape(name, record, pmap)
        dock = cls.__new__(cls)
        dock.created = False
        s = parts[0].schema
        try:
            rollout = dock_rollout(name, parts, pmap)
        except BaseException:
            for opened in parts:
                opened.close()
            raise
        wanted = Schema.build(pmap.prompts_num, pmap.n, s.columns, s.consumers, s.length_columns, rollout,
                              s.group_columns)
        dock._assemble(name, parts, pmap, opening, wanted)
        return dock

    def _assemble(self, name: str, parts: list[TransferDock], pmap: PartitionMap, opening: dict[str, Any],
                  schema: Schema) -> None:
        self._name = name
        self._parts = parts
        self._pmap = pmap
        self._opening = opening
        self._schema = schema
        self._rollout = schema.rollout
        self._checks = DockChecks(name, schema)
        self._seen = parts[0].schema  # the partition schema self._schema was last taken from (see _check)
        first = parts[0].session
        self._listener = PutListener(first.client, [p.keys.events for p in parts], sharded=first.sharded_events)
        self._turn = random.randrange(pmap.count)  # where this object's next sampled get starts
        self._dealt = [0] * pmap.count  # reserve_groups' round robin (partitioned_generation.py)
        self._drained = Drained(DRAINED_SECONDS)  # partitions a get asks last (partitioned_gets.py)

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Hand back the connections of every partition (see ``TransferDock.close``). Idempotent."""
        self._listener.close()
        for part in self._parts:
            part.close()

    def __enter__(self) -> PartitionedDock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Callable[..., PartitionedDock], tuple[Any, ...]]:
        self._parts[0].__reduce__()  # raises, naming why, where a dock opened so would not pickle
        return _reattach, (self._parts[0].session.url, self._name, self._opening)

    def __repr__(self) -> str:
        return (f"TransferDock({self._name!r} at {self._parts[0].session.server}, prompts_num={self.prompts_num}, "
                f"n_samples_per_prompt={self.n_samples_per_prompt}, columns={list(self.columns)}, "
                f"consumers={list(self.consumers)}, partitions={[p.name for p in self._parts]})")

    # -- what it is -----------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def partition_map(self) -> PartitionMap:
        """Which partition holds which of the dock's rows, and as which of its own (``partition_map.py``)."""
        return self._pmap

    @property
    def partitions(self) -> tuple[TransferDock, ...]:
        """The partitions, each a dock of its own (for inspection: its rows are numbered its own way)."""
        return tuple(self._parts)

    @property
    def schema(self) -> Schema:
        _ = self._check  # adopts a growth partition 0 adopted
        return self._schema

    @property
    def _check(self) -> DockChecks:
        """Checks against the dock's schema as partition 0 holds it now: a growth (``grow``) that partition
        adopted (this process's, or another's once partition 0 made a call since) is adopted here too, as a
        dock of one partition adopts one at its next call."""
        first = self._parts[0].schema
        if first is not self._seen:
            grown = dataclasses.replace(self._schema, columns=first.columns, consumers=first.consumers,
                                        group_columns=first.group_columns)
            self._schema, self._checks, self._seen = grown, DockChecks(self._name, grown), first
        return self._checks

    @property
    def prompts_num(self) -> int:
        return self._pmap.prompts_num

    @property
    def n_samples_per_prompt(self) -> int:
        return self._pmap.n

    @property
    def capacity(self) -> int:
        return self._schema.capacity

    @property
    def columns(self) -> tuple[str, ...]:
        return self._parts[0].columns

    @property
    def consumers(self) -> tuple[str, ...]:
        return self._parts[0].consumers

    @property
    def client(self) -> Client:
        return self._parts[0].client

    @property
    def keys(self) -> DockKeys:
        """The keys of the dock's name: only its record (``keys.partitions``) is there; each partition's are
        ``dock.partitions[k].keys``."""
        return DockKeys(self._name)

    @property
    def session(self) -> DockSession:
        raise BrokerError(f"dock {self._name!r} has {self._pmap.count} partitions, each with its own session "
                          "(dock.partitions[k].session): code built on one dock's session (the TransferQueue slice) "
                          "needs a dock of one partition")

    binding = session

    @property
    def fingerprint(self) -> str:
        """The partitions' stored schemas, as their scripts check them, one after another: what a run's
        checkpoint records to know its dock again (a binding of scripts needs one partition's: ``binding``)."""
        return "\n\n".join(f"{part.name}\n{part.fingerprint}" for part in self._parts)

    # -- writes that reach every partition -----------------------------------------------------

    def _every(self, call: Callable[[TransferDock], T]) -> list[T]:
        """``call`` on every partition in order (``every``: a ReplicationError is raised once all had it)."""
        return every([functools.partial(call, part) for part in self._parts])

    def clear(self, indexes: Sequence[int] | None = None, *, consumer: str | None = None, age: bool = True) -> None:
        """Forget rows (see ``TransferDock.clear``): ``indexes`` cut by partition, or every partition in order."""
        self._drained.refilled()  # a consumer's clear offers its rows again
        if indexes is not None:
            rows = self._check.rows(indexes)
            every([functools.partial(self._parts[p].clear, local, consumer=consumer, age=age)
                   for p, (_, local) in self._pmap.split(rows).parts.items()])
            return
        if consumer is not None and age is True and self._rollout.partial:
            self._end_iteration(consumer)  # every partition ages if the iteration trained in any
            return
        self._every(lambda part: part.clear(consumer=consumer, age=age))

    def set_version(self, version: int) -> None:
        self._every(lambda part: part.set_version(version))

    def version(self) -> int:
        """The lowest of the partitions' versions (see the module docstring)."""
        return min(part.version() for part in self._parts)

    def reset_consumer(self, consumer: str, indexes: Sequence[int] | None = None) -> int:
        self._drained.refilled()  # its rows are offered again
        if indexes is None:
            return sum(self._every(lambda part: part.reset_consumer(consumer)))
        rows = self._check.rows(indexes)
        split = self._pmap.split(rows).parts
        return sum(self._parts[p].reset_consumer(consumer, local) for p, (_, local) in split.items())

    def register_consumer_columns(self, columns_of: Mapping[str, Sequence[str]]) -> None:
        self._every(lambda part: part.register_consumer_columns(columns_of))

    def consumer_columns(self, consumer: str | None = None) -> list[str]:
        return self._parts[0].consumer_columns(consumer)

    def set_quota(self, nbytes: int | None) -> int:
        """Give each partition an equal share of ``nbytes`` (see ``TransferDock.set_quota``); the bytes held."""
        share = nbytes if nbytes is None or not is_int(nbytes) or nbytes < 0 else -(-int(nbytes) // self._pmap.count)
        return sum(self._every(lambda part: part.set_quota(share)))

    def set_setting(self, name: str, value: str) -> None:
        self._every(lambda part: part.set_setting(name, value))

    def setting(self, name: str) -> str | None:
        return self._parts[0].setting(name)

    def update_metrics(self, key: str | Mapping[str, Any] = "", value: Any = None, cumulate: bool = False) -> None:
        self._parts[0].update_metrics(key, value, cumulate)

    def get_metrics(self) -> dict[str, Any]:
        return self._parts[0].get_metrics()

    def refresh(self) -> Schema:
        for part in self._parts:
            part.refresh()
        return self.schema

    def grow(self, columns: Sequence[str] = (), consumers: Sequence[str] = (),
             group_columns: Sequence[str] = ()) -> Schema:
        """Add columns and consumers (see ``TransferDock.grow``) to every partition, in order. A growth that
        partition 0 refuses (a name taken, a group column of per-row values) changes nothing; one that fails
        in a later partition (the server went away) leaves the earlier ones grown: repeat it (names a partition
        has are skipped). Until every partition has grown, a put or get naming a new name is refused whole
        (every partition's part is checked before any is sent): the partitions never disagree on a row."""
        self._every(lambda part: part.grow(columns, consumers, group_columns))
        return self.schema

    def delete(self) -> None:
        """Delete the dock: its record first (no one opens it after that), then every partition."""
        first = self._parts[0].session
        record = DockKeys(self._name).partitions
        first.write("delete", lambda: first.client.delete(record), returns=False)
        self._every(lambda part: part.delete())

    # -- reads that join the partitions ---------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The partitions' counts summed (each partition's is one consistent snapshot; together they are not)."""
        return joined(self._name, [part.status() for part in self._parts])

    def all_consumed(self, consumer: str) -> bool:
        done = [part.all_consumed(consumer) for part in self._parts]  # every partition gives back expired leases
        return all(done)

    def reclaim(self, consumer: str, *, all_leases: bool = False) -> int:
        self._drained.refilled()  # leases given back: their rows are offered again
        return sum(part.reclaim(consumer, all_leases=all_leases) for part in self._parts)

    def get_cur_index(self) -> int:
        """Rows ``prefetch_request_index`` handed out so far, over every partition."""
        return sum(part.get_cur_index() for part in self._parts)

    def prefetch_request_index(self, experience_num: int) -> list[int] | None:
        """The next rows of one partition's batch, partitions in turn (fewer at a partition's end); None once
        every partition handed out all of its rows. Rows never repeat: each partition's cursor is atomic."""
        for p in self._order():
            local = self._parts[p].prefetch_request_index(experience_num)
            if local:
                return self._pmap.global_rows(p, local)
        return None


def _reattach(target: str, name: str, opening: dict[str, Any]) -> PartitionedDock:
    """Unpickle a partitioned dock: open it again from its record."""
    return PartitionedDock.attach(target, name, **opening)
