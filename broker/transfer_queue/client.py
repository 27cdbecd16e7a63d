"""``TransferQueueClient``: TransferQueue's low-level client on the broker (``get_meta``, ``put``, ``get_data``,
statuses, clears), and ``AsyncTransferQueueClient``, the same as coroutines.

Over 400 lines: TransferQueue's ``transfer_queue.client`` holds both clients, and code written for it imports
them from this one module; the work they share is in system.py, partition_data.py and tensors.py.

Every call goes to Redis from the caller's process; there is no controller. A sampler runs here over the rows
Redis says are ready and unconsumed, and its choice is taken atomically (``System.claim``).

A system may be cut into sub-systems (``broker.partitions``, systems.py): each call finds the one holding its
partition (``Systems.route``) and works there as on a system of one; the rows of a sub-system are handed to
users as global indexes (``Route.glob``) and turned back (``Route.local``) where a call names them.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from broker.api.delivery import HandedRows, LeasedRows
from broker.errors import (
    BrokerError,
    GetMetaError,
    GetMetaTimeoutError,
    InvalidArgumentTypeError,
    InvalidExperienceError,
    SampleNotFoundError,
)
from broker.transfer_queue import tensors
from broker.transfer_queue.metadata import DELIVERY, BatchMeta
from broker.transfer_queue.names import dock_name_of
from broker.transfer_queue.partition_state import Snapshot
from broker.transfer_queue.sampler import BaseSampler
from broker.transfer_queue.system import System, delivery_of
from broker.transfer_queue.systems import Route, Systems

MODES = ("fetch", "force_fetch", "insert")



class TransferQueueClient:
    """TransferQueue's client: one per process (``broker.transfer_queue.get_client()``), safe from many threads."""

    def __init__(self, system: System | Systems, sampler: BaseSampler, *, polling_mode: bool = False,
                 get_meta_timeout: float = 5.0, lease: float | None = None, client_id: str = "client",
                 stack_uniform: bool = False):
        self.client_id = client_id
        self._systems = system if isinstance(system, Systems) else Systems.of(system)
        self._sampler = sampler
        self._polling, self._timeout, self._lease = polling_mode, get_meta_timeout, lease
        #: ``broker.stack_uniform``: fields of equal rows as one stacked tensor, not TransferQueue's jagged one.
        self._stack_uniform = stack_uniform

    @property
    def system(self) -> System:
        """The system, when it is one dock (``broker.partitions`` 1); BrokerError when it is cut in several."""
        return self._systems.system

    @property
    def systems(self) -> Systems:
        """The system's sub-systems (one, or ``broker.partitions``): systems.py."""
        return self._systems

    # -- reading what to read -----------------------------------------------------------------------------

    def get_meta(
        self,
        data_fields: list[str],
        batch_size: int | None = None,
        partition_id: str | None = None,
        mode: str = "fetch",
        task_name: str | None = None,
        sampling_config: dict[str, Any] | None = None,
        *,
        lease: float | None = None,
    ) -> BatchMeta:
        """Which rows to read (``fetch``: chosen by the sampler among those produced in ``data_fields`` and not
        consumed by ``task_name``, and now consumed by it; ``force_fetch``: every row of the partition;
        ``insert``: ``batch_size`` new rows to put into).

        ``fetch`` waits up to ``broker.get_meta_timeout`` seconds for enough rows, then raises TimeoutError
        (with ``polling_mode``: returns an empty BatchMeta at once). ``lease`` (seconds; default the conf's
        ``broker.lease``): the rows come back to other readers unless ``ack(meta)`` comes in time — a reader
        that dies loses nothing. The meta's ``extra_info["broker_delivery"]`` carries the lease; a ``put`` with
        this meta writes only while the lease is this reader's, and acks it.
        """
        if mode not in MODES:
            raise GetMetaError(f"mode must be one of {MODES}, got {mode!r}")
        fields = _names("data_fields", data_fields, allow_empty=mode == "force_fetch")
        partition = _partition(partition_id)
        route = self._systems.route(partition)
        system = route.system
        if mode == "insert":
            count = _count(batch_size)
            rows = system.new_rows(partition, count).rows
            return self._meta(route, partition, rows, fields, insert=True)
        if mode == "force_fetch":  # every row of the partition, the fields asked for (none: none), as they are
            if system.created(partition) == "0":
                raise GetMetaError(f"partition {partition!r} not found")
            return self._meta(route, partition, system.partition_rows(partition), fields)
        count = _count(batch_size)
        if not isinstance(task_name, str) or not task_name:
            raise GetMetaError(f"get_meta(mode='fetch') needs a task_name, got {task_name!r}")
        # TransferQueue's StreamingDataset puts task_name and partition_id into sampling_config too (its controller
        # passes the config to the sampler as keywords): the arguments of this call name them here.
        config = {k: v for k, v in (sampling_config or {}).items() if k not in ("task_name", "partition_id")}
        lease = self._lease if lease is None else lease
        rank, batch_index = config.get("dp_rank"), config.get("batch_index")
        # The partition's creation time in the name: a partition cleared and made again under its name does not
        # hand a DP group the batches recorded before the clear (the records outlive it, for a day).
        label = f"{partition}@{system.created(partition)}|{task_name}|{rank}|{batch_index}"

        sampler = self._sampler
        before: list[set[Any]] = []

        def entries() -> set[Any]:
            return {(c.partition_id, c.task_name, c.dp_rank, c.batch_index) for c in sampler.cached_results()}

        def choose(ready: list[int]) -> tuple[list[int], list[int]]:  # global indexes, as the sampler sees them
            before[:] = [entries()]
            if len(ready) < count and not self._cached(partition, task_name, config):
                # Another rank of this DP group, perhaps in another process, may have taken this batch already
                # (its rows now consumed, so not among the ready ones): its record is this rank's batch.
                recorded = route.glob(system.recorded(label) or []) if rank is not None else None
                if not recorded:
                    return [], []
                sampler.remember(partition, task_name, rank, batch_index, recorded)
                return recorded, recorded
            # TransferQueue's controller passes its partition: SeqlenBalancedSampler reads the rows' lengths
            # from their custom meta (the tags here), read only if the sampler asks.
            try:
                sampled, consumed = sampler(ready, count, task_name=task_name, partition_id=partition,
                                            partition=_CustomMeta(route, partition), **config)
            except BrokerError:
                raise
            except Exception as exc:  # a user's sampler: TransferQueue's controller answers its failure so
                raise GetMetaError(
                    f"partition {partition!r}, task {task_name!r}: the sampler {type(sampler).__name__} failed: "
                    f"{type(exc).__name__}: {exc}") from exc
            return list(sampled), list(consumed)

        def name() -> str | None:
            # A sampler that cached its choice for this DP rank and batch (RankAwareSampler, GRPOGroupNSampler
            # given a dp_rank) means every rank of the group must get it, in whatever process: the take is
            # named after it. One that did not (SequentialSampler) hands each caller its own rows.
            if rank is None or sampler.cached(partition, task_name, rank, batch_index) is None:
                return None
            return label

        def refused() -> None:  # the choice was not taken: the sampler must not keep it cached
            for entry in entries() - (before[0] if before else set()):
                sampler.forget(*entry)

        deadline = time.monotonic() + self._timeout
        got: list[tuple[list[int], HandedRows | None]] = []
        shared: list[bool] = []

        def choose_rows(ready: list[int]) -> tuple[list[int], list[int]]:  # the sub-system's rows
            sampled, consumed = choose(route.glob(ready))
            return route.rows(sampled), route.rows(consumed)

        def attempt() -> bool:
            rows, handed = system.claim(partition, fields, task_name, choose_rows, lease=lease, name=name,
                                        refused=refused)
            sampled = route.glob(rows)
            if sampled and name() is not None:
                shared.append(True)
            if sampled:
                got.append((sampled, route.global_delivery(handed)))
            elif before:
                refused()  # too few rows: a sampler that cached an empty choice would keep returning it
            return bool(sampled)

        if not system.wait_ready(deadline if not self._polling else time.monotonic(), attempt):
            if self._polling:
                return BatchMeta.empty()
            have = len(system.ready_unconsumed(partition, fields, task_name))
            raise GetMetaTimeoutError(
                f"partition {partition!r}, task {task_name!r}: {count} samples with fields {fields} wanted, "
                f"{have} ready within {self._timeout} s (broker.get_meta_timeout)", {})
        sampled, handed = got[0]
        if shared:  # the choice of this rank's group, perhaps another process's: cached here as it is
            # This sampler's own choice keeps what it cached with it (a SeqlenBalancedSampler's shares of the
            # batch's other ranks); another process's choice replaces whatever this one cached.
            if sampler.cached(partition, task_name, rank, batch_index) != (list(sampled), list(sampled)):
                refused()
            sampler.remember(partition, task_name, rank, batch_index, sampled)
        meta = self._meta(route, partition, route.rows(sampled), fields)
        if isinstance(handed, LeasedRows):
            # The delivery fences the reader's put of its results into these rows (a reader whose lease ran
            # out, its rows handed to another, cannot write them), and that put acks the lease.
            meta.extra_info[DELIVERY] = handed
        return meta

    def _cached(self, partition: str, task: str, config: Mapping[str, Any]) -> bool:
        return bool(self._sampler.has_cached_result(partition, task, dict(config)))

    def _meta(self, route: Route, partition: str, rows: list[int], fields: Sequence[str], *,
              insert: bool = False) -> BatchMeta:
        """The metadata of ``rows`` (the sub-system's, handed out as global indexes): the schema the partition
        has of ``fields`` and their production status. For an insert (new rows), every field asked for is
        named, with an empty schema where the partition has none yet, and nothing is produced, as
        TransferQueue's controller makes it (a put then fills it in)."""
        system = route.system
        schema = system.field_schema(partition, list(fields))
        if insert:
            for field in fields:
                schema.setdefault(field, {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": False})
            status = np.zeros(len(rows), dtype=np.int8)
        else:
            status = system.produced(partition, rows, list(fields)) if fields else np.zeros(len(rows), dtype=np.int8)
        return BatchMeta(global_indexes=route.glob(rows), partition_ids=[partition] * len(rows), field_schema=schema,
                         production_status=status, custom_meta=system.tags(partition, rows))

    def ack(self, metadata: BatchMeta) -> int:
        """End the lease ``get_meta(lease=...)`` took on these rows: for a reader that writes no result into
        them (a put with this metadata acks them itself). Returns how many rows it released."""
        released = 0
        for delivery, rows in _by_delivery(metadata):
            if isinstance(delivery, LeasedRows) and rows:
                route = self._systems.route_of_index(rows[0])  # a delivery is one take: one sub-system's rows
                local = route.local_delivery(delivery)
                assert isinstance(local, LeasedRows)
                released += route.system.dock.ack(local.consumer, route.rows(rows), local.token)
        return released

    # -- data ----------------------------------------------------------------------------------------------------

    def put(self, data: Any, metadata: BatchMeta | None = None, partition_id: str | None = None,
            data_parser: Callable[[Any], Any] | None = None) -> BatchMeta:
        """Write ``data`` (a TensorDict, one row per sample) into the rows of ``metadata``, or into new rows of
        ``partition_id``; returns the metadata of the rows, their fields now produced."""
        size = tensors.batch_size_of(data)
        if data_parser is not None:
            raise InvalidExperienceError("data_parser is a SimpleStorage hook TransferQueue applies in its storage "
                                         "units; parse the data before the put here")
        if metadata is None:
            partition = _partition(partition_id)
        else:
            if metadata.size != size:
                raise InvalidExperienceError(f"data has {size} rows, metadata {metadata.size}")
            partitions = set(metadata.partition_ids)
            if len(partitions) > 1:
                raise InvalidExperienceError(f"metadata spans partitions {sorted(partitions)}; put each alone "
                                             "(BatchMeta.chunk_by_partition)")
            partition = _partition(partition_id or (metadata.partition_ids[0] if size else None))
        route = self._systems.route(partition)
        with route.system.writing():  # rows, data, tags: no checkpoint copies the put half done
            return self._put(data, metadata, partition, route, size)

    def _put(self, data: Any, metadata: BatchMeta | None, partition: str, route: Route, size: int) -> BatchMeta:
        fence: HandedRows | None = None
        given = None
        system = route.system
        if metadata is None:
            given = system.new_rows(partition, size)
            rows, fence = given.rows, delivery_of(given)  # a clear_partition meanwhile refuses it (FencedError)
            custom: list[dict[str, Any]] = [{} for _ in rows]
        else:
            rows = route.local(metadata.global_indexes, partition)
            custom = list(metadata.custom_meta)
        try:
            parts = [(fence, rows)] if metadata is None else \
                [(route.local_delivery(d), route.local(part, partition)) for d, part in _by_delivery(metadata)]
            if len(parts) == 1:
                self.write(partition, rows, data, parts[0][0])
            else:  # a concatenation of batches of several takes: each part fenced (and acked) by its own lease
                at = {r: i for i, r in enumerate(rows)}
                for delivery, part in parts:
                    self.write(partition, part, data[[at[r] for r in part]], delivery)
        except BaseException:
            if given is not None:  # new samples that never got their data are not left in the partition
                system.give_back(partition, given)
            raise
        if any(custom):
            system.set_tags(partition, rows, custom)
        if metadata is None:  # as TransferQueue: the meta of an insert of the data's fields, then filled in
            metadata = self._meta(route, partition, rows, tensors.field_names(data), insert=True)
        # TransferQueue's put adds the data's fields to the metadata given, in place, and returns that object:
        # code that ignores the return value (verl's tqbridge) reads the new fields from its own meta.
        return metadata.add_fields(data)

    def write(self, partition: str, rows: list[int], data: Any, delivery: HandedRows | None = None) -> None:
        """The put itself: record the fields' schema, grow the dock by new fields, write the rows (fenced by
        ``delivery``, the rows as they were handed out or looked up, when given). ``rows`` and ``delivery``
        are those of the sub-system holding ``partition``, not global indexes."""
        if rows:
            self.write_columns(partition, rows, tensors.put_columns(data, len(rows)), delivery)

    def write_columns(self, partition: str, rows: list[int], columns: tensors.Columns,
                      delivery: HandedRows | None = None) -> None:
        """``write`` of columns ``tensors.put_columns`` made (and checked) already: a put checks its data before
        it looks its keys up, so a put refused for its data makes no key."""
        values, schema = columns
        system = self._systems.route(partition).system
        system.ensure_fields(list(values))
        system.record_schema(partition, schema)
        system.dock.put_experience({dock_name_of(f): v for f, v in values.items()}, rows, delivery=delivery)

    def get_data(self, metadata: BatchMeta) -> Any:
        """The rows of ``metadata``, the fields it names, as a TensorDict in its order; an empty TensorDict for
        a meta of no rows or no fields (TransferQueue's ``TensorDict({}, batch_size=0)`` either way). A meta
        joining partitions of several sub-systems is read from each, one after another."""
        if metadata.size == 0 or not metadata.field_names:
            return tensors.assemble({}, 0, {})
        fields = list(metadata.field_names)
        groups: dict[int, list[int]] = {}  # positions in the meta, by sub-system (its base), in the meta's order
        for i, p in enumerate(metadata.partition_ids):
            groups.setdefault(self._systems.route(_partition(p)).base, []).append(i)
        if len(groups) == 1:
            partition = _partition(metadata.partition_ids[0])
            route = self._systems.route(partition)
            return self.read(partition, route.local(metadata.global_indexes, partition), fields)
        # Partitions of several sub-systems (a concat of metas): each sub-system's rows read there, and the
        # fields joined in the meta's order, as one read of them all would have given them. The schema is that
        # of the meta's first partition, as with partitions of one sub-system.
        rows: dict[str, list[Any]] = {f: [None] * metadata.size for f in fields}
        schema: dict[str, dict[str, Any]] | None = None
        for positions in groups.values():
            partition = _partition(metadata.partition_ids[positions[0]])
            route = self._systems.route(partition)
            local = route.local([metadata.global_indexes[i] for i in positions], partition)
            columns, part_schema = self._columns(partition, local, fields)
            schema = part_schema if schema is None else schema
            for field, column in columns.items():
                for i, value in zip(positions, tensors.rows_of(column)):
                    rows[field][i] = value
        return tensors.assemble({f: tensors.joined(r) for f, r in rows.items()}, metadata.size, schema,
                                stack_uniform=self._stack_uniform)

    def read(self, partition: str, rows: list[int], fields: list[str], state: Snapshot | None = None) -> Any:
        """The rows' fields as a TensorDict, checked first against ``state`` (the partition's snapshot; read
        here, in one round trip, when not given). A snapshot that looked the rows up by key fences the read:
        FencedError if a clear took any of them since (their bytes may be another key's by then). ``rows``
        are the sub-system's holding ``partition``, not global indexes."""
        columns, schema = self._columns(partition, rows, fields, state)
        return tensors.assemble(columns, len(rows), schema, stack_uniform=self._stack_uniform)

    def _columns(self, partition: str, rows: list[int], fields: list[str], state: Snapshot | None = None
                 ) -> tuple[dict[str, tensors.Column], dict[str, dict[str, Any]]]:
        """``read``'s columns, as ``read_rows(stack=True)`` gives them, and the fields' schemas."""
        route = self._systems.route(partition)
        system = route.system
        state = system.snapshot(partition) if state is None else state
        schema = {f: state.schema[f] for f in fields if f in state.schema}
        unique = list(dict.fromkeys(rows))  # a key asked for twice is read once and given twice, as there
        missing = [f for f in fields if f not in schema]
        if missing:
            raise SampleNotFoundError(f"partition {partition!r} has no field {missing} (it has "
                                      f"{sorted(state.schema)})")
        for field, ok in zip(fields, state.produced_each(rows, fields)):
            if not ok.all():
                unready = route.glob(r for r, o in zip(rows, ok) if not o)
                raise SampleNotFoundError(f"partition {partition!r}: field {field!r} is not produced for "
                                          f"global indexes {unready[:8]}")
        read = system.dock.read_rows([dock_name_of(f) for f in fields], unique, stack=True, delivery=state.delivery)
        columns = {f: read[dock_name_of(f)] for f in fields}
        if len(unique) != len(rows):
            at = {r: i for i, r in enumerate(unique)}
            columns = {f: tensors.take(column, [at[r] for r in rows]) for f, column in columns.items()}
        return columns, schema

    def set_custom_meta(self, metadata: BatchMeta) -> None:
        """Store each sample's ``custom_meta`` (TransferQueue's per-sample metadata; the KV API's tags)."""
        for partition, meta in _by_partition(metadata):
            route = self._systems.route(partition)
            route.system.set_tags(partition, route.local(meta.global_indexes, partition), list(meta.custom_meta),
                                  merge=False)

    # -- clearing -------------------------------------------------------------------------------------------

    def clear_partition(self, partition_id: str) -> None:
        partition = _partition(partition_id)
        self._systems.route(partition).system.release(partition, None)
        self._sampler.clear_cache(partition)

    def clear_samples(self, metadata: BatchMeta) -> None:
        for partition, meta in _by_partition(metadata):
            route = self._systems.route(partition)
            route.system.release(partition, route.local(meta.global_indexes, partition))

    # -- status ----------------------------------------------------------------------------------------------

    def get_consumption_status(
        self, task_name: str, partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The partition's global indexes and, per index, 1 if ``task_name`` consumed it; ``(None, None)`` for
        a partition that does not exist, as TransferQueue answers."""
        partition = _partition(partition_id)
        route = self._systems.route(partition)
        if route.system.created(partition) == "0":
            return None, None
        members, consumed = self._status(route.system, partition, task_name)
        rows = np.flatnonzero(members)
        return (torch.as_tensor(rows + route.base, dtype=torch.long),
                torch.as_tensor(_at(consumed, rows), dtype=torch.int8))

    def get_production_status(
        self, data_fields: list[str], partition_id: str
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The partition's global indexes and, per index and field of ``data_fields``, 1 if it is produced: an
        ``(indexes, fields)`` int8 matrix, as TransferQueue's. ``(None, None)`` for a partition that does not
        exist or a field it never had. As there, a field named twice is one column, and the columns follow the
        order the fields were first put (TransferQueue's, in a partition; here, in the system, or in the
        partition's sub-system: the same whenever partitions get their fields in the same order, as each step of
        a pipeline does)."""
        partition = _partition(partition_id)
        fields = list(dict.fromkeys(_names("data_fields", data_fields)))
        route = self._systems.route(partition)
        system = route.system
        if system.created(partition) == "0" or set(fields) - set(system.field_schema(partition, fields)):
            return None, None
        fields = system.in_put_order(fields)
        members, *ready = system.status(partition, fields, None)
        rows = np.flatnonzero(members)
        status = np.stack([_at(bits, rows) for bits in ready], axis=1).astype(np.int8) if ready else \
            np.zeros((len(rows), 0), dtype=np.int8)
        return torch.as_tensor(rows + route.base, dtype=torch.long), torch.as_tensor(status, dtype=torch.int8)

    def check_consumption_status(self, task_name: str, partition_id: str) -> bool:
        rows, status = self.get_consumption_status(task_name, partition_id)
        return bool(rows is not None and status is not None and len(rows) > 0 and bool(status.all()))

    def check_production_status(self, data_fields: list[str], partition_id: str) -> bool:
        """Whether the partition has samples and every one of ``data_fields`` is produced in each."""
        rows, status = self.get_production_status(data_fields, partition_id)
        return bool(rows is not None and status is not None and len(rows) > 0 and bool(status.all()))

    def reset_consumption(self, partition_id: str, task_name: str | None = None) -> bool:
        """Offer the partition's rows again to ``task_name`` (None: every task)."""
        partition = _partition(partition_id)
        system = self._systems.route(partition).system
        rows = system.partition_rows(partition)
        if not rows:
            return True
        consumers = system.dock.consumers
        for consumer in consumers if task_name is None else [dock_name_of(task_name)]:
            if consumer in consumers:
                system.dock.reset_consumer(consumer, rows)
        return True

    @staticmethod
    def _status(system: System, partition: str, task: str) -> tuple[np.ndarray, np.ndarray]:
        if not system.has_task(task):
            system.dock.refresh()  # another process (a data loader's worker, say) may have added the task
        if not system.has_task(task):
            members = system.status(partition, [], None)[0]
            return members, np.zeros(len(members), dtype=bool)
        members, consumed = system.status(partition, [], task)
        return members, consumed

    def get_partition_list(self) -> list[str]:
        return self._systems.partitions()

    # -- keys ---------------------------------------------------------------------------------------------------

    def kv_retrieve_meta(self, keys: list[str] | str, partition_id: str, create: bool = False) -> BatchMeta:
        """The metadata of the samples of ``keys`` (``create``: new rows for new keys)."""
        partition = _partition(partition_id)
        keys = _keys(keys)
        route = self._systems.route(partition)
        system = route.system
        if create:
            rows = system.rows_for_keys(partition, keys).rows
        else:  # the keys the partition holds, in order (a key twice, twice); the others left out, as there
            rows = [r for r in system.snapshot(partition, keys=keys).found_rows() if r is not None]
        return self._meta(route, partition, rows, system.common_fields(partition, rows))

    def kv_retrieve_keys(self, global_indexes: list[int] | int, partition_id: str) -> list[str | None]:
        partition = _partition(partition_id)
        indexes = [global_indexes] if isinstance(global_indexes, int) else list(global_indexes)
        route = self._systems.route(partition)  # an index of another sub-system is no key of this partition
        return route.system.keys_of_rows(partition, route.local_or_none(indexes))

    def kv_list(self, partition_id: str | None = None) -> dict[str, dict[str, Any]]:
        """``{partition: {key: tags}}`` of one partition or all; ``{}`` for a partition that does not exist."""
        if partition_id is None:
            partitions = self._systems.partitions()
        else:
            partition = _partition(partition_id)
            partitions = [partition] if self._systems.route(partition).system.created(partition) != "0" else []
        return {p: self._systems.route(p).system.listing(p) for p in partitions}

    def close(self) -> None:
        """Nothing to stop: the process's connections close with ``broker.transfer_queue.close()``."""


class AsyncTransferQueueClient(TransferQueueClient):
    """The client's calls as coroutines (``async_get_meta``, ``async_put``, ...), each run on a thread."""


def _async(name: str) -> Callable[..., Any]:
    sync = getattr(TransferQueueClient, name)

    @functools.wraps(sync)
    async def call(self: TransferQueueClient, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(sync, self, *args, **kwargs)

    call.__name__ = call.__qualname__ = f"async_{name}"
    return call


for _name in ("get_meta", "put", "get_data", "set_custom_meta", "clear_partition", "clear_samples",
              "get_consumption_status", "get_production_status", "check_consumption_status",
              "check_production_status", "reset_consumption", "get_partition_list", "kv_retrieve_meta",
              "kv_retrieve_keys", "kv_list", "ack"):
    setattr(TransferQueueClient, f"async_{_name}", _async(_name))


def _at(bits: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``bits`` at ``rows`` as int8, rows past the bitmap's end being 0."""
    out = np.zeros(len(rows), dtype=np.int8)
    inside = rows < len(bits)
    out[inside] = bits[rows[inside]]
    return out


def _by_partition(metadata: BatchMeta) -> list[tuple[str, BatchMeta]]:
    if metadata.size == 0:
        return []
    return [(_partition(m.partition_ids[0]), m) for m in metadata.chunk_by_partition()]


class _CustomMeta:
    """What TransferQueue's controller passes a sampler as ``partition``: the rows' custom meta (tags)."""

    def __init__(self, route: Route, partition: str):
        self.route, self.partition = route, partition

    def get_custom_meta(self, global_indices: Sequence[int]) -> dict[int, dict[str, Any]]:
        indexes = [int(g) for g in global_indices]
        tags = self.route.system.tags(self.partition, self.route.local(indexes, self.partition))
        return {g: t for g, t in zip(indexes, tags) if t}


def deliveries_of(metadata: BatchMeta) -> list[HandedRows]:
    """The deliveries a BatchMeta carries: none, the one of its ``get_meta``, or those of the batches ``concat``
    joined (``extra_info["broker_delivery"]``)."""
    value = metadata.extra_info.get(DELIVERY)
    return [d for d in (value if isinstance(value, tuple) else (value,)) if isinstance(d, HandedRows)]


def _by_delivery(metadata: BatchMeta) -> list[tuple[HandedRows | None, list[int]]]:
    """The meta's rows grouped by the delivery that holds each (``None``: rows of no delivery), in the meta's
    order within each group. A row two deliveries hold (handed out again after a lease ran out) goes with the
    later one, the only one whose lease can still be live."""
    deliveries = deliveries_of(metadata)
    owner: dict[int, int] = {}
    for i, delivery in enumerate(deliveries):
        for row in delivery:
            owner[int(row)] = i
    groups: dict[int | None, list[int]] = {}
    for row in metadata.global_indexes:
        groups.setdefault(owner.get(int(row)), []).append(int(row))
    return [(None if i is None else deliveries[i], part) for i, part in groups.items()]


def _partition(partition_id: Any) -> str:
    """Any str is a partition, the empty one too (as in TransferQueue): it is the last part of its keys'
    names (``tq:rows:<partition>``), after the dock's hash tag, so no character of it can move a key."""
    if not isinstance(partition_id, str):
        raise InvalidArgumentTypeError(f"partition_id must be a str, got {type(partition_id).__name__}")
    return partition_id


def _names(what: str, names: Any, allow_empty: bool = False) -> list[str]:
    if isinstance(names, str):
        names = [names]
    if names is None and allow_empty:
        return []
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise InvalidExperienceError(f"{what} must be a list of field names, got {names!r:.80}")
    if not names and not allow_empty:
        raise InvalidExperienceError(f"{what} must name at least one field")
    return list(names)


def _keys(keys: Any) -> list[str]:
    """A key or a list of keys as a list; any str is a key (the empty one too, as in TransferQueue)."""
    if isinstance(keys, str):
        return [keys]
    if not isinstance(keys, (list, tuple)):
        raise InvalidArgumentTypeError(f"keys must be a str or a list of str, got {type(keys).__name__}")
    if not all(isinstance(k, str) for k in keys):
        raise InvalidArgumentTypeError(f"Not all elements in `keys` are strings: {keys!r:.80}")
    return list(keys)


def _count(batch_size: Any) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidExperienceError(f"batch_size must be an int >= 1, got {batch_size!r}")
    return batch_size
