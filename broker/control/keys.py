"""The one place that builds Redis key names.

Every key of dock NAME starts with ``td:{NAME}:``. The braces are a Redis Cluster hash tag: all of a
dock's keys hash to one slot, so a Lua script or MULTI touching several of them is legal on a cluster.

The layout of every key (pattern, type, what it holds) is ``key_layout()`` at the end of this module. It is
built by calling the key builders below, so it cannot drift from them; docs/operations.md shows it as a table
that ``tests/architecture/test_docs.py`` checks against it (``python -m tests.architecture.test_docs`` writes it anew).

On a Redis Cluster the keys of a dock live in the slot of ``{NAME}``, but a sharded dock's bytes are spread
over the data shards ``{NAME~S}``, whose tags the schema stores (``Schema.shards``). Their names cannot
clash with another dock's: ``~`` is not allowed in names.

Over 400 lines: the project keeps one place that builds every Redis key of the core, so that a key's name,
its type and its row in the layout are read and changed together (a slice's own keys, TransferQueue's, are
its own: ``broker/transfer_queue/keys.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

from broker.errors import SchemaError

PREFIX = "td"

#: Names of docks, columns and consumers: safe inside a hash tag, in redis-cli and in a SCAN pattern.
NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,128}")

#: SCAN pattern matching the meta key of every dock on a server.
META_PATTERN = f"{PREFIX}:{{*}}:meta"
_META_RE = re.compile(r"^" + PREFIX + r":\{(?P<name>[^{}]+)\}:meta$")


def scan_pattern(docks: str = "*", rest: str = "*") -> str:
    """SCAN pattern of the keys ``rest`` (a glob after ``td:{NAME}:``) of the docks whose names match the
    glob ``docks``: ``scan_pattern("bench-*")`` is every key of every dock named ``bench-...``."""
    return f"{PREFIX}:{{{docks}}}:{rest}"


def shard_tag(dock: str, index: int) -> str:
    """Hash tag of candidate data shard ``index`` of ``dock`` (see ``DockKeys.shard_data``)."""
    return f"{dock}~{index}"


def shard_pattern(dock: str) -> str:
    """SCAN pattern of every data shard key of ``dock``."""
    return f"{PREFIX}:{{{dock}~*}}:*"


#: A partition of a partitioned dock is a dock of its own named ``NAME~pK`` (``partition_name``): its own hash tag, so
#: its own slot. ``~`` is not allowed in the names users give, so it clashes with no dock of theirs.
_PARTITION_RE = re.compile(r"(?P<dock>[A-Za-z0-9_.\-]{1,128})~p(?P<index>[0-9]{1,6})")


def partition_name(dock: str, index: int) -> str:
    """The name (and hash tag) of candidate partition ``index`` of the partitioned dock ``dock`` (see
    ``broker/api/partitioned.py``; which candidates a dock uses is in its record, ``DockKeys.partitions``)."""
    return f"{dock}~p{index}"


def partition_of_name(name: str) -> str | None:
    """The partitioned dock whose partition ``name`` is, or None if ``name`` is not a partition's."""
    m = _PARTITION_RE.fullmatch(name)
    return m.group("dock") if m else None


def group_field(group: int) -> str:
    """Field of group ``group`` in a group column's data hash: ``g`` and the group in decimal (row fields
    are bare decimals, so the two never clash). lua/include/forget.lua builds it too."""
    return f"g{group}"


def check_name(kind: str, name: object) -> str:
    """Return ``name`` if it is a valid dock, column or consumer name, else raise SchemaError. A dock's name may
    also be a partition's (``partition_name``): a partition is opened as the dock it is."""
    if kind == "dock" and isinstance(name, str) and _PARTITION_RE.fullmatch(name):
        return name
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):  # match() with $ took "grpo\n"
        raise SchemaError(
            f"invalid {kind} name {name!r}: use 1-128 characters from letters, digits, '_', '.', '-'"
        )
    return name


def dock_name_from_meta_key(key: bytes | str) -> str | None:
    """The dock name inside a meta key found by SCAN, or None if the key is not one of ours."""
    text = key.decode() if isinstance(key, bytes) else key
    m = _META_RE.match(text)
    return m.group("name") if m else None


class DockKeys:
    """Key names of one dock."""

    __slots__ = ("name", "base")

    def __init__(self, name: str):
        self.name = check_name("dock", name)
        self.base = f"{PREFIX}:{{{name}}}:"

    @property
    def meta(self) -> str:
        return self.base + "meta"

    def aside(self, column: str) -> str:
        """Where a put's bar sets the data hash of ``column`` aside until lua/put.lua lets the put land."""
        return f"{self.base}aside:{column}"

    def tail_aside(self, column: str) -> str:
        """Where a put's bar sets ``tail(column)`` aside, as ``aside`` is for the data hash."""
        return f"{self.base}tailaside:{column}"

    @property
    def partitions(self) -> str:
        """The record of a partitioned dock: JSON of its partitions' names and its shape (see
        ``broker/api/partitioned.py``); a dock of one partition has none."""
        return self.base + "partitions"

    @property
    def scratch(self) -> str:
        return self.base + "scratch"

    @property
    def scratch2(self) -> str:
        return self.base + "scratch2"

    @property
    def scratch3(self) -> str:
        return self.base + "scratch3"

    @property
    def epoch(self) -> str:
        return self.base + "epoch"

    @property
    def generations(self) -> str:
        return self.base + "gen"

    @property
    def events(self) -> str:
        """Pub/sub channel on which puts announce new rows."""
        return self.base + "events"

    def data(self, column: str) -> str:
        return f"{self.base}data:{column}"

    def tail(self, column: str) -> str:
        """The rest of the rows of ``column`` whose head in ``data(column)`` was cut to fit the server
        allocator's size classes (``data/fit.py``), under the same fields."""
        return f"{self.base}tail:{column}"

    @property
    def replicated(self) -> str:
        return self.base + "replicated"

    @staticmethod
    def shard_replicated(tag: str) -> str:
        """The counter written before a WAIT on the node of data shard ``tag`` (see connection/replication.py)."""
        return f"{PREFIX}:{{{tag}}}:replicated"

    @staticmethod
    def shard_data(tag: str, column: str, epoch: int) -> str:
        """A sharded dock's data hash of ``column`` on shard ``tag`` for the rows written in ``epoch``."""
        return f"{PREFIX}:{{{tag}}}:data:{column}:{epoch}"

    def ready(self, column: str) -> str:
        return f"{self.base}ready:{column}"

    def group_ready(self, column: str) -> str:
        return f"{self.base}gready:{column}"

    def consumed(self, consumer: str) -> str:
        return f"{self.base}consumed:{consumer}"

    def group_taken(self, consumer: str) -> str:
        return f"{self.base}gtaken:{consumer}"

    def group_remnant(self, consumer: str) -> str:
        """Groups offered to ``consumer`` again with some of their rows still handed to it (acked): what
        group sampling hands out of such a group is its other rows (lua/include/leases.lua)."""
        return f"{self.base}gremnant:{consumer}"

    def leases(self, consumer: str) -> str:
        return f"{self.base}leases:{consumer}"

    def tokens(self, consumer: str) -> str:
        return f"{self.base}tokens:{consumer}"

    def redelivered(self, consumer: str) -> str:
        return f"{self.base}redelivered:{consumer}"

    def failures(self, consumer: str) -> str:
        return f"{self.base}failures:{consumer}"

    def dead(self, consumer: str) -> str:
        return f"{self.base}dead:{consumer}"

    def lengths(self, column: str) -> str:
        return f"{self.base}len:{column}"

    @property
    def cursor(self) -> str:
        return self.base + "cursor"

    @property
    def metrics(self) -> str:
        return self.base + "metrics"

    @property
    def consumer_columns(self) -> str:
        return self.base + "columns_of"

    @property
    def finished(self) -> str:
        return self.base + "finished"

    @property
    def group_finished(self) -> str:
        return self.base + "gfinished"

    @property
    def rows_finished(self) -> str:
        return self.base + "rfinished"

    @property
    def group_rolled(self) -> str:
        return self.base + "grolled"

    def age(self, k: int) -> str:
        return f"{self.base}age:{k}"

    def group_age(self, k: int) -> str:
        return f"{self.base}gage:{k}"

    def wait(self, w: int) -> str:
        return f"{self.base}wait:{w}"

    def group_wait(self, w: int) -> str:
        return f"{self.base}gwait:{w}"

    @property
    def group_batch(self) -> str:
        return self.base + "gbatch"

    @property
    def claimed(self) -> str:
        return self.base + "claimed"

    @property
    def group_versions(self) -> str:
        return self.base + "gversions"

    @property
    def version(self) -> str:
        return self.base + "version"

    @property
    def discarded(self) -> str:
        return self.base + "discarded"

    @property
    def admitted(self) -> str:
        return self.base + "admitted"

    def rollout_keys(self, age_buckets: int) -> list[str]:
        """The rows' generation status: what a whole clear deletes and a partial one edits, in the order
        the scripts take them: finished, gfinished, rfinished, grolled, claimed, gversions, then the age
        bitmaps of rows (0 .. age_buckets-1) and of groups, then the wait bitmaps of rows and of groups
        (1 .. age_buckets-1), then the iteration's batch."""
        return [self.finished, self.group_finished, self.rows_finished, self.group_rolled, self.claimed,
                self.group_versions,
                *(self.age(a) for a in range(age_buckets)), *(self.group_age(a) for a in range(age_buckets)),
                *(self.wait(w) for w in range(1, age_buckets)), *(self.group_wait(w) for w in range(1, age_buckets)),
                self.group_batch]

    def reply(self, request_id: str) -> str:
        return f"{self.base}reply:{request_id}"

    def named(self, label: str) -> str:
        """The record of a named take (lua/take.lua): the rows the first take under ``label`` handed out."""
        return f"{self.base}named:{label}"

    @property
    def named_index(self) -> str:
        """Every record of a named take (``named``) alive, with when it expires: how they are found without SCAN."""
        return self.base + "named"

    def staged(self, run: str, key: str) -> str:
        """Where a checkpoint (broker/api/snapshot.py) keeps its copy of the dock's
        ``key`` during run ``run``: in the dock's slot, under a prefix nothing else of the dock uses."""
        if not key.startswith(self.base):
            raise SchemaError(f"{key!r} is not a key of dock {self.name!r}")
        check_name("checkpoint run", run)
        return f"{self.base}ckpt:{run}:{key[len(self.base):]}"

    @property
    def reply_pattern(self) -> str:
        """SCAN pattern of the replies the dock's sampling calls keep for retries."""
        return self.base + "reply:*"

    def every_key(self, columns: Sequence[str], consumers: Sequence[str], age_buckets: int = 0) -> list[str]:
        """Every key the dock has (but reply keys, which expire by themselves): what ``delete`` removes."""
        per_column = (self.data, self.tail, self.ready, self.group_ready, self.lengths)
        per_consumer = (self.consumed, self.group_taken, self.leases, self.tokens, self.redelivered, self.failures,
                        self.dead, self.group_remnant)
        keys = [kind(c) for kind in per_column for c in columns]
        keys += [kind(c) for kind in per_consumer for c in consumers]
        return keys + [self.meta, self.scratch, self.scratch2, self.scratch3, self.epoch, self.generations,
                       *self.batch_keys, self.consumer_columns, *self.rollout_keys(age_buckets), self.version,
                       self.admitted, self.replicated, self.named_index]

    @property
    def batch_keys(self) -> list[str]:
        """Keys that belong to one batch beside the rows (reset by a whole clear): cursor, metrics and the
        count of discarded groups."""
        return [self.cursor, self.metrics, self.discarded]


# The key layout as a table: built by calling the builders above with placeholder names, so a renamed key
# changes the table, and tests/architecture/test_docs.py checks that docs/operations.md shows exactly this.


class KeyRow(NamedTuple):
    """One row of the key layout: a key pattern, its Redis type, and what it holds."""

    key: str
    type: str
    holds: str


class _Placeholder(int):
    """An integer part of a key (an age, an epoch, a shard) that prints as its name in a pattern."""

    label: str

    def __new__(cls, label: str) -> _Placeholder:
        placeholder = super().__new__(cls, 0)
        placeholder.label = label
        return placeholder

    def __format__(self, spec: str) -> str:
        return self.label


#: Rows of the key layout that slices outside the core add (``register_layout``), after the core's.
_SLICE_LAYOUTS: list[Callable[[], list[KeyRow]]] = []


def register_layout(rows: Callable[[], list[KeyRow]]) -> None:
    """The hook a slice outside the core (``broker/transfer_queue/``) calls at its import to add the rows of its
    own keys (beside a dock's, in its slot) to ``key_layout``; the slice builds those keys itself (its own
    ``DockKeys`` subclass), so the core never imports it. Registering the same function again is a no-op."""
    if rows not in _SLICE_LAYOUTS:
        _SLICE_LAYOUTS.append(rows)


def key_layout() -> list[KeyRow]:
    """Every key of dock NAME (COLUMN, CONSUMER, K, W, S, EPOCH, REQUEST standing for their parts), then those
    of the slices registered (``register_layout``)."""
    return _core_layout() + [row for rows in _SLICE_LAYOUTS for row in rows()]


def _core_layout() -> list[KeyRow]:
    k = DockKeys("NAME")
    column, consumer = "COLUMN", "CONSUMER"
    age, waited = _Placeholder("K"), _Placeholder("W")
    shard = shard_tag("NAME", _Placeholder("S"))
    return [
        KeyRow(k.meta, "hash", "the schema: `format_version`, `prompts_num`, `n_samples_per_prompt`, `columns`, "
               "`consumers` and `length_columns` (JSON lists), `rollout` (JSON of the `Rollout` settings, `{}` for "
               "none), `shards`, `group_columns` (JSON list; absent when none); not part of the schema: "
               "`dead_letter_after`, and `versioned` once `set_version` ran "
               "(a version key missing then was lost)"),
        KeyRow(k.partitions, "string", "a partitioned dock's record (JSON): `format`, `prompts_num`, "
               "`n_samples_per_prompt`, `block` and `partitions`, the names of its P partitions; partition K is a "
               f"dock of its own, `{partition_name('NAME', _Placeholder('K'))}`, with every key of this table in its "
               "own slot; group g is in partition (g div block) mod P"),
        KeyRow(k.data(column), "hash", "field = row index in decimal, value = one encoded row; in a group column "
               f"(meta `group_columns`) field = `{group_field(_Placeholder('G'))}` (G = group), value = the group's "
               "one encoded value, read by its n rows"),
        KeyRow(k.tail(column), "hash", "field = row index, value = the rest of a row whose value in "
               "td:{NAME}:data:COLUMN was cut to fit the server allocator's size classes (`data/fit.py`); no field "
               "for a row stored whole, nor in a group column or a sharded dock"),
        KeyRow(k.ready(column), "bitmap", "bit i set when row i of COLUMN is written"),
        KeyRow(k.group_ready(column), "bitmap", "bit g set when all n rows of group g are written in COLUMN (kept by "
               "`put`)"),
        KeyRow(k.lengths(column), "string", "one big-endian u32 per row of a length column: what `seqlen` "
               "sampling and `balance` weigh"),
        KeyRow(k.consumed(consumer), "bitmap", "bit i set when row i was handed to CONSUMER"),
        KeyRow(k.group_taken(consumer), "bitmap", "bit g set when any row of group g was handed to CONSUMER"),
        KeyRow(k.group_remnant(consumer), "bitmap", "bit g set when group g came back to CONSUMER (its lease ran "
               "out, or `reclaim`) with some of its rows acked: group sampling may offer it again and hands out only "
               "its rows not handed out; may list groups that are no longer such (it is a hint: the row bits decide)"),
        KeyRow(k.leases(consumer), "sorted set", "rows handed out under a lease and not yet acked; score = "
               "deadline (ms of server time)"),
        KeyRow(k.tokens(consumer), "hash", "field = leased row, value = token of the call holding its lease "
               "(what an ack must name)"),
        KeyRow(k.redelivered(consumer), "string", "counter of rows given back after their lease expired"),
        KeyRow(k.failures(consumer), "hash", "field = row, value = deliveries to CONSUMER whose bytes could not "
               "be read (corrupt, or missing)"),
        KeyRow(k.dead(consumer), "hash", "dead letters: field = row, value = why it is no longer handed to "
               "CONSUMER (its bytes failed `dead_letter_after` reads)"),
        KeyRow(k.reply("REQUEST"), "string", "the reply of a call that changed the dock, kept so that a resend "
               "gets it instead of applying twice: until the same client thread's next such call deletes it, or "
               "60 s"),
        KeyRow(k.named("LABEL"), "string", "a named `take`'s rows (`start,length,...|row,row,...`), kept until its "
               "time to live (a day by default): what later takes under LABEL get"),
        KeyRow(k.named_index, "sorted set", "member = the key of a named take's record, score = when it expires (ms "
               "of server time); records gone are dropped at the next named take"),
        KeyRow(k.staged("RUN", k.base + "KEY"), "any", "a checkpoint's copy of td:{NAME}:KEY while run "
               "RUN saves or loads it (expires within the hour if the run dies)"),
        KeyRow(k.aside(column), "hash", "a data hash a put's bar sets aside until `put` lets the put land (a "
               "string in its place fails the HSETs of a put that does not); exists only inside the put's MULTI/EXEC"),
        KeyRow(k.tail_aside(column), "hash", "the same for td:{NAME}:tail:COLUMN"),
        KeyRow(k.scratch, "string", "work space of the `sample` script, deleted before it returns"),
        KeyRow(k.scratch2, "string", "more of it: the tiers of oldest-first sampling"),
        KeyRow(k.scratch3, "string", "more of it: the iteration's batch"),
        KeyRow(k.epoch, "string", "counter of whole clears, moved forward by a restore (the read fence, with `gen`)"),
        KeyRow(k.generations, "string", "one big-endian u32 per row (`BITFIELD ... GET u32 #ROW`): clears of "
               "that row so far"),
        KeyRow(k.events, "channel", "pub/sub: every put publishes the number of rows it wrote"),
        KeyRow(k.cursor, "string", "next row `prefetch_request_index` hands out (reset by a whole clear)"),
        KeyRow(k.metrics, "hash", "metric name → JSON number or list of numbers (reset by a whole clear)"),
        KeyRow(k.consumer_columns, "hash", "consumer → JSON list of the columns it reads when "
               "`get_experience` is given none"),
        KeyRow(k.finished, "bitmap", "partial rollout: bit i set when row i's response is finished"),
        KeyRow(k.group_finished, "bitmap", "bit g set when all n rows of group g are finished"),
        KeyRow(k.rows_finished, "bitmap", "`gfinished` spread over the rows of each group, for row-wise sampling"),
        KeyRow(k.group_rolled, "bitmap", "bit g set once group g had a response put: from then on it ages"),
        KeyRow(k.age(age), "bitmap", "rows of groups of age K (K = 0 .. max_age, the last: that old or older); "
               "ageing renames the bitmaps"),
        KeyRow(k.group_age(age), "bitmap", "the same, one bit per group"),
        KeyRow(k.wait(waited), "bitmap", "rows of groups whose prompt waited through W clears without being "
               "generated (W = 1 .. max_age); sampled after the aged groups, before newer prompts"),
        KeyRow(k.group_wait(waited), "bitmap", "the same, one bit per group"),
        KeyRow(k.group_batch, "bitmap", "partial rollout: the groups of this iteration, which every consumer but "
               "the rollout takes first; emptied by the iteration clear"),
        KeyRow(k.claimed, "bitmap", "groups `reserve_groups` handed out for new prompts; free again once "
               "forgotten"),
        KeyRow(k.group_versions, "sorted set", "member = group, score = oldest policy version of its rows"),
        KeyRow(k.version, "string", "the current policy version (`set_version`; kept by clears)"),
        KeyRow(k.discarded, "hash", "groups discarded since the last whole clear, by who: a consumer, `stale` "
               "or `regenerated`"),
        KeyRow(k.admitted, "string", "rows `prefetch_request_index` admitted under a staleness bound"),
        KeyRow(k.replicated, "string", "counter written before each `WAIT` of `wait_replicas`"),
        KeyRow(DockKeys.shard_replicated(shard), "string", "the same on the node of data shard S"),
        KeyRow(DockKeys.shard_data(shard, column, _Placeholder("EPOCH")), "hash", "a sharded dock's row bytes on "
               "data shard S (its own hash tag, so its own slot), written in epoch EPOCH; field = "
               "`ROW:GENERATION`"),
    ]


def key_layout_markdown() -> str:
    """The key layout as a Markdown table (what docs/operations.md shows)."""
    lines = ["| key | type | contents |", "|---|---|---|"]
    lines += [f"| `{row.key}` | {row.type} | {row.holds} |" for row in key_layout()]
    return "\n".join(lines) + "\n"
