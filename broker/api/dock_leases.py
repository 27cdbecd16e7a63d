"""The dock's verbs of who holds which rows: explicit takes, leases and their acks, the batch cursor, and the
columns each consumer reads.

A part of ``TransferDock``'s face (see dock.py): each verb with its user documentation, delegating to
``Handouts`` (handout.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from broker.api.delivery import HandedRows, LeasedRows
from broker.api.handout import Handouts
from broker.errors import InvalidExperienceError


class LeaseVerbs:
    """Takes, leases, acks, the cursor and consumers' columns: a base of ``TransferDock``."""

    _handouts: Handouts

    def take(
        self, consumer: str, indexes: Sequence[int], columns: Sequence[str] | None = None, *,
        lease: float | None = None, exclusive: bool = False, name: str | None = None, name_ttl: float = 86400.0,
    ) -> HandedRows | None:
        """Hand rows ``indexes`` to ``consumer`` without reading them: the rows as their delivery.

        For a reader that decides which rows to take from the status bitmaps and reads their bytes
        later (``read_rows``), as TransferQueue's ``get_meta`` then ``get_data`` do. The rows must be
        written in every column of ``columns`` (None: the consumer's registered columns), else
        ExperienceTimeoutError names the missing cells and nothing is marked. ``lease`` as in
        ``get_experience``.

        ``exclusive=True`` makes it a compare-and-set: if another caller was handed one of the rows first
        (and it was not given back), nothing is marked and it returns None; the caller reads the bitmaps
        again and chooses other rows. Without it, taking rows already handed out marks them again.

        ``name`` makes the take shared: the first take under that name (kept ``name_ttl`` seconds) hands
        its rows out and records them in the same step; a later take under the name hands nothing out
        and returns the recorded rows, whatever ``indexes`` it gives. The ranks of one data-parallel
        group that must read the same batch use it.
        """
        return self._handouts.take(consumer, indexes, columns, lease, exclusive, name, name_ttl)

    def reclaim(self, consumer: str, *, all_leases: bool = False) -> int:
        """Give back ``consumer``'s rows whose lease ran out, so they are offered to it again; returns how many
        of its rows are still leased. Sampling and takes do this themselves: a reader that chooses rows from
        the status bitmaps (``consumed_rows``) calls it before reading them.

        ``all_leases=True`` gives back every row still out on a lease, expired or not, at once: for a caller
        who knows that every holder is gone (a driver that restarted the consumer's whole worker group), so
        the rows need not wait out their leases. A holder that was not gone after all loses them as if its
        lease had expired: its ack releases nothing and its fenced write is refused."""
        return self._handouts.reclaim(consumer, all_leases)

    def ack(self, consumer: str, indexes: Sequence[int], token: str | None = None) -> int:
        """Confirm that ``consumer`` is done with leased rows; returns how many this released.

        ``indexes`` is the :class:`LeasedRows` ``get_experience`` returned (it carries the lease's
        token), or any rows of it with ``token=rows.token``. Only rows still leased under that token
        are released: after the lease expired and the rows went to another call, or after a clear, the
        ack changes nothing and the rows are redone (at-least-once). Acking twice is harmless.
        """
        return self._handouts.ack(consumer, indexes, token)

    def give_back(self, consumer: str, rows: LeasedRows) -> int:
        """Offer leased rows to ``consumer`` again now, rather than when their lease runs out: a worker that
        will not process them hands them back (as SQS's visibility timeout set to 0). Returns how many went
        back.

        ``rows`` is the :class:`LeasedRows` ``get_experience`` or ``take`` returned (or a slice of it). Only
        rows still leased under its token go back: none acked, none whose lease ran out and went to another
        call, none a clear took since; so giving back twice gives back nothing more. Rows handed out as whole
        groups go back as groups. Rows handed out without a lease cannot be given back (InvalidExperienceError):
        nothing would tell this delivery's rows from the same rows handed out again since.
        """
        if not isinstance(rows, LeasedRows):
            raise InvalidExperienceError(
                f"give_back takes rows handed out under a lease (LeasedRows), got {type(rows).__name__}: rows "
                "handed out for good are the consumer's (reset_consumer offers rows again)")
        return self._handouts.give_back(consumer, rows)

    def all_consumed(self, consumer: str) -> bool:
        """True when every row has been handed to ``consumer`` and none is still out on a lease.

        It first gives back the consumer's rows whose lease expired, so a loop ``while not
        all_consumed(...)`` redoes the rows of a worker that died, even one that took explicit rows.

        On a partial-rollout dock an iteration is ``gbs_train`` groups, as in MindSpeed: the rollout
        consumer is done once that many groups are finished, any other once it holds that many groups.
        """
        return self._handouts.all_consumed(consumer)

    def prefetch_request_index(self, experience_num: int) -> list[int] | None:
        """Atomically take the next ``experience_num`` rows of the batch (fewer at its end); None
        once every row was handed out. Many rollout ranks calling at once never get the same row;
        a whole ``clear()`` starts again from row 0.

        Under a staleness bound it is also admission control (see lua/prefetch.lua): None while the
        rows would train more than ``max_staleness`` versions after the current one. The two Nones
        differ in ``get_cur_index()``: past the last row when the batch is spent."""
        return self._handouts.prefetch_request_index(experience_num)

    def get_cur_index(self) -> int:
        """The next row ``prefetch_request_index`` would hand out (past the end once spent)."""
        return self._handouts.get_cur_index()

    def reset_consumer(self, consumer: str, indexes: Sequence[int] | None = None) -> int:
        """Offer rows (``None``: every row) to ``consumer`` again, ending their leases; returns how many
        of them had been handed to it. Their data and the other consumers' marks stay."""
        return self._handouts.reset_consumer(consumer, indexes)

    def register_consumer_columns(self, columns_of: Mapping[str, Sequence[str]]) -> None:
        """Record the columns each consumer reads when ``get_experience`` is given none.

        Stored in Redis (one field per consumer), so every process sees them; registering a consumer
        again replaces its columns. A whole clear keeps them: they describe the pipeline, not a batch.
        """
        self._handouts.register_consumer_columns(columns_of)

    def consumer_columns(self, consumer: str | None = None) -> list[str]:
        """The columns registered for ``consumer``; with None, every column of the dock."""
        return self._handouts.consumer_columns(consumer)

