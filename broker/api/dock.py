"""TransferDock: MindSpeed-RL's experience dock, kept in Redis so any process on any machine can share it.

This module is the dock's face: its lifecycle, its properties and every verb, each with its argument
checks' home and its documentation. The work is done by the parts it holds, all on one ``DockSession``
(``session.py``: connection, keys, scripts, byte store, replica waits):

- ``Puts`` (``puts.py``): the put path, from the call down to the store;
- ``Handouts`` (``handout.py``) and ``RowReader`` (``reads.py``): sampling, taking, leases and acks, and
  reading the rows handed out;
- ``Generation`` (``generation.py``): partial rollout, versions, the staleness bound, discarding groups;
- ``Admin`` (``admin.py``): metrics, status, dead letters, clear, delete, grow.

See docs/design.md for a put and a get walked through the planes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, overload

import torch

from broker.api.admin import Admin
from broker.api.checks import is_int
from broker.api.delivery import HandedRows
from broker.api.generation import Generation
from broker.api.handout import Handouts
from broker.api.puts import Puts
from broker.api.reads import Batch, RowReader, StackedBatch
from broker.api.session import DockSession
from broker.connection import DEFAULT_CALL_TIMEOUT, Client, uncarried
from broker.control.keys import DockKeys
from broker.control.rollout import Rollout
from broker.control.schema import Schema
from broker.errors import BrokerError, SchemaError

__all__ = ["TransferDock", "Batch", "StackedBatch", "DEAD_LETTER_AFTER"]

#: How many times, by default, a row whose bytes cannot be read is handed to a consumer before it becomes
#: a dead letter for it: enough to ride out a row being rewritten while it was read, few enough that a
#: corrupt row does not hold a worker up for long.
DEAD_LETTER_AFTER = 3


class TransferDock:
    """Columns of per-row tensors with ready and consumed status, shared through Redis.

    Rows are grouped by prompt: group g is rows ``[g*n, (g+1)*n)``, the n responses of one prompt.
    See docs/guide.md for its use and ``control/keys.py`` for its keys; every method is safe to call
    from many threads and processes.
    """

    def __init__(
        self,
        url_or_client: str | Client,
        name: str,
        prompts_num: int,
        n_samples_per_prompt: int,
        columns: Sequence[str],
        consumers: Sequence[str],
        *,
        policy: str = "fifo",
        seed: int | None = None,
        length_columns: Sequence[str] = (),
        group_columns: Sequence[str] = (),
        rollout: Rollout | None = None,
        shards: int | None = None,
        wait_replicas: int = 0,
        wait_timeout: float = 1.0,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        dead_letter_after: int = DEAD_LETTER_AFTER,
        allow_volatile_eviction: bool = False,
    ):
        """Create dock ``name``, or attach to it if it exists with the same schema.

        ``url_or_client`` is a URL (``redis://``, ``rediss://``, ``unix://``) or a client made with
        ``decode_responses=False`` (``fakeredis.FakeRedis()`` works). ``policy`` picks which qualifying
        rows sampling hands out: ``"fifo"`` (lowest group first), ``"random"`` (reproducible with
        ``seed``) or ``"seqlen"`` (a batch of average total length, see ``get_experience``).
        ``length_columns`` are columns holding one integer per row (``prompt_length``,
        ``response_length``): their sum is a row's cost when sampling or ordering balances load.
        ``rollout`` turns on partial rollout and the staleness bound (see :class:`broker.Rollout`).
        ``group_columns`` (among ``columns``) hold one value per group, stored once per group of n rows
        (the prompt's tokens, an image): puts give a value per row as for any column, and the rows of a
        group must hold equal values; reads give each row its own tensor (see data/groups.py).

        ``shards`` spreads the rows' bytes over that many data shards (see ``data/sharded_store.py``); None: on a Redis
        Cluster one per primary, each on its own, and on one server none (the bytes stay in the dock's
        slot, as does a dock with partial rollout or a staleness bound). Only a dock being made uses it:
        an existing dock keeps the shards it was made with.

        ``wait_replicas=k`` makes every call that writes (puts, hand-outs, clears, drops, acks,
        ``set_version``, metrics, ``grow``, ``delete``, the dock's creation: all of them) wait (``WAIT``, up
        to ``wait_timeout`` seconds per node, within ``call_timeout``) until k replicas of each node it
        wrote to have its writes, so a primary failing right after the call does not take them along. A
        call that hands something out (``get_experience``, ``prefetch_request_index``, ``reserve_groups``)
        logs a shortfall, or any failure of the wait, and returns what it handed out: raising would lose
        it. Every other call raises ReplicationError after it was applied: ``result`` holds what the call
        returns, and the message says whether repeating it is safe (it is not for ``clear(consumer=...)``,
        ``age_groups``, ``update_metrics(cumulate=True)``, ``drop_groups`` and a put that acked its lease).
        A node with fewer replicas in sync than k is waited on for those it has, and logged as degraded.
        See connection/replication.py and docs/cluster.md.

        ``call_timeout`` (seconds, default 30) bounds each call, retries included, unless it has a
        ``timeout`` of its own (``get_experience``); a call out of time raises BrokerTimeoutError. It
        bounds only clients the broker opened from a URL: a client passed in keeps its own timeouts.

        ``dead_letter_after``: how many times a row whose bytes cannot be read (corrupt, or missing) is
        handed to a consumer before it becomes a dead letter for it (see ``get_experience`` and
        ``dead_letters``). Like ``shards``, only a dock being made stores it.

        Opening checks the server (see control/server_checks.py): a server that may evict the dock's keys
        (``maxmemory-policy`` other than ``noeviction``), or lacks a command the broker needs (renamed or
        denied), raises ServerConfigError. ``allow_volatile_eviction=True`` accepts a ``volatile-*``
        policy, which evicts only the replies kept for resends: a call resent after a lost reply may then
        be applied twice.
        """
        wanted = Schema.build(prompts_num, n_samples_per_prompt, columns, consumers, length_columns, rollout,
                              group_columns)
        if shards is not None and (not is_int(shards) or shards < 0):
            raise SchemaError(f"shards must be None or an int >= 0, got {shards!r}")
        if not is_int(dead_letter_after) or dead_letter_after < 1:
            raise SchemaError(f"dead_letter_after must be an int >= 1, got {dead_letter_after!r:.40}")
        session = DockSession(url_or_client, name, policy, seed, (wait_replicas, wait_timeout), call_timeout,
                              allow_volatile_eviction)
        with session.closed_on_error():
            #: Whether this call made the dock (False: it existed, with this schema).
            self.created = session.create(wanted, shards, dead_letter_after)
        self._assemble(session)

    @classmethod
    def attach(
        cls, url_or_client: str | Client, name: str, *, policy: str = "fifo", seed: int | None = None,
        wait_replicas: int = 0, wait_timeout: float = 1.0, call_timeout: float = DEFAULT_CALL_TIMEOUT,
        allow_volatile_eviction: bool = False,
    ) -> TransferDock:
        """Open the existing dock ``name`` from the schema stored in Redis (``wait_replicas``,
        ``call_timeout``, ``allow_volatile_eviction``: see ``__init__``)."""
        session = DockSession(url_or_client, name, policy, seed, (wait_replicas, wait_timeout), call_timeout,
                              allow_volatile_eviction)
        with session.closed_on_error():
            session.attach()
        dock = cls.__new__(cls)
        dock.created = False
        dock._assemble(session)
        return dock

    def _assemble(self, session: DockSession) -> None:
        """Hold the session and the parts that work on it (see the module docstring)."""
        self._session = session
        self._generation = Generation(session)
        self._reader = RowReader(session)
        self._puts = Puts(session, self._generation)
        self._handouts = Handouts(session, self._generation, self._reader)
        self._admin = Admin(session)

    def close(self) -> None:
        """Stop using the dock object (the dock in Redis stays): hand back its connections. Idempotent.

        Docks opened from one URL in a process share one client; its connections close with the last
        of them. A client passed in is left open: it is the caller's. Calls after ``close`` raise
        BrokerError.
        """
        self._session.close()

    def __enter__(self) -> TransferDock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Pickles as (URL, name) so a dock can be handed to Ray actors and subprocesses.
    def __reduce__(self) -> tuple[Callable[..., TransferDock], tuple[Any, ...]]:
        s = self._session
        if s.url is None:
            raise BrokerError(
                f"dock {self.name!r} was opened from a client with no URL ({type(s.client).__name__}); "
                "open it from a URL to pickle it"
            )
        missing = [] if s.owns_client else uncarried(s.client)
        if missing:
            raise BrokerError(
                f"dock {self.name!r} was opened from a client whose {', '.join(missing)} a URL cannot carry: "
                "unpickled, it would connect without them; open it from a URL (rediss://...?ssl_ca_certs=FILE) "
                "to pickle it"
            )
        return _reattach, (s.url, self.name, s.policy, s.seed, s.durability, s.call_timeout, s.allow_volatile)

    def __repr__(self) -> str:
        s = self._session.schema
        return (
            f"TransferDock({self.name!r} at {self._session.server}, prompts_num={s.prompts_num}, "
            f"n_samples_per_prompt={s.n_samples_per_prompt}, columns={list(s.columns)}, "
            f"consumers={list(s.consumers)}{f', shards={list(s.shards)}' if s.shards else ''})"
        )

    # -- schema ---------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._session.name

    @property
    def schema(self) -> Schema:
        return self._session.schema

    @property
    def prompts_num(self) -> int:
        return self._session.schema.prompts_num

    @property
    def n_samples_per_prompt(self) -> int:
        return self._session.schema.n_samples_per_prompt

    @property
    def capacity(self) -> int:
        """Rows in the dock: prompts_num × n_samples_per_prompt."""
        return self._session.schema.capacity

    @property
    def columns(self) -> tuple[str, ...]:
        return self._session.schema.columns

    @property
    def consumers(self) -> tuple[str, ...]:
        return self._session.schema.consumers

    @property
    def fingerprint(self) -> str:
        """The stored schema as the dock's scripts check it: what an adapter binds its own scripts to."""
        return self._session.fingerprint

    @property
    def binding(self) -> tuple[Schema, str]:
        """``(schema, fingerprint)`` read together: what a caller that builds keys from the schema and sends
        the fingerprint with them reads, since another thread sharing this object may adopt a growth between
        a read of one and of the other."""
        return self._session.binding

    @property
    def rollout(self) -> Rollout:
        """The dock's partial-rollout and staleness settings."""
        return self._session.schema.rollout

    @property
    def keys(self) -> DockKeys:
        """The names of the dock's Redis keys (for inspection; write through the dock's methods)."""
        return self._session.keys

    @property
    def client(self) -> Client:
        """The Redis client the dock talks through."""
        return self._session.client

    # -- rows: put, hand out, ack, read (puts.py, handout.py, reads.py) ---------------------------

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
        return self._handouts.get(consumer, experience_columns, experience_count, indexes, get_n_samples, timeout,
                                  policy, lease, dp_size=dp_size, balance=balance, dp_padding=dp_padding,
                                  max_staleness=max_staleness, stack=stack)

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

    # -- partial rollout, versions and discarding (generation.py) ----------------------------------

    def age_groups(self) -> None:
        """Make every group holding a response, or its placeholder, one iteration older (the queue's
        ``increment_ages``; ``clear(consumer=...)`` ages only groups that were generated)."""
        self._generation.age_groups()

    def unready(self, columns: Sequence[str], indexes: Sequence[int]) -> int:
        """Mark rows of columns not ready, keeping their bytes (the TransferQueue's
        ``clear_data_status``); returns how many cells were ready."""
        return self._generation.unready(columns, indexes)

    def get_update_ready(self, require_max_age_all_finished: bool = True) -> bool:
        """The stop signal of a partial-rollout iteration (MindSpeed's): at least ``gbs_train`` groups
        finished, and with ``require_max_age_all_finished`` every group of age ``max_age - 1``
        finished too, so no response waits more than ``max_age`` iterations."""
        return self._generation.get_update_ready(require_max_age_all_finished)

    def get_incomplete_response_num(self) -> int:
        """Rows holding a prompt whose response is not finished (MindSpeed's count): rows with a
        response or its placeholder, less the finished ones."""
        return self._generation.get_incomplete_response_num()

    def set_version(self, version: int) -> None:
        """Set the current policy version (the trainer, after each update); versions only grow."""
        self._generation.set_version(version)

    def version(self) -> int:
        """The current policy version (0 until ``set_version``). DataLostError if it was set and the server
        lost it since (see lua/include/current_version.lua): 0 would let stale rows through."""
        return self._generation.version()

    def reserve_groups(self, count: int, column: str) -> list[int] | None:
        """Claim ``count`` free groups for new prompts, lowest first (None, claiming nothing, if fewer
        are free): a group is free when it is neither claimed nor written in ``column``, and stays
        claimed until it is forgotten. Writers calling at once never get the same group. Under partial
        rollout this is where the next batch goes: rows never move here, so the groups freed by
        ``clear(consumer=...)`` are wherever the trained ones were."""
        return self._generation.reserve_groups(count, column)

    def drop_groups(self, consumer: str, groups: Sequence[int], *, delivery: HandedRows | None = None) -> int:
        """Discard whole groups ``consumer`` rejects (DAPO's dynamic sampling: all n rewards equal):
        their rows are forgotten and free for new prompts at once, and they are counted under the
        consumer in ``status()["discarded"]``. Returns how many groups were dropped; a resend of the
        call after a lost reply drops and counts nothing twice.

        ``delivery``: the rows ``get_experience`` handed the consumer, which hold these groups. The drop
        is then fenced by it as a put is (FencedError, nothing dropped): once a clear or another drop
        took the groups (the driver may have refilled them with new prompts), or the lease ran out and
        they went to another worker, a late filter must not drop what it never judged. Without it, the
        groups are dropped whatever they hold now.

        A worker still holding rows of a dropped group finds them gone at its read (the read fence), and
        its ack releases nothing.
        """
        return self._generation.drop_groups(consumer, groups, delivery=delivery)

    # -- administration (admin.py) -----------------------------------------------------------------

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


def _reattach(url: str, name: str, policy: str, seed: int | None, durability: tuple[int, float] = (0, 1.0),
              call_timeout: float = DEFAULT_CALL_TIMEOUT, allow_volatile_eviction: bool = False) -> TransferDock:
    """Unpickle a dock: reconnect to its server and read its schema there."""
    return TransferDock.attach(url, name, policy=policy, seed=seed, wait_replicas=durability[0],
                               wait_timeout=durability[1], call_timeout=call_timeout,
                               allow_volatile_eviction=allow_volatile_eviction)
