"""A dock's session: what every part of a ``TransferDock`` uses to talk to Redis.

One ``DockSession`` per dock object holds the connection, the dock's keys, its script wrappers, its
byte store, the wake-ups of puts and the replica waits, and the schema this object knows. Its four
ways of running a call are the only doors to Redis the parts use:

- ``run``: one call, bounded by ``call_timeout``, Redis errors turned into the broker's, and a schema
  grown by another process adopted once;
- ``write``: ``run``, then the wait for replicas (``wait_replicas``) of what it wrote;
- ``forget``: a script that forgets rows, the deletion of their bytes on the data shards, and the wait;
- ``reads``: a read-only pipeline.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import redis

from broker.api.checks import DockChecks, check_call_timeout, check_durability, check_flag, check_policy
from broker.connection import (
    DEFAULT_CALL_TIMEOUT,
    Client,
    busy_retried,
    call_deadline,
    connect,
    disconnect,
    extend_call,
    frames,
    redact,
    redis_errors,
)
from broker.connection.replication import REPEAT_SAFE, Repeat, Replication
from broker.control import server_checks
from broker.control.keys import DockKeys
from broker.control.put_listener import PutListener
from broker.control.rollout import Rollout
from broker.control.schema import Schema, fingerprint
from broker.control.scripts import DockScripts, Forgot, read_pipeline
from broker.data.sharded_store import ShardedStore, choose_shards
from broker.data.slot_store import SlotStore
from broker.data.store import DataStore
from broker.errors import BrokerError, DecodeError, DockNotFoundError, InvalidExperienceError, SchemaError

T = TypeVar("T")

#: How many times a call races other processes before it gives up (a grow against other growers).
RACE_RETRIES = 16


class DockSession:
    """The connection, keys, scripts, store and schema of one dock object, and the ways to call Redis."""

    def __init__(
        self, target: str | Client, name: str, policy: str = "fifo", seed: int | None = None,
        durability: tuple[int, float] = (0, 1.0), call_timeout: float = DEFAULT_CALL_TIMEOUT,
        allow_volatile_eviction: bool = False,
    ):
        """Connect to the dock's server and check it (see control/server_checks.py); the schema comes later, from
        ``create`` or ``attach``. Closes what it opened if it fails."""
        self.policy = check_policy(policy)
        self.allow_volatile = check_flag("allow_volatile_eviction", allow_volatile_eviction)
        self.durability = check_durability(*durability)
        self.call_timeout = check_call_timeout(call_timeout, self.durability)
        self.keys = DockKeys(name)
        self.closed = True  # until connected: close() then has nothing to hand back
        with call_deadline(self.call_timeout):  # a URL's client asks the server whether it is a cluster
            self.client, self.url = connect(target)
        self.owns_client = isinstance(target, str)
        #: Whether the client sends ``Framed`` values uncopied (its connections were opened here).
        self.frames = frames(self.client)
        self.closed = False
        self.server = redact(self.url) if self.url else repr(self.client)
        self.where = f"{self.server} (dock {name!r})"  # names the dock in every Redis error
        with self.closed_on_error():  # what the broker needs of the server: one round trip
            found = self.run(lambda: server_checks.check_server(
                self.client, self.keys, self.server, wait_replicas=self.durability[0],
                allow_volatile=self.allow_volatile))
        self.scripts = DockScripts(self.client, self.keys, allow_oom=found.script_flags, publish=found.publish)
        #: Whether puts cut rows to the allocator's size classes (data/fit.py): where they are sent uncopied,
        #: and unless the server says it allocates otherwise than jemalloc (Redis's default on Linux), whose
        #: classes they fit. On the C allocator a cut row only costs its tail.
        self.cuts = self.frames and found.allocator.split("-")[0] in ("", "jemalloc")
        #: Whether puts announce with sharded pub/sub (SPUBLISH: Redis 7 clusters).
        self.sharded_events = found.publish == "SPUBLISH"
        self.listener = PutListener(self.client, self.keys.events, sharded=self.sharded_events)
        self.seed = seed
        self.seeds = Seeds(seed)
        self.replication = Replication(self.client, self.durability[0], round(self.durability[1] * 1000))
        #: Held while a schema read from Redis is compared with the one held and adopted: threads share this
        #: object, and one that read the meta before another adopted a later growth must not take the older
        #: read for a recreation, nor put the older schema back.
        self._adopting = threading.Lock()
        # Set by create/attach through set_schema.
        #: The schema and the fingerprint of the meta it came from, one tuple: callers that build keys from the
        #: schema and send its fingerprint read both at once, since another thread may adopt a growth between
        #: two reads (``schema`` and ``fingerprint`` are its halves).
        self.binding: tuple[Schema, str]
        self.check: DockChecks
        self.store: DataStore

    @property
    def name(self) -> str:
        return self.keys.name

    @property
    def schema(self) -> Schema:
        return self.binding[0]

    @property
    def fingerprint(self) -> str:
        return self.binding[1]

    # -- the dock's schema ----------------------------------------------------------------------

    def create(self, wanted: Schema, shards: int | None, dead_letter_after: int) -> bool:
        """Make the dock with schema ``wanted``, or adopt the one stored if it is the same; whether this
        call made it."""
        if wanted.rollout == Rollout() or shards:
            tags = self.run(lambda: choose_shards(self.client, self.name, shards))
            wanted = dataclasses.replace(wanted, shards=tags)
            self.check_data_nodes(tags)  # before the dock is made there
        fields = wanted.to_meta()
        fields["dead_letter_after"] = str(int(dead_letter_after))  # read by lua/release.lua; not schema
        stored = self.run(lambda: self.scripts.create(fields))
        if isinstance(stored, bytes):
            raise SchemaError(f"dock {self.name!r} exists with partitions (its record: "
                              f"{stored.decode(errors='replace'):.200}): open it with the same partitions=, or with "
                              "TransferDock.attach")
        if stored is None:
            # Repeating the constructor after a shortfall attaches to the dock made here.
            self.replicated("creating the dock", None, [self.keys.replicated])
            self.set_schema(wanted, fingerprint(fields))
            return True
        existing = Schema.from_meta(stored, where=self.keys.meta)
        diff = wanted.differences(existing)
        if diff:
            raise SchemaError(f"dock {self.name!r} exists with a different schema: " + "; ".join(diff))
        self.set_schema(existing, fingerprint(stored))
        if existing.shards != wanted.shards:
            self.check_data_nodes(existing.shards)
        return False

    def attach(self) -> None:
        """Adopt the schema stored in Redis (DockNotFoundError if there is none)."""
        self.set_schema(*self.run(self.stored))
        self.check_data_nodes(self.schema.shards)

    def check_data_nodes(self, shards: Sequence[str]) -> None:
        """Refuse nodes holding the data shards ``shards`` that may evict (see control/server_checks.py)."""
        self.run(lambda: server_checks.check_data_nodes(
            self.client, self.keys, shards, self.server, allow_volatile=self.allow_volatile))

    def set_schema(self, schema: Schema, stored_fingerprint: str) -> None:
        """Use ``schema`` from now on: checks, scripts and the byte store follow it."""
        self.binding = (schema, stored_fingerprint)
        self.check = DockChecks(self.name, schema)
        self.scripts.bind(schema, stored_fingerprint)
        self.store = (
            ShardedStore(self.client, self.keys, self.scripts, schema.columns, schema.shards,
                         schema.n_samples_per_prompt, self.replication)
            if schema.shards
            else SlotStore(self.client, self.keys, self.scripts, schema.columns, schema.group_columns,
                           schema.n_samples_per_prompt, cuts=self.cuts)
        )

    def stored(self) -> tuple[Schema, str]:
        """The schema stored in Redis and its fingerprint; DockNotFoundError if there is none."""
        with redis_errors(self.where):
            # bytes, not str: connect() refuses clients that decode responses
            meta = cast("dict[bytes, bytes]", self.client.hgetall(self.keys.meta))
        if not meta:
            raise DockNotFoundError(f"no dock named {self.name!r} at {self.server}")
        return Schema.from_meta(meta, where=self.keys.meta), fingerprint(meta)

    def partial_rollout(self, what: str) -> Rollout:
        """The dock's rollout settings; InvalidExperienceError if it has no partial rollout, which ``what``
        needs."""
        rollout = self.schema.rollout
        if not rollout.partial:
            raise InvalidExperienceError(f"dock {self.name!r} has no partial rollout (max_age > 1): {what} needs it")
        return rollout

    def refresh(self) -> Schema:
        """Read the schema again, adopting columns or consumers another process added."""
        for _ in range(RACE_RETRIES):
            before = self.fingerprint
            stored, stored_fingerprint = self.run(self.stored)
            with self._adopting:
                if self.fingerprint != before:
                    continue  # another thread adopted a growth during the read, maybe newer than it: read again
                if stored_fingerprint != self.fingerprint:
                    if not stored.contains(self.schema):
                        raise SchemaError(f"dock {self.name!r} was recreated with another schema; open it again")
                    self.set_schema(stored, stored_fingerprint)
                return self.schema
        return self.schema  # other threads kept adopting growths, each newer than what this one read

    def _follow_growth(self) -> bool | None:
        """After a script refused this object's schema: adopt the stored one if it is this object's own,
        grown (True); None if the stored schema is the one this object holds already (another thread of
        this process adopted it between the call and now, or is adopting it); False if it is not this
        object's schema grown (recreated, edited, gone, not a dock's), and the script's error stands."""
        known = getattr(self, "schema", None)
        if known is None:
            return False
        before = self.fingerprint
        try:
            stored, stored_fingerprint = self.stored()
        except (DockNotFoundError, DecodeError):  # gone, or not ours: the script's error stands
            return False
        with self._adopting:
            if self.fingerprint != before:
                return None  # another thread adopted a growth during the read (maybe newer than it): call again
            if not stored.contains(known):
                return False
            if stored_fingerprint == self.fingerprint:
                return None
            self.set_schema(stored, stored_fingerprint)
            return True

    # -- calling Redis --------------------------------------------------------------------------

    def run(self, call: Callable[[], T]) -> T:
        """``call``, bounded by call_timeout (or the deadline of the public call around it, if sooner),
        with Redis errors as the broker's."""
        if self.closed:
            raise BrokerError(f"dock {self.name!r} at {self.server} was closed; open it again to use it")
        with call_deadline(self.call_timeout):
            unmoved = 0
            while True:
                sent = getattr(self, "fingerprint", None)  # the schema held as the call went out
                try:
                    with redis_errors(self.where):
                        return busy_retried(call)  # another client's long script: wait
                except SchemaError:
                    # Every script refuses to run on a schema other than the one this object knows, and runs
                    # nothing before it checks. If another process only grew the dock, adopt the grown schema
                    # and run the call again, as often as others keep growing it (each time the schema moved
                    # on; the call's deadline bounds it all). Threads share this object: the call may have
                    # gone out bound to the schema another thread was replacing, so a refusal is tried again
                    # while the schema held moved since the call went out (another thread adopted a growth),
                    # and a few times under the schema held still. Anything else (recreated, edited) stays
                    # an error.
                    followed = self._follow_growth()
                    if followed is False:
                        raise
                    if followed is None and self.fingerprint == sent:  # refused under the schema held still
                        unmoved += 1
                        if unmoved > RACE_RETRIES:
                            raise

    def write(
        self, what: str, call: Callable[[], T], *, hands_out: bool = False, repeat: Repeat = REPEAT_SAFE,
        shards: Sequence[str] = (), returns: bool = True, drop: bool = False,
        give_back: Callable[[T], T] | None = None,
    ) -> T:
        """Run ``call``, which writes (as ``run``), then wait for replicas of the control slot (and of the
        data shards whose ``replicated`` counters ``shards`` names): see ``replicated``. Both within one
        call_timeout. Every call that writes goes through here, ``forget`` or ``replicated``.
        ``returns``: the public call returns what ``call`` does (else None, and so does a ReplicationError's
        ``result``); ``drop``: delete the counters again (``delete``). ``give_back`` (with ``hands_out``):
        what was handed out is given back when the replicas fall short, and the call returns its value."""
        with call_deadline(self.call_timeout):
            result = self.run(call)
            outcome = "gave it back" if give_back is not None else None
            if not self.replicated(what, result if returns else None, [self.keys.replicated, *shards],
                                   hands_out=hands_out, repeat=repeat, drop=drop, hands_out_outcome=outcome):
                if give_back is not None:
                    extend_call(self.call_timeout, bound=f"call_timeout={self.call_timeout:g} s (giving back)")
                    return self.run(lambda: give_back(result))
        return result

    def forget(
        self, what: str, script: Callable[[], Forgot], *, whole: bool = False, hands_out: bool = False,
        repeat: Repeat = REPEAT_SAFE, returns: bool = True,
    ) -> int:
        """A call that forgets rows: ``script`` (clear.lua, discard.lua), the deletion of the bytes it ended
        from the data shards, then the wait for the replicas of the control slot and of those shards
        (``write``'s arguments); the script's value."""
        with call_deadline(self.call_timeout):
            value, shards = self.run(lambda: self.store.forget(script(), whole=whole))
            self.replicated(what, value if returns else None, [self.keys.replicated, *shards],
                            hands_out=hands_out, repeat=repeat)
        return value

    def replicated(
        self, what: str, result: Any, keys: Sequence[str], *, hands_out: bool = False, repeat: Repeat = REPEAT_SAFE,
        drop: bool = False, hands_out_outcome: str | None = None,
    ) -> bool:
        """The one place where, with ``wait_replicas``, a call that wrote waits until the replicas of the
        nodes holding ``keys`` (the dock's ``replicated`` counters) have its writes (see connection/replication.py;
        a sharded put's bytes, before their marks, are waited for by the store).

        A shortfall raises ReplicationError carrying ``result``, saying ``repeat``. A call that
        ``hands_out`` rows (groups, cursor positions) logs it instead, whatever went wrong: they are
        marked handed out on the primary, and raising would lose those handed out without a lease.
        Bounded by the call's deadline if it has one, else by call_timeout. False if a hand-out's replicas
        fell short (``hands_out_outcome`` says in the log what the call does about it).
        """
        if not self.replication.replicas:
            return True
        with call_deadline(self.call_timeout):
            return self.replication.wait(keys, f"dock {self.name!r}: {what}", hands_out=hands_out, result=result,
                                         repeat=repeat, drop=drop, hands_out_outcome=hands_out_outcome)

    def reads(self, build: Callable[[redis.client.Pipeline], None], *, transaction: bool = False) -> list[Any]:
        """The replies of the read pipeline ``build`` queues; an error reply raises, as a broker error."""
        return self.run(lambda: read_pipeline(self.client, self.scripts.load_all, build, transaction=transaction))

    def read_int(self, key: str) -> int:
        """An integer key (a counter, the cursor, the version), 0 when unset."""
        raw = self.run(lambda: self.client.get(key))
        try:
            return int(raw or 0)
        except ValueError:
            raise DecodeError(f"{key}: not an integer") from None

    # -- lifecycle ------------------------------------------------------------------------------

    @contextmanager
    def closed_on_error(self) -> Iterator[None]:
        """Hand the connection back if opening fails: the caller never gets an object to close."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Hand back the connections (see ``TransferDock.close``). Idempotent."""
        if self.closed:
            return
        self.closed = True
        listener = getattr(self, "listener", None)  # absent when opening failed early
        if listener is not None:
            listener.close()
        if self.owns_client and self.url is not None:
            disconnect(self.url)


class Seeds:
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
