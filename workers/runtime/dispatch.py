"""The broker as one tensor-parallel group sees it: TP rank 0 talks to Redis, the others get broadcasts.

Every rank of the group calls the same methods in the same order; the collectives inside keep them
in step. A batch crosses the group as MindSpeed-RL sends it: rank 0 packs each column into one flat
tensor plus per-row lengths (``pack_experience_columns``), broadcasts a small header, then the
indexes and lengths in one tensor and each column's flat data; every rank then pads the same rows the
same way (``unpack_pad_experience``, width a multiple of the TP size).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from broker import ExperienceTimeoutError, FencedError, HandedRows, LeasedRows, TransferDock
from broker.api.batches import pack_experience_columns, unpack_pad_experience

from ..model.parallel_state import ParallelState

#: Dtypes a column may have on the wire; the header carries the position in this list.
WIRE_DTYPES = (torch.int64, torch.int32, torch.float32, torch.float64, torch.int16, torch.int8, torch.uint8,
               torch.float16, torch.bfloat16)

log = logging.getLogger(__name__)


class Dispatcher:
    """``all_consumed`` / ``dispatch`` / ``collect`` for one consumer, shared by the ranks of a TP group."""

    def __init__(self, dock: TransferDock, consumer: str, state: ParallelState, pad_id: int,
                 lease: float = 0.0) -> None:
        self.dock = dock
        self.consumer = consumer
        self.state = state
        self.pad_id = pad_id
        #: Seconds each batch is leased for (0: taken for good). A leased batch is acked by the fenced put
        #: of its result (``collect``), or, for a role that writes nothing (a trainer), by ``collect`` too.
        self.lease = lease
        #: On rank 0, the delivery of the batch dispatched last: the rows travel the group as a tensor,
        #: and the writes of their results name it (see ``collect``).
        self.delivery: HandedRows | None = None

    def _broadcast(self, tensor: Tensor) -> None:
        if self.state.tp_group is not None:
            dist.broadcast(tensor, src=self.state.tp_src, group=self.state.tp_group)

    def all_consumed(self) -> bool:
        """Rank 0 asks the broker; MAX over the group so every rank leaves the loop together."""
        return self.agree(lambda: self.dock.all_consumed(self.consumer))

    def agree(self, decide: Callable[[], bool]) -> bool:
        """``decide()`` on rank 0 (the one that talks to the broker), the same answer on every rank."""
        done = torch.zeros(1, dtype=torch.int64)
        if self.state.is_tp_src:
            done[0] = int(decide())
        if self.state.tp_group is not None:
            dist.all_reduce(done, op=dist.ReduceOp.MAX, group=self.state.tp_group)
        return bool(done[0])

    def dispatch(
        self,
        columns: Sequence[str],
        count: int,
        indexes: Sequence[int] | None = None,
        timeout: float | None = None,
        **get_kwargs: Any,
    ) -> tuple[dict[str, Tensor], list[int]] | None:
        """A padded batch of ``count`` rows and their indexes on every rank, or None on every rank.

        Without ``indexes`` rank 0 samples whole groups (or what ``get_kwargs`` says, e.g. the rows one
        by one); with them (guarantee_order) it takes exactly those rows, and rows not written within
        ``timeout`` count as an empty get, to be retried. ``count`` 0 (on rank 0): nothing is asked for.
        """
        columns = list(columns)
        header = torch.zeros(1 + 2 * len(columns), dtype=torch.int64)
        data: dict[str, Tensor] = {}
        lengths: dict[str, Tensor] = {}
        rows: list[int] = []
        if self.state.is_tp_src and (count > 0 or indexes is not None):
            got = self._get(columns, count, indexes, timeout, get_kwargs)
            if got is not None:
                batch, rows = got
                self.delivery = rows if isinstance(rows, HandedRows) else None
                data, lengths = pack_experience_columns({c: batch[c] for c in columns}, len(rows))
                header[0] = len(rows)
                for i, column in enumerate(columns):
                    header[1 + 2 * i] = data[column].numel()
                    header[2 + 2 * i] = WIRE_DTYPES.index(data[column].dtype)
        self._broadcast(header)
        got_rows = int(header[0])
        if got_rows == 0:
            return None
        if self.state.tp_group is not None:
            # Indexes and every column's lengths travel together: one collective instead of 1 + columns.
            ints = torch.empty((1 + len(columns)) * got_rows, dtype=torch.int64)
            if self.state.is_tp_src:
                ints.copy_(torch.cat([torch.tensor(rows, dtype=torch.int64), *(lengths[c].long() for c in columns)]))
            self._broadcast(ints)
            parts = ints.view(1 + len(columns), got_rows)
            rows = parts[0].tolist()
            lengths = {c: parts[1 + i].to(torch.int32) for i, c in enumerate(columns)}
            for i, column in enumerate(columns):
                if not self.state.is_tp_src:
                    data[column] = torch.empty(int(header[1 + 2 * i]), dtype=WIRE_DTYPES[int(header[2 + 2 * i])])
                self._broadcast(data[column])
        padded = unpack_pad_experience(data, lengths, pad_id=self.pad_id, multiple=self.state.tp_size)
        return padded, rows

    def _get(
        self, columns: list[str], count: int, indexes: Sequence[int] | None, timeout: float | None,
        get_kwargs: Mapping[str, Any],
    ) -> tuple[dict[str, list[Tensor]], list[int]] | None:
        lease = {"lease": self.lease} if self.lease else {}
        if indexes is None:
            batch, rows = self.dock.get_experience(self.consumer, columns, count, timeout=timeout, **lease,
                                                   **get_kwargs)
            return None if batch is None else (_one_dtype(batch), rows)
        try:
            batch, rows = self.dock.get_experience(self.consumer, columns, indexes=list(indexes), timeout=timeout,
                                                   **lease)
        except ExperienceTimeoutError:
            return None
        return batch, rows

    def collect(self, output: Mapping[str, Sequence[Tensor]], indexes: Sequence[int], **put_kwargs: Any) -> None:
        """Rank 0 writes the group's result back; the other ranks computed the same and drop theirs.

        The put names the batch's delivery: if the rows were cleared or dropped meanwhile (they may hold
        other prompts now), or its lease ran out and they went to another worker, it writes nothing, and the
        result is dropped with a warning. Under a lease the put acks the rows it writes; a role that writes
        nothing (a trainer, whose result is its model) acks them here, once its step is done.
        """
        if not self.state.is_tp_src:
            return
        if output:
            try:
                self.dock.put_experience(dict(output), list(indexes), delivery=self.delivery, **put_kwargs)
            except FencedError as exc:
                log.warning("%s: result of rows %s dropped: %s", self.consumer, list(indexes)[:8], exc)
        elif isinstance(self.delivery, LeasedRows):
            self.dock.ack(self.consumer, list(indexes), token=self.delivery.token)


def _one_dtype(batch: dict[str, list[Tensor]]) -> dict[str, list[Tensor]]:
    """Rows of a column in one dtype: a partial-rollout dock's placeholder responses are int32 ([-1],
    [0]), the responses generated so far int64, and a packed column takes one dtype."""
    for column, values in batch.items():
        dtypes = {v.dtype for v in values if isinstance(v, Tensor)}
        if len(dtypes) > 1:
            common = dtypes.pop()
            for d in dtypes:
                common = torch.promote_types(common, d)
            batch[column] = [v.to(common) for v in values]
    return batch


def guaranteed_ranges(capacity: int, dp_size: int, dp_rank: int, count: int) -> list[list[int]]:
    """guarantee_order: DP rank ``dp_rank``'s fixed slice of the dock, in batches of ``count`` rows."""
    share = capacity // dp_size
    start = dp_rank * share
    return [list(range(s, min(s + count, start + share))) for s in range(start, start + share, count)]
