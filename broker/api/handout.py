"""Handing rows out: sampling whole groups or rows (lua/sample.lua), taking explicit rows (lua/take.lua),
waiting for puts, leases and their acks, the batch cursor, and what each consumer reads.

A hand-out marks rows in the control plane first and reads their bytes after (``reads.py``); a clear
landing in between makes the call hand rows out afresh, never return the next batch's bytes. Rows handed
out come back as their delivery (``delivery.py``), which fences the stage's put of its results.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import redis

from broker.api import metrics
from broker.api.balance import balanced_batch, dp_padded
from broker.api.checks import (
    abbrev,
    check_flag,
    check_lease,
    check_policy,
    check_timeout,
    is_int,
    lease_token,
)
from broker.api.delivery import HandedRows, LeasedRows, check_delivery, fenced_handout
from broker.api.dp_padding import drop_padding
from broker.api.generation import AGE_COLUMN, AGES_KEY, Generation, asks_age, check_rollout_get
from broker.api.get_request import GetRequest
from broker.api.reads import Batch, RowReader, StackedBatch, Unreadable
from broker.api.session import RACE_RETRIES, DockSession
from broker.connection import LAST_TRY_SECONDS, call_deadline, extend_call, waiting_call
from broker.control.scripts import AlreadyTaken, Handout, Selection, new_request_id, rows_of, runs_of
from broker.errors import DecodeError, ExperienceTimeoutError, InvalidExperienceError

T = TypeVar("T")

#: Sampling with no partial rollout and no staleness bound.
_PLAIN = Selection()

#: Longest a waiting reader sleeps between checks even without a notification. Pub/sub delivers at
#: most once (a reconnect can drop a message), so this bounds the cost of a lost one; it is not polling.
_RECHECK_SECONDS = 1.0

#: How many times one call hands rows out again after a clear took some of them away before their
#: bytes were read (see ``RowReader.read``). Each retry means a clear landed in a window of one round
#: trip, so running out of them takes a clearer in a tight loop; the call then finds nothing this time.
_FENCE_RETRIES = RACE_RETRIES


class Handouts:
    """Handing rows out and taking them back: a part of ``TransferDock``, on the dock's session."""

    def __init__(self, session: DockSession, generation: Generation, reader: RowReader):
        self._s, self._generation, self._reader = session, generation, reader

    def get(self, request: GetRequest) -> tuple[StackedBatch, list[int]] | tuple[None, None]:
        """Hand rows to ``request.consumer`` (see ``TransferDock.get_experience``)."""
        consumer, indexes, timeout = request.consumer, request.indexes, request.timeout
        # The wait and every attempt end by ``timeout`` (see waiting_call and _wait); reading rows once
        # handed out, by call_timeout (see RowReader.read).
        with metrics.observe(self._s.name, "get") as call, waiting_call(timeout, self._s.call_timeout):
            self._s.check.consumer(consumer)
            experience_columns = request.experience_columns
            if experience_columns is None:
                experience_columns = self.consumer_columns(consumer)
            rollout = self._s.schema.rollout
            want_age = asks_age(rollout, consumer, experience_columns, self._s.schema.columns)
            if want_age:
                experience_columns = [c for c in experience_columns if c != AGE_COLUMN]
            columns = self._s.check.columns_to_read(experience_columns)
            check_timeout(timeout)
            lease_ms = check_lease(request.lease)
            groups = check_flag("get_n_samples", request.get_n_samples)
            ranks = self._s.check.dp_size(request.dp_size)
            weigh_by = self._s.check.balance(request.balance)
            dp_padding = check_flag("dp_padding", request.dp_padding)
            stack = check_flag("stack", request.stack)
            staleness = self._generation.staleness(consumer, request.max_staleness)
            got: tuple[Batch, list[int]] | None
            check_rollout_get(self._s.name, rollout, consumer, groups, indexes is not None)
            if indexes is not None:
                rows = self._s.check.rows(indexes)
                self._s.check.take_count(request.experience_count, rows)
                got = self._take_rows(consumer, columns, rows, lease_ms, timeout, call, stack)
            else:
                count = self._s.check.sample_count(request.experience_count, groups)
                policy = check_policy(request.policy or self._s.policy)
                weights = (weigh_by or list(self._s.schema.length_columns)) if policy == "seqlen" else []
                select = self._generation.selection(consumer, groups, staleness)
                if request.fewer and not select.fewer:
                    select = dataclasses.replace(select, fewer=True)
                sampler = self._sampler(consumer, columns, count, groups, policy, lease_ms, call, weights, select,
                                        stack, request.on_left)
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
            # Stacked only now, in the batch's final order: each column built once (see RowReader.read).
            return self._reader.stacked(batch) if stack else batch, rows

    def _balanced(
        self, batch: Batch, rows: list[int], ranks: int, weigh_by: list[str], groups: bool
    ) -> tuple[Batch, list[int]]:
        """``batch`` reordered so that ``ranks`` equal chunks of it carry nearly equal load.

        A row's cost is the sum of its length columns, read from their u32 arrays with one BITFIELD
        per column in one round trip (the batch was handed out already: its order needs no atomicity).
        A batch that does not split into ``ranks`` equal chunks is left as it is.
        """
        cost = self._row_costs(rows, weigh_by)
        return balanced_batch(batch, rows, ranks, cost, self._s.schema.n_samples_per_prompt, groups)

    def _row_costs(self, rows: list[int], columns: list[str]) -> list[int]:
        """Sum of the length columns of each row, from the length arrays the puts keep."""
        def reads(pipe: redis.client.Pipeline) -> None:
            for c in columns:
                args = [x for r in rows for x in ("GET", "u32", f"#{r}")]
                pipe.execute_command("BITFIELD", self._s.keys.lengths(c), *args)

        replies = self._s.reads(reads)
        return [sum(int(reply[i]) for reply in replies) for i in range(len(rows))]

    def _take_rows(
        self, consumer: str, columns: list[str], rows: list[int], lease_ms: int, timeout: float | None,
        call: metrics.Call, stack: bool,
    ) -> tuple[Batch, list[int]]:
        runs = runs_of(rows)
        missing: dict[str, list[int]] = {}

        def take() -> tuple[Batch, list[int]] | None:
            missing.clear()
            for _ in range(_FENCE_RETRIES):
                token = "r" + new_request_id() if lease_ms else ""
                got = self._s.run(functools.partial(self._s.scripts.take, consumer, columns, runs, lease_ms=lease_ms,
                                                    token=token))
                if isinstance(got, dict):
                    for col, cells in got.items():  # the script goes by runs; report in the caller's order
                        unwritten = set(cells)
                        missing[col] = [r for r in rows if r in unwritten]
                    return None
                assert isinstance(got, Handout)  # neither exclusive nor named: never refused
                try:
                    batch = self._reader.read(columns, rows, got, call, stack)
                except Unreadable as bad:  # give back only what this take handed out
                    fresh = got if got.fresh is None else got.only(got.fresh)
                    self._reader.give_back_unreadable(consumer, fresh, token, new_request_id(), False, bad)
                if batch is not None:
                    self._s.replicated("get_experience", None, [self._s.keys.replicated], hands_out=True)
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
            f"dock {self._s.name!r}, consumer {consumer!r}: rows not written within timeout={timeout}: {detail}",
            missing,
        )

    def _sampler(
        self, consumer: str, columns: list[str], count: int, groups: bool, policy: str, lease_ms: int,
        call: metrics.Call, weigh_by: Sequence[str] = (), select: Selection = _PLAIN, stack: bool = False,
        on_left: Callable[[int], None] | None = None,
    ) -> Callable[[], tuple[Batch, list[int]] | None]:
        """One sampling attempt of ``count`` units (groups when ``groups``, else rows), checked already;
        ``on_left`` is told what each sampling script says still qualifies after its pick."""
        rollout = self._s.schema.rollout
        # The rollout consumer's response columns are not ready while rows are out for generation, and
        # a row it is handed back (lease expired, or put unfinished) still holds its partial response:
        # only the other columns decide which rows qualify; the read takes the responses as they are.
        status_columns = [c for c in columns if c not in select.unready] if select.unready else columns
        if not status_columns:
            raise InvalidExperienceError(
                f"dock {self._s.name!r}: the rollout consumer must read a column beside the response columns "
                f"{list(rollout.response_columns)} (the prompt), which decides the rows it may take"
            )

        def sample() -> tuple[Batch, list[int]] | None:
            for _ in range(_FENCE_RETRIES):
                # A fresh id per attempt; the client's own retries of this one call resend the same id,
                # so a reply lost on a dropped connection is answered again, not sampled twice.
                request_id = new_request_id()
                token = ("g" if groups else "r") + request_id if lease_ms else ""
                seed = self._s.seeds.peek() if policy != "fifo" else 0  # "seqlen" may fall back to random
                sampled = self._s.run(functools.partial(
                    self._s.scripts.sample, consumer, status_columns, groups=groups, count=count, policy=policy,
                    seed=seed, lease_ms=lease_ms, request_id=request_id, token=token, weigh_by=weigh_by,
                    select=select,
                ))
                if sampled.stale:
                    self._generation.discard_stale(list(sampled.stale), select.max_staleness)
                if on_left is not None:
                    on_left(sampled.left)
                handout = sampled.handout
                if handout is None:
                    return None
                if policy != "fifo":
                    self._s.seeds.advance(seed)
                rows = rows_of(handout.runs)
                try:
                    batch = self._reader.read(columns, rows, handout, call, stack)
                except Unreadable as bad:
                    self._reader.give_back_unreadable(consumer, handout, token, request_id, groups, bad)
                if batch is not None:
                    if select.tiers:
                        ages = self._s.schema.rollout.age_buckets - 1  # the age tiers come first
                        batch, rows = self._generation.oldest_first(batch, rows, handout.tiers, ages)
                    self._s.replicated("get_experience", None, [self._s.keys.replicated], hands_out=True)
                    return batch, self._handed_out(rows, handout, token, consumer)
                # A clear took some of the rows between sampling and reading: give back the rest
                # (they were never delivered) and sample again.
                give_back = functools.partial(self._s.scripts.release, consumer, handout, token, request_id,
                                              groups=groups)
                # Part of a hand-out: a shortfall is logged, as the hand-out's own is (hands_out).
                self._s.write("get_experience (giving back rows a clear took)", give_back, hands_out=True)
            return None

        return sample

    @staticmethod
    def _handed_out(rows: list[int], handout: Handout, token: str, consumer: str) -> HandedRows:
        """``rows`` as the delivery they are: with the lease's ``token`` if they were leased."""
        if token:
            return LeasedRows(rows, token, consumer, handout.epoch, handout.runs, handout.generations)
        return HandedRows(rows, handout.epoch, handout.runs, handout.generations)

    def _wait(self, attempt: Callable[[], T | None], timeout: float | None) -> T | None:
        """Run ``attempt`` until it returns a value or ``timeout`` seconds pass, woken by puts. Each attempt,
        the last one made at ``timeout`` too, has at least LAST_TRY_SECONDS to answer."""
        def attempt_in_time() -> T | None:
            extend_call(LAST_TRY_SECONDS)
            # Each Redis call of the attempt goes through the session (``run``, ``write``, ``forget``) on its
            # own; the attempt as a whole is bounded by call_timeout, as one call.
            with call_deadline(self._s.call_timeout):
                return attempt()

        return self._s.listener.wait(attempt_in_time, timeout, _RECHECK_SECONDS)

    def take(
        self, consumer: str, indexes: Sequence[int], columns: Sequence[str] | None, lease: float | None,
        exclusive: bool, name: str | None, name_ttl: float,
    ) -> HandedRows | None:
        """Hand explicit rows out without reading them (see ``TransferDock.take``)."""
        with metrics.observe(self._s.name, "take") as call:
            self._s.check.consumer(consumer)
            if self._s.schema.rollout.partial and consumer == self._s.schema.rollout.consumer:
                raise InvalidExperienceError(
                    f"dock {self._s.name!r}: the rollout consumer of a partial-rollout dock samples its rows "
                    "(oldest first); explicit indexes are not supported for it"
                )
            cols = self._s.check.columns_to_read(self.consumer_columns(consumer) if columns is None else columns)
            lease_ms = check_lease(lease)
            exclusive = check_flag("exclusive", exclusive)
            if name is not None and (not isinstance(name, str) or not name or len(name) > 256):
                raise InvalidExperienceError(f"name must be None or a non-empty str of at most 256 chars, "
                                             f"got {name!r:.60}")
            name_ms = check_lease(name_ttl) if name is not None else 0
            if name is not None and not name_ms:
                raise InvalidExperienceError(f"name_ttl must be > 0 seconds, got {name_ttl!r}")
            rows = self._s.check.rows(indexes)
            token = "r" + new_request_id() if lease_ms else ""

            def take() -> HandedRows | AlreadyTaken | dict[str, list[int]]:
                got = self._s.scripts.take(consumer, cols, runs_of(rows), lease_ms=lease_ms, token=token,
                                           exclusive=exclusive, name=name or "", name_ms=name_ms, order=rows)
                if isinstance(got, Handout):
                    # A named take that found its record returns the recorded rows, in their order.
                    handed = list(got.order) if got.recorded else rows
                    return self._handed_out(handed, got, token, consumer)
                return got

            got = self._s.write("take", take, hands_out=True)
            if isinstance(got, AlreadyTaken):
                return None
            if isinstance(got, dict):
                detail = "; ".join(f"{col}: rows {abbrev(r)}" for col, r in got.items())
                raise ExperienceTimeoutError(
                    f"dock {self._s.name!r}, consumer {consumer!r}: rows not written: {detail}", got)
            call.rows = len(got)
            return got

    def give_back(self, consumer: str, delivery: HandedRows, groups: bool | None = None) -> int:
        """Offer the rows of ``delivery`` (handed to ``consumer``) to it again now; how many went back (see
        ``TransferDock.give_back``). ``groups``: whether they were handed out as whole groups (None: a leased
        delivery's token says so, lua/sample.lua)."""
        self._s.check.consumer(consumer)
        check_delivery(delivery, consumer)
        if groups is None:
            groups = isinstance(delivery, LeasedRows) and delivery.token.startswith("g")
        rows = sorted(set(drop_padding({}, delivery)[1]))
        handout = fenced_handout(delivery, rows)
        token = delivery.token if isinstance(delivery, LeasedRows) else ""
        request_id = new_request_id()
        return self._s.write("give_back", lambda: self._s.scripts.release(
            consumer, handout, token, request_id, groups=groups).given_back)

    def reclaim(self, consumer: str, all_leases: bool = False) -> int:
        """Give back ``consumer``'s rows whose lease ran out (all leased rows with ``all_leases``); how many of
        its rows are still leased."""
        self._s.check.consumer(consumer)
        return self._s.write("reclaim", lambda: self._s.scripts.reclaim(consumer, all_leases)[1])

    def all_consumed(self, consumer: str) -> bool:
        """Whether ``consumer`` was handed every row and acked every lease, after giving back expired ones."""
        self._s.check.consumer(consumer)

        def done() -> bool:  # the expired leases given back (a write) and the answer, waited on together
            consumed, leased = self._s.scripts.reclaim(consumer)
            rollout = self._s.schema.rollout
            if not rollout.partial:
                return consumed == self._s.schema.capacity and leased == 0
            if consumer == rollout.consumer:
                return self._generation.finished_groups() >= rollout.gbs_train
            return consumed == rollout.gbs_train * self._s.schema.n_samples_per_prompt and leased == 0

        return self._s.write("all_consumed (giving back expired leases)", done)

    def prefetch_request_index(self, experience_num: int) -> list[int] | None:
        """Take the next ``experience_num`` rows of the batch (see ``TransferDock``)."""
        if not is_int(experience_num) or experience_num < 1:
            raise InvalidExperienceError(f"experience_num must be a positive int, got {experience_num!r}")
        return self._s.write("prefetch_request_index", lambda: self._s.scripts.prefetch(int(experience_num)),
                           hands_out=True)

    def get_cur_index(self) -> int:
        """The next row ``prefetch_request_index`` would hand out."""
        return self._s.read_int(self._s.keys.cursor)

    def reset_consumer(self, consumer: str, indexes: Sequence[int] | None = None) -> int:
        """Offer rows to ``consumer`` again; how many had been handed to it."""
        self._s.check.consumer(consumer)
        rows = [] if indexes is None else self._s.check.rows(indexes)
        return self._s.write("reset_consumer", lambda: self._s.scripts.reset(consumer, rows))

    def ack(self, consumer: str, indexes: Sequence[int], token: str | None = None) -> int:
        """Release leased rows of ``consumer``; how many this released."""
        with metrics.observe(self._s.name, "ack") as call:
            self._s.check.consumer(consumer)
            token = lease_token(indexes, consumer, token)
            rows = self._s.check.rows(drop_padding({}, indexes)[1])  # padding rows were never leased
            call.rows = self._s.write("ack", lambda: self._s.scripts.ack(consumer, token, rows))
            return call.rows

    def register_consumer_columns(self, columns_of: Mapping[str, Sequence[str]]) -> None:
        """Record the columns each consumer reads by default."""
        if not isinstance(columns_of, Mapping) or not columns_of:
            raise InvalidExperienceError("columns_of must be a non-empty dict of consumer -> list of columns")
        stored = {}
        for consumer, columns in columns_of.items():
            self._s.check.consumer(consumer)
            stored[consumer] = json.dumps(self._s.check.columns_to_read(columns))
        self._s.write("register_consumer_columns", lambda: self._s.scripts.columns_of(stored), returns=False)

    def consumer_columns(self, consumer: str | None = None) -> list[str]:
        """The columns registered for ``consumer``; with None, every column."""
        if consumer is None:
            return list(self._s.schema.columns)
        self._s.check.consumer(consumer)
        raw = self._s.run(lambda: self._s.client.hget(self._s.keys.consumer_columns, consumer))
        if raw is None:
            raise InvalidExperienceError(
                f"dock {self._s.name!r}: no experience_columns given and none registered for consumer {consumer!r} "
                "(register_consumer_columns)"
            )
        try:
            columns = json.loads(raw)
        except (ValueError, RecursionError):  # RecursionError: nested past the limit, by another client
            raise DecodeError(f"{self._s.keys.consumer_columns} field {consumer}: not a JSON list") from None
        if not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
            raise DecodeError(f"{self._s.keys.consumer_columns} field {consumer}: not a list of column names")
        return columns
