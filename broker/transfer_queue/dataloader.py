"""TransferQueue's ``StreamingDataset`` / ``StreamingDataLoader`` on the broker: a torch ``IterableDataset`` that
yields ``(TensorDict, BatchMeta)`` micro-batches of a task's rows as they become ready, and the DataLoader that
wraps it (``num_workers`` / ``prefetch_factor`` fetch ahead in worker processes).

Over 400 lines: TransferQueue's ``StreamingDataset`` and ``StreamingDataLoader`` share their fetch, lease and
worker-process logic, which TransferQueue also keeps in one module.

As in TransferQueue: each batch is ``get_meta(data_fields, batch_size, partition_id, task_name, sampling_config=
{"dp_rank", "task_name", "batch_index", "partition_id"})`` then ``get_data``, kept in ``buffer`` and cut into
micro-batches by ``process_batch_fn``; the ranks of one DP group (same ``dp_rank``) get the same rows under
``RankAwareSampler``, whatever process they run in (the take is named after the rank and batch, see
``client.py``); ``should_check_consumption_status=True`` stops once every row of the partition was handed to the
task; ``reset()`` replays the buffer, ``step(partition_id)`` moves to another partition.

Each process opens its own client from the conf, which the dataset carries when pickled into a worker
(``broker.url`` and ``broker.namespace``: resolved when the dataset is made, from the conf or from this process's
``init``); a worker never calls ``init`` and never touches Ray.

Where it differs from TransferQueue, and why:

- ``num_workers=W``: worker ``w`` fetches batches ``w, w + W, w + 2W, ...`` (TransferQueue's workers each start at
  batch 0, so under ``RankAwareSampler`` every worker of a rank yields the same rows: W copies of each batch),
  and claims batch ``k`` only after batch ``k - 1`` was claimed (a counter the loader's workers share). So rows go
  to batches in order, a prefetched batch waits only for the consumer (never, leased, behind an earlier batch
  still waiting for rows), and the ranks of one DP group agree on every batch whatever their ``num_workers``.
- A worker's item is a whole batch's micro-batches, which the loader's iterator hands out one at a time: the
  DataLoader takes the workers' items in turn, so micro-batches come out in batch order, a batch's together
  (TransferQueue's workers yield single micro-batches, interleaving those of different batches).
  ``prefetch_factor`` therefore counts batches; a ``collate_fn`` is still applied to each micro-batch, in the
  worker.
- A micro-batch's ``BatchMeta`` is the meta of exactly the rows of its TensorDict (TransferQueue's cuts the meta
  with ``BatchMeta.chunk``, which puts the remainder first: 7 rows in micro-batches of 3 gave rows 0-2, 3-5, 6
  but metas of 3, 2, 2 rows).
- Waiting for rows: ``get_meta`` is asked without blocking and, when too few rows are ready, again after a
  pause that grows from 5 ms to 0.1 s (``$TQ_STREAMING_DATASET_EMPTY_BATCH_SLEEP_INTERVAL`` caps it; TransferQueue
  sleeps 1 s), so a batch is yielded soon after its rows are put.
- A rank whose DP group's other rank took batch ``k`` already gets that batch even when no row is ready any more
  (TransferQueue's controller only looks at its cache once enough rows are ready), so a finite loader's ranks
  end on the same batch.
- Invalid arguments raise ``InvalidExperienceError``, a ``ValueError`` as TransferQueue's are (and
  ``chunk_batch_fn`` given something other than a TensorDict a ``TypeError`` as well, as TransferQueue's).

Beyond TransferQueue: ``lease=`` seconds (default: the conf's ``broker.lease``). Each batch is taken under a lease:
rows not acked before it runs out go back to the task, for any reader, so a trainer that dies mid-batch loses
nothing (neither the micro-batch it was on nor those of the batch it had not reached).

When the ack comes: a micro-batch is acked when its consumer asks for the next one, and at the end of the
iteration. That request is the one moment the consumer says it is done with a micro-batch: the loop body has
finished with it. It is made in the consumer's process (the loader's iterator acks there, wherever a worker
fetched the batch), and it needs no change to a training loop. Leaving a loop with ``break`` acks nothing (an
exception leaves it the same way, and then the micro-batch was not done): call ``ack()`` after a ``break``, or
the last micro-batch's rows go to another reader when the lease runs out. ``auto_ack=False`` leaves every ack to
``ack(meta)`` / ``ack()`` (all handed so far), for a trainer that counts a micro-batch done only after its
optimizer step. A ``put`` with a micro-batch's meta (results written back) is fenced by its lease and acks it.

The lease must cover the time a batch waits in the prefetch queue (``num_workers * prefetch_factor`` batches)
as well as its step: one that runs out hands the rows to another reader as well (at-least-once), and the late
ack releases nothing. The ranks of a DP group share the lease of the rank that took the batch first: its ack
ends it. A finite loader stops once every row was handed out; rows whose lease runs out after that are the
next pass's or another reader's.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from broker.api.delivery import LeasedRows
from broker.errors import BrokerError, ExperienceTimeoutError, InvalidArgumentTypeError, InvalidExperienceError
from broker.transfer_queue.client import TransferQueueClient
from broker.transfer_queue.config import merged, plain
from broker.transfer_queue.interface import _chosen_docks, _sampler_of, _stored, get_client, open_systems
from broker.transfer_queue.metadata import DELIVERY, BatchMeta
from broker.transfer_queue.systems import Systems

log = logging.getLogger(__name__)

#: TransferQueue's variable for the pause between empty fetches (seconds); here it caps a growing pause.
SLEEP_ENV = "TQ_STREAMING_DATASET_EMPTY_BATCH_SLEEP_INTERVAL"
FIRST_PAUSE, LONGEST_PAUSE = 0.005, 0.1

#: ``fetch_batch_fn(tq_client=, data_fields=, batch_size=, partition_id=, task_name=, sampling_config=,
#: batch_index=)`` -> ``(TensorDict or None when nothing is ready, BatchMeta)``.
FetchBatchFn = Callable[..., tuple[Any, BatchMeta]]
#: ``process_batch_fn(td, batch_meta, micro_batch_size=)`` -> ``[(TensorDict, BatchMeta), ...]``.
ProcessBatchFn = Callable[..., Sequence[tuple[Any, BatchMeta]]]


class StreamingDataset(IterableDataset):  # type: ignore[type-arg]  # yields (TensorDict, BatchMeta)
    """Micro-batches of ``task_name``'s rows of ``partition_id`` as they become ready (TransferQueue's
    ``StreamingDataset``; see the module's docstring for ``lease`` and ``auto_ack``)."""

    def __init__(
        self,
        config: Any,
        batch_size: int,
        micro_batch_size: int,
        data_fields: list[str],
        partition_id: str,
        task_name: str,
        dp_rank: int,
        should_check_consumption_status: bool = False,
        fetch_batch_fn: FetchBatchFn | None = None,
        process_batch_fn: ProcessBatchFn | None = None,
        *,
        lease: float | None = None,
        auto_ack: bool = True,
    ):
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise InvalidExperienceError(f"micro_batch_size must be an int >= 1, got {micro_batch_size!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidExperienceError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if isinstance(data_fields, str) or not isinstance(data_fields, (list, tuple)) or not data_fields:
            raise InvalidExperienceError(f"data_fields must be a list of at least one field name, got {data_fields!r}")
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
            raise InvalidExperienceError(f"dp_rank must be an int >= 0, got {dp_rank!r}")
        self.config = config
        self.batch_size = batch_size
        self.micro_batch_size = micro_batch_size
        self.data_fields = list(data_fields)
        self.partition_id = partition_id
        self.task_name = task_name
        self.dp_rank = dp_rank
        self.should_check_consumption_status = should_check_consumption_status
        self.fetch_batch_fn: FetchBatchFn = fetch_batch_fn or default_fetch_batch_fn
        self.process_batch_fn: ProcessBatchFn = process_batch_fn or chunk_batch_fn
        self.sampling_config: dict[str, Any] = {"dp_rank": dp_rank, "task_name": task_name}
        #: Batches fetched by this process, for ``reset()`` to replay (as TransferQueue keeps them).
        self.buffer: list[tuple[Any, BatchMeta]] = []
        self.batch_index = 0
        self._conf = _resolved(config)
        if lease is None:
            lease = self._conf["broker"]["lease"]
        if lease is not None and (isinstance(lease, bool) or not isinstance(lease, (int, float)) or not lease > 0):
            raise InvalidExperienceError(f"lease must be None or a number of seconds > 0, got {lease!r}")
        self.lease: float | None = None if lease is None else float(lease)
        self.auto_ack = bool(auto_ack)
        #: Set by a StreamingDataLoader wrapping it: each batch's micro-batches are one item (a ``_Bundle``),
        #: which the loader's iterator hands out one by one and acks.
        self._bundles = False
        #: Set by a StreamingDataLoader with workers before it starts them: the turns they claim batches in.
        self._turns: _Turns | None = None
        #: Leased micro-batches handed to this process's consumer and not acked yet.
        self._unacked: list[BatchMeta] = []
        self._tq_client: TransferQueueClient | None = None
        self._client_pid = 0
        super().__init__()

    # -- the client of this process --------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """What a worker process gets: the conf to reconnect with, not this process's client or its leases."""
        state = dict(self.__dict__)
        state["_tq_client"], state["_client_pid"], state["_unacked"] = None, 0, []
        if multiprocessing.context.get_spawning_popen() is None:
            state["_turns"] = None  # shared memory crosses only into the processes a loader starts
        return state

    def _client(self) -> TransferQueueClient:
        """This process's own client (a forked worker opens its own rather than use its parent's)."""
        if self._tq_client is None or self._client_pid != os.getpid():
            self._tq_client = _open_client(self.config, self._conf, self.lease)
            self._client_pid = os.getpid()
        return self._tq_client

    # -- iterating ---------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        if self._bundles:
            return self._stream()
        micro_batches = (m for bundle in self._stream() for m in bundle)
        return micro_batches if get_worker_info() is not None else self._acking(micro_batches)

    def _stream(self) -> Iterator[_Bundle]:
        """Each batch's micro-batches: of the buffer from ``batch_index`` on, then of batches fetched as rows get
        ready."""
        client = self._client()
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        turns = self._turns if workers > 1 else None
        cap = float(os.environ.get(SLEEP_ENV) or LONGEST_PAUSE)
        pause = FIRST_PAUSE
        while True:
            if self.batch_index < len(self.buffer):
                batch, meta = self.buffer[self.batch_index]
                self.batch_index += 1
                log.debug("StreamingDataset: batch %d of %d buffered", self.batch_index, len(self.buffer))
                yield _Bundle(self.process_batch_fn(batch, meta, micro_batch_size=self.micro_batch_size))
                continue
            index = worker + self.batch_index * workers  # this worker's share: w, w + W, ... (module docstring)
            turn = "claim" if turns is None else turns.turn(index)
            if turn == "end":
                return
            batch = None
            if turn == "claim":
                try:
                    batch, meta = self.fetch_batch_fn(
                        tq_client=client, data_fields=self.data_fields, batch_size=self.batch_size,
                        partition_id=self.partition_id, task_name=self.task_name,
                        sampling_config=self.sampling_config, batch_index=index)
                except ExperienceTimeoutError:  # a fetch_batch_fn of its own that waited: nothing ready yet
                    batch = None
            if batch is not None:
                self.buffer.append((batch, meta))
                if turns is not None:
                    turns.claimed(index)
                pause = FIRST_PAUSE
                continue
            if turn == "claim" and self.should_check_consumption_status and self._consumed(client):
                if turns is not None:
                    turns.end_at(index)
                return
            time.sleep(pause)
            pause = min(pause * 2, cap)

    def _consumed(self, client: TransferQueueClient) -> bool:
        """Whether every row of the partition was handed to the task (rows whose lease ran out are given back
        first: they are not consumed)."""
        client.systems.reclaim(self.task_name)
        return client.check_consumption_status(self.task_name, self.partition_id)

    def _acking(self, items: Iterator[Any]) -> Iterator[Any]:
        """``items`` for a consumer in this process: each micro-batch acked when the next is asked for."""
        while True:
            if self.auto_ack:
                self.ack()
            try:
                item = next(items)
            except StopIteration:
                return
            self._handed(item)
            yield item

    def _handed(self, item: Any) -> None:
        """Note the leased micro-batches in ``item`` (a loader's item: the pair, or what a collate_fn made)."""
        for part in item if isinstance(item, (tuple, list)) else (item,):
            if isinstance(part, BatchMeta) and isinstance(part.extra_info.get(DELIVERY), LeasedRows):
                self._unacked.append(part)

    # -- leases ------------------------------------------------------------------------------------------------

    def ack(self, meta: BatchMeta | None = None) -> int:
        """End the lease of a micro-batch's rows (``meta``), or of every micro-batch handed to this process's
        consumer and not acked yet (None). Returns how many rows it released: fewer than handed when a lease
        ran out first (those rows went, or will go, to another reader too)."""
        if meta is None:
            todo, self._unacked = self._unacked, []
        else:
            todo = [meta]
            self._unacked = [m for m in self._unacked if m is not meta]
        released = 0
        for one in todo:
            delivery = one.extra_info.get(DELIVERY)
            if isinstance(delivery, LeasedRows) and one.size:
                released += self._client().ack(one)
        return released

    # -- TransferQueue's controls --------------------------------------------------------------------------------

    def reset(self) -> None:
        """Start the next iteration at the first buffered batch (the same rows again, not fetched again)."""
        self.batch_index = 0

    def step(self, partition_id: str) -> None:
        """Move to ``partition_id``: the buffer is emptied and the next iteration fetches from there."""
        self.buffer = []
        self.batch_index = 0
        self.partition_id = partition_id


class StreamingDataLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader over a :class:`StreamingDataset` yielding its ``(TensorDict, BatchMeta)`` micro-batches as
    they are (TransferQueue's ``StreamingDataLoader``); ``num_workers`` processes fetch ahead, each with its own
    client. Its iterator acks each leased micro-batch when the next is asked for (see the dataset)."""

    def __init__(
        self,
        dataset: StreamingDataset,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
    ):
        if not isinstance(dataset, StreamingDataset):
            raise InvalidExperienceError(f"StreamingDataLoader wraps a StreamingDataset, got {type(dataset).__name__}")
        self.dataset: StreamingDataset = dataset
        # A worker's item is a whole batch's micro-batches, so that the workers' turns keep batches whole and in
        # order; this loader's iterator hands them out one at a time, and acks them, in the consumer's process.
        dataset._bundles = True
        super().__init__(
            dataset=dataset, batch_size=None, shuffle=None, sampler=None, batch_sampler=None,
            num_workers=num_workers, collate_fn=_EachMicroBatch(collate_fn), pin_memory=pin_memory, drop_last=False,
            timeout=0, worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
            generator=None, prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # an iterator that also acks
        if self.num_workers > 1:
            if self.dataset._turns is None or not self.persistent_workers:  # new workers: their first batches
                context = self.multiprocessing_context or torch.multiprocessing
                self.dataset._turns = _Turns(context, self.dataset.batch_index * self.num_workers)
            else:  # the same workers go on where they were: the batch they stopped at is to claim again
                self.dataset._turns.restart()
        return _Acking(super().__iter__(), self.dataset)

    def ack(self, meta: BatchMeta | None = None) -> int:
        """The dataset's :meth:`StreamingDataset.ack`: a micro-batch, or all handed and not acked (None)."""
        return self.dataset.ack(meta)

    def reset(self) -> None:
        """Replay the buffer from its first batch (see :meth:`StreamingDataset.reset`)."""
        self.dataset.reset()

    def step(self, partition_id: str) -> None:
        """Move to another partition (see :meth:`StreamingDataset.step`)."""
        self.dataset.step(partition_id)

    def get_buffer(self) -> list[tuple[Any, BatchMeta]]:
        """The batches this process fetched (with ``num_workers`` they are in the workers' copies)."""
        return self.dataset.buffer


class _Turns:
    """The batch a loader's workers may claim next, in shared memory: batch ``k`` is claimed only after batch
    ``k - 1``. Otherwise a worker would take rows for a later batch while its sibling still waits for rows for an
    earlier one; that batch would then wait, leased, behind it in the DataLoader's order, and at the end of the
    rows a gap would stay where a rank of the same DP group fetching in fewer workers stops."""

    def __init__(self, context: Any, first: int):
        self._shared = context.Array("q", [first, -1])  # the next batch to claim; the batch the rows ended at

    def turn(self, index: int) -> str:
        """``claim`` (batch ``index`` is next), ``wait`` (an earlier one is not claimed yet) or ``end``."""
        with self._shared.get_lock():
            following, end = self._shared[0], self._shared[1]
        if 0 <= end <= index:
            return "end"
        return "claim" if following >= index else "wait"

    def claimed(self, index: int) -> None:
        with self._shared.get_lock():
            self._shared[0] = max(self._shared[0], index + 1)

    def end_at(self, index: int) -> None:
        """Every row was handed out when batch ``index`` was to be claimed: no worker claims it or a later one."""
        with self._shared.get_lock():
            end = self._shared[1]
            self._shared[1] = index if end < 0 else min(end, index)

    def restart(self) -> None:
        with self._shared.get_lock():
            self._shared[1] = -1


class _Bundle(list):  # type: ignore[type-arg]
    """One batch's micro-batches, as one item of a StreamingDataLoader's workers."""


class _EachMicroBatch:
    """A loader's collate_fn applied to each micro-batch of a bundle (in the worker, as TransferQueue applies it);
    none: the micro-batches as they are."""

    def __init__(self, collate_fn: Callable[[Any], Any] | None):
        self.collate_fn = collate_fn

    def __call__(self, bundle: list[Any]) -> _Bundle:  # a _Bundle, which DataLoader's type calls a list
        if self.collate_fn is None:
            return _Bundle(bundle)
        return _Bundle(self.collate_fn(m) for m in bundle)


class _Acking:
    """A StreamingDataLoader's iterator: the micro-batches of its items one at a time, each ``__next__`` first
    acking what the consumer was handed before."""

    def __init__(self, inner: Any, dataset: StreamingDataset):
        self._inner, self._dataset = inner, dataset
        self._ready: collections.deque[Any] = collections.deque()

    def __iter__(self) -> _Acking:
        return self

    def __next__(self) -> Any:
        if self._dataset.auto_ack:
            self._dataset.ack()
        while not self._ready:
            self._ready.extend(next(self._inner))  # StopIteration ends the loop
        item = self._ready.popleft()
        self._dataset._handed(item)
        return item

    def __getattr__(self, name: str) -> Any:  # the DataLoader iterator's own attributes
        return getattr(self._inner, name)


def default_fetch_batch_fn(
    tq_client: TransferQueueClient, data_fields: list[str], batch_size: int, partition_id: str, task_name: str,
    sampling_config: dict[str, Any], batch_index: int,
) -> tuple[Any, BatchMeta]:
    """``get_meta`` for this rank's batch ``batch_index``, then its data; ``(None, empty meta)`` if too few rows
    are ready (the dataset's client never blocks)."""
    config = {**sampling_config, "batch_index": batch_index, "partition_id": partition_id}
    meta = tq_client.get_meta(data_fields=data_fields, batch_size=batch_size, partition_id=partition_id,
                              task_name=task_name, sampling_config=config)
    if meta.size == 0:
        return None, meta
    return tq_client.get_data(meta), meta


def chunk_batch_fn(td: Any, batch_meta: BatchMeta, micro_batch_size: int = 1) -> list[tuple[Any, BatchMeta]]:
    """``td`` and its meta cut into micro-batches of ``micro_batch_size`` rows (the last may be shorter), each
    meta naming exactly its TensorDict's rows. Nested tensors (which do not slice along the batch) are unbound
    once and rebuilt per micro-batch in their layout."""
    from tensordict import TensorDict

    if not isinstance(td, TensorDict):  # a TypeError, as TransferQueue's
        raise InvalidArgumentTypeError(f"chunk_batch_fn cuts a TensorDict, got {type(td).__name__}")
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise InvalidExperienceError(f"micro_batch_size must be an int >= 1, got {micro_batch_size!r}")
    if len(td.batch_size) == 0:
        raise InvalidExperienceError("chunk_batch_fn needs a TensorDict with a batch dimension")
    total = int(td.batch_size[0])
    if micro_batch_size > total:
        raise InvalidExperienceError(f"micro_batch_size ({micro_batch_size}) exceeds the batch's {total} rows")
    if batch_meta.size != total:
        raise InvalidExperienceError(f"the batch has {total} rows but its meta {batch_meta.size}")
    nested = {key: (value.unbind(0), value.layout) for key, value in td.items()
              if isinstance(value, torch.Tensor) and value.is_nested}
    dense = td.exclude(*nested) if nested else td
    pieces = []
    for start in range(0, total, micro_batch_size):
        end = min(start + micro_batch_size, total)
        piece = dense[start:end]
        for key, (rows, layout) in nested.items():
            piece[key] = torch.nested.as_nested_tensor(list(rows[start:end]), layout=layout)
        pieces.append((piece, batch_meta[start:end]))
    return pieces


def _resolved(config: Any) -> dict[str, Any]:
    """The conf with ``broker.url`` and ``broker.namespace`` settled, so that a worker can reconnect: from the
    conf, else this process's ``init`` (the system it attached to), else ``$REDIS_URL``."""
    conf = merged(config)
    broker = conf["broker"]
    if broker["url"]:
        return conf
    try:
        attached: Systems | None = get_client().systems
    except BrokerError:
        attached = None
    if attached is not None:
        broker["url"] = attached.url
        if "namespace" not in (plain(config).get("broker") or {}):
            broker["namespace"] = attached.namespace
    elif os.environ.get("REDIS_URL"):
        broker["url"] = os.environ["REDIS_URL"]
    else:
        raise BrokerError("StreamingDataset cannot tell where the system is: give config.broker.url (the conf "
                          "init returns has it), call broker.transfer_queue.init() in this process first, or "
                          "set $REDIS_URL")
    return conf


def _open_client(config: Any, conf: dict[str, Any], lease: float | None) -> TransferQueueClient:
    """A client of the system ``conf`` names, for this process alone: polling (the dataset waits itself), with
    the sampler the dataset's conf names, else the system's."""
    url, namespace = str(conf["broker"]["url"]), str(conf["broker"]["namespace"])
    stored = _stored(url, namespace)  # a system not made yet: the dataset's conf, not stored (init stores one)
    effective, docks = stored if stored is not None else (conf, _chosen_docks(url, namespace, conf))
    own = (plain(config).get("controller") or {}).get("sampler")
    chosen = own if own is not None else effective["controller"]["sampler"]
    sampler = _sampler_of({"controller": {"sampler": chosen}}, effective)
    system = open_systems(url, namespace, effective, docks)
    return TransferQueueClient(system, sampler, polling_mode=True, lease=lease,
                               client_id=f"StreamingDataset_{uuid.uuid4().hex[:8]}",
                               stack_uniform=bool(effective["broker"].get("stack_uniform", False)))
