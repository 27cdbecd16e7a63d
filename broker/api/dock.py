"""TransferDock: MindSpeed-RL's experience dock, kept in Redis so any process on any machine can share it.

This module is the dock's face: its lifecycle and its properties; every verb, with its documentation, is in one
of the four bases the class is made of, by what it does: ``dock_rows.py`` (put, get, read), ``dock_leases.py``
(takes, leases, acks, the cursor, consumers' columns), ``dock_generation.py`` (partial rollout, versions,
drops) and ``dock_admin.py`` (metrics, status, dead letters, clear, grow, row status). The work is done by the
parts it holds, all on one ``DockSession`` (``session.py``: connection, keys, scripts, byte store, replica
waits):

- ``Puts`` (``puts.py``): the put path, from the call down to the store;
- ``Handouts`` (``handout.py``) and ``RowReader`` (``reads.py``): sampling, taking, leases and acks, and
  reading the rows handed out;
- ``Generation`` (``generation.py``): partial rollout, versions, the staleness bound, discarding groups;
- ``Admin`` (``admin.py``): metrics, status, dead letters, clear, delete, grow.

See docs/design.md for a put and a get walked through the planes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from broker.api.admin import Admin
from broker.api.checks import is_int
from broker.api.dock_admin import AdminVerbs
from broker.api.dock_generation import GenerationVerbs
from broker.api.dock_leases import LeaseVerbs
from broker.api.dock_rows import RowVerbs
from broker.api.generation import Generation
from broker.api.handout import Handouts
from broker.api.puts import Puts
from broker.api.reads import Batch, RowReader, StackedBatch
from broker.api.session import DockSession
from broker.connection import DEFAULT_CALL_TIMEOUT, Client, uncarried
from broker.control.keys import DockKeys
from broker.control.rollout import Rollout
from broker.control.schema import Schema
from broker.errors import BrokerError, DockNotFoundError, SchemaError

__all__ = ["TransferDock", "Batch", "StackedBatch", "DEAD_LETTER_AFTER"]

#: How many times, by default, a row whose bytes cannot be read is handed to a consumer before it becomes
#: a dead letter for it: enough to ride out a row being rewritten while it was read, few enough that a
#: corrupt row does not hold a worker up for long.
DEAD_LETTER_AFTER = 3


class TransferDock(RowVerbs, LeaseVerbs, GenerationVerbs, AdminVerbs):
    """Columns of per-row tensors with ready and consumed status, shared through Redis.

    Rows are grouped by prompt: group g is rows ``[g*n, (g+1)*n)``, the n responses of one prompt.
    See docs/guide.md for its use and ``control/keys.py`` for its keys; every method is safe to call
    from many threads and processes.
    """

    def __new__(cls, *args: Any, partitions: int = 1, **kwargs: Any) -> Any:
        """A dock of one partition; with ``partitions`` other than 1, a ``PartitionedDock`` (see ``__init__``)."""
        if partitions != 1 and cls is TransferDock:
            from broker.api.partitioned import PartitionedDock  # it builds on this module

            return PartitionedDock(*args, partitions=partitions, **kwargs)
        return super().__new__(cls)

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
        partitions: int = 1,
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

        ``partitions=P`` (P > 1) makes a partitioned dock (``broker/api/partitioned.py``, docs/cluster.md): P
        docks, each with its own hash tag (on a cluster each on its own primary), the groups dealt to them in
        blocks of consecutive groups round robin (``partition_map.py``), behind one object with these methods
        and these row indexes, so that one dock's scripts spread over P primaries instead of running on one.
        Only a dock being made uses it:
        ``attach`` opens a dock with the partitions it was made with.

        Opening checks the server (see control/server_checks.py): a server that may evict the dock's keys
        (``maxmemory-policy`` other than ``noeviction``), or lacks a command the broker needs (renamed or
        denied), raises ServerConfigError. ``allow_volatile_eviction=True`` accepts a ``volatile-*``
        policy, which evicts only the replies kept for resends: a call resent after a lost reply may then
        be applied twice.
        """
        wanted = Schema.build(prompts_num, n_samples_per_prompt, columns, consumers, length_columns, rollout,
                              group_columns)
        if partitions != 1:
            raise SchemaError(f"partitions must be an int in 1..1024, got {partitions!r:.40}")
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
            try:
                session.attach()
            except DockNotFoundError:
                if not session.run(lambda: session.client.exists(session.keys.partitions)):
                    raise
                from broker.api.partitioned import PartitionedDock  # it builds on this module

                session.close()
                return PartitionedDock.attach(  # type: ignore[return-value]
                    url_or_client, name, policy=policy, seed=seed, wait_replicas=wait_replicas,
                    wait_timeout=wait_timeout, call_timeout=call_timeout,
                    allow_volatile_eviction=allow_volatile_eviction)
        dock: TransferDock = cls.__new__(cls)
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

    @property
    def session(self) -> DockSession:
        """The dock's one door to Redis (``broker.api.session.DockSession``): ``run`` a read, ``write`` a change
        with the dock's deadline, retries, translated errors and replica waits. The hook for code built on
        a dock that keeps keys of its own beside the dock's (the TransferQueue slice), so its calls get what
        the dock's own get; a worker uses the dock's methods."""
        return self._session


def _reattach(url: str, name: str, policy: str, seed: int | None, durability: tuple[int, float] = (0, 1.0),
              call_timeout: float = DEFAULT_CALL_TIMEOUT, allow_volatile_eviction: bool = False) -> TransferDock:
    """Unpickle a dock: reconnect to its server and read its schema there."""
    return TransferDock.attach(url, name, policy=policy, seed=seed, wait_replicas=durability[0],
                               wait_timeout=durability[1], call_timeout=call_timeout,
                               allow_volatile_eviction=allow_volatile_eviction)
