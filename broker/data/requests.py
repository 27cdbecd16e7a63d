"""What a put hands the store: its rows' encoded bytes and what the scripts record with them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from broker.connection import Framed
from broker.control.scripts import Fence, Finish, new_request_id

#: Per column, field -> encoded bytes: what a put writes (field = the row in decimal; in a group column on
#: one slot, ``group_field(g)`` per group: see data/groups.py). A ``Framed`` value is
#: sent from the tensor's own memory, by a client that ``frames`` (see connection/framing.py).
Encoded = dict[str, dict[str, bytes | Framed]]

#: How long a sharded put naming a leased delivery holds the lease while its bytes travel (claim.lua),
#: by default: the longest a call may take.
HOLD_MS = 60_000


@dataclass(frozen=True)
class PutRequest:
    """One put, as the dock hands it down: checked, encoded and sorted already (see ``api/puts.py``)."""

    #: Per column, field (the row in decimal, or a group's field) -> encoded bytes.
    encoded: Encoded
    #: The rows, as runs (see ``runs_of``).
    runs: Sequence[int]
    #: Per length column, one length per row in ascending row order.
    lengths: dict[str, list[int]]
    #: Completion flags and version to record with the marks, if any.
    finish: Finish | None = None
    #: The delivery the put is fenced by (a stage's result for rows it was handed), if any.
    fence: Fence | None = None
    #: With a leased ``fence``: end the lease of the rows in the same step.
    ack: bool = False
    #: How long a sharded put holds the lease of a leased ``fence`` while its bytes travel (claim.lua).
    hold_ms: int = HOLD_MS
    #: Per column, field -> the tail of a row cut to the allocator's size classes (data/fit.py), whose head
    #: is the field's value in ``encoded``; set by the store, once per put.
    tails: dict[str, dict[str, bytes]] = dataclasses.field(default_factory=dict)
    #: The put's request id (lua/include/once.lua), the same however often the call runs it: a put run again
    #: (the session adopting a schema another process grew between two of its slices) finds the slices that
    #: landed by their kept replies, and writes only the rest (their ids follow from it: ``step_id``).
    request_id: str = dataclasses.field(default_factory=new_request_id)
    #: For a leased put that acks: an id the same in every sending of the same put (api/delivery.py
    #: ``put_id``), from which its slices' ids follow instead, so that the put sent again after it was cut
    #: short (its time bound, its connection) writes only the slices that did not land.
    resend_id: str | None = None

    @property
    def nbytes(self) -> int:
        """The bytes of the values the put's HSETs write, tails included (what the dock's quota counts)."""
        return sum(sum(map(len, values.values())) for kind in (self.encoded, self.tails) for values in kind.values())


def step_id(request_id: str, runs: Sequence[int]) -> str:
    """The request id of the step of put ``request_id`` writing rows ``runs`` (a slice): a put cut the same
    way again gives its slices the same ids, one cut otherwise gives them others."""
    return f"{request_id}.{runs[0]}.{sum(runs[1::2])}"


