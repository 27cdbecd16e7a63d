"""Reading the bytes of rows handed out, and what happens when they cannot be read.

``RowReader.read`` fetches the rows' bytes from the store and decodes them, or says a clear took some of
them since the hand-out (the read fence: ``data/sharded_store.py`` and lua/include/generations.lua); rows whose
bytes are corrupt or missing are given back and counted, and become dead letters after
``dead_letter_after`` deliveries (lua/release.lua).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any, NoReturn, cast

import torch

from broker.api import metrics
from broker.api.checks import abbrev, check_flag
from broker.api.delivery import HandedRows, check_delivery, fenced_handout
from broker.api.session import DockSession
from broker.connection import extend_call
from broker.control.scripts import Handout, rows_of
from broker.data import codec, stacking
from broker.errors import DecodeError, FencedError, MissingDataError

#: A batch: per column, one row per index: a tensor, or the plain value that was put (see ``codec``).
Batch = dict[str, list[Any]]
#: A batch read with ``stack=True``: per column one tensor where its rows stack (see ``data/stacking.py``),
#: else the list of a ``Batch``.
StackedBatch = dict[str, Any]


_is_none = functools.partial(operator.is_, None)


class Unreadable(Exception):
    """Rows of a hand-out whose bytes could not be read (row -> why), raised by ``RowReader.read``."""

    def __init__(self, rows: dict[int, str], corrupt: bool):
        super().__init__(rows)
        self.rows, self.corrupt = rows, corrupt


class RowReader:
    """Rows' bytes in, decoded: a part of ``TransferDock``, on the dock's session."""

    def __init__(self, session: DockSession):
        self._s = session

    def read(
        self, columns: list[str], rows: list[int], handout: Handout, call: metrics.Call, stack: bool = False,
    ) -> Batch | None:
        """The rows' bytes, decoded; None if a clear took any of them since ``handout`` handed them out
        (the read fence: see ``data/sharded_store.py`` and lua/include/generations.lua). Rows whose bytes cannot be
        read raise Unreadable, naming each of them; the caller gives the hand-out back.

        With ``stack``, a column whose rows stack is only checked here (every row, as decoding would) and
        left as its ``stacking.Checked`` rows, which the caller may reorder or repeat like any column;
        ``stacked`` then builds each such column once, in the batch's final order."""
        fields = [str(r) for r in rows]
        # The rows are handed out: cut short now, those without a lease would be lost. The rest of the call
        # (this read, the wait for replicas, balancing) gets call_timeout, even past a get's own timeout.
        extend_call(self._s.call_timeout, bound=f"call_timeout={self._s.call_timeout:g} s (rows were handed out)")
        store = self._s.store
        values_by_column = self._s.run(lambda: store.received(columns, rows, handout) if stack
                                       else store.read(columns, rows, handout))
        if values_by_column is None:
            return None
        batch: Batch = {}
        unreadable: dict[int, str] = {}
        corrupt = False
        nbytes = 0
        for col, values in zip(columns, values_by_column):
            if isinstance(values, torch.Tensor):  # received straight into one tensor, every row checked
                batch[col] = [stacking.InBuffer(values, i) for i in range(len(rows))]
                nbytes += values.nbytes
                continue
            if call.live:  # a metric only: not summed row by row for nothing
                nbytes += sum(len(v) for v in values if v is not None)
            key = self._s.keys.data(col) if not self._s.schema.shards else f"column {col!r} of dock {self._s.name!r}"
            if not any(map(_is_none, values)):  # per row in C (a row's ``==`` is never asked, unlike ``in``)
                try:
                    checked = stacking.checked_rows(values, where=key, fields=fields) if stack else None
                    batch[col] = checked or codec.decode_rows(cast("list[bytes]", values), where=key, fields=fields)
                    continue
                except DecodeError:
                    pass  # find every row that fails, below: the good ones must not be lost with it
            for row, field, value in zip(rows, fields, values):
                if value is None:
                    # No clear touched it (the fence held): its bytes were removed behind the broker's back,
                    # evicted, or lost with a cluster primary that failed before its replica had them.
                    unreadable.setdefault(row, f"{key}: marked ready but holds no bytes")
                    continue
                try:
                    codec.decode_rows([value], where=key, fields=[field])
                except DecodeError as exc:
                    unreadable.setdefault(row, str(exc))
                    corrupt = True
        if unreadable:
            raise Unreadable(unreadable, corrupt)
        if call.live:
            call.nbytes += nbytes
        return batch

    def give_back_unreadable(
        self, consumer: str, handout: Handout, token: str, request_id: str, groups: bool, bad: Unreadable,
    ) -> NoReturn:
        """Give back a hand-out some of whose rows could not be read, count their failed deliveries, and
        raise: DecodeError (or MissingDataError when bytes were only missing) saying what became of them.

        Raising after marking them consumed lost the good rows (never delivered, all_consumed True); with
        a lease the same batch came back for ever. Now every row is given back, and a row that keeps
        failing becomes a dead letter after ``dead_letter_after`` deliveries (lua/release.lua), so the
        good rows are delivered by the calls that follow."""
        released = self._s.write(
            "get_experience (giving back rows that could not be read)",
            lambda: self._s.scripts.release(consumer, handout, token, request_id, groups=groups, unreadable=bad.rows),
            hands_out=True,  # the error below reports what became of them; a shortfall is logged
        )
        detail = "; ".join(f"row {row}: {why}" for row, why in list(bad.rows.items())[:4])
        counts = ", ".join(f"row {row} {n}" for row, n in zip(bad.rows, released.failures))
        fate = (f"rows {abbrev(list(released.dead))} are dead letters now (see dock.dead_letters())" if released.dead
                else "they are handed out again until they fail dead_letter_after times")
        message = (f"dock {self._s.name!r}, consumer {consumer!r}: {len(bad.rows)} of the rows handed out could not be "
                   f"read ({detail}); {released.given_back} rows were given back; failed deliveries so far: {counts}; "
                   f"{fate}")
        raise (DecodeError if bad.corrupt else MissingDataError)(message)

    def _moved(self, handout: Handout) -> list[int]:
        """The rows of ``handout`` a clear took since it was made (its epoch, or their generations, moved)."""
        epoch, generations = self._s.run(lambda: self._s.scripts.fence_now(handout.runs))
        rows = rows_of(handout.runs)
        if epoch != handout.epoch:
            return rows
        return [r for i, r in enumerate(rows) if generations[4 * i: 4 * i + 4] != handout.generations[4 * i: 4 * i + 4]]

    @staticmethod
    def stacked(batch: Batch) -> StackedBatch:
        """A batch ``read(..., stack=True)`` gave, each column one tensor where its rows stack."""
        return {col: stacking.stacked(values) if values and isinstance(values[0], stacking.Checked)
                else stacking.gathered(values) if values and isinstance(values[0], stacking.InBuffer)
                else stacking.stack_decoded(values) for col, values in batch.items()}

    def read_now(
        self, columns: Sequence[str], indexes: Sequence[int], stack: bool = False, *,
        delivery: HandedRows | None = None,
    ) -> StackedBatch:
        """The rows' values as stored now, None where a row is not written; marks nothing. With ``stack``,
        a column written in every row and whose rows stack is one tensor (see ``data/stacking.py``). With
        ``delivery``, FencedError if a clear took any of the rows since it handed them out (the read fence
        of ``store.read``)."""
        names = self._s.check.columns_to_read(columns)
        rows = self._s.check.rows(indexes)
        stack = check_flag("stack", stack)
        fields = [str(r) for r in rows]
        out: StackedBatch = {}
        store = self._s.store
        handout = None if delivery is None else fenced_handout(check_delivery(delivery), rows)
        if handout is None:
            got = self._s.run(lambda: store.received(names, rows, None) if stack else store.read_now(names, rows))
        else:
            got = self._s.run(lambda: store.received(names, rows, handout) if stack
                              else store.read(names, rows, handout))
            if got is None:
                raise FencedError(f"dock {self._s.name!r}: rows {abbrev(self._moved(handout))} were cleared since "
                                  "the delivery named handed them out: they may hold other rows' values now; nothing "
                                  "was read")
        for col, values in zip(names, got or []):
            if isinstance(values, torch.Tensor):  # received straight into one tensor, every row checked
                out[col] = values
                continue
            if stack and None not in values:
                out[col] = stacking.decode_stacked(values, where=self._s.keys.data(col), fields=fields)
                continue
            present = [(f, v) for f, v in zip(fields, values) if v is not None]
            decoded = iter(codec.decode_rows([v for _, v in present], where=self._s.keys.data(col),
                                             fields=[f for f, _ in present]))
            out[col] = [None if v is None else next(decoded) for v in values]
        return out
