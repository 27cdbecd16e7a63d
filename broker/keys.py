"""The one place that builds Redis key names.

Every key of dock NAME starts with ``td:{NAME}:``. The braces are a Redis Cluster hash tag: all of a
dock's keys hash to one slot, so a Lua script or MULTI touching several of them is legal on a cluster.

=================================  ======  ============================================================
key                                type    contents
=================================  ======  ============================================================
``td:{NAME}:meta``                 hash    schema: prompts_num, n_samples_per_prompt, columns, consumers,
                                           format version
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
``td:{NAME}:reply:REQUEST``        string  rows a sampling call returned, kept briefly so a retry
                                           after a lost reply gets the same rows
``td:{NAME}:scratch``              string  work space of the sampling script; deleted before it returns
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
=================================  ======  ============================================================
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .errors import SchemaError

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
    def scratch(self) -> str:
        return self.base + "scratch"

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

    def reply(self, request_id: str) -> str:
        return f"{self.base}reply:{request_id}"

    @property
    def reply_pattern(self) -> str:
        """SCAN pattern of the replies the dock's sampling calls keep for retries."""
        return self.base + "reply:*"

    def every_key(self, columns: Sequence[str], consumers: Sequence[str]) -> list[str]:
        """Every key the dock has (but reply keys, which expire by themselves): what ``delete`` removes."""
        per_column = (self.data, self.ready, self.group_ready, self.lengths)
        per_consumer = (self.consumed, self.group_taken, self.leases, self.tokens, self.redelivered)
        keys = [kind(c) for kind in per_column for c in columns]
        keys += [kind(c) for kind in per_consumer for c in consumers]
        return keys + [self.meta, self.scratch, self.epoch, self.generations, *self.batch_keys,
                       self.consumer_columns]

    @property
    def batch_keys(self) -> list[str]:
        """Keys that belong to one batch beside the rows (reset by a whole clear): cursor and metrics."""
        return [self.cursor, self.metrics]
