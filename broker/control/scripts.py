"""The control plane: the Lua scripts in ``lua/``, one file per atomic operation, and one typed wrapper per
script. Everything they touch lives in the dock's own slot ``{NAME}`` (status bitmaps, leases, replies);
the row bytes are the data plane's (``store.py``), which a script reaches only when the dock keeps them in
its own slot too.

Each wrapper is the single place that knows its script's contract: it builds the KEYS and ARGV in the
order the script's header gives, and turns the reply into Python values. The dock calls only these.

A line ``-- @include NAME`` in a script is replaced by ``lua/include/NAME.lua`` so helpers are
written once; an include declares what it needs the same way (see ``expand_includes``). Scripts are
sent with EVALSHA through redis-py ``Script`` objects, which load the text again when the server
answers NOSCRIPT (after a restart or ``SCRIPT FLUSH``); inside a pipeline ``run_pipeline`` does that.

Every script that changes the dock in a way a second run would change again carries a request id,
made once per call (``new_request_id``) and the same in every resend of it, and keeps its reply for
``REPLY_TTL_MS`` (lua/include/once.lua): a client retrying after a lost reply gets that reply back
instead of applying the call twice. The others are idempotent as they are (fence, reclaim, grow,
columns_of, version, unready, status, claim).
"""

from __future__ import annotations

import functools
import hashlib
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import redis
from redis.client import Pipeline

from broker.connection import Client
from broker.control.keys import DockKeys
from broker.control.schema import Schema

#: Script name -> file in lua/. Listed explicitly so a missing file fails at import, not mid-run.
SCRIPT_FILES = {
    "create": "create.lua",
    "put": "put.lua",
    "bar": "bar.lua",
    "unbar": "unbar.lua",
    "claim": "claim.lua",
    "sample": "sample.lua",
    "take": "take.lua",
    "fence": "fence.lua",
    "release": "release.lua",
    "ack": "ack.lua",
    "reclaim": "reclaim.lua",
    "clear": "clear.lua",
    "prefetch": "prefetch.lua",
    "metrics": "metrics.lua",
    "grow": "grow.lua",
    "columns_of": "columns_of.lua",
    "reset": "reset.lua",
    "discard": "discard.lua",
    "version": "version.lua",
    "reserve": "reserve.lua",
    "unready": "unready.lua",
    "status": "status.lua",
    "mark": "mark.lua",
}

#: How long a script keeps its reply for a resend of the same call (lua/include/once.lua). A resend
#: comes within the client's retries, seconds after the call; a minute leaves room for slow retries.
REPLY_TTL_MS = 60_000


def new_request_id() -> str:
    """A request id for one call (see the module docstring): unique, the same in every resend of the call."""
    return uuid.uuid4().hex


#: Scripts run for many docks at once, outside any dock object (see ``StatusScript``).
_SHARED = ("status",)

#: Scripts sent as text (EVAL), never by hash: they must run even when the server lost its scripts (see
#: lua/bar.lua). They are a few hundred bytes, sent with every put.
_AS_TEXT = ("bar", "unbar")

_INCLUDE = re.compile(r"^-- @include (\w+)[ \t]*$", re.MULTILINE)


def lua_dir() -> Path:
    """The folder holding the Lua files: inside the installed package, or lua/ of a source checkout."""
    packaged = resources.files("broker") / "lua"
    if packaged.is_dir():
        return Path(str(packaged))
    source = Path(__file__).resolve().parents[2] / "lua"
    if source.is_dir():
        return source
    raise FileNotFoundError(f"broker Lua scripts not found in {packaged} nor in {source}")


@functools.cache
def script_text(name: str) -> str:
    """Source of script ``name`` with its includes pasted in (see ``expand_includes``)."""
    folder = lua_dir()
    return expand_includes((folder / SCRIPT_FILES[name]).read_text(encoding="utf-8"),
                           lambda include: (folder / "include" / f"{include}.lua").read_text(encoding="utf-8"))


class IncludeError(Exception):
    """A Lua include is missing or includes itself, directly or not (a packaging or editing mistake)."""


def expand_includes(text: str, read: Callable[[str], str]) -> str:
    """``text`` with each ``-- @include NAME`` line replaced by ``read(NAME)``, itself expanded.

    An include declares what it needs with the same lines, so a script names only what it calls.
    Each include is pasted once per script, where it is first needed, after what it needs (Lua
    ``local function``s must be defined above their callers); a later mention pastes nothing. A
    cycle or a missing include raises IncludeError naming the chain.
    """
    pasted: set[str] = set()

    def expand(source: str, chain: tuple[str, ...]) -> str:
        def paste(match: re.Match[str]) -> str:
            include = match.group(1)
            if include in chain:
                raise IncludeError(f"Lua includes form a cycle: {' -> '.join((*chain, include))}")
            if include in pasted:
                return ""
            try:
                body = read(include)
            except FileNotFoundError:
                via = f" (needed by {' -> '.join(chain)})" if chain else ""
                raise IncludeError(f"Lua include {include!r} not found{via}") from None
            body = expand(body, (*chain, include))
            pasted.add(include)
            return body

        return _INCLUDE.sub(paste, source)

    return expand(text, ())


#: Redis 7 script flag letting a script write when the server is at ``maxmemory``. Without it a full
#: server refuses every script's first write, so consumers could not even mark rows consumed, and the
#: clear that would free memory fails too. Data itself never goes through scripts (puts HSET in the
#: MULTI, which a full server refuses whole), so the scripts' few bytes of status are safe to allow.
ALLOW_OOM = "#!lua flags=allow-oom\n"


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
_NO_FINISH = ["-", ""]


@dataclass(frozen=True)
class Sampled:
    """What one sampling call did: the rows it handed out (None: too few qualified), and the stale
    groups it left out, which the caller discards (see lua/discard.lua)."""

    handout: Handout | None
    stale: tuple[int, ...] = ()


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
        return cls(int(reply[0]), int(reply[1]), _numbers(reply[2]), bytes(reply[3]))


@dataclass(frozen=True)
class Marked:
    """What mark.lua did: the rows written, or (``stale``) the rows whose generation, or the epoch, moved."""

    written: int
    stale: tuple[int, ...] = ()
    epoch_moved: bool = False


class DockScripts:
    """The scripts of one dock on one client: one method per Lua file, each building its KEYS and ARGV.

    ``schema`` must be set (``bind``) before any script but ``create`` runs: every script checks that
    the dock still holds the schema this client knows.
    """

    def __init__(self, client: Client, keys: DockKeys, *, allow_oom: bool, publish: str = "PUBLISH"):
        prefix = ALLOW_OOM if allow_oom else ""
        self._keys = keys
        #: How puts announce themselves: PUBLISH, or on a Redis 7 cluster SPUBLISH, which stays on the
        #: shard of the dock's slot instead of being broadcast to every node (see put_listener.py).
        self.publish = publish
        self._scripts = {
            name: client.register_script(prefix + script_text(name))
            for name in SCRIPT_FILES if name not in _SHARED + _AS_TEXT
        }
        # Without the header: it travels with every put.
        self._texts = {name: prefix + re.sub(r"^--\[\[.*?\]\]\n", "", script_text(name), flags=re.DOTALL)
                       for name in _AS_TEXT}
        self._schema: Schema | None = None
        self._expected = ""

    def bind(self, schema: Schema, fingerprint: str) -> None:
        """Use ``schema``; ``fingerprint`` (``schema.fingerprint`` of the stored meta) is what scripts check."""
        self._schema, self._expected = schema, fingerprint

    def _call(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return self._scripts[name](keys, args)

    def _once(self, name: str, keys: list[str], args: list[Any], request_id: str | None = None) -> Any:
        """Run a script that keeps its reply for resends of the call (lua/include/once.lua): the reply key
        goes last in KEYS and the time to keep it last in ARGV."""
        return self._call(name, [*keys, self._keys.reply(request_id or new_request_id())], [*args, REPLY_TTL_MS])

    def _queue_once(self, pipe: Pipeline, name: str, keys: list[str], args: list[Any], request_id: str) -> None:
        self._queue(pipe, name, [*keys, self._keys.reply(request_id)], [*args, REPLY_TTL_MS])

    def _queue(self, pipe: Pipeline, name: str, keys: list[str], args: list[Any]) -> None:
        # EVALSHA sent as is rather than through Script(client=pipe), which costs a SCRIPT EXISTS round
        # trip per call; run_pipeline loads the script and repeats the pipeline on NOSCRIPT.
        pipe.execute_command("EVALSHA", self._scripts[name].sha, len(keys), *keys, *args)

    def load_all(self, client: Client) -> None:
        """Load every script (after a NOSCRIPT inside a MULTI, where redis-py does not do it)."""
        for script in self._scripts.values():
            client.script_load(script.script)
        StatusScript.load(client)

    def _consumer_keys(self, consumer: str) -> list[str]:
        k = self._keys
        return [k.consumed(consumer), k.group_taken(consumer), k.leases(consumer), k.tokens(consumer)]

    # -- one wrapper per script, in the order of SCRIPT_FILES --------------------------------------

    def create(self, fields: dict[str, str]) -> dict[bytes, bytes] | None:
        """Store ``fields`` as the dock's meta unless a dock exists; None if stored, else the stored meta."""
        reply = self._once("create", [self._keys.meta], [x for pair in fields.items() for x in pair])
        if reply[0] == 1:
            return None
        return dict(zip(reply[1::2], reply[2::2]))

    def put(
        self, pipe: Pipeline, columns: Sequence[str], runs: Sequence[int], lengths: dict[str, list[int]],
        finish: Finish | None, request_id: str, fence: Fence | None = None, ack: bool = False,
    ) -> None:
        """Queue the first steps of a put on one slot, before the HSETs of its bytes: lua/put.lua (check,
        and mark rows ``runs`` of ``columns`` written, with what a rollout put records beside them,
        ``finish``), then lua/bar.lua, which makes the HSETs fail unless put.lua let them through. With
        ``fence``, the put lands only while that delivery is current; with ``ack`` too, it ends the
        delivery's lease of its rows. ``unbar`` follows the HSETs.

        ``lengths`` holds, per length column written, its rows' values in the order of ``runs``.
        """
        k = self._keys
        leased = fence is not None and bool(fence.token)
        keys = [k.meta, k.gate, k.epoch, k.generations, *self._lease_keys(fence)]
        keys += [kind(c) for c in columns for kind in (k.data, k.ready, k.group_ready)]
        keys += [k.lengths(c) for c in lengths] + (self._finish_keys() if finish else [])
        fenced = ["1", fence.epoch, fence.generations, fence.token] if fence else ["0", 0, b"", ""]
        args = [self._expected, self._n, k.events, self.publish, len(lengths),
                *(finish.args() if finish else _NO_FINISH), *fenced, "1" if ack and leased else "0", len(runs),
                *runs, *(v for values in lengths.values() for v in values), *(finish.flag_args() if finish else [])]
        self._queue_once(pipe, "put", keys, args, request_id)
        self._queue_text(pipe, "bar", self._barred(columns))

    def unbar(self, pipe: Pipeline, columns: Sequence[str]) -> None:
        """Queue the last step of a put on one slot, after its HSETs (lua/unbar.lua)."""
        self._queue_text(pipe, "unbar", self._barred(columns))

    def _barred(self, columns: Sequence[str]) -> list[str]:
        """The KEYS of lua/bar.lua and lua/unbar.lua."""
        k = self._keys
        return [k.gate, *(key for c in columns for key in (k.data(c), k.aside(c)))]

    def _queue_text(self, pipe: Pipeline, name: str, keys: list[str]) -> None:
        pipe.execute_command("EVAL", self._texts[name], len(keys), *keys)

    def _lease_keys(self, fence: Fence | None) -> list[str]:
        """td:{NAME}:tokens:CONSUMER and td:{NAME}:leases:CONSUMER of the lease ``fence`` names; the meta key
        twice without one (the scripts then leave them alone)."""
        k = self._keys
        if fence is None or not fence.token:
            return [k.meta, k.meta]
        return [k.tokens(fence.consumer), k.leases(fence.consumer)]

    def _finish_keys(self) -> list[str]:
        """The keys of lua/include/finish.lua, in its order."""
        k = self._keys
        return [k.finished, k.group_finished, k.rows_finished, k.group_rolled, k.age(0), k.group_age(0),
                k.group_versions, *self._consumer_keys(self._bound.rollout.consumer)]

    def mark(
        self, columns: Sequence[str], runs: Sequence[int], lengths: dict[str, list[int]], epoch: int,
        generations: bytes, finish: Finish | None = None, fence: Fence | None = None, request_id: str | None = None,
        ack: bool = False,
    ) -> Marked:
        """Mark rows ``runs`` of ``columns`` ready after their bytes went to the data shards under
        ``epoch`` and ``generations``, with what ``finish`` records (lua/mark.lua): unless a clear moved
        them meanwhile, or the lease of the delivery ``fence`` names is no longer its own (FencedError).
        With ``ack``, the put ends that lease of its rows."""
        k = self._keys
        token = fence.token if fence else ""
        keys = [k.meta, k.epoch, k.generations, *self._lease_keys(fence)]
        keys += [key for c in columns for key in (k.ready(c), k.group_ready(c))]
        keys += [k.lengths(c) for c in lengths] + (self._finish_keys() if finish else [])
        args = [self._expected, self._n, k.events, self.publish, len(lengths), epoch, generations, token,
                "1" if ack and token else "0", *(finish.args() if finish else _NO_FINISH), len(runs), *runs,
                *(v for values in lengths.values() for v in values), *(finish.flag_args() if finish else [])]
        reply = self._once("mark", keys, args, request_id)
        if int(reply[0]) >= 0:
            return Marked(int(reply[0]))
        return Marked(0, _numbers(reply[2]), epoch_moved=int(reply[1]) != epoch)

    def claim(self, runs: Sequence[int], fence: Fence, hold_ms: int) -> None:
        """Check, before a sharded put sends its bytes, that the delivery ``fence`` names still holds the
        rows, and hold its lease for ``hold_ms`` (lua/claim.lua); FencedError if it does not."""
        k = self._keys
        keys = [k.meta, k.epoch, k.generations, *self._lease_keys(fence)]
        self._call("claim", keys, [self._expected, fence.epoch, fence.generations, fence.token, hold_ms, *runs])

    def sample(
        self, consumer: str, columns: Sequence[str], *, groups: bool, count: int, policy: str, seed: int,
        lease_ms: int, request_id: str, token: str, weigh_by: Sequence[str] = (), select: Selection | None = None,
    ) -> Sampled:
        """Pick ``count`` units (groups or rows) for ``consumer`` and mark them; no handout if too few qualify.

        ``weigh_by``: the length columns the ``"seqlen"`` policy sums; ``select``: see ``Selection``.
        """
        k, schema = self._keys, self._bound
        select = select or Selection()
        status = k.group_ready if groups else k.ready
        keys = [k.meta, k.consumed(consumer), k.group_taken(consumer), k.leases(consumer), k.tokens(consumer),
                k.redelivered(consumer), k.scratch, k.epoch, k.generations,
                *(status(c) for c in columns), *select.require, *(k.lengths(c) for c in weigh_by), *select.tiers,
                *(key for c in select.unready for key in (k.ready(c), k.group_ready(c)))]
        if select.tiers:
            keys.append(k.scratch2)
        if select.max_staleness is not None:
            keys += [k.version, k.group_versions]
        if select.batch is not None:
            keys += [k.group_batch, k.scratch3]
        units = schema.prompts_num if groups else schema.capacity
        args = [self._expected, "groups" if groups else "rows", count, self._n, units, policy, seed, lease_ms,
                token, len(weigh_by), len(select.tiers), int(select.fewer), select.cap,
                len(select.unready), "" if select.max_staleness is None else select.max_staleness,
                "" if select.batch is None else select.batch]
        reply = self._once("sample", keys, args, request_id)
        if not reply:
            return Sampled(None)
        stale = _numbers(reply[3])
        if int(reply[0]) < 0:
            return Sampled(None, stale)
        runs = tuple(int(x) for x in reply[4:])
        return Sampled(Handout(runs, int(reply[0]), reply[1], _numbers(reply[2])), stale)

    def take(
        self, consumer: str, columns: Sequence[str], runs: Sequence[int], *, lease_ms: int, token: str
    ) -> Handout | dict[str, list[int]]:
        """Mark rows ``runs`` handed to ``consumer`` if written in every column; else the missing cells."""
        k = self._keys
        keys = [k.meta, *self._consumer_keys(consumer), k.redelivered(consumer), k.epoch, k.generations,
                *(k.ready(c) for c in columns)]
        reply = self._once("take", keys, [self._expected, self._n, lease_ms, token, *runs])
        if reply[0] == 1:
            return Handout(tuple(runs), int(reply[1]), reply[2], fresh=_numbers(reply[3]))
        missing: dict[str, list[int]] = {}
        for pos, row in zip(reply[1::2], reply[2::2]):
            missing.setdefault(columns[int(pos) - 1], []).append(int(row))
        return missing

    def fence(self, pipe: Pipeline, runs: Sequence[int]) -> None:
        """Queue the read of the epoch and generations of ``runs``, after the reads of their bytes.

        ``fence_holds`` judges the reply. Epoch and generations only ever grow, so if they are unchanged
        after the bytes were read, no clear touched the rows from the handout until then: the check need
        not share a MULTI with the reads (Redis refuses every MULTI on a full server; plain reads pass).
        """
        self._queue(pipe, "fence", *self._fence_args(runs))

    def fence_now(self, runs: Sequence[int]) -> tuple[int, bytes]:
        """The epoch and generations of ``runs`` now (4 bytes per row, in run order): what a put on a
        sharded dock writes its bytes under."""
        epoch, generations = self._call("fence", *self._fence_args(runs))
        return int(epoch), bytes(generations)

    def _fence_args(self, runs: Sequence[int]) -> tuple[list[str], list[Any]]:
        """The KEYS and ARGV of lua/fence.lua for ``runs``."""
        k = self._keys
        return [k.meta, k.epoch, k.generations], [self._expected, *runs]

    @staticmethod
    def fence_holds(reply: Any, handout: Handout) -> bool:
        """Whether no clear touched the handout's rows between handing them out and the fence's read."""
        return int(reply[0]) == handout.epoch and reply[1] == handout.generations

    def release(
        self, consumer: str, handout: Handout, token: str, request_id: str, *, groups: bool = False,
        unreadable: Mapping[int, str] | None = None,
    ) -> Released:
        """Give back the rows a call (``request_id``) handed out but could not deliver; count a failed
        delivery of each ``unreadable`` row (row -> why), and make a dead letter of one that failed as
        often as the dock allows (its whole group if ``groups``: see lua/release.lua)."""
        k = self._keys
        keys = [k.meta, *self._consumer_keys(consumer), k.epoch, k.generations, k.reply(request_id),
                k.failures(consumer), k.dead(consumer)]
        bad = [x for row, why in (unreadable or {}).items() for x in (row, why)]
        args = [self._expected, self._n, handout.epoch, handout.generations, token, REPLY_TTL_MS,
                "groups" if groups else "rows", len(bad) // 2, *bad, *handout.runs]
        reply = self._call("release", keys, args)
        return Released(int(reply[0]), _numbers(reply[1]), _numbers(reply[2]))

    def ack(self, consumer: str, token: str, rows: Sequence[int]) -> int:
        """Release rows of ``consumer`` leased under ``token``; returns how many were."""
        k = self._keys
        return int(self._once("ack", [k.meta, k.leases(consumer), k.tokens(consumer)], [self._expected, token, *rows]))

    def reclaim(self, consumer: str) -> tuple[int, int]:
        """Give back ``consumer``'s expired leases; returns (rows consumed, rows still leased)."""
        keys = [self._keys.meta, *self._consumer_keys(consumer), self._keys.redelivered(consumer)]
        consumed, leased = self._call("reclaim", keys, [self._expected, self._n])
        return int(consumed), int(leased)

    def _forget_layout(self) -> tuple[list[str], list[Any]]:
        """The KEYS and ARGV[2..6] of the scripts that forget rows (lua/include/forget.lua)."""
        k, schema = self._keys, self._bound
        keys = [k.meta, k.epoch, k.generations]
        per_column: tuple[Callable[[str], str], ...] = (k.data, k.ready, k.group_ready)
        per_consumer: tuple[Callable[[str], str], ...] = (k.consumed, k.group_taken, k.leases, k.tokens, k.redelivered,
                                                          k.failures, k.dead)
        keys += [kind(c) for kind in per_column for c in schema.columns]
        keys += [kind(c) for kind in per_consumer for c in schema.consumers]
        keys += [k.lengths(c) for c in schema.length_columns] + k.batch_keys
        keys += k.rollout_keys(schema.rollout.age_buckets)
        args = [len(schema.columns), len(schema.consumers), self._n, len(schema.length_columns),
                schema.rollout.age_buckets]
        return keys, args

    def clear(self, rows: Sequence[int] = (), *, iteration_of: str | None = None, age: bool = True) -> Forgot:
        """Forget ``rows`` (all rows when empty), or end the iteration of consumer ``iteration_of``
        (ageing the groups kept unless not ``age``), or with ``iteration_of=""`` only age them
        (lua/clear.lua); returns the cells removed from data hashes, and what to delete from shards."""
        keys, layout = self._forget_layout()
        schema = self._bound
        responses = schema.rollout.response_columns
        first_response = schema.columns.index(responses[0]) + 1 if responses else 0
        if iteration_of == "":
            mode: list[Any] = ["age", 0, first_response]
        elif iteration_of is not None:
            mode = ["iteration" if age else "trained", schema.consumers.index(iteration_of) + 1, first_response]
        else:
            mode = ["rows", *rows] if rows else ["all"]
        keys += [self._keys.scratch, self._keys.scratch2]
        return Forgot.parse(self._once("clear", keys, [self._expected, *layout, *mode]))

    def discard(
        self, groups: Sequence[int], *, regenerate: bool, field: str, max_staleness: int | None,
        placeholders: dict[str, bytes] | None = None, fence: Fence | None = None,
    ) -> Forgot:
        """Drop or regenerate ``groups``, counted under ``field`` (lua/discard.lua); returns how many were,
        and what to delete from the data shards.

        ``max_staleness``: discard only groups still older than the current version minus it.
        ``placeholders``: the encoded placeholder of each response column, written by "regenerate".
        ``fence``: the delivery the groups' rows came in (its generations of the groups' rows, ascending):
        the drop is refused (FencedError) unless it still holds them.
        """
        schema = self._bound
        keys, layout = self._forget_layout()
        keep = [schema.columns.index(c) + 1 for c in schema.rollout.prompt_columns] if regenerate else []
        pairs = [x for c, b in (placeholders or {}).items() for x in (schema.columns.index(c) + 1, b)]
        fenced: list[Any] = [0, 0, b"", ""]
        if fence:  # without a lease only the generations fence the drop: any consumer's position will do
            fenced = [schema.consumers.index(fence.consumer) + 1 if fence.token else 1, fence.epoch,
                      fence.generations, fence.token]
        args = [self._expected, *layout, "regenerate" if regenerate else "drop", field,
                "" if max_staleness is None else max_staleness, *fenced, len(keep), *keep, len(pairs) // 2, *pairs,
                *groups]
        return Forgot.parse(self._once("discard", keys + [self._keys.admitted, self._keys.version], args))

    def reserve(self, count: int, column: str) -> list[int] | None:
        """Claim ``count`` free groups for new prompts of ``column`` (lua/reserve.lua); None if too few are free."""
        k = self._keys
        reply = self._once("reserve", [k.meta, k.claimed, k.group_ready(column), k.scratch],
                           [self._expected, count, self._bound.prompts_num])
        return [int(g) for g in reply] if reply else None

    def unready(self, columns: Sequence[str], rows: Sequence[int]) -> int:
        """Mark ``rows`` of ``columns`` not ready, keeping their bytes (lua/unready.lua)."""
        k = self._keys
        keys = [k.meta, *(key for c in columns for key in (k.ready(c), k.group_ready(c)))]
        return int(self._call("unready", keys, [self._expected, self._n, *rows]))

    def version(self, version: int) -> int:
        """Set the dock's current policy version (lua/version.lua); versions only grow."""
        return int(self._call("version", [self._keys.meta, self._keys.version], [self._expected, version]))

    def prefetch(self, count: int) -> list[int] | None:
        """The next ``count`` rows of the batch for a rollout rank (fewer at its end); None once it is
        spent, or while the staleness bound's admission control refuses (lua/prefetch.lua)."""
        k, schema = self._keys, self._bound
        rollout = schema.rollout
        batch = rollout.gbs_train * self._n if rollout.bounded else 0
        reply = self._once("prefetch", [k.meta, k.cursor, k.admitted, k.version],
                           [self._expected, count, schema.capacity, batch, rollout.max_staleness or 0])
        if not reply or int(reply[0]) < 0:
            return None
        return list(range(int(reply[0]), int(reply[1])))

    def metrics(self, values: dict[str, str], append: bool) -> int:
        """Store metrics (name -> JSON text); ``append`` extends stored lists (see lua/metrics.lua)."""
        args = [self._expected, "append" if append else "set", *(x for pair in values.items() for x in pair)]
        return int(self._once("metrics", [self._keys.meta, self._keys.metrics], args))

    def grow(self, grown: Schema) -> None:
        """Store the columns and consumers of ``grown`` if the dock still holds the schema bound now."""
        fields = grown.to_meta()
        self._call("grow", [self._keys.meta], [self._expected, fields["columns"], fields["consumers"]])

    def columns_of(self, columns: dict[str, str]) -> int:
        """Record the columns (a JSON list) each consumer reads by default."""
        args = [self._expected, *(x for pair in columns.items() for x in pair)]
        return int(self._call("columns_of", [self._keys.meta, self._keys.consumer_columns], args))

    def reset(self, consumer: str, rows: Sequence[int]) -> int:
        """Make ``rows`` (all when empty) available to ``consumer`` again; returns how many were handed out."""
        keys = [self._keys.meta, *self._consumer_keys(consumer)]
        return int(self._once("reset", keys, [self._expected, self._n, *rows]))

    @property
    def _bound(self) -> Schema:
        if self._schema is None:  # a programming error of the dock, not of its user
            raise RuntimeError("DockScripts.bind was not called before a script that needs the schema")
        return self._schema

    @property
    def _n(self) -> int:
        return self._bound.n_samples_per_prompt


class StatusScript:
    """lua/status.lua: one dock's counts. Not a ``DockScripts`` method: callers queue it for many docks
    in one pipeline (``broker.status``), and it writes nothing, so it needs no Redis 7 flag."""

    text = script_text("status")
    sha = hashlib.sha1(text.encode()).hexdigest()

    @staticmethod
    def bitmaps(keys: DockKeys, schema: Schema) -> list[tuple[str, int]]:
        """Every bitmap the script counts, in its order, with the number of bits it may have."""
        rows, groups = schema.capacity, schema.prompts_num
        out = []
        for col in schema.columns:
            out += [(keys.ready(col), rows), (keys.group_ready(col), groups)]
        for consumer in schema.consumers:
            out += [(keys.consumed(consumer), rows), (keys.group_taken(consumer), groups)]
        out += [(keys.finished, rows), (keys.group_finished, groups)]
        out += [(keys.group_age(a), groups) for a in range(schema.rollout.age_buckets)]
        out += [(keys.group_wait(w), groups) for w in range(1, schema.rollout.age_buckets)]
        return out

    @classmethod
    def queue(cls, pipe: Pipeline, keys: DockKeys, schema: Schema, fingerprint: str) -> None:
        """Queue the read of the dock's counts; ``fingerprint`` is the schema the caller expects."""
        rollout = schema.rollout
        bitmaps = [key for key, _ in cls.bitmaps(keys, schema)]
        rest = [kind(c) for c in schema.consumers for kind in (keys.leases, keys.redelivered, keys.dead)]
        responses = keys.data(rollout.response_columns[0]) if rollout.response_columns else keys.meta
        rest += [keys.version, keys.discarded, keys.group_versions, responses]
        staleness = "" if rollout.max_staleness is None else rollout.max_staleness
        pipe.execute_command("EVALSHA", cls.sha, 1 + len(bitmaps) + len(rest), keys.meta, *bitmaps, *rest,
                             fingerprint, len(bitmaps), staleness)

    @classmethod
    def parse(
        cls, reply: list[Any], keys: DockKeys, schema: Schema
    ) -> tuple[list[tuple[int, int]], list[tuple[int, Any, int]], tuple[Any, str, int, int]]:
        """(bits set, bytes) per bitmap, in ``bitmaps``' order; (leased rows, raw counter, dead letters) per
        consumer; (raw version, "field=count,..." discarded, stale groups, rows holding a response)."""
        bitmaps = 2 * len(cls.bitmaps(keys, schema))
        head, per_consumer, tail = reply[:bitmaps], reply[bitmaps:-4], reply[-4:]
        pairs = list(zip(head[0::2], head[1::2]))
        triples = list(zip(per_consumer[0::3], per_consumer[1::3], per_consumer[2::3]))
        text = tail[1].decode() if isinstance(tail[1], bytes) else str(tail[1])
        return pairs, triples, (tail[0], text, int(tail[2]), int(tail[3]))

    @classmethod
    def load(cls, client: Client) -> None:
        client.script_load(cls.text)


def _numbers(text: bytes | str) -> tuple[int, ...]:
    """The integers of a script's comma-separated list ("" is none)."""
    if isinstance(text, bytes):
        text = text.decode()
    return tuple(int(x) for x in text.split(",")) if text else ()


def run_pipeline(
    client: Client, load: Callable[[Client], None], build: Callable[[Pipeline], None], *,
    transaction: bool,
) -> list[Any]:
    """Run the pipeline (a MULTI/EXEC if ``transaction``) that ``build`` queues; its replies, errors included.

    A server that lost the scripts fails only their EVALSHAs (everything else applies), so ``load``
    loads them and the whole pipeline, which must be idempotent, runs again.
    """
    for attempt in range(2):
        pipe = client.pipeline(transaction=transaction)
        build(pipe)
        replies = pipe.execute(raise_on_error=False)
        if attempt == 0 and any(isinstance(r, redis.exceptions.NoScriptError) for r in replies):
            load(client)
            continue
        return replies
    raise AssertionError("unreachable")


def read_pipeline(
    client: Client, load: Callable[[Client], None], build: Callable[[Pipeline], None], *, transaction: bool = False,
) -> list[Any]:
    """The replies of the read pipeline ``build`` queues (see ``run_pipeline``); an error reply raises."""
    replies = run_pipeline(client, load, build, transaction=transaction)
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


for _name in SCRIPT_FILES:  # fail at import if the package was built without its Lua files
    script_text(_name)
