"""What a dock does for generation: partial rollout (ages, finished groups, the stop signal), versions
and the staleness bound, and discarding groups (see ``rollout.py`` for the settings).

``Generation`` is a part of ``TransferDock``: the dock's facade (``dock_generation.py``) checks nothing twice and
delegates its generation calls here; the hand-out (``handout.py``) asks it how partial rollout and the
staleness bound shape a sampling call, and the put (``puts.py``) for the placeholders of new prompts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import redis
import torch

from broker.api.checks import check_flag, check_version, is_int
from broker.api.delivery import HandedRows, check_delivery, fence_of
from broker.api.session import DockSession
from broker.connection.replication import do_not_repeat
from broker.control.rollout import PLACEHOLDER_LENGTH, PLACEHOLDER_RESPONSE, Rollout
from broker.control.scripts import Reservation, Selection
from broker.data.codec import encode_column
from broker.errors import DataLostError, DecodeError, InvalidExperienceError

T = TypeVar("T")
#: A batch, as ``TransferDock`` returns it: per column, one row per index.
Rows = dict[str, list[Any]]

#: The column the rollout consumer of a partial-rollout dock may ask for beside the stored ones: each
#: row's age (iterations its group has been kept), a one-element int32 tensor as MindSpeed returns it.
AGE_COLUMN = "age"

#: Key of the rows' ages inside a batch on its way out (renamed "age" if the caller asked for it).
AGES_KEY = "\0age"


def asks_age(rollout: Rollout, consumer: str, columns: Any, stored: Sequence[str]) -> bool:
    """Whether a get of ``columns`` asks for the rows' ages beside the stored columns: only the rollout consumer
    of a partial rollout may, where no column is named ``age``."""
    return (rollout.partial and consumer == rollout.consumer and isinstance(columns, (list, tuple))
            and AGE_COLUMN in columns and AGE_COLUMN not in stored)


def check_rollout_get(name: str, rollout: Rollout, consumer: str, groups: bool, explicit: bool) -> None:
    """The rollout consumer of a partial rollout takes unfinished rows one by one, sampled oldest first:
    InvalidExperienceError for a get of whole groups or of explicit rows."""
    if not (rollout.partial and consumer == rollout.consumer):
        return
    if groups:
        raise InvalidExperienceError(
            "get_n_samples not supported for rollout when actor_rollout enables partial_rollout: "
            f"consumer {consumer!r} of dock {name!r} takes unfinished rows one by one"
        )
    if explicit:
        raise InvalidExperienceError(
            f"dock {name!r}: the rollout consumer of a partial-rollout dock samples its rows "
            "(oldest first); explicit indexes are not supported for it"
        )


class Generation:
    """Partial rollout, versions and discarding: a part of ``TransferDock``, on the dock's session."""

    def __init__(self, session: DockSession):
        self._s = session

    def placeholders(self, count: int, skip: Mapping[Any, Any] = {}) -> Rows:
        """The placeholder responses of ``count`` prompt rows, for the response columns not in ``skip``."""
        out = {}
        for c in self._s.schema.rollout.response_columns:
            if c not in skip:
                value = PLACEHOLDER_LENGTH if c in self._s.schema.length_columns else PLACEHOLDER_RESPONSE
                out[c] = [torch.tensor([value], dtype=torch.int32)] * count
        return out

    # -- how sampling goes --------------------------------------------------------------------

    def staleness(self, consumer: str, max_staleness: int | None) -> int | None:
        """The staleness bound of a call: None for the rollout consumer and without a bound."""
        rollout = self._s.schema.rollout
        if max_staleness is not None:
            bound: int | None = check_version(max_staleness, "max_staleness")
        else:
            bound = rollout.max_staleness
        return None if consumer == rollout.consumer else bound

    def selection(self, consumer: str, groups: bool, staleness: int | None) -> Selection:
        """How partial rollout and the staleness bound shape one sampling call (see ``Selection``)."""
        rollout, k = self._s.schema.rollout, self._s.keys
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
            cap=rollout.gbs_train * self._s.schema.n_samples_per_prompt, max_staleness=staleness,
            batch=rollout.gbs_train if groups else None,
        )

    @staticmethod
    def oldest_first(batch: Rows, rows: list[int], tiers: Sequence[int], top: int) -> tuple[Rows, list[int]]:
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

    def finished_groups(self) -> int:
        return int(self._s.run(lambda: self._s.client.bitcount(self._s.keys.group_finished)))

    def age_groups(self) -> None:
        """Make every generated group one iteration older."""
        self._s.partial_rollout("age_groups")
        self._s.forget("age_groups", lambda: self._s.scripts.clear(iteration_of=""), returns=False,
                     repeat=do_not_repeat("a repeat would age the groups again"))

    def unready(self, columns: Sequence[str], indexes: Sequence[int]) -> int:
        """Mark rows of columns not ready, keeping their bytes; how many cells were ready."""
        names = self._s.check.columns_to_read(columns)
        rows = self._s.check.rows(indexes)
        shared = [c for c in names if c in self._s.schema.group_columns]
        if shared:
            # A forget deletes a group's bytes once no row of the group is ready (lua/include/forget.lua):
            # rows made not ready here would lose the bytes they kept. (Refused on data shards too, where
            # they are stored per row: a dock means the same on either store.)
            raise InvalidExperienceError(
                f"dock {self._s.name!r}: columns {shared} are group columns (one value per group); unready takes "
                "per-row columns (the responses being continued)"
            )
        return self._s.write("unready", lambda: self._s.scripts.unready(names, rows))

    def get_update_ready(self, require_max_age_all_finished: bool = True) -> bool:
        """The stop signal of a partial-rollout iteration."""
        rollout = self._s.partial_rollout("get_update_ready")
        check_flag("require_max_age_all_finished", require_max_age_all_finished)
        k = self._s.keys

        def reads(pipe: redis.client.Pipeline) -> None:
            pipe.get(k.group_finished)
            pipe.get(k.group_age(rollout.max_age - 1))

        finished, last_age = self._s.reads(reads, transaction=True)
        finished, last_age = finished or b"", last_age or b""
        if _bitmap_count(finished) < rollout.gbs_train:
            return False
        if not require_max_age_all_finished:
            return True
        # Groups of the last age that are not finished: last_age AND NOT finished, over prompts_num / 8 bytes.
        return not any(a & ~f & 0xFF for a, f in zip(last_age, finished.ljust(len(last_age), b"\0")))

    def get_incomplete_response_num(self) -> int:
        """Rows holding a prompt whose response is not finished."""
        rollout = self._s.partial_rollout("get_incomplete_response_num")
        k = self._s.keys

        def reads(pipe: redis.client.Pipeline) -> None:
            pipe.hlen(k.data(rollout.response_columns[0]))
            pipe.bitcount(k.finished)

        held, finished = self._s.reads(reads, transaction=True)
        return max(0, int(held) - int(finished))

    # -- versions and discarding --------------------------------------------------------------

    def set_version(self, version: int) -> None:
        """Set the current policy version."""
        v = check_version(version)
        self._s.write("set_version", lambda: self._s.scripts.version(v), returns=False)

    def version(self) -> int:
        """The current policy version."""
        k = self._s.keys

        def reads(pipe: redis.client.Pipeline) -> None:
            pipe.get(k.version)
            pipe.hmget(k.meta, ["versioned"])

        # One MULTI: a set_version between two plain reads would look like a lost key.
        raw, (versioned,) = self._s.reads(reads, transaction=True)
        if raw is None and versioned is not None:
            raise DataLostError(
                f"dock {self._s.name!r}: {k.version} is gone although set_version set it: the server lost it "
                "(evicted under a maxmemory-policy other than noeviction, deleted by hand, or lost in a failover); "
                "the dock's other keys may be lost too: delete the dock and make it again"
            )
        try:
            return int(raw or 0)
        except ValueError:
            raise DecodeError(f"{k.version}: not an integer") from None

    def reserve_groups(self, count: int, column: str) -> list[int] | None:
        """Claim ``count`` free groups for new prompts (None if fewer are free)."""
        if not is_int(count) or count < 1:
            raise InvalidExperienceError(f"count must be a positive int, got {count!r:.40}")
        self._s.check.columns([column])
        # Groups claimed are handed out: raising would leave them claimed by nobody until forgotten. With
        # wait_replicas, a claim the replicas did not acknowledge is given back instead (lua/unreserve.lua):
        # a failover could undo it, and with it the drop or clear that freed the groups just before, and a
        # caller putting its prompts there would overwrite a live group, or another writer's. Either the
        # give-back replicates after the claim or neither survives: the groups end free, and None is
        # returned as when too few are free (the caller tries again).
        reserved = self.reserve(int(count), column)
        return None if reserved is None else list(reserved.groups)

    def reserve(self, count: int, column: str) -> Reservation | None:
        """``reserve_groups``' claim, checked by the caller, as the script gave it (a partitioned dock gives
        back the claims of its partitions when one of them has too few free groups: ``unreserve``)."""
        return self._s.write("reserve_groups", lambda: self._s.scripts.reserve(count, column),
                             hands_out=True, give_back=self._give_back)

    def unreserve(self, reserved: Reservation) -> int:
        """Give back what ``reserve`` claimed, but the groups something forgot since; how many."""
        return self._s.write("reserve_groups (giving back)", lambda: self._s.scripts.unreserve(reserved))

    def _give_back(self, reserved: Reservation | None) -> None:
        if reserved is not None:
            self._s.scripts.unreserve(reserved)

    def drop_groups(self, consumer: str, groups: Sequence[int], *, delivery: HandedRows | None = None) -> int:
        """Discard whole groups ``consumer`` rejects; how many were dropped."""
        self._s.check.consumer(consumer)
        picked = self._s.check.groups(groups)
        fence = None
        if delivery is not None:
            n = self._s.schema.n_samples_per_prompt
            rows = [g * n + j for g in sorted(set(picked)) for j in range(n)]
            fence = fence_of(check_delivery(delivery, consumer), rows)
        repeat = (do_not_repeat("a repeat would be refused (FencedError)") if fence is not None
                  else do_not_repeat("a repeat would count the groups as discarded again"))
        return self._s.forget("drop_groups", lambda: self._s.scripts.discard(
            picked, regenerate=False, field=consumer, max_staleness=None, fence=fence), repeat=repeat)

    def discard_stale(self, groups: list[int], max_staleness: int | None) -> None:
        """Apply the staleness policy to groups a sampling call found stale and left out."""
        rollout = self._s.schema.rollout
        regenerate = rollout.stale_policy == "regenerate"
        placeholders = None
        if regenerate and rollout.partial:  # what the rollout reads as the response so far
            one = self.placeholders(1)
            placeholders = {c: bytes(encode_column(c, rows, 1)[0]) for c, rows in one.items()}
        # Part of a hand-out (sampling found the groups): a shortfall is logged, as the hand-out's own is.
        self._s.forget("get_experience (discarding stale groups)", lambda: self._s.scripts.discard(
            groups, regenerate=regenerate, field="regenerated" if regenerate else "stale",
            max_staleness=max_staleness, placeholders=placeholders,
        ), hands_out=True, returns=False)


def _bitmap_count(bitmap: bytes) -> int:
    """Bits set in a bitmap read with GET."""
    return int.from_bytes(bitmap, "big").bit_count() if bitmap else 0
