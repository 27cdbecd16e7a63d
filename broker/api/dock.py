"""TransferDock: MindSpeed-RL's experience dock, kept in Redis so any process on any machine can share it."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar, cast

import numpy as np
import redis
import torch

from broker.api import metrics
from broker.api.balance import balanced_order, dp_padded
from broker.api.checks import (
    DockChecks,
    abbrev,
    check_call_timeout,
    check_durability,
    check_flag,
    check_lease,
    check_policy,
    check_sizes,
    check_timeout,
    check_version,
    completion_flags,
    drop_padding,
    encode_column,
    is_int,
    lease_token,
    length_values,
    metric_values,
    unchecked_value,
)
from broker.api.delivery import HandedRows, LeasedRows, check_delivery, fence_of, reordered
from broker.api.generation import AGE_COLUMN, AGES_KEY, GenerationCalls
from broker.connection import (
    DEFAULT_CALL_TIMEOUT,
    LAST_TRY_SECONDS,
    Client,
    call_deadline,
    connect,
    disconnect,
    extend_call,
    redact,
    redis_errors,
    sizes_unchecked,
    uncarried,
    value_limit,
    waiting_call,
)
from broker.connection.replication import REPEAT_SAFE, Replication
from broker.control import server_checks
from broker.control.keys import DockKeys
from broker.control.put_listener import PutListener
from broker.control.rollout import Rollout
from broker.control.schema import CHECKED_FIELDS, Schema, fingerprint
from broker.control.scripts import (
    DockScripts,
    Finish,
    Forgot,
    Handout,
    Selection,
    new_request_id,
    read_pipeline,
    rows_of,
    runs_of,
)
from broker.control.status import DockRef, read_statuses
from broker.data import codec
from broker.data.store import DataStore, ShardedStore, SlotStore, choose_shards
from broker.errors import (
    BrokerError,
    DecodeError,
    DockNotFoundError,
    ExperienceTimeoutError,
    InvalidExperienceError,
    MissingDataError,
    SchemaError,
)

#: A batch: per column, one row per index: a tensor, or the plain value that was put (see ``codec``).
Batch = dict[str, list[Any]]

#: Key of the completion flags inside a put while padding rows are dropped with the data (no column
#: name holds a NUL).
_FLAGS = "\0rollout_completed"
#: Sampling with no partial rollout and no staleness bound.
_PLAIN = Selection()

T = TypeVar("T")

#: Longest a waiting reader sleeps between checks even without a notification. Pub/sub delivers at
#: most once (a reconnect can drop a message), so this bounds the cost of a lost one; it is not polling.
_RECHECK_SECONDS = 1.0

#: How many times one call hands rows out again after a clear took some of them away before their
#: bytes were read (see ``_read``). Each retry means a clear landed in a window of one round trip, so
#: running out of them takes a clearer in a tight loop; the call then finds nothing this time.
_FENCE_RETRIES = 16


#: How many times, by default, a row whose bytes cannot be read is handed to a consumer before it becomes
#: a dead letter for it: enough to ride out a row being rewritten while it was read, few enough that a
#: corrupt row does not hold a worker up for long.
DEAD_LETTER_AFTER = 3


class _Unreadable(Exception):
    """Rows of a hand-out whose bytes could not be read (row -> why), raised by ``_read`` to its caller."""

    def __init__(self, rows: dict[int, str], corrupt: bool):
        super().__init__(rows)
        self.rows, self.corrupt = rows, corrupt


class TransferDock(GenerationCalls):
    """Columns of per-row tensors with ready and consumed status, shared through Redis.

    Rows are grouped by prompt: group g is rows ``[g*n, (g+1)*n)``, the n responses of one prompt.
    See the README for the key layout; every method is safe to call from many threads and processes.
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

        ``shards`` spreads the rows' bytes over that many data shards (see ``store.py``); None: on a Redis
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
        See replication.py and the README.

        ``call_timeout`` (seconds, default 30) bounds each call, retries included, unless it has a
        ``timeout`` of its own (``get_experience``); a call out of time raises BrokerTimeoutError. It
        bounds only clients the broker opened from a URL: a client passed in keeps its own timeouts.

        ``dead_letter_after``: how many times a row whose bytes cannot be read (corrupt, or missing) is
        handed to a consumer before it becomes a dead letter for it (see ``get_experience`` and
        ``dead_letters``). Like ``shards``, only a dock being made stores it.

        Opening checks the server (see server_checks.py): a server that may evict the dock's keys
        (``maxmemory-policy`` other than ``noeviction``), or lacks a command the broker needs (renamed or
        denied), raises ServerConfigError. ``allow_volatile_eviction=True`` accepts a ``volatile-*``
        policy, which evicts only the replies kept for resends: a call resent after a lost reply may then
        be applied twice.
        """
        wanted = Schema.build(prompts_num, n_samples_per_prompt, columns, consumers, length_columns, rollout)
        if shards is not None and (not is_int(shards) or shards < 0):
            raise SchemaError(f"shards must be None or an int >= 0, got {shards!r}")
        if not is_int(dead_letter_after) or dead_letter_after < 1:
            raise SchemaError(f"dead_letter_after must be an int >= 1, got {dead_letter_after!r:.40}")
        self._open(url_or_client, name, policy, seed, (wait_replicas, wait_timeout), call_timeout,
                   allow_volatile_eviction)
        with self._closed_on_error():
            if wanted.rollout == Rollout() or shards:
                tags = self._run(lambda: choose_shards(self._client, name, shards))
                wanted = dataclasses.replace(wanted, shards=tags)
                self._check_data_nodes(tags)  # before the dock is made there
            fields = wanted.to_meta()
            fields["dead_letter_after"] = str(int(dead_letter_after))  # read by lua/release.lua; not schema
            stored = self._run(lambda: self._scripts.create(fields))
            #: Whether this call made the dock (False: it existed, with this schema).
            self.created = stored is None
            if stored is None:
                # Repeating the constructor after a shortfall attaches to the dock made here.
                self._replicated("creating the dock", None, [self._keys.replicated])
                self._set_schema(wanted, fingerprint(fields))
                return
            existing = Schema.from_meta(stored, where=self._keys.meta)
            diff = wanted.differences(existing)
            if diff:
                raise SchemaError(f"dock {name!r} exists with a different schema: " + "; ".join(diff))
            self._set_schema(existing, fingerprint(stored))
            if existing.shards != wanted.shards:
                self._check_data_nodes(existing.shards)

    @classmethod
    def attach(
        cls, url_or_client: str | Client, name: str, *, policy: str = "fifo", seed: int | None = None,
        wait_replicas: int = 0, wait_timeout: float = 1.0, call_timeout: float = DEFAULT_CALL_TIMEOUT,
        allow_volatile_eviction: bool = False,
    ) -> TransferDock:
        """Open the existing dock ``name`` from the schema stored in Redis (``wait_replicas``,
        ``call_timeout``, ``allow_volatile_eviction``: see ``__init__``)."""
        dock = cls.__new__(cls)
        dock.created = False
        dock._open(url_or_client, name, policy, seed, (wait_replicas, wait_timeout), call_timeout,
                   allow_volatile_eviction)
        with dock._closed_on_error():
            dock._set_schema(*dock._run(dock._stored))
            dock._check_data_nodes(dock._schema.shards)
        return dock

    @contextmanager
    def _closed_on_error(self) -> Iterator[None]:
        """Hand the connection back if opening fails: the caller never gets an object to close."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    def _open(
        self, target: str | Client, name: str, policy: str, seed: int | None, durability: tuple[int, float] = (0, 1.0),
        call_timeout: float = DEFAULT_CALL_TIMEOUT, allow_volatile_eviction: bool = False,
    ) -> None:
        self._policy = check_policy(policy)
        self._allow_volatile = check_flag("allow_volatile_eviction", allow_volatile_eviction)
        self._durability = check_durability(*durability)
        self._call_timeout = check_call_timeout(call_timeout, self._durability)
        self._keys = DockKeys(name)
        self._closed = True  # until connected: close() then has nothing to hand back
        with call_deadline(self._call_timeout):  # a URL's client asks the server whether it is a cluster
            self._client, self._url = connect(target)
        self._owns_client = isinstance(target, str)
        self._closed = False
        self._server = redact(self._url) if self._url else repr(self._client)
        self._where = f"{self._server} (dock {name!r})"  # names the dock in every Redis error
        with self._closed_on_error():  # what the broker needs of the server: one round trip
            server = self._run(lambda: server_checks.check_server(
                self._client, self._keys, self._server, wait_replicas=self._durability[0],
                allow_volatile=self._allow_volatile))
        self._scripts = DockScripts(self._client, self._keys, allow_oom=server.script_flags, publish=server.publish)
        self._listener = PutListener(self._client, self._keys.events, sharded=server.publish == "SPUBLISH")
        self._seed = seed
        self._seeds = _Seeds(seed)
        self._replication = Replication(self._client, self._durability[0], round(self._durability[1] * 1000))

    def _check_data_nodes(self, shards: Sequence[str]) -> None:
        """Refuse nodes holding the data shards ``shards`` that may evict (see server_checks.py)."""
        self._run(lambda: server_checks.check_data_nodes(
            self._client, self._keys, shards, self._server, allow_volatile=self._allow_volatile))

    def _set_schema(self, schema: Schema, stored_fingerprint: str) -> None:
        self._schema = schema
        self._check = DockChecks(self.name, schema)
        self._fingerprint = stored_fingerprint
        self._scripts.bind(schema, stored_fingerprint)
        columns = lambda: self._schema.columns  # noqa: E731  # the store sees columns a grow adds
        self._store: DataStore = (
            ShardedStore(self._client, self._keys, self._scripts, columns, schema.shards, schema.n_samples_per_prompt)
            if schema.shards else SlotStore(self._client, self._keys, self._scripts, columns)
        )

    def close(self) -> None:
        """Stop using the dock object (the dock in Redis stays): hand back its connections. Idempotent.

        Docks opened from one URL in a process share one client; its connections close with the last
        of them. A client passed in is left open: it is the caller's. Calls after ``close`` raise
        BrokerError.
        """
        if self._closed:
            return
        self._closed = True
        listener = getattr(self, "_listener", None)  # absent when opening failed early
        if listener is not None:
            listener.close()
        if self._owns_client and self._url is not None:
            disconnect(self._url)

    def __enter__(self) -> TransferDock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # Pickles as (URL, name) so a dock can be handed to Ray actors and subprocesses.
    def __reduce__(self) -> tuple[Callable[..., TransferDock], tuple[Any, ...]]:
        if self._url is None:
            raise BrokerError(
                f"dock {self.name!r} was opened from a client with no URL ({type(self._client).__name__}); "
                "open it from a URL to pickle it"
            )
        missing = [] if self._owns_client else uncarried(self._client)
        if missing:
            raise BrokerError(
                f"dock {self.name!r} was opened from a client whose {', '.join(missing)} a URL cannot carry: "
                "unpickled, it would connect without them; open it from a URL (rediss://...?ssl_ca_certs=FILE) "
                "to pickle it"
            )
        return _reattach, (self._url, self.name, self._policy, self._seed, self._durability, self._call_timeout,
                           self._allow_volatile)

    def __repr__(self) -> str:
        s = self._schema
        return (
            f"TransferDock({self.name!r} at {self._server}, prompts_num={s.prompts_num}, "
            f"n_samples_per_prompt={s.n_samples_per_prompt}, columns={list(s.columns)}, "
            f"consumers={list(s.consumers)}{f', shards={list(s.shards)}' if s.shards else ''})"
        )

    # -- schema -------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._keys.name

    @property
    def schema(self) -> Schema:
        return self._schema

    @property
    def prompts_num(self) -> int:
        return self._schema.prompts_num

    @property
    def n_samples_per_prompt(self) -> int:
        return self._schema.n_samples_per_prompt

    @property
    def capacity(self) -> int:
        """Rows in the dock: prompts_num × n_samples_per_prompt."""
        return self._schema.capacity

    @property
    def columns(self) -> tuple[str, ...]:
        return self._schema.columns

    @property
    def consumers(self) -> tuple[str, ...]:
        return self._schema.consumers

    @property
    def rollout(self) -> Rollout:
        """The dock's partial-rollout and staleness settings."""
        return self._schema.rollout

    @property
    def keys(self) -> DockKeys:
        """The names of the dock's Redis keys (for inspection; write through the dock's methods)."""
        return self._keys

    @property
    def client(self) -> Client:
        """The Redis client the dock talks through."""
        return self._client

    # -- writing ------------------------------------------------------------------------------

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
        with metrics.observe(self.name, "put") as call:
            rollout = self._schema.rollout
            check_flag("is_prompt", is_prompt)
            check_flag("ack", ack)
            version = None if version is None else check_version(version)
            if delivery is None and isinstance(indexes, HandedRows):
                delivery = indexes
            if delivery is not None:
                delivery = check_delivery(delivery)
            given = indexes
            if rollout_completed is not None:
                if not rollout.partial:
                    raise InvalidExperienceError(
                        f"dock {self.name!r} has no partial rollout (max_age > 1): rollout_completed means nothing here"
                    )
                data_dict = {**data_dict, _FLAGS: rollout_completed}  # padding rows drop their flags too
            data_dict, indexes = drop_padding(data_dict, indexes)
            if not indexes and indexes is not given:
                return  # nothing but padding
            rows = self._check.rows(indexes)
            flags = None
            if rollout_completed is not None:
                data_dict = dict(data_dict)
                flags = completion_flags(data_dict.pop(_FLAGS), len(rows))
            if rollout.partial and is_prompt:
                data_dict = {**self._placeholders(len(rows), skip=data_dict), **data_dict}
            elif rollout.partial and flags is None and any(c in data_dict for c in rollout.response_columns):
                raise InvalidExperienceError(
                    f"dock {self.name!r} has partial rollout on: a put of response columns "
                    f"{[c for c in rollout.response_columns if c in data_dict]} must give rollout_completed"
                )
            self._check.data(data_dict)
            fields = [str(r) for r in rows]
            # Encode everything before the first Redis call: a bad tensor must not leave a half put.
            encoded = {c: dict(zip(fields, encode_column(c, value, len(rows)))) for c, value in data_dict.items()}
            in_run_order = sorted(range(len(rows)), key=rows.__getitem__)
            lengths = {}
            for c in self._schema.length_columns:
                if c in data_dict:
                    values = length_values(c, data_dict[c], len(rows))
                    lengths[c] = [values[i] for i in in_run_order]
            # The server would refuse an oversized value only by closing the connection mid-send, and the
            # client's retries would send it again and again.
            limit = self._run(lambda: value_limit(self._client))
            check_sizes(encoded, limit.bytes, limit.setting)
            runs = runs_of(rows)
            fence = None if delivery is None else fence_of(delivery, rows_of(runs))
            finish = None
            if flags is not None or version is not None:
                finish = Finish(None if flags is None else tuple(flags[i] for i in in_run_order), version)
            durable = None
            if self._replication.replicas:  # a sharded put's bytes reach the shards' replicas before its marks
                durable = lambda keys: self._replicated(  # noqa: E731
                    "put", None, keys, applied=False,
                    outcome="its bytes were written to the data shards' primaries, but no row was marked ready",
                )
            repeat = REPEAT_SAFE
            if fence is not None and fence.token and ack:
                repeat = "do not repeat it: it acked its lease, so a repeat is refused (FencedError)"
            hold_ms = int(self._call_timeout * 1000)  # a sharded put holds its lease for as long as it may take
            with sizes_unchecked(unchecked_value(encoded, limit)):  # a size refused unseen is not sent again
                self._write("put", lambda: self._store.put(encoded, runs, lengths, finish, fence, durable, hold_ms,
                                                           ack), repeat=repeat, returns=False)
            if call.live:
                call.rows, call.nbytes = len(rows), sum(len(v) for m in encoded.values() for v in m.values())

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
    ) -> tuple[Batch, list[int]] | tuple[None, None]:
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
        """
        # The wait and every attempt end by ``timeout`` (see waiting_call and _wait); reading rows once
        # handed out, by call_timeout (see _read).
        with metrics.observe(self.name, "get") as call, waiting_call(timeout, self._call_timeout):
            self._check.consumer(consumer)
            if experience_columns is None:
                experience_columns = self.consumer_columns(consumer)
            rollout = self._schema.rollout
            generating = rollout.partial and consumer == rollout.consumer
            want_age = (
                generating and isinstance(experience_columns, (list, tuple))
                and AGE_COLUMN in experience_columns and AGE_COLUMN not in self._schema.columns
            )
            if want_age:
                experience_columns = [c for c in experience_columns if c != AGE_COLUMN]
            columns = self._check.columns_to_read(experience_columns)
            check_timeout(timeout)
            lease_ms = check_lease(lease)
            groups = check_flag("get_n_samples", get_n_samples)
            ranks = self._check.dp_size(dp_size)
            weigh_by = self._check.balance(balance)
            check_flag("dp_padding", dp_padding)
            staleness = self._staleness(consumer, max_staleness)
            got: tuple[Batch, list[int]] | None
            if generating and groups:
                raise InvalidExperienceError(
                    "get_n_samples not supported for rollout when actor_rollout enables partial_rollout: "
                    f"consumer {consumer!r} of dock {self.name!r} takes unfinished rows one by one"
                )
            if indexes is not None:
                if generating:
                    raise InvalidExperienceError(
                        f"dock {self.name!r}: the rollout consumer of a partial-rollout dock samples its rows "
                        "(oldest first); explicit indexes are not supported for it"
                    )
                rows = self._check.rows(indexes)
                self._check.take_count(experience_count, rows)
                got = self._take_rows(consumer, columns, rows, lease_ms, timeout, call)
            else:
                count = self._check.sample_count(experience_count, groups)
                policy = check_policy(policy or self._policy)
                weights = (weigh_by or list(self._schema.length_columns)) if policy == "seqlen" else []
                select = self._selection(consumer, groups, staleness)
                sampler = self._sampler(consumer, columns, count, groups, policy, lease_ms, call, weights, select)
                got = self._wait(sampler, timeout)
            if got is None:
                call.empty = True
                return None, None
            batch, rows = got
            if want_age:
                batch[AGE_COLUMN] = batch.pop(AGES_KEY)
            batch.pop(AGES_KEY, None)
            if ranks > 1 and weigh_by and len(rows) >= ranks:
                # Explicit rows come in the caller's order, not as whole groups: balance them as rows.
                batch, rows = self._balanced(batch, rows, ranks, weigh_by, groups and indexes is None)
            if ranks > 1 and dp_padding and len(rows) % ranks:
                batch, rows = dp_padded(batch, rows, ranks)
            call.rows = len(rows)
            return batch, rows

    def _balanced(
        self, batch: Batch, rows: list[int], ranks: int, weigh_by: list[str], groups: bool
    ) -> tuple[Batch, list[int]]:
        """``batch`` reordered so that ``ranks`` equal chunks of it carry nearly equal load.

        A row's cost is the sum of its length columns, read from their u32 arrays with one BITFIELD
        per column in one round trip (the batch was handed out already: its order needs no atomicity).
        A batch that does not split into ``ranks`` equal chunks is left as it is.
        """
        cost = self._row_costs(rows, weigh_by)
        n = self.n_samples_per_prompt
        if groups and len(rows) % n == 0 and (len(rows) // n) % ranks == 0:
            # Rows of one group are consecutive in the batch: order whole groups.
            group_cost = [sum(cost[g * n : (g + 1) * n]) for g in range(len(rows) // n)]
            order = [g * n + j for g in balanced_order(group_cost, ranks) for j in range(n)]
        elif len(rows) % ranks == 0:
            order = balanced_order(cost, ranks)
        else:
            return batch, rows
        return reordered(batch, rows, order)

    def _row_costs(self, rows: list[int], columns: list[str]) -> list[int]:
        """Sum of the length columns of each row, from the length arrays the puts keep."""
        def reads(pipe: redis.client.Pipeline) -> None:
            for c in columns:
                args = [x for r in rows for x in ("GET", "u32", f"#{r}")]
                pipe.execute_command("BITFIELD", self._keys.lengths(c), *args)

        replies = self._reads(reads)
        return [sum(int(reply[i]) for reply in replies) for i in range(len(rows))]

    def _take_rows(
        self, consumer: str, columns: list[str], rows: list[int], lease_ms: int, timeout: float | None,
        call: metrics.Call,
    ) -> tuple[Batch, list[int]]:
        runs = runs_of(rows)
        missing: dict[str, list[int]] = {}

        def take() -> tuple[Batch, list[int]] | None:
            missing.clear()
            for _ in range(_FENCE_RETRIES):
                token = "r" + new_request_id() if lease_ms else ""
                got = self._scripts.take(consumer, columns, runs, lease_ms=lease_ms, token=token)
                if not isinstance(got, Handout):
                    for col, cells in got.items():  # the script goes by runs; report in the caller's order
                        unwritten = set(cells)
                        missing[col] = [r for r in rows if r in unwritten]
                    return None
                try:
                    batch = self._read(columns, rows, got, call)
                except _Unreadable as bad:  # give back only what this take handed out
                    fresh = got if got.fresh is None else got.only(got.fresh)
                    self._give_back_unreadable(consumer, fresh, token, new_request_id(), False, bad)
                if batch is not None:
                    self._replicated("get_experience", None, [self._keys.replicated], hands_out=True)
                    return batch, self._handed_out(rows, got, token, consumer)
                # A clear took some rows between the take and the read. Nothing to give back: a take
                # may re-take rows already handed out, and the next try marks the same rows again.
            return None

        got = self._wait(take, timeout)
        if got is not None:
            return got
        if missing:
            detail = "; ".join(f"{col}: rows {abbrev(r)}" for col, r in missing.items())
        else:
            detail = f"rows {abbrev(rows)} were cleared each of the {_FENCE_RETRIES} times they were read"
        raise ExperienceTimeoutError(
            f"dock {self.name!r}, consumer {consumer!r}: rows not written within timeout={timeout}: {detail}",
            missing,
        )

    def _sampler(
        self, consumer: str, columns: list[str], count: int, groups: bool, policy: str, lease_ms: int,
        call: metrics.Call, weigh_by: Sequence[str] = (), select: Selection = _PLAIN,
    ) -> Callable[[], tuple[Batch, list[int]] | None]:
        """One sampling attempt of ``count`` units (groups when ``groups``, else rows), checked already."""
        rollout = self._schema.rollout
        # The rollout consumer's response columns are not ready while rows are out for generation, and
        # a row it is handed back (lease expired, or put unfinished) still holds its partial response:
        # only the other columns decide which rows qualify; the read takes the responses as they are.
        status_columns = [c for c in columns if c not in select.unready] if select.unready else columns
        if not status_columns:
            raise InvalidExperienceError(
                f"dock {self.name!r}: the rollout consumer must read a column beside the response columns "
                f"{list(rollout.response_columns)} (the prompt), which decides the rows it may take"
            )

        def sample() -> tuple[Batch, list[int]] | None:
            for _ in range(_FENCE_RETRIES):
                # A fresh id per attempt; the client's own retries of this one call resend the same id,
                # so a reply lost on a dropped connection is answered again, not sampled twice.
                request_id = new_request_id()
                token = ("g" if groups else "r") + request_id if lease_ms else ""
                seed = self._seeds.peek() if policy != "fifo" else 0  # "seqlen" may fall back to random
                sampled = self._scripts.sample(
                    consumer, status_columns, groups=groups, count=count, policy=policy, seed=seed,
                    lease_ms=lease_ms, request_id=request_id, token=token,
                    weigh_by=weigh_by, select=select,
                )
                if sampled.stale:
                    self._discard_stale(list(sampled.stale), select.max_staleness)
                handout = sampled.handout
                if handout is None:
                    return None
                if policy != "fifo":
                    self._seeds.advance(seed)
                rows = rows_of(handout.runs)
                try:
                    batch = self._read(columns, rows, handout, call)
                except _Unreadable as bad:
                    self._give_back_unreadable(consumer, handout, token, request_id, groups, bad)
                if batch is not None:
                    if select.tiers:
                        ages = self._schema.rollout.age_buckets - 1  # the age tiers come first
                        batch, rows = self._oldest_first(batch, rows, handout.tiers, ages)
                    self._replicated("get_experience", None, [self._keys.replicated], hands_out=True)
                    return batch, self._handed_out(rows, handout, token, consumer)
                # A clear took some of the rows between sampling and reading: give back the rest
                # (they were never delivered) and sample again.
                give_back = functools.partial(self._scripts.release, consumer, handout, token, request_id,
                                              groups=groups)
                # Part of a hand-out: a shortfall is logged, as the hand-out's own is (hands_out).
                self._write("get_experience (giving back rows a clear took)", give_back, hands_out=True)
            return None

        return sample

    # -- waiting for replicas (wait_replicas) ----------------------------------------------------

    def _write(
        self, what: str, call: Callable[[], T], *, hands_out: bool = False, repeat: str = REPEAT_SAFE,
        shards: Sequence[str] = (), returns: bool = True, drop: bool = False,
    ) -> T:
        """Run ``call``, which writes (as ``_run``), then wait for replicas of the control slot (and of the
        data shards whose ``replicated`` counters ``shards`` names): see ``_replicated``. Both within one
        call_timeout. Every call that writes goes through here, ``_forget`` or ``_replicated``.
        ``returns``: the public call returns what ``call`` does (else None, and so does a ReplicationError's
        ``result``); ``drop``: delete the counters again (``delete``)."""
        with call_deadline(self._call_timeout):
            result = self._run(call)
            self._replicated(what, result if returns else None, [self._keys.replicated, *shards],
                             hands_out=hands_out, repeat=repeat, drop=drop)
        return result

    def _forget(
        self, what: str, script: Callable[[], Forgot], *, whole: bool = False, hands_out: bool = False,
        repeat: str = REPEAT_SAFE, returns: bool = True,
    ) -> int:
        """A call that forgets rows: ``script`` (clear.lua, discard.lua), the deletion of the bytes it ended
        from the data shards, then the wait for the replicas of the control slot and of those shards
        (``_write``'s arguments); the script's value."""
        with call_deadline(self._call_timeout):
            value, shards = self._run(lambda: self._store.forget(script(), whole=whole))
            self._replicated(what, value if returns else None, [self._keys.replicated, *shards],
                             hands_out=hands_out, repeat=repeat)
        return value

    def _replicated(
        self, what: str, result: Any, keys: Sequence[str], *, hands_out: bool = False, repeat: str = REPEAT_SAFE,
        outcome: str = "it was applied on the primaries", applied: bool = True, drop: bool = False,
    ) -> None:
        """The one place where, with ``wait_replicas``, a call that wrote waits until the replicas of the
        nodes holding ``keys`` (the dock's ``replicated`` counters) have its writes (see replication.py).

        A shortfall raises ReplicationError carrying ``result`` and ``applied``, saying ``outcome`` and
        ``repeat``. A call that ``hands_out`` rows (groups, cursor positions) logs it instead, whatever
        went wrong: they are marked handed out on the primary, and raising would lose those handed out
        without a lease. Bounded by the call's deadline if it has one, else by call_timeout.
        """
        if not self._replication.replicas:
            return
        with call_deadline(self._call_timeout):
            self._replication.wait(keys, f"dock {self.name!r}: {what}", hands_out=hands_out, result=result,
                                   outcome=outcome, repeat=repeat, applied=applied, drop=drop)

    @staticmethod
    def _handed_out(rows: list[int], handout: Handout, token: str, consumer: str) -> HandedRows:
        """``rows`` as the delivery they are: with the lease's ``token`` if they were leased."""
        if token:
            return LeasedRows(rows, token, consumer, handout.epoch, handout.runs, handout.generations)
        return HandedRows(rows, handout.epoch, handout.runs, handout.generations)

    def _read(self, columns: list[str], rows: list[int], handout: Handout, call: metrics.Call) -> Batch | None:
        """The rows' bytes, decoded; None if a clear took any of them since ``handout`` handed them out
        (the read fence: see ``store.py`` and lua/include/generations.lua). Rows whose bytes cannot be
        read raise _Unreadable, naming each of them; the caller gives the hand-out back."""
        fields = [str(r) for r in rows]
        # The rows are handed out: cut short now, those without a lease would be lost. The rest of the call
        # (this read, the wait for replicas, balancing) gets call_timeout, even past a get's own timeout.
        extend_call(self._call_timeout, bound=f"call_timeout={self._call_timeout:g} s (rows were handed out)")
        values_by_column = self._run(lambda: self._store.read(columns, rows, handout))
        if values_by_column is None:
            return None
        batch: Batch = {}
        unreadable: dict[int, str] = {}
        corrupt = False
        for col, values in zip(columns, values_by_column):
            key = self._keys.data(col) if not self._schema.shards else f"column {col!r} of dock {self.name!r}"
            if all(v is not None for v in values):
                try:
                    batch[col] = codec.decode_rows(cast("list[bytes]", values), where=key, fields=fields)
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
            raise _Unreadable(unreadable, corrupt)
        if call.live:
            call.nbytes += sum(len(v) for values in values_by_column for v in values if v is not None)
        return batch

    def _give_back_unreadable(
        self, consumer: str, handout: Handout, token: str, request_id: str, groups: bool, bad: _Unreadable,
    ) -> NoReturn:
        """Give back a hand-out some of whose rows could not be read, count their failed deliveries, and
        raise: DecodeError (or MissingDataError when bytes were only missing) saying what became of them.

        Raising after marking them consumed lost the good rows (never delivered, all_consumed True); with
        a lease the same batch came back for ever. Now every row is given back, and a row that keeps
        failing becomes a dead letter after ``dead_letter_after`` deliveries (lua/release.lua), so the
        good rows are delivered by the calls that follow."""
        released = self._write(
            "get_experience (giving back rows that could not be read)",
            lambda: self._scripts.release(consumer, handout, token, request_id, groups=groups, unreadable=bad.rows),
            hands_out=True,  # the error below reports what became of them; a shortfall is logged
        )
        detail = "; ".join(f"row {row}: {why}" for row, why in list(bad.rows.items())[:4])
        counts = ", ".join(f"row {row} {n}" for row, n in zip(bad.rows, released.failures))
        fate = (f"rows {abbrev(list(released.dead))} are dead letters now (see dock.dead_letters())" if released.dead
                else "they are handed out again until they fail dead_letter_after times")
        message = (f"dock {self.name!r}, consumer {consumer!r}: {len(bad.rows)} of the rows handed out could not be "
                   f"read ({detail}); {released.given_back} rows were given back; failed deliveries so far: {counts}; "
                   f"{fate}")
        raise (DecodeError if bad.corrupt else MissingDataError)(message)

    def _wait(self, attempt: Callable[[], T | None], timeout: float | None) -> T | None:
        """Run ``attempt`` until it returns a value or ``timeout`` seconds pass, woken by puts. Each attempt,
        the last one made at ``timeout`` too, has at least LAST_TRY_SECONDS to answer."""
        def attempt_in_time() -> T | None:
            extend_call(LAST_TRY_SECONDS)
            return self._run(attempt)

        return self._listener.wait(attempt_in_time, timeout, _RECHECK_SECONDS)

    # -- status and clearing ------------------------------------------------------------------

    def all_consumed(self, consumer: str) -> bool:
        """True when every row has been handed to ``consumer`` and none is still out on a lease.

        It first gives back the consumer's rows whose lease expired, so a loop ``while not
        all_consumed(...)`` redoes the rows of a worker that died, even one that took explicit rows.

        On a partial-rollout dock an iteration is ``gbs_train`` groups, as in MindSpeed: the rollout
        consumer is done once that many groups are finished, any other once it holds that many groups.
        """
        self._check.consumer(consumer)

        def done() -> bool:  # the expired leases given back (a write) and the answer, waited on together
            consumed, leased = self._scripts.reclaim(consumer)
            rollout = self._schema.rollout
            if not rollout.partial:
                return consumed == self.capacity and leased == 0
            if consumer == rollout.consumer:
                return self._finished_groups() >= rollout.gbs_train
            return consumed == rollout.gbs_train * self.n_samples_per_prompt and leased == 0

        return self._write("all_consumed (giving back expired leases)", done)

    # -- what the workers of a batch share beside rows -----------------------------------------

    def register_consumer_columns(self, columns_of: Mapping[str, Sequence[str]]) -> None:
        """Record the columns each consumer reads when ``get_experience`` is given none.

        Stored in Redis (one field per consumer), so every process sees them; registering a consumer
        again replaces its columns. A whole clear keeps them: they describe the pipeline, not a batch.
        """
        if not isinstance(columns_of, Mapping) or not columns_of:
            raise InvalidExperienceError("columns_of must be a non-empty dict of consumer -> list of columns")
        stored = {}
        for consumer, columns in columns_of.items():
            self._check.consumer(consumer)
            stored[consumer] = json.dumps(self._check.columns_to_read(columns))
        self._write("register_consumer_columns", lambda: self._scripts.columns_of(stored), returns=False)

    def consumer_columns(self, consumer: str | None = None) -> list[str]:
        """The columns registered for ``consumer``; with None, every column of the dock."""
        if consumer is None:
            return list(self.columns)
        self._check.consumer(consumer)
        raw = self._run(lambda: self._client.hget(self._keys.consumer_columns, consumer))
        if raw is None:
            raise InvalidExperienceError(
                f"dock {self.name!r}: no experience_columns given and none registered for consumer {consumer!r} "
                "(register_consumer_columns)"
            )
        try:
            columns = json.loads(raw)
        except ValueError:
            raise DecodeError(f"{self._keys.consumer_columns} field {consumer}: not a JSON list") from None
        if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
            raise DecodeError(f"{self._keys.consumer_columns} field {consumer}: not a list of column names")
        return columns

    def update_metrics(self, key: str | Mapping[str, Any] = "", value: Any = None, cumulate: bool = False) -> None:
        """Set a shared metric, or with ``cumulate`` append to its list (MindSpeed's ``Metric.update``).

        ``value`` is a number or a list of numbers (tensors and numpy values too); ``key`` may be a
        dict of several. Stored in Redis, so every worker on every node writes to the same place and
        appends are never lost between workers. A whole ``clear()`` resets them.
        """
        values = metric_values(key, value, cumulate)
        repeat = "do not repeat it: a repeat appends the values again" if cumulate else REPEAT_SAFE
        self._write("update_metrics", lambda: self._scripts.metrics(values, cumulate), repeat=repeat, returns=False)

    def get_metrics(self) -> dict[str, Any]:
        """Every shared metric: name -> number or list of numbers."""
        raw = cast("dict[bytes, bytes]", self._run(lambda: self._client.hgetall(self._keys.metrics)))
        out = {}
        for name, text in raw.items():
            try:
                out[name.decode()] = json.loads(text)
            except ValueError:
                raise DecodeError(f"{self._keys.metrics} field {name!r}: not a JSON number or list") from None
        return out

    def prefetch_request_index(self, experience_num: int) -> list[int] | None:
        """Atomically take the next ``experience_num`` rows of the batch (fewer at its end); None
        once every row was handed out. Many rollout ranks calling at once never get the same row;
        a whole ``clear()`` starts again from row 0.

        Under a staleness bound it is also admission control (see lua/prefetch.lua): None while the
        rows would train more than ``max_staleness`` versions after the current one. The two Nones
        differ in ``get_cur_index()``: past the last row when the batch is spent."""
        if not is_int(experience_num) or experience_num < 1:
            raise InvalidExperienceError(f"experience_num must be a positive int, got {experience_num!r}")
        return self._write("prefetch_request_index", lambda: self._scripts.prefetch(int(experience_num)),
                           hands_out=True)

    def get_cur_index(self) -> int:
        """The next row ``prefetch_request_index`` would hand out (past the end once spent)."""
        return self._read_int(self._keys.cursor)

    def reset_consumer(self, consumer: str, indexes: Sequence[int] | None = None) -> int:
        """Offer rows (``None``: every row) to ``consumer`` again, ending their leases; returns how many
        of them had been handed to it. Their data and the other consumers' marks stay."""
        self._check.consumer(consumer)
        rows = [] if indexes is None else self._check.rows(indexes)
        return self._write("reset_consumer", lambda: self._scripts.reset(consumer, rows))

    def read_rows(self, columns: Sequence[str], indexes: Sequence[int]) -> Batch:
        """The rows' values as stored now, ``None`` where a row is not written; marks nothing.

        For inspection and MindSpeed's ``get_experience_data``: no consumer is involved, so unlike
        ``get_experience`` it promises nothing about rows a clear removes meanwhile.
        """
        names = self._check.columns_to_read(columns)
        rows = self._check.rows(indexes)
        fields = [str(r) for r in rows]
        out: Batch = {}
        for col, values in zip(names, self._run(lambda: self._store.read_now(names, rows))):
            present = [(f, v) for f, v in zip(fields, values) if v is not None]
            decoded = iter(codec.decode_rows([v for _, v in present], where=self._keys.data(col),
                                             fields=[f for f, _ in present]))
            out[col] = [None if v is None else next(decoded) for v in values]
        return out

    def ack(self, consumer: str, indexes: Sequence[int], token: str | None = None) -> int:
        """Confirm that ``consumer`` is done with leased rows; returns how many this released.

        ``indexes`` is the :class:`LeasedRows` ``get_experience`` returned (it carries the lease's
        token), or any rows of it with ``token=rows.token``. Only rows still leased under that token
        are released: after the lease expired and the rows went to another call, or after a clear, the
        ack changes nothing and the rows are redone (at-least-once). Acking twice is harmless.
        """
        with metrics.observe(self.name, "ack") as call:
            self._check.consumer(consumer)
            token = lease_token(indexes, consumer, token)
            rows = self._check.rows(drop_padding({}, indexes)[1])  # padding rows were never leased
            call.rows = self._write("ack", lambda: self._scripts.ack(consumer, token, rows))
            return call.rows

    def status(self) -> dict[str, Any]:
        """A consistent snapshot of the dock's counts (one MULTI/EXEC).

        ``columns``: rows and whole groups written, per column. ``consumers``: rows handed out
        (``consumed``), of which ``leased`` still await an ack, and rows given back after their lease
        expired (``redelivered``, since the last whole clear). Keys holding what no broker writes raise
        DecodeError; a dock whose schema vanished or changed raises DockNotFoundError or SchemaError.
        """
        ref = DockRef(self._keys, self._schema, self._fingerprint)
        (result,) = self._run(lambda: read_statuses(self._client, [ref]))
        if isinstance(result, BrokerError):
            raise result
        return result

    def dead_letters(self, consumer: str | None = None) -> dict[str, dict[int, str]]:
        """The dead letters: per consumer (or of ``consumer`` alone), row -> why it is no longer handed to it.

        A row becomes one when its bytes could not be read (corrupt, or missing) ``dead_letter_after``
        times in deliveries to the consumer; it stays handed out, so the consumer goes on without it
        (``all_consumed`` counts it), and handed out as a whole group, its group stays with it. Drop them
        with ``drop_dead_letters`` (or ``clear`` of the rows); ``redis-cli HGETALL td:{NAME}:dead:CONSUMER``
        shows the same."""
        consumers = list(self.consumers) if consumer is None else [self._check.consumer(consumer)]

        def reads(pipe: redis.client.Pipeline) -> None:
            for c in consumers:
                pipe.hgetall(self._keys.dead(c))

        out: dict[str, dict[int, str]] = {}
        for c, raw in zip(consumers, self._reads(reads)):
            try:
                letters = {int(row): why.decode(errors="replace") for row, why in raw.items()}
            except ValueError:
                raise DecodeError(f"{self._keys.dead(c)}: a field is not a row number") from None
            out[c] = dict(sorted(letters.items()))
        return out

    def drop_dead_letters(self, consumer: str | None = None) -> list[int]:
        """Forget the rows that are dead letters (of ``consumer``, or of any consumer) as ``clear`` forgets
        rows: bytes, marks and the dead letters themselves; returns the rows. The producer may write them
        anew."""
        rows = sorted({row for letters in self.dead_letters(consumer).values() for row in letters})
        if rows:
            self.clear(rows)
        return rows

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
        with metrics.observe(self.name, "clear") as call:
            if consumer is not None:
                if indexes is not None:
                    raise InvalidExperienceError("clear takes indexes or consumer, not both")
                self._check.consumer(consumer)
                check_flag("age", age)
                self._forget(
                    f"clear(consumer={consumer!r})", lambda: self._scripts.clear(iteration_of=consumer, age=age),
                    returns=False, repeat="do not repeat it: a repeat would age the groups kept again and start "
                    "the cursor and the metrics again",
                )
                return
            rows = [] if indexes is None else self._check.rows(indexes)
            self._forget("clear", lambda: self._scripts.clear(rows), whole=not rows, returns=False)
            call.rows = len(rows) if rows else self.capacity

    def delete(self) -> None:
        """Remove the dock from Redis entirely, schema included.

        Replies that sampling calls keep for retries (``td:{NAME}:reply:*``) are left to expire within a
        minute: finding them would need a SCAN of the whole server.
        """
        keys = self._keys.every_key(self.columns, self.consumers, self._schema.rollout.age_buckets)
        keys += self._run(self._store.data_keys)
        # The wait's counters are deleted again after it (drop): a deleted dock leaves no key.
        shards = [DockKeys.shard_replicated(tag) for tag in self._schema.shards]
        self._write("delete", lambda: self._client.delete(*dict.fromkeys(keys)), shards=shards, returns=False,
                    drop=True)

    def _run(self, call: Callable[[], T]) -> T:
        if self._closed:
            raise BrokerError(f"dock {self.name!r} at {self._server} was closed; open it again to use it")
        # Bounded by call_timeout, or by the deadline of the public call around it if sooner.
        with call_deadline(self._call_timeout):
            try:
                with redis_errors(self._where):
                    return call()
            except SchemaError:
                # Every script refuses to run on a schema other than the one this object knows, and runs
                # nothing before it checks. If another process only grew the dock, adopt the grown schema
                # and run the call again; anything else (recreated, edited) stays an error.
                if not self._follow_growth():
                    raise
            with redis_errors(self._where):
                return call()

    def _reads(self, build: Callable[[redis.client.Pipeline], None], *, transaction: bool = False) -> list[Any]:
        """The replies of the read pipeline ``build`` queues; an error reply raises, as a broker error
        (inside ``_run``, whose ``redis_errors`` turns Redis errors into the broker's)."""
        return self._run(lambda: read_pipeline(self._client, self._scripts.load_all, build, transaction=transaction))

    def _read_int(self, key: str) -> int:
        """An integer key (a counter, the cursor, the version), 0 when unset."""
        raw = self._run(lambda: self._client.get(key))
        try:
            return int(raw or 0)
        except ValueError:
            raise DecodeError(f"{key}: not an integer") from None

    def _stored(self) -> tuple[Schema, str]:
        """The schema stored in Redis and its fingerprint; DockNotFoundError if there is none."""
        with redis_errors(self._where):
            # bytes, not str: connect() refuses clients that decode responses
            meta = cast("dict[bytes, bytes]", self._client.hgetall(self._keys.meta))
        if not meta:
            raise DockNotFoundError(f"no dock named {self.name!r} at {self._server}")
        return Schema.from_meta(meta, where=self._keys.meta), fingerprint(meta)

    def _follow_growth(self) -> bool:
        """Adopt the stored schema if it is this object's own, grown; whether it did."""
        known = getattr(self, "_schema", None)
        if known is None:
            return False
        try:
            stored, stored_fingerprint = self._stored()
        except (DockNotFoundError, DecodeError):  # gone, or not ours: the script's error stands
            return False
        if not stored.contains(known) or stored_fingerprint == self._fingerprint:
            return False
        self._set_schema(stored, stored_fingerprint)
        return True

    def refresh(self) -> Schema:
        """Read the schema again, to see columns or consumers another process added; returns it."""
        stored, stored_fingerprint = self._run(self._stored)
        if stored_fingerprint != self._fingerprint:
            if not stored.contains(self._schema):
                raise SchemaError(f"dock {self.name!r} was recreated with another schema; open it again")
            self._set_schema(stored, stored_fingerprint)
        return self._schema

    def grow(self, columns: Sequence[str] = (), consumers: Sequence[str] = ()) -> Schema:
        """Add columns and consumers to the dock, keeping every row; returns the grown schema.

        Names it has already are skipped, so many workers may grow it with the same names at once.
        Other processes' dock objects adopt the grown schema at their next call. Removing names, or
        changing the size, would lose rows and is not offered: make a new dock for that.
        """
        wrote = False
        for _ in range(_FENCE_RETRIES):
            self.refresh()
            grown = self._schema.grown(columns, consumers)
            if grown == self._schema:
                if wrote:
                    self._replicated("grow", grown, [self._keys.replicated])
                return grown
            try:
                # not _run: a changed schema here means retry, not adopt
                with call_deadline(self._call_timeout), redis_errors(self._where):
                    self._scripts.grow(grown)
                wrote = True
            except SchemaError:
                pass  # another process grew it between our read and our write
            # Either way the next refresh reads what is stored now, and returns once it holds our names.
        raise BrokerError(f"dock {self.name!r}: other processes kept growing it; {_FENCE_RETRIES} tries failed")

    # == Row status and callers' settings, for adapters (broker.adapters) ===========================
    # What an adapter reads and keeps beside rows (MindSpeed's status vectors, the TransferQueue's topic
    # timeout), so that none reaches past the dock to its client or keys. Each delegates to the code above.

    def ready_rows(self, columns: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Per column (None: every column), a bool tensor of ``capacity`` rows, True where the row is
        written (ready). One consistent read of all of them."""
        names = list(self.columns) if columns is None else self._check.columns_to_read(columns)
        return dict(zip(names, self._row_masks([self._keys.ready(c) for c in names])))

    def consumed_rows(self, consumers: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Per consumer (None: every consumer), a bool tensor of ``capacity`` rows, True where the row
        was handed to it (leased or for good). One consistent read of all of them."""
        if consumers is not None and not isinstance(consumers, (list, tuple)):
            raise InvalidExperienceError(f"consumers must be a list of consumer names, got {consumers!r:.60}")
        names = list(self.consumers) if consumers is None else [self._check.consumer(c) for c in consumers]
        return dict(zip(names, self._row_masks([self._keys.consumed(c) for c in names])))

    def finished_rows(self) -> torch.Tensor:
        """On a partial-rollout dock, a bool tensor of ``capacity`` rows, True on every row of a group
        whose responses are all finished."""
        self._partial("finished_rows")
        (mask,) = self._row_masks([self._keys.rows_finished])
        return mask

    #: Fields of the meta hash the dock itself writes (the schema, and what create.lua and version.lua add).
    _OWN_META_FIELDS = frozenset((*CHECKED_FIELDS, "dead_letter_after", "versioned"))

    def set_setting(self, name: str, value: str) -> None:
        """Keep a caller's setting with the dock (a field of its meta hash), for every process attached
        to it: the TransferQueue keeps its topic's timeout so. A write like the others (it waits for
        ``wait_replicas``); the dock's own fields are refused."""
        field = self._setting_field(name)
        if not isinstance(value, str):
            raise InvalidExperienceError(f"a setting's value is a str, got {type(value).__name__}")
        self._write("set_setting", lambda: self._client.hset(self._keys.meta, field, value), returns=False)

    def setting(self, name: str) -> str | None:
        """The setting ``name`` kept with ``set_setting``; None if there is none."""
        field = self._setting_field(name)
        raw = cast("bytes | None", self._run(lambda: self._client.hget(self._keys.meta, field)))
        try:
            return None if raw is None else raw.decode()
        except UnicodeDecodeError:
            raise DecodeError(f"{self._keys.meta} field {field!r}: not UTF-8 text") from None

    def _setting_field(self, name: Any) -> str:
        if not isinstance(name, str) or not name or name in self._OWN_META_FIELDS:
            raise InvalidExperienceError(
                f"a setting's name is a non-empty str other than the dock's own fields "
                f"{sorted(self._OWN_META_FIELDS)}, got {name!r:.60}"
            )
        return name

    def _row_masks(self, keys: Sequence[str]) -> list[torch.Tensor]:
        """The row bitmaps ``keys`` as bool tensors of ``capacity`` rows, read in one MULTI/EXEC."""
        def reads(pipe: redis.client.Pipeline) -> None:
            for key in keys:
                pipe.get(key)

        masks = []
        for raw in self._reads(reads, transaction=True):
            # Not unpackbits(count=capacity): it leaves the padding of an empty bitmap uninitialised.
            bits = np.unpackbits(np.frombuffer(raw or b"", dtype=np.uint8))[: self.capacity]
            mask = np.zeros(self.capacity, dtype=bool)  # a bitmap ends at its last row ever set
            mask[: len(bits)] = bits
            masks.append(torch.from_numpy(mask))
        return masks

    # == end of: row status and callers' settings, for adapters =====================================




def _reattach(url: str, name: str, policy: str, seed: int | None, durability: tuple[int, float] = (0, 1.0),
              call_timeout: float = DEFAULT_CALL_TIMEOUT, allow_volatile_eviction: bool = False) -> TransferDock:
    """Unpickle a dock: reconnect to its server and read its schema there."""
    return TransferDock.attach(url, name, policy=policy, seed=seed, wait_replicas=durability[0],
                               wait_timeout=durability[1], call_timeout=call_timeout,
                               allow_volatile_eviction=allow_volatile_eviction)


class _Seeds:
    """Seeds of the random policy: the i-th call that hands rows out uses the i-th seed of ``seed``.

    A call that finds too few rows, or waits and tries again, uses no seed, so a run whose first
    call had to wait picks the same rows as one whose rows were there at once.
    """

    def __init__(self, seed: int | None):
        self._rng = random.Random(seed)
        self._next = self._rng.getrandbits(31)
        self._lock = threading.Lock()

    def peek(self) -> int:
        return self._next

    def advance(self, used: int) -> None:
        with self._lock:  # threads that peeked the same seed advance it once
            if self._next == used:
                self._next = self._rng.getrandbits(31)
