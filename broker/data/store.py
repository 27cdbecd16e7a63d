"""Where a dock's row bytes live: the one interface of the two stores, and what they share.

The control plane is the Lua scripts (``control/scripts/``, ``lua/``): status bitmaps, leases, sampling, all
in the dock's own slot ``{NAME}`` so that each operation is one atomic script. The bytes are kept
apart from it by one of two stores with one small interface (``DataStore``):

- ``SlotStore`` (``slot_store.py``): the bytes in the dock's slot, as on one Redis server; a put is one
  MULTI per slice holding the checking and marking script (lua/put.lua) and the HSETs.
- ``ShardedStore`` (``sharded_store.py``): the bytes spread over data shards on the cluster's primaries; a
  put is two steps, bytes then marks (lua/mark.lua); its module's docstring walks through every
  interleaving of puts, clears and reads, and why each is safe.

The session (``api/session.py``) picks one by the schema (``Schema.shards``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import redis
import torch

from broker.control.scripts import DockScripts, Forgot, Handout, Hold
from broker.data.requests import PutRequest

log = logging.getLogger(__name__)


class DataStore(Protocol):
    """Where a dock's row bytes live (see the module docstring)."""

    def put(self, put: PutRequest) -> None:
        """Write the rows' bytes and mark them ready in their columns, with what ``finish`` records; all
        or nothing, and once however often it is resent. With ``fence``, only while that delivery still
        holds the rows (else FencedError, nothing written), and with ``ack`` too, ending its lease of
        them in the same step. On data shards with ``wait_replicas``, the bytes reach the shards'
        replicas before they are marked (in one slot bytes and marks are one MULTI); the caller waits
        for the marks' replicas, as for every call that writes."""

    def read(self, columns: Sequence[str], rows: Sequence[int], handout: Handout) -> list[list[bytes | None]] | None:
        """The bytes of the handout's ``rows`` (in that order) per column, or None if a clear took any of
        them between the handout and the read."""

    def read_now(self, columns: Sequence[str], rows: Sequence[int]) -> list[list[bytes | None]]:
        """The bytes of ``rows`` per column as stored now, None where there are none; checks nothing."""

    def received(
        self, columns: Sequence[str], rows: Sequence[int], handout: Handout | None,
    ) -> list[torch.Tensor | Sequence[bytes | bytearray | None]] | None:
        """As ``read`` (with ``handout``) or ``read_now``, a column whose rows stack as one tensor where the
        store can receive them straight into it (see ``SlotStore.received``)."""

    def forget(self, forgot: Forgot, *, whole: bool = False) -> tuple[int, list[str]]:
        """Delete from the data shards what a script forgot (nothing to do in one slot): its value, and the
        ``replicated`` counters of the shards it deleted bytes on (the call that forgot waits for their
        replicas too)."""

    def data_keys(self) -> list[str]:
        """Every key holding the dock's row bytes now (for ``delete``)."""


def unhold(scripts: DockScripts, hold: Hold, dock: str) -> None:
    """Give the rows of a put that ended the deadline their lease had before claim.lua held it (see
    lua/unhold.lua). Where that cannot reach the server, the hold runs out by itself at the put's time
    bound, as before: worth a warning, not the put's error."""
    try:
        scripts.unhold(hold)
    except redis.RedisError as exc:
        log.warning("dock %r: the lease a put held (to its time bound) could not be given its own deadline back: %s",
                    dock, exc)


def few(rows: Sequence[int]) -> str:
    """The first rows of ``rows`` for an error message."""
    return f"{list(rows[:8])}{'...' if len(rows) > 8 else ''}"
