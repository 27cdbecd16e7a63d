"""The put path, top to bottom and in one direction: check the call (``api/checks.py``: flags, delivery,
rows with padding dropped, completion flags, columns, lengths), add partial rollout's placeholders, encode
every value (``data/codec.py``), check the encoded sizes against the server's limit (``connection/sizes.py``),
and hand the store one ``PutRequest`` (``data/slot_store.py`` or ``data/sharded_store.py``), which writes the
bytes and marks the rows ready through the scripts (``lua/put.lua``, or ``lua/mark.lua`` on data shards).
Nothing is sent before everything is encoded: a bad tensor never leaves half a put.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from broker.api import metrics
from broker.api.checks import check_flag, check_version, completion_flags, length_values
from broker.api.delivery import HandedRows, LeasedRows, check_delivery, fence_of, put_id
from broker.api.dp_padding import drop_padding
from broker.api.generation import Generation
from broker.api.session import DockSession
from broker.connection import Framed, check_sizes, sizes_unchecked, unchecked_value, value_limit
from broker.connection.replication import REPEAT_SAFE, Repeat, do_not_repeat
from broker.control.schema import Schema
from broker.control.scripts import Finish, rows_of, runs_of
from broker.data import collector, groups
from broker.data.codec import encode_column
from broker.data.requests import Encoded, PutRequest
from broker.errors import InvalidExperienceError

#: Key of the completion flags inside a put while padding rows are dropped with the data (no column
#: name holds a NUL).
_FLAGS = "\0rollout_completed"


class Puts:
    """Writing rows: a part of ``TransferDock``, on the dock's session."""

    def __init__(self, session: DockSession, generation: Generation):
        self._s, self._generation = session, generation

    def put(
        self, data_dict: Mapping[str, Any], indexes: Sequence[int], *, is_prompt: bool = False,
        rollout_completed: Any = None, version: int | None = None, delivery: HandedRows | None = None,
        ack: bool = True,
    ) -> None:
        """Check, encode and write rows (see ``TransferDock.put_experience``)."""
        with metrics.observe(self._s.name, "put") as call:
            # A large put's many objects are freed as it returns, before the collector runs again (data/collector.py).
            with collector.paused(value_count(data_dict, indexes)):
                prepared = self.prepare(data_dict, indexes, is_prompt=is_prompt, rollout_completed=rollout_completed,
                                        version=version, delivery=delivery, ack=ack)
                if prepared is not None:
                    self.send(prepared)
                    if call.live:
                        call.rows = prepared.rows
                        call.nbytes = sum(len(v) for m in prepared.request.encoded.values() for v in m.values())

    def prepare(
        self, data_dict: Mapping[str, Any], indexes: Sequence[int], *, is_prompt: bool = False,
        rollout_completed: Any = None, version: int | None = None, delivery: HandedRows | None = None,
        ack: bool = True,
    ) -> Prepared | None:
        """Everything a put does before it writes: every check, the encoding, the sizes against the server's
        limit; None if the put held padding rows only. A partitioned dock prepares every partition's part
        before it sends any, so a bad put writes nothing anywhere."""
        checked = self._checked(data_dict, indexes, is_prompt, rollout_completed, version, delivery, ack)
        if checked is None:
            return None
        request = self._request(checked)
        repeat = REPEAT_SAFE
        if request.fence is not None and request.fence.token and ack:
            repeat = do_not_repeat("it acked its lease, so a repeat is refused (FencedError)")
        # The server would refuse an oversized value only by closing the connection mid-send, and the
        # client's retries would send it again and again.
        limit = self._s.run(lambda: value_limit(self._s.client))
        check_sizes(request.encoded, limit.bytes, limit.setting)
        return Prepared(request, repeat, unchecked_value(request.encoded, limit), len(checked.rows))

    def send(self, prepared: Prepared) -> None:
        """Write a prepared put (``prepare``)."""
        with sizes_unchecked(prepared.unchecked):  # a size refused unseen is not resent
            self._s.write("put", lambda: self._s.store.put(prepared.request), repeat=prepared.repeat, returns=False)

    def _checked(
        self, data_dict: Mapping[str, Any], indexes: Sequence[int], is_prompt: bool, rollout_completed: Any,
        version: int | None, delivery: HandedRows | None, ack: bool,
    ) -> _Checked | None:
        """Every check of the call, before anything is encoded: the flags, the version, the delivery, the rows
        (padding dropped), the completion flags, the columns (partial rollout's placeholders added to a
        prompt's put) and the lengths; None if the put held padding rows only."""
        check_flag("is_prompt", is_prompt)
        check_flag("ack", ack)
        version = None if version is None else check_version(version)
        if delivery is None and isinstance(indexes, HandedRows):
            delivery = indexes
        if delivery is not None:
            delivery = check_delivery(delivery)
        rollout = self._s.schema.rollout
        given = indexes
        if rollout_completed is not None:
            if not rollout.partial:
                raise InvalidExperienceError(
                    f"dock {self._s.name!r} has no partial rollout (max_age > 1): rollout_completed means nothing here"
                )
            data_dict = {**data_dict, _FLAGS: rollout_completed}  # padding rows drop their flags too
        data_dict, indexes = drop_padding(data_dict, indexes)
        if not indexes and indexes is not given:
            return None
        rows = self._s.check.rows(indexes)
        data: Mapping[str, Any] = data_dict
        flags = None
        if rollout_completed is not None:
            data = {c: v for c, v in data_dict.items() if c != _FLAGS}
            flags = completion_flags(data_dict[_FLAGS], len(rows))
        if rollout.partial and is_prompt:
            data = {**self._generation.placeholders(len(rows), skip=data), **data}
        elif rollout.partial and flags is None and any(c in data for c in rollout.response_columns):
            raise InvalidExperienceError(
                f"dock {self._s.name!r} has partial rollout on: a put of response columns "
                f"{[c for c in rollout.response_columns if c in data]} must give rollout_completed"
            )
        self._s.check.data(data)
        lengths = {c: length_values(c, data[c], len(rows)) for c in self._s.schema.length_columns if c in data}
        return _Checked(data, rows, flags, lengths, version, delivery, ack)

    def _request(self, checked: _Checked) -> PutRequest:
        """Everything encoded, and the rows' lengths and flags in ascending row order (the scripts' order)."""
        data, rows, flags, version, delivery, ack = (
            checked.data, checked.rows, checked.flags, checked.version, checked.delivery, checked.ack)
        fields = [str(r) for r in rows]
        framed = self._s.frames  # large rows sent from the tensors' own memory (connection/framing.py)
        encoded: Encoded = {c: dict(zip(fields, encode_column(c, value, len(rows), framed=framed)))
                            if c not in self._s.schema.group_columns  # else one field per group (data/groups.py)
                            else encode_group_column(c, value, rows, self._s.schema, framed)
                            for c, value in data.items()}
        in_run_order = sorted(range(len(rows)), key=rows.__getitem__)
        lengths = {c: [values[i] for i in in_run_order] for c, values in checked.lengths.items()}
        runs = runs_of(rows)
        finish = None
        if flags is not None or version is not None:
            finish = Finish(None if flags is None else tuple(flags[i] for i in in_run_order), version)
        request = PutRequest(
            encoded, runs, lengths, finish,
            fence=None if delivery is None else fence_of(delivery, rows_of(runs)), ack=ack,
            hold_ms=int(self._s.call_timeout * 1000),  # a sharded put holds its lease for as long as it may take
        )
        if isinstance(delivery, LeasedRows) and ack:  # sent again, it writes only what did not land
            request = dataclasses.replace(request, resend_id=put_id(delivery, encoded, runs))
        return request


def value_count(data_dict: Any, indexes: Any) -> int:
    """Values a put holds (rows x columns, before any check): what decides whether the collector is paused."""
    try:
        return len(indexes) * len(data_dict)
    except TypeError:  # malformed: the checks name it
        return 0


class Prepared(NamedTuple):
    """A put checked, encoded and sized (``Puts.prepare``), ready to send."""

    request: PutRequest
    repeat: Repeat  #: what a ReplicationError after it says of repeating it
    unchecked: Any  #: what ``sizes_unchecked`` lets through unseen (``unchecked_value``)
    rows: int


class _Checked(NamedTuple):
    """A put's call, checked whole (``Puts._checked``), not yet encoded."""

    data: Mapping[str, Any]  #: column -> its rows, as given (placeholders added)
    rows: list[int]  #: the rows, in the caller's order, padding dropped
    flags: list[bool] | None  #: completion flags in the caller's order
    lengths: dict[str, list[int]]  #: per length column written, its rows' lengths in the caller's order
    version: int | None
    delivery: HandedRows | None
    ack: bool


def encode_group_column(
    column: str, value: Any, rows: list[int], schema: Schema, framed: bool = False,
) -> dict[str, bytes | Framed]:
    """A group column's fields for a put of ``rows`` (see data/groups.py): one per group in one slot, one
    per row (its group's bytes) on data shards. A value given for many rows as the same object (``[img] * n``)
    is encoded once; the rows of a group must hold equal values (else InvalidExperienceError, nothing sent)."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "OUS" and value.ndim > 0:
        value = list(value)  # as encode_column reads it: one value per element along dim 0
    if isinstance(value, (list, tuple)) and len(value) == len(rows):
        first: dict[int, int] = {}  # id of a value -> its position among the distinct ones (kept alive by value)
        distinct: list[Any] = []
        for v in value:
            if id(v) not in first:
                first[id(v)] = len(distinct)
                distinct.append(v)
        encoded = encode_column(column, distinct, len(distinct), framed=framed)
        each = [encoded[first[id(v)]] for v in value]
    else:
        each = encode_column(column, value, len(rows), framed=framed)  # a stacked tensor, or a mistake it names
    n = schema.n_samples_per_prompt
    folded = groups.fold(column, rows, n, each)
    return groups.per_row(rows, n, folded) if schema.shards else folded
