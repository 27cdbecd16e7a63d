"""What a dock does for generation: partial rollout (ages, finished groups, the stop signal), versions
and the staleness bound, and discarding groups (see ``rollout.py`` for the settings).

``GenerationCalls`` is a part of ``TransferDock`` kept apart so that the dock's module stays about
putting, handing out and reading rows; it uses the dock's connection, scripts and checks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import redis
import torch

from broker.api.checks import DockChecks, bitmap_count, check_flag, check_version, encode_column, is_int
from broker.api.delivery import HandedRows, check_delivery, fence_of
from broker.connection import Client
from broker.connection.replication import REPEAT_SAFE
from broker.control.keys import DockKeys
from broker.control.rollout import PLACEHOLDER_LENGTH, PLACEHOLDER_RESPONSE, Rollout
from broker.control.schema import Schema
from broker.control.scripts import DockScripts, Forgot, Selection
from broker.data.store import DataStore
from broker.errors import DataLostError, DecodeError, InvalidExperienceError

T = TypeVar("T")
#: A batch, as ``TransferDock`` returns it: per column, one row per index.
Rows = dict[str, list[Any]]

#: The column the rollout consumer of a partial-rollout dock may ask for beside the stored ones: each
#: row's age (iterations its group has been kept), a one-element int32 tensor as MindSpeed returns it.
AGE_COLUMN = "age"

#: Key of the rows' ages inside a batch on its way out (renamed "age" if the caller asked for it).
AGES_KEY = "\0age"


class GenerationCalls:
    """Partial rollout, versions and discarding, on the dock's connection (mixed into ``TransferDock``)."""

    # What the dock provides.
    _schema: Schema
    _keys: DockKeys
    _scripts: DockScripts
    _client: Client
    _check: DockChecks
    _store: DataStore

    def _run(self, call: Callable[[], T]) -> T:
        raise NotImplementedError

    def _write(
        self, what: str, call: Callable[[], T], *, hands_out: bool = False, repeat: str = REPEAT_SAFE,
        shards: Sequence[str] = (), returns: bool = True, drop: bool = False,
    ) -> T:
        raise NotImplementedError

    def _forget(
        self, what: str, script: Callable[[], Forgot], *, whole: bool = False, hands_out: bool = False,
        repeat: str = REPEAT_SAFE, returns: bool = True,
    ) -> int:
        raise NotImplementedError

    def _reads(self, build: Callable[[redis.client.Pipeline], None], *, transaction: bool = False) -> list[Any]:
        raise NotImplementedError

    def _read_int(self, key: str) -> int:
        raise NotImplementedError

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def n_samples_per_prompt(self) -> int:
        raise NotImplementedError

    def _placeholders(self, count: int, skip: Mapping[Any, Any] = {}) -> Rows:
        """The placeholder responses of ``count`` prompt rows, for the response columns not in ``skip``."""
        out = {}
        for c in self._schema.rollout.response_columns:
            if c not in skip:
                value = PLACEHOLDER_LENGTH if c in self._schema.length_columns else PLACEHOLDER_RESPONSE
                out[c] = [torch.tensor([value], dtype=torch.int32)] * count
        return out

    # -- how sampling goes --------------------------------------------------------------------

    def _staleness(self, consumer: str, max_staleness: int | None) -> int | None:
        """The staleness bound of a call: None for the rollout consumer and without a bound."""
        rollout = self._schema.rollout
        if max_staleness is not None:
            bound: int | None = check_version(max_staleness, "max_staleness")
        else:
            bound = rollout.max_staleness
        return None if consumer == rollout.consumer else bound

    def _selection(self, consumer: str, groups: bool, staleness: int | None) -> Selection:
        """How partial rollout and the staleness bound shape one sampling call (see ``Selection``)."""
        rollout, k = self._schema.rollout, self._keys
        if not rollout.partial:
            return Selection(max_staleness=staleness)
        # Oldest first: the groups of each age from the oldest, then the prompts that waited longest for
        # their first generation; what is left after the tiers (age 0, new prompts) goes lowest first.
        oldest_first = range(rollout.age_buckets - 1, 0, -1)
        if consumer == rollout.consumer or not groups:
            tiers = (*(k.age(a) for a in oldest_first), *(k.wait(w) for w in oldest_first))
        else:
            tiers = (*(k.group_age(a) for a in oldest_first), *(k.group_wait(w) for w in oldest_first))
        if consumer == rollout.consumer:
            return Selection(tiers=tiers, fewer=True, unready=rollout.response_columns, max_staleness=staleness)
        return Selection(
            tiers=tiers,
            require=(k.group_finished if groups else k.rows_finished,),
            cap=rollout.gbs_train * self.n_samples_per_prompt, max_staleness=staleness,
            batch=rollout.gbs_train if groups else None,
        )

    @staticmethod
    def _oldest_first(batch: Rows, rows: list[int], tiers: Sequence[int], top: int) -> tuple[Rows, list[int]]:
        """The batch in the order sampling picked it, oldest group first, with each row's age.

        Tier t (1 = the first) of the first ``top`` holds the groups of age ``top - t + 1``; the wait
        tiers after them, and rows of no tier, are of age 0.
        """
        order = sorted(range(len(rows)), key=lambda i: (tiers[i] == 0, tiers[i], rows[i]))
        out = {c: [values[i] for i in order] for c, values in batch.items()}
        out[AGES_KEY] = [torch.tensor([top - tiers[i] + 1 if 0 < tiers[i] <= top else 0], dtype=torch.int32)
                         for i in order]
        return out, [rows[i] for i in order]

    # -- partial rollout ----------------------------------------------------------------------

    def _finished_groups(self) -> int:
        return int(self._run(lambda: self._client.bitcount(self._keys.group_finished)))

    def _partial(self, what: str) -> Rollout:
        rollout = self._schema.rollout
        if not rollout.partial:
            raise InvalidExperienceError(f"dock {self.name!r} has no partial rollout (max_age > 1): {what} needs it")
        return rollout

    def age_groups(self) -> None:
        """Make every group holding a response, or its placeholder, one iteration older (the queue's
        ``increment_ages``; ``clear(consumer=...)`` ages only groups that were generated)."""
        self._partial("age_groups")
        self._forget("age_groups", lambda: self._scripts.clear(iteration_of=""), returns=False,
                     repeat="do not repeat it: a repeat would age the groups again")

    def unready(self, columns: Sequence[str], indexes: Sequence[int]) -> int:
        """Mark rows of columns not ready, keeping their bytes (the TransferQueue's
        ``clear_data_status``); returns how many cells were ready."""
        names = self._check.columns_to_read(columns)
        rows = self._check.rows(indexes)
        return self._write("unready", lambda: self._scripts.unready(names, rows))

    def get_update_ready(self, require_max_age_all_finished: bool = True) -> bool:
        """The stop signal of a partial-rollout iteration (MindSpeed's): at least ``gbs_train`` groups
        finished, and with ``require_max_age_all_finished`` every group of age ``max_age - 1``
        finished too, so no response waits more than ``max_age`` iterations."""
        rollout = self._partial("get_update_ready")
        check_flag("require_max_age_all_finished", require_max_age_all_finished)
        k = self._keys

        def reads(pipe: redis.client.Pipeline) -> None:
            pipe.get(k.group_finished)
            pipe.get(k.group_age(rollout.max_age - 1))

        finished, last_age = self._reads(reads, transaction=True)
        finished, last_age = finished or b"", last_age or b""
        if bitmap_count(finished) < rollout.gbs_train:
            return False
        if not require_max_age_all_finished:
            return True
        # Groups of the last age that are not finished: last_age AND NOT finished, over prompts_num / 8 bytes.
        return not any(a & ~f & 0xFF for a, f in zip(last_age, finished.ljust(len(last_age), b"\0")))

    def get_incomplete_response_num(self) -> int:
        """Rows holding a prompt whose response is not finished (MindSpeed's count): rows with a
        response or its placeholder, less the finished ones."""
        rollout = self._partial("get_incomplete_response_num")
        k = self._keys

        def reads(pipe: redis.client.Pipeline) -> None:
            pipe.hlen(k.data(rollout.response_columns[0]))
            pipe.bitcount(k.finished)

        held, finished = self._reads(reads, transaction=True)
        return max(0, int(held) - int(finished))

    # -- versions and discarding --------------------------------------------------------------

    def set_version(self, version: int) -> None:
        """Set the current policy version (the trainer, after each update); versions only grow."""
        v = check_version(version)
        self._write("set_version", lambda: self._scripts.version(v), returns=False)

    def version(self) -> int:
        """The current policy version (0 until ``set_version``). DataLostError if it was set and the server
        lost it since (see lua/include/current_version.lua): 0 would let stale rows through."""
        k = self._keys

        def reads(pipe: redis.client.Pipeline) -> None:
            pipe.get(k.version)
            pipe.hmget(k.meta, ["versioned"])

        # One MULTI: a set_version between two plain reads would look like a lost key.
        raw, (versioned,) = self._reads(reads, transaction=True)
        if raw is None and versioned is not None:
            raise DataLostError(
                f"dock {self.name!r}: {k.version} is gone although set_version set it: the server lost it "
                "(evicted under a maxmemory-policy other than noeviction, deleted by hand, or lost in a failover); "
                "the dock's other keys may be lost too: delete the dock and make it again"
            )
        try:
            return int(raw or 0)
        except ValueError:
            raise DecodeError(f"{k.version}: not an integer") from None

    def reserve_groups(self, count: int, column: str) -> list[int] | None:
        """Claim ``count`` free groups for new prompts, lowest first (None, claiming nothing, if fewer
        are free): a group is free when it is neither claimed nor written in ``column``, and stays
        claimed until it is forgotten. Writers calling at once never get the same group. Under partial
        rollout this is where the next batch goes: rows never move here, so the groups freed by
        ``clear(consumer=...)`` are wherever the trained ones were."""
        if not is_int(count) or count < 1:
            raise InvalidExperienceError(f"count must be a positive int, got {count!r:.40}")
        self._check.columns([column])
        # Groups claimed are handed out: raising would leave them claimed by nobody until forgotten.
        return self._write("reserve_groups", lambda: self._scripts.reserve(int(count), column), hands_out=True)

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
        self._check.consumer(consumer)
        picked = self._check.groups(groups)
        fence = None
        if delivery is not None:
            n = self.n_samples_per_prompt
            rows = [g * n + j for g in sorted(set(picked)) for j in range(n)]
            fence = fence_of(check_delivery(delivery, consumer), rows)
        repeat = ("do not repeat it: a repeat would be refused (FencedError)" if fence is not None
                  else "do not repeat it: a repeat would count the groups as discarded again")
        return self._forget("drop_groups", lambda: self._scripts.discard(
            picked, regenerate=False, field=consumer, max_staleness=None, fence=fence), repeat=repeat)

    def _discard_stale(self, groups: list[int], max_staleness: int | None) -> None:
        """Apply the staleness policy to groups a sampling call found stale and left out."""
        rollout = self._schema.rollout
        regenerate = rollout.stale_policy == "regenerate"
        placeholders = None
        if regenerate and rollout.partial:  # what the rollout reads as the response so far
            one = self._placeholders(1)
            placeholders = {c: encode_column(c, rows, 1)[0] for c, rows in one.items()}
        # Part of a hand-out (sampling found the groups): a shortfall is logged, as the hand-out's own is.
        self._forget("get_experience (discarding stale groups)", lambda: self._scripts.discard(
            groups, regenerate=regenerate, field="regenerated" if regenerate else "stale",
            max_staleness=max_staleness, placeholders=placeholders,
        ), hands_out=True, returns=False)
