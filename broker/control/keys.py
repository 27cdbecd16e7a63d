"""The one place that builds Redis key names.

Every key of dock NAME starts with ``td:{NAME}:``. The braces are a Redis Cluster hash tag: all of a
dock's keys hash to one slot, so a Lua script or MULTI touching several of them is legal on a cluster.

=================================  ======  ============================================================
key                                type    contents
=================================  ======  ============================================================
``td:{NAME}:meta``                 hash    schema: prompts_num, n_samples_per_prompt, columns, consumers,
                                           format version; ``versioned`` once ``set_version`` ran (the
                                           version key missing then was lost: lua/include/current_version.lua)
``td:{NAME}:data:COLUMN``          hash    field = row index in decimal, value = one encoded tensor
``td:{NAME}:ready:COLUMN``         bitmap  bit i set when row i of COLUMN is written
``td:{NAME}:gready:COLUMN``        bitmap  bit g set when all n rows of group g are written in COLUMN
``td:{NAME}:consumed:CONSUMER``    bitmap  bit i set when row i was handed to CONSUMER
``td:{NAME}:gtaken:CONSUMER``      bitmap  bit g set when any row of group g was handed to CONSUMER
``td:{NAME}:leases:CONSUMER``      zset    rows handed out under a lease and not yet acked; score =
                                           deadline in ms of server time
``td:{NAME}:tokens:CONSUMER``      hash    field = leased row, value = token of the call holding its
                                           lease (an ack must name it)
``td:{NAME}:redelivered:CONSUMER`` string  counter: rows given back to CONSUMER after a lease expired
``td:{NAME}:failures:CONSUMER``    hash    field = row, value = deliveries of it to CONSUMER whose bytes
                                           could not be read (corrupt, or missing)
``td:{NAME}:dead:CONSUMER``        hash    dead letters: field = row, value = why it is no longer handed
                                           to CONSUMER (its bytes failed ``dead_letter_after`` reads)
``td:{NAME}:reply:REQUEST``        string  the reply of a call that changed the dock, kept for a minute
                                           so that a resend after a lost reply gets it instead of
                                           applying the call twice (lua/include/once.lua)
``td:{NAME}:gate``                 string  "go" from put.lua to bar.lua when a put may land; exists only
                                           inside the put's MULTI/EXEC
``td:{NAME}:aside:COLUMN``         hash    a data hash set aside by bar.lua while a refused put's HSETs
                                           fail; exists only inside the put's MULTI/EXEC
``td:{NAME}:scratch``              string  work space of the sampling script; deleted before it returns
``td:{NAME}:scratch2``             string  more of it (tiers of oldest-first sampling)
``td:{NAME}:scratch3``             string  more of it (the iteration's batch)
``td:{NAME}:epoch``                string  counter: whole clears so far (the read fence, with gen)
``td:{NAME}:gen``                  string  u32 per row, big-endian (``BITFIELD ... GET u32 #ROW``): clears
                                           of that row so far
``td:{NAME}:events``               pubsub  channel; every put publishes on it to wake waiting readers
``td:{NAME}:len:COLUMN``           string  u32 per row, big-endian: the value of row i of a length column
                                           (``prompt_length``, ...), which balanced sampling sums
``td:{NAME}:cursor``               string  counter: next row ``prefetch_request_index`` hands out
``td:{NAME}:metrics``              hash    field = metric name, value = a number or a list of numbers, in
                                           JSON; shared by every worker, reset by a whole clear
``td:{NAME}:columns_of``           hash    field = consumer, value = JSON list of the columns it reads
                                           when ``get_experience`` is given none
``td:{NAME}:finished``             bitmap  partial rollout: bit i set when row i's response is finished
``td:{NAME}:gfinished``            bitmap  bit g set when all n rows of group g are finished
``td:{NAME}:rfinished``            bitmap  bit i set when every row of row i's group is finished (the
                                           group bit spread over its rows, for row-wise sampling)
``td:{NAME}:grolled``              bitmap  bit g set once the rollout put any response of group g: from
                                           then on the group ages
``td:{NAME}:age:K``                bitmap  rows of groups of age K (K = 0 .. max_age; the last holds every
                                           group that old or older); a clear that ends an iteration ages
                                           them by renaming the bitmaps, not by touching rows
``td:{NAME}:gage:K``               bitmap  the same, one bit per group
``td:{NAME}:wait:W``               bitmap  rows of groups whose prompt waited through W clears without being
                                           generated (W = 1 .. max_age, the last: that many or more);
                                           sampled after the aged groups, before newer prompts
``td:{NAME}:gwait:W``              bitmap  the same, one bit per group
``td:{NAME}:gbatch``               bitmap  partial rollout: the groups of this iteration, the first gbs_train
                                           handed to a consumer other than the rollout; the others take
                                           these first (see sample.lua); emptied by the iteration clear
``td:{NAME}:claimed``              bitmap  bit g set when group g was reserved for new prompts
                                           (``reserve_groups``); a group forgotten is free again
``td:{NAME}:gversions``            zset    member = group, score = oldest policy version of its rows
``td:{NAME}:version``              string  the current policy version (``set_version``); kept by clears
``td:{NAME}:discarded``            hash    groups discarded since the last whole clear: field = the consumer
                                           that dropped them, or ``stale`` / ``regenerated``
``td:{NAME}:admitted``             string  rows ``prefetch_request_index`` admitted under a staleness bound
``td:{NAME}:replicated``           string  counter: written before each WAIT of ``wait_replicas`` (see
                                           connection/replication.py); ``td:{NAME~S}:replicated`` on each shard
``td:{NAME~S}:data:COLUMN:EPOCH``  hash    a sharded dock's row bytes (see data/store.py): data shard S (its
                                           own hash tag, so its own slot), rows written in epoch EPOCH;
                                           field = ``ROW:GENERATION``, value = one encoded tensor
=================================  ======  ============================================================

On a Redis Cluster the keys above live in the slot of ``{NAME}``, but a sharded dock's bytes are spread
over the data shards ``{NAME~S}``, whose tags the schema stores (``Schema.shards``). Their names cannot
clash with another dock's: ``~`` is not allowed in names.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

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


def check_name(kind: str, name: object) -> str:
    """Return ``name`` if it is a valid dock, column or consumer name, else raise SchemaError."""
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

    @property
    def gate(self) -> str:
        return self.base + "gate"

    def aside(self, column: str) -> str:
        return f"{self.base}aside:{column}"

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

    @property
    def reply_pattern(self) -> str:
        """SCAN pattern of the replies the dock's sampling calls keep for retries."""
        return self.base + "reply:*"

    def every_key(self, columns: Sequence[str], consumers: Sequence[str], age_buckets: int = 0) -> list[str]:
        """Every key the dock has (but reply keys, which expire by themselves): what ``delete`` removes."""
        per_column = (self.data, self.ready, self.group_ready, self.lengths)
        per_consumer = (self.consumed, self.group_taken, self.leases, self.tokens, self.redelivered, self.failures,
                        self.dead)
        keys = [kind(c) for kind in per_column for c in columns]
        keys += [kind(c) for kind in per_consumer for c in consumers]
        return keys + [self.meta, self.scratch, self.scratch2, self.scratch3, self.epoch, self.generations,
                       *self.batch_keys, self.consumer_columns, *self.rollout_keys(age_buckets), self.version,
                       self.admitted, self.replicated]

    @property
    def batch_keys(self) -> list[str]:
        """Keys that belong to one batch beside the rows (reset by a whole clear): cursor, metrics and the
        count of discarded groups."""
        return [self.cursor, self.metrics, self.discarded]
