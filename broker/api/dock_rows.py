"""The dock's verbs that move rows: ``put_experience``, ``get_experience`` and ``read_rows``.

A part of ``TransferDock``'s face (see dock.py): each verb with its user documentation, delegating to the part
that does the work (``Puts`` in puts.py, ``Handouts`` in handout.py, ``RowReader`` in reads.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

from broker.api.delivery import HandedRows
from broker.api.get_request import GetRequest
from broker.api.handout import Handouts
from broker.api.puts import Puts
from broker.api.reads import Batch, RowReader, StackedBatch


class RowVerbs:
    """Rows in and out: a base of ``TransferDock``, on the parts it assembles."""

    _puts: Puts
    _handouts: Handouts
    _reader: RowReader

    def put_experience(
        self, data_dict: Mapping[str, Any], indexes: Sequence[int], *, is_prompt: bool = False,
        rollout_completed: Any = None, version: int | None = None, delivery: HandedRows | None = None,
        ack: bool = True,
    ) -> None:
        """Write rows ``indexes`` of some columns and mark them ready, atomically, and once however often
        the call is resent after a lost reply.

        Each value of ``data_dict`` is a stacked tensor (split along dim 0 into rows), a list of rows
        (tensors or plain values, see ``codec``) or a numpy object array, with one row per index.
        Writing a row again replaces it. Rows whose index is ``PAD_INDEX`` (-2, the padding
        ``get_experience(..., dp_padding=True)`` adds) are skipped, with their data.

        On a partial-rollout dock (see :class:`broker.Rollout`): ``is_prompt=True`` also writes the
        placeholder responses (``[-1]``, ``[0]`` in a length column) of the response columns not given;
        a put of response columns gives ``rollout_completed``, one flag per row (MindSpeed's
        ``tensor([1])`` works): unfinished rows go back to the rollout consumer, and a group whose rows
        are all finished becomes visible to the other consumers. ``version`` records the policy
        version that produced the rows (the staleness bound keeps each group's oldest).

        A put of rows that ``get_experience`` handed out is fenced by that delivery (``indexes`` is the
        :class:`HandedRows` or :class:`LeasedRows` it returned, or a slice of it; or pass it as
        ``delivery``): it lands only while no clear or drop has taken the rows since, and, under a lease,
        while the lease is still this delivery's (not run out and given back to another worker, not
        acked). Otherwise it raises FencedError and writes nothing, so a slow worker's late result never
        lands on rows that hold other prompts now or that another worker redoes. A put naming no
        delivery (a plain list of rows: the producer of new prompts) is not fenced.

        A put naming a leased delivery also acks the rows it writes, in the same step (``ack=False``: it
        does not): written, a stage's result is final, as Kafka commits a consumer's offsets in the
        transaction of what it produced. A separate ack could come too late: a lease that ran out before
        it goes back to the consumer, and a redo would replace a result the next stage has already read.
        A stage writing its result in several puts passes ``ack=False`` to all but the last.
        """
        self._puts.put(data_dict, indexes, is_prompt=is_prompt, rollout_completed=rollout_completed, version=version,
                       delivery=delivery, ack=ack)

    @overload
    def get_experience(
        self, consumer: str, experience_columns: Sequence[str] | None = ..., experience_count: int | None = ...,
        indexes: Sequence[int] | None = ..., get_n_samples: bool = ..., timeout: float | None = ...,
        policy: str | None = ..., lease: float | None = ..., *, dp_size: int = ..., balance: bool | Sequence[str] = ...,
        dp_padding: bool = ..., max_staleness: int | None = ..., stack: Literal[False] = ...,
    ) -> tuple[Batch, list[int]] | tuple[None, None]: ...

    @overload
    def get_experience(
        self, consumer: str, experience_columns: Sequence[str] | None = ..., experience_count: int | None = ...,
        indexes: Sequence[int] | None = ..., get_n_samples: bool = ..., timeout: float | None = ...,
        policy: str | None = ..., lease: float | None = ..., *, dp_size: int = ..., balance: bool | Sequence[str] = ...,
        dp_padding: bool = ..., max_staleness: int | None = ..., stack: bool,
    ) -> tuple[StackedBatch, list[int]] | tuple[None, None]: ...

    def get_experience(
        self,
        consumer: str,
        experience_columns: Sequence[str] | None = None,
        experience_count: int | None = None,
        indexes: Sequence[int] | None = None,
        get_n_samples: bool = True,
        timeout: float | None = None,
        policy: str | None = None,
        lease: float | None = None,
        *,
        dp_size: int = 1,
        balance: bool | Sequence[str] = False,
        dp_padding: bool = False,
        max_staleness: int | None = None,
        stack: bool = False,
    ) -> tuple[StackedBatch, list[int]] | tuple[None, None]:
        """Hand rows to ``consumer`` and return ``({column: [tensor per row]}, rows)``.

        Without ``indexes``: atomically pick ``experience_count`` rows written in every requested
        column and not yet handed to this consumer (whole groups when ``get_n_samples``), mark them
        consumed and return them. If too few qualify, return ``(None, None)`` — at once when
        ``timeout`` is None, else after waiting up to ``timeout`` seconds for puts (``float("inf")``:
        until they come).

        With ``indexes``: wait up to ``timeout`` seconds (None: do not wait) until those rows are
        written in every requested column, then mark and return them; if they are not, raise
        ExperienceTimeoutError naming the missing cells, having marked nothing. ``experience_count``
        may then be left out; if given it must equal ``len(indexes)``.

        Either way the bytes returned are the ones written when the rows were handed out: a ``clear``
        landing in between makes the call hand rows out again, never return the next batch's bytes.

        With ``lease`` (seconds), the rows come back as :class:`LeasedRows`, a list carrying the lease's
        token, and must be confirmed with :meth:`ack` within that time; rows not acked in time are
        offered to this consumer again (at-least-once delivery, for workers that may die).
        ``lease=None`` hands rows out for good.

        ``experience_columns=None`` reads the columns registered for the consumer
        (:meth:`register_consumer_columns`). ``policy="seqlen"`` picks, among the qualifying units,
        a batch of average total length (MindSpeed's ``use_batch_seqlen_balance``; see lua/sample.lua).

        For ``dp_size`` data-parallel ranks that each take one of ``dp_size`` equal consecutive
        chunks: ``balance`` (True: by every length column of the dock; or a list of them) orders the
        rows so that the chunks carry nearly equal token load (Karmarkar-Karp, see ``balance.py``),
        whole groups together when ``get_n_samples`` and the groups split evenly; ``dp_padding``
        fills a batch that is not a multiple of ``dp_size`` by repeating its last row under index
        ``PAD_INDEX`` (-2), which puts skip.

        On a partial-rollout dock (see :class:`broker.Rollout`) the rollout consumer is handed unfinished
        rows one by one (``get_n_samples=False``), oldest group first, and as many as there are when
        fewer than ``experience_count`` are (at least one); the response columns of those rows stop
        being ready until the rollout puts them again; ``"age"`` among the columns returns each row's
        age. Every other consumer is handed only groups whose rows are all finished, oldest first, and
        at most ``gbs_train`` groups per iteration (see ``clear(consumer=...)``). Under a staleness
        bound (the dock's ``max_staleness``, or this call's) a consumer other than the rollout one is
        never handed a group produced by a version older than the current one minus the bound; such
        groups are dropped or regenerated as the dock's ``stale_policy`` says, and counted.

        With ``stack=True`` a column comes back as one tensor instead of a list, decoded straight into it
        (allocated once, each row's bytes copied into its slice, no tensor per row on the way): of shape
        ``(rows, *shape)`` when every row is a tensor of one dtype and shape; a jagged nested tensor
        (``torch.nested.nested_tensor_from_jagged``, layout ``torch.jagged``, ``unbind()`` gives the rows)
        when the rows are tensors of one dtype and rank >= 1 that differ only in their first dim; otherwise
        (plain values, mixed dtypes or ranks) the list as without it. In the order of ``rows``, balanced
        and DP padding included. The tensors are writable and own their memory.
        """
        return self._handouts.get(GetRequest(
            consumer, experience_columns, experience_count, indexes, get_n_samples, timeout, policy, lease,
            dp_size=dp_size, balance=balance, dp_padding=dp_padding, max_staleness=max_staleness, stack=stack))


    @overload
    def read_rows(self, columns: Sequence[str], indexes: Sequence[int], *, stack: Literal[False] = ...,
                  delivery: HandedRows | None = None) -> Batch: ...

    @overload
    def read_rows(self, columns: Sequence[str], indexes: Sequence[int], *, stack: bool,
                  delivery: HandedRows | None = None) -> StackedBatch: ...

    def read_rows(self, columns: Sequence[str], indexes: Sequence[int], *, stack: bool = False,
                  delivery: HandedRows | None = None) -> StackedBatch:
        """The rows' values as stored now, ``None`` where a row is not written; marks nothing.

        For inspection and MindSpeed's ``get_experience_data``: no consumer is involved, so unlike
        ``get_experience`` it promises nothing about rows a clear removes meanwhile, unless it names the
        ``delivery`` the rows came in (``get_experience``'s rows, or rows an adapter looked up with their
        generations): then it raises FencedError, reading nothing, once a clear took any of them since, as a
        put naming it would. ``stack=True`` makes a column one tensor as in ``get_experience``; a column with
        an unwritten row stays a list.
        """
        return self._reader.read_now(columns, indexes, stack, delivery=delivery)
