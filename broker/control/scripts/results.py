"""What the wrappers hand back, and the row runs their scripts take: plain values, no Redis in them.

Rows travel as runs (``runs_of``: start, length, ...), which keeps a call's ARGV short for the contiguous
rows a dock mostly hands out; ``rows_of`` is the inverse.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def runs_of(rows: Sequence[int]) -> list[int]:
    """Distinct rows as runs of consecutive rows, flattened: [start, length, start, length, ...]."""
    out: list[int] = []
    for row in sorted(set(rows)):
        if out and row == out[-2] + out[-1]:
            out[-1] += 1
        else:
            out += [row, 1]
    return out


def rows_of(runs: Sequence[int]) -> list[int]:
    """The rows of flattened runs, ascending: the inverse of ``runs_of``."""
    return [r for start, length in zip(runs[::2], runs[1::2]) for r in range(start, start + length)]


@dataclass(frozen=True)
class AlreadyTaken:
    """An exclusive take's refusal (lua/take.lua): these of its rows were handed to the consumer already."""

    rows: tuple[int, ...]


@dataclass(frozen=True)
class Reservation:
    """Groups lua/reserve.lua claimed, with the dock's epoch and their rows' generations then, by which
    lua/unreserve.lua gives them back only if nothing forgot them since."""

    groups: tuple[int, ...]
    epoch: int
    generations: bytes


@dataclass(frozen=True)
class Handout:
    """Rows a sample or take handed out, with what their read checks (see lua/include/generations.lua).

    ``runs`` are the rows, ascending, as flattened runs; ``epoch`` and ``generations`` (4 bytes per row,
    in run order) are what the dock's clears had made of them when they were handed out.
    """

    runs: tuple[int, ...]
    epoch: int
    generations: bytes
    #: Per row, in run order, the tier sampling took it from (1 = the first tier; 0 = none of them).
    tiers: tuple[int, ...] = ()
    #: The rows this call handed out that were not handed out before (what it gives back if it cannot
    #: deliver); None: all of them (sampling only hands out rows not handed out).
    fresh: tuple[int, ...] | None = None
    #: A named take found the record of an earlier take under its name: these are the recorded rows,
    #: ``order`` the order its first caller gave them in.
    recorded: bool = False
    order: tuple[int, ...] = ()

    def only(self, rows: Sequence[int]) -> Handout:
        """The handout of ``rows`` alone (rows of this one): their runs and generations."""
        keep = set(rows)
        handed = rows_of(self.runs)
        gens = b"".join(self.generations[4 * i : 4 * i + 4] for i, r in enumerate(handed) if r in keep)
        return Handout(tuple(runs_of([r for r in handed if r in keep])), self.epoch, gens)


@dataclass(frozen=True)
class Released:
    """What release.lua did: rows given back, rows made dead letters, and the failed deliveries so far of
    each unreadable row (in the order the call named them)."""

    given_back: int
    dead: tuple[int, ...] = ()
    failures: tuple[int, ...] = ()


@dataclass(frozen=True)
class Fence:
    """The delivery a write names (lua/include/delivery.lua): the write lands only while it is current.

    ``generations`` are the delivery's generations of the rows written (4 bytes per row, ascending,
    as the write's runs list them); ``consumer`` and ``token`` name its lease ("" without one).
    """

    epoch: int
    generations: bytes
    consumer: str = ""
    token: str = ""


@dataclass(frozen=True)
class Hold:
    """A lease claim.lua held for a put of several steps: the delivery, the deadline the rows were held to
    (ms of server time), ``moved``: row, its own deadline, row, deadline, ... (as the script returned
    them), which lua/unhold.lua gives back when the put ends; and ``landed``, the steps of a resumed put that
    landed before (numbered from 0)."""

    fence: Fence
    until_ms: int
    moved: list[bytes]
    landed: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Finish:
    """What a rollout put records beside its bytes (lua/include/finish.lua): completion ``flags``, one per
    row in the order of the put's runs (None: no flags), and the ``version`` of the rows (None: none)."""

    flags: tuple[bool, ...] | None = None
    version: int | None = None

    def args(self) -> list[Any]:
        """ARGV the marking scripts take for it: the mode ("1" flags, "0" version only) and the version."""
        return ["0" if self.flags is None else "1", "" if self.version is None else str(self.version)]

    def flag_args(self) -> list[str]:
        return [("1" if f else "0") for f in (self.flags or ())]


#: The ARGV of the marking scripts when a put records nothing beside its bytes.
NO_FINISH = ["-", ""]


@dataclass(frozen=True)
class Sampled:
    """What one sampling call did: the rows it handed out (None: too few qualified), and the stale
    groups it left out, which the caller discards (see lua/discard.lua)."""

    handout: Handout | None
    stale: tuple[int, ...] = ()
    #: Units that still qualified after the pick (0 when nothing was handed out: with ``Selection.fewer`` none
    #: qualified; without it, fewer than asked may have).
    left: int = 0


@dataclass(frozen=True)
class Selection:
    """How a sampling call picks beyond its columns and policy (see lua/sample.lua's ARGV[12..16])."""

    #: Bitmaps (of groups in group mode, else of rows) to pick from first, in order: the age bitmaps.
    tiers: tuple[str, ...] = ()
    #: Extra status bitmaps every unit must be in (the finished groups, for other consumers).
    require: tuple[str, ...] = ()
    #: Hand out what qualifies when fewer than asked do.
    fewer: bool = False
    #: Hand out nothing once the consumer holds this many rows (0: no cap).
    cap: int = 0
    #: Columns whose readiness the handout takes back (the rollout's response columns).
    unready: tuple[str, ...] = ()
    #: Versions a handed-out group may lag the current one, or None: no staleness bound.
    max_staleness: int | None = None
    #: Groups of an iteration's batch (partial rollout, group mode), or None (see lua/sample.lua ARGV[17]).
    batch: int | None = None


@dataclass(frozen=True)
class Forgot:
    """What a script that forgets rows did (clear.lua, discard.lua): its ``value``, and on a sharded dock
    the bytes the client must delete from the data shards (see include/forget.lua forgotten_reply).

    ``epoch`` is the epoch those bytes were written in (None: the dock is not sharded); ``rows`` the rows
    forgotten, each with the generation in ``generations`` (4 bytes per row) its bytes were written under.
    """

    value: int
    epoch: int | None = None
    rows: tuple[int, ...] = ()
    generations: bytes = b""

    @classmethod
    def parse(cls, reply: Any) -> Forgot:
        if not isinstance(reply, list):
            return cls(int(reply))
        return cls(int(reply[0]), int(reply[1]), numbers_of(reply[2]), bytes(reply[3]))


@dataclass(frozen=True)
class Marked:
    """What mark.lua did: the rows written, or (``stale``) the rows whose generation, or the epoch, moved."""

    written: int
    stale: tuple[int, ...] = ()
    epoch_moved: bool = False


def numbers_of(text: bytes | str) -> tuple[int, ...]:
    """The integers of a script's comma-separated list ("" is none)."""
    if isinstance(text, bytes):
        text = text.decode()
    return tuple(int(x) for x in text.split(",")) if text else ()
