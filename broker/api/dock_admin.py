"""The dock's administration verbs: metrics, status, dead letters, clear, quota, delete, grow, and the row status
and settings adapters read.

A part of ``TransferDock``'s face (see dock.py): each verb with its user documentation, delegating to
``Admin`` (admin.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from broker.api.admin import Admin
from broker.api.session import DockSession
from broker.control.schema import Schema


class AdminVerbs:
    """Metrics, status, dead letters, clears, quota, growth, row status and settings: a base of ``TransferDock``."""

    _session: DockSession
    _admin: Admin

    def update_metrics(self, key: str | Mapping[str, Any] = "", value: Any = None, cumulate: bool = False) -> None:
        """Set a shared metric, or with ``cumulate`` append to its list (MindSpeed's ``Metric.update``).

        ``value`` is a number or a list of numbers (tensors and numpy values too); ``key`` may be a
        dict of several. Stored in Redis, so every worker on every node writes to the same place and
        appends are never lost between workers. A whole ``clear()`` resets them.
        """
        self._admin.update_metrics(key, value, cumulate)

    def get_metrics(self) -> dict[str, Any]:
        """Every shared metric: name -> number or list of numbers."""
        return self._admin.get_metrics()

    def status(self) -> dict[str, Any]:
        """A consistent snapshot of the dock's counts (one MULTI/EXEC).

        ``columns``: rows and whole groups written, per column. ``consumers``: rows handed out
        (``consumed``), of which ``leased`` still await an ack, and rows given back after their lease
        expired (``redelivered``, since the last whole clear). Keys holding what no broker writes raise
        DecodeError; a dock whose schema vanished or changed raises DockNotFoundError or SchemaError.
        """
        return self._admin.status()

    def dead_letters(self, consumer: str | None = None) -> dict[str, dict[int, str]]:
        """The dead letters: per consumer (or of ``consumer`` alone), row -> why it is no longer handed to it.

        A row becomes one when its bytes could not be read (corrupt, or missing) ``dead_letter_after``
        times in deliveries to the consumer; it stays handed out, so the consumer goes on without it
        (``all_consumed`` counts it), and handed out as a whole group, its group stays with it. Drop them
        with ``drop_dead_letters`` (or ``clear`` of the rows); ``redis-cli HGETALL td:{NAME}:dead:CONSUMER``
        shows the same."""
        return self._admin.dead_letters(consumer)

    def drop_dead_letters(self, consumer: str | None = None) -> list[int]:
        """Forget the rows that are dead letters (of ``consumer``, or of any consumer) as ``clear`` forgets
        rows: bytes, marks and the dead letters themselves; returns the rows. The producer may write them
        anew."""
        return self._admin.drop_dead_letters(consumer)

    def clear(self, indexes: Sequence[int] | None = None, *, consumer: str | None = None, age: bool = True) -> None:
        """Forget every row (``indexes=None``) or some rows: their bytes, status bits and leases.

        A reader that was handed some of these rows and has not read them yet gets rows handed out
        afresh instead (see ``get_experience``); an ack of their old leases releases nothing.

        ``consumer=...`` ends an iteration instead (MindSpeed's ``clear(consumer)`` under partial
        rollout): the rows handed to that consumer (the trainer's) are forgotten, every group kept grows
        one iteration older, unfinished responses stay for the next iteration, and the cursor of
        ``prefetch_request_index`` and the metrics start again. ``age=False`` leaves the ageing to
        :meth:`age_groups` (the TransferQueue's two calls).
        """
        self._admin.clear(indexes, consumer=consumer, age=age)

    def set_quota(self, nbytes: int | None) -> int:
        """Bound the bytes the dock's rows may hold to ``nbytes`` (None: no bound); returns the bytes it holds.

        Counted are the rows' encoded values as stored (what the puts wrote and no clear removed), exactly,
        by the scripts that write and delete them. A put that would take the dock past its quota raises
        QuotaExceededError and writes nothing; a quota below what the dock holds refuses puts until clears
        bring it under. Docks with a quota pay a little per row written or forgotten for the count. A
        sharded dock cannot have one (``shards``; on a cluster, make it with ``shards=0``). The quota is
        the dock's, for every client of it, kept with its rows by checkpoints, and shown by ``status()``.
        It bounds the broker's puts, not raw writes of a client allowed to write the dock's keys: size
        ``maxmemory`` for those (docs/operations.md).
        """
        return self._admin.set_quota(nbytes)

    def delete(self) -> None:
        """Remove the dock from Redis entirely, schema included.

        Replies that sampling calls keep for retries (``td:{NAME}:reply:*``) are left to expire within a
        minute: finding them would need a SCAN of the whole server.
        """
        self._admin.delete()

    def refresh(self) -> Schema:
        """Read the schema again, to see columns or consumers another process added; returns it."""
        return self._session.refresh()

    def grow(
        self, columns: Sequence[str] = (), consumers: Sequence[str] = (), group_columns: Sequence[str] = (),
    ) -> Schema:
        """Add columns and consumers to the dock, keeping every row; returns the grown schema.

        ``group_columns`` (see ``__init__``) must be among the ``columns`` added, or group columns already:
        a column holding per-row values cannot become one (SchemaError).
        Names it has already are skipped, so many workers may grow it with the same names at once.
        Other processes' dock objects adopt the grown schema at their next call. Removing names, or
        changing the size, would lose rows and is not offered: make a new dock for that.
        """
        return self._admin.grow(columns, consumers, group_columns)

    # -- row status and callers' settings, for adapters (admin.py) ------------------------------------
    # What an adapter reads and keeps beside rows (MindSpeed's status vectors, the TransferQueue's topic
    # timeout), so that none reaches past the dock to its client or keys.

    def ready_rows(self, columns: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Per column (None: every column), a bool tensor of ``capacity`` rows, True where the row is
        written (ready). One consistent read of all of them."""
        return self._admin.ready_rows(columns)

    def consumed_rows(self, consumers: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Per consumer (None: every consumer), a bool tensor of ``capacity`` rows, True where the row
        was handed to it (leased or for good). One consistent read of all of them."""
        return self._admin.consumed_rows(consumers)

    def finished_rows(self) -> torch.Tensor:
        """On a partial-rollout dock, a bool tensor of ``capacity`` rows, True on every row of a group
        whose responses are all finished."""
        return self._admin.finished_rows()

    def set_setting(self, name: str, value: str) -> None:
        """Keep a caller's setting with the dock (a field of its meta hash), for every process attached
        to it: the TransferQueue keeps its topic's timeout so. A write like the others (it waits for
        ``wait_replicas``); the dock's own fields are refused."""
        self._admin.set_setting(name, value)

    def setting(self, name: str) -> str | None:
        """The setting ``name`` kept with ``set_setting``; None if there is none."""
        return self._admin.setting(name)
