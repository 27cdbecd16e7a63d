"""A dock's schema: its size, columns and consumers, as stored in ``td:{NAME}:meta``."""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from broker.control.keys import check_name
from broker.control.rollout import Rollout
from broker.errors import DecodeError, SchemaError

#: Version of the key layout and meta format; a dock written by another version is refused.
FORMAT_VERSION = 1

#: Meta fields every script compares with what its client expects (lua/include/schema.lua), in order.
CHECKED_FIELDS = ("format_version", "prompts_num", "n_samples_per_prompt", "columns", "consumers", "length_columns",
                  "rollout", "shards", "group_columns")

#: Bitmaps of more rows than this would be slow to scan and big to hold; raise it deliberately.
MAX_CAPACITY = 1 << 26

#: Longest meta field a reader parses (a JSON list of thousands of 128-character names fits); a longer one
#: is garbage another client wrote.
MAX_META_FIELD = 1 << 20


@dataclass(frozen=True)
class Schema:
    """What a dock holds: ``prompts_num`` groups of ``n_samples_per_prompt`` rows, named columns and consumers."""

    prompts_num: int
    n_samples_per_prompt: int
    columns: tuple[str, ...]
    consumers: tuple[str, ...]
    #: Columns whose rows are one integer each (``prompt_length``, ``response_length``): puts also
    #: record them in a u32 array per column (``DockKeys.lengths``), which balanced sampling reads.
    length_columns: tuple[str, ...] = ()
    #: Partial rollout and the staleness bound (see ``rollout.py``); ``Rollout()`` turns both off.
    rollout: Rollout = Rollout()
    #: Hash tags of the data shards (``DockKeys.shard_data``) on a Redis Cluster, chosen when the dock is
    #: made so that they land on distinct primaries; empty: the row bytes stay in the dock's own slot.
    shards: tuple[str, ...] = ()
    #: Columns holding one value per group (a prompt's tokens, an image): stored once per group of n in
    #: one slot (field ``group_field(g)`` of the column's data hash), served to each of its n rows. On data
    #: shards they are stored per row, as other columns (see data/groups.py). Absent from the meta of a
    #: dock without any, so such a dock's meta is what it was before they existed.
    group_columns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for field in ("prompts_num", "n_samples_per_prompt"):
            value = getattr(self, field)
            if type(value) is not int or value < 1:
                raise SchemaError(f"{field} must be a positive int, got {value!r}")
        if self.capacity > MAX_CAPACITY:
            raise SchemaError(f"capacity {self.capacity} rows exceeds the limit of {MAX_CAPACITY}")
        for kind, names in (("column", self.columns), ("consumer", self.consumers)):
            if isinstance(names, str) or not names:
                raise SchemaError(f"{kind}s must be a non-empty list of names, got {names!r}")
            for name in names:
                check_name(kind, name)
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise SchemaError(f"duplicate {kind} names: {dupes}")
        if isinstance(self.length_columns, str):
            raise SchemaError(f"length_columns must be a list of column names, got {self.length_columns!r}")
        unknown = [c for c in self.length_columns if c not in self.columns]
        if unknown:
            raise SchemaError(f"length_columns {unknown} are not columns of the dock ({list(self.columns)})")
        if not isinstance(self.rollout, Rollout):
            raise SchemaError(f"rollout must be a broker.Rollout, got {self.rollout!r}")
        self.rollout.check(self.columns, self.consumers)
        self._check_group_columns()
        if self.shards and self.rollout != Rollout():
            # Partial rollout and regeneration write placeholders from inside scripts, which reach only
            # the dock's own slot: such docks keep their bytes there (see data/slot_store.py).
            raise SchemaError("a sharded dock takes no partial rollout or staleness settings (rollout=Rollout())")

    def _check_group_columns(self) -> None:
        if isinstance(self.group_columns, str):
            raise SchemaError(f"group_columns must be a list of column names, got {self.group_columns!r}")
        unknown = [c for c in self.group_columns if c not in self.columns]
        if unknown:
            raise SchemaError(f"group_columns {unknown} are not columns of the dock ({list(self.columns)}); "
                              "a group column must be one of the columns too")
        dupes = sorted({c for c in self.group_columns if self.group_columns.count(c) > 1})
        if dupes:
            raise SchemaError(f"duplicate group_columns: {dupes}")
        responses = [c for c in self.group_columns if c in self.rollout.response_columns]
        if responses:
            # Each row's response is its own: placeholders and regeneration write them per row.
            raise SchemaError(f"group_columns {responses} are response columns of the rollout; responses are per row")

    @classmethod
    def build(
        cls, prompts_num: Any, n_samples_per_prompt: Any, columns: Iterable[str], consumers: Iterable[str],
        length_columns: Iterable[str] = (), rollout: Rollout | None = None, group_columns: Iterable[str] = (),
    ) -> Schema:
        """Schema from user arguments (any sequences of names); ``__post_init__`` checks them."""
        def as_tuple(names: Iterable[str]) -> Any:  # a bare string stays one, so validation can name the mistake
            return names if isinstance(names, str) else tuple(names)

        def as_int(value: Any) -> Any:  # numpy integers are ints too; bools and floats are left for the check to name
            if isinstance(value, np.integer) and not isinstance(value, np.bool_):
                return operator.index(value)
            return value

        return cls(as_int(prompts_num), as_int(n_samples_per_prompt), as_tuple(columns), as_tuple(consumers),
                   as_tuple(length_columns), Rollout() if rollout is None else rollout,
                   group_columns=as_tuple(group_columns))

    @property
    def capacity(self) -> int:
        """Rows in the dock: prompts_num × n_samples_per_prompt."""
        return self.prompts_num * self.n_samples_per_prompt

    def to_meta(self) -> dict[str, str]:
        """Fields of the meta hash."""
        fields = {
            "format_version": str(FORMAT_VERSION),
            "prompts_num": str(self.prompts_num),
            "n_samples_per_prompt": str(self.n_samples_per_prompt),
            "columns": json.dumps(list(self.columns)),
            "consumers": json.dumps(list(self.consumers)),
            "length_columns": json.dumps(list(self.length_columns)),
            "rollout": self.rollout.to_json(),
            "shards": json.dumps(list(self.shards)),
        }
        if self.group_columns:  # absent when none: the meta (and its fingerprint) of such a dock is unchanged
            fields["group_columns"] = json.dumps(list(self.group_columns))
        return fields

    @classmethod
    def from_meta(cls, meta: dict[bytes, bytes], *, where: str) -> Schema:
        """Parse a meta hash read from Redis; anything malformed raises DecodeError naming ``where``.

        Any client allowed to write the dock's keys may write anything here, so nothing in it may crash the
        reader (``broker status`` and the exporter read every dock's): a field longer than any broker
        writes is refused unparsed, and JSON nested past Python's recursion limit is malformed like the rest.
        """
        long = [k for k, v in meta.items() if len(v) > MAX_META_FIELD]
        if long:
            raise DecodeError(f"{where}: field {long[0]!r:.40} holds more than {MAX_META_FIELD} bytes, which no "
                              "broker writes")
        try:
            fields = {k.decode(): v.decode() for k, v in meta.items()}
            version = int(fields["format_version"])
        except (UnicodeDecodeError, KeyError, ValueError) as exc:
            raise DecodeError(f"{where}: not a dock meta hash ({exc!r})") from None
        if version != FORMAT_VERSION:
            raise DecodeError(f"{where}: dock format version {version}, this broker reads {FORMAT_VERSION}")
        try:
            schema = cls(
                int(fields["prompts_num"]),
                int(fields["n_samples_per_prompt"]),
                tuple(json.loads(fields["columns"])),
                tuple(json.loads(fields["consumers"])),
                tuple(json.loads(fields.get("length_columns", "[]"))),  # absent in docks made before it existed
                Rollout.from_json(fields.get("rollout", "{}")),  # likewise
                tuple(json.loads(fields.get("shards", "[]"))),  # likewise
                tuple(json.loads(fields.get("group_columns", "[]"))),  # likewise, and in docks without any
            )
        except (KeyError, ValueError, TypeError, SchemaError, RecursionError) as exc:
            raise DecodeError(f"{where}: malformed dock meta ({type(exc).__name__}: {str(exc)[:200]})") from None
        return schema

    def differences(self, other: Schema) -> list[str]:
        """Human-readable differences from ``other`` (the stored schema); empty if compatible.

        Columns and consumers compare as sets: their order carries no meaning. The shards are not
        compared: the stored ones hold the bytes, whatever the cluster's topology has become since.
        """
        out = []
        for field in ("prompts_num", "n_samples_per_prompt"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                out.append(f"{field}: stored {theirs}, requested {mine}")
        for field in ("columns", "consumers", "length_columns", "group_columns"):
            mine, theirs = set(getattr(self, field)), set(getattr(other, field))
            if mine != theirs:
                parts = []
                if theirs - mine:
                    parts.append(f"stored only {sorted(theirs - mine)}")
                if mine - theirs:
                    parts.append(f"requested only {sorted(mine - theirs)}")
                out.append(f"{field}: " + ", ".join(parts))
        if self.rollout != other.rollout:
            out.append(f"rollout: stored {other.rollout}, requested {self.rollout}")
        return out


    def grown(
        self, columns: Iterable[str] = (), consumers: Iterable[str] = (), group_columns: Iterable[str] = (),
    ) -> Schema:
        """This schema with ``columns`` and ``consumers`` added (those it has already are skipped), and
        ``group_columns`` among the columns added (or group columns already): a column holding per-row
        values cannot turn into a group column, its rows' bytes are stored per row."""
        def plus(names: tuple[str, ...], more: Iterable[str]) -> tuple[str, ...]:
            if isinstance(more, str) or not isinstance(more, (list, tuple)):
                raise SchemaError(f"expected a list of names, got {more!r}")
            return names + tuple(dict.fromkeys(m for m in more if m not in names))

        groups = plus(self.group_columns, group_columns)
        per_row = [c for c in groups if c in self.columns and c not in self.group_columns]
        if per_row:
            raise SchemaError(f"columns {per_row} hold per-row values already; only a new column can be a group column")
        return Schema(self.prompts_num, self.n_samples_per_prompt, plus(self.columns, columns),
                      plus(self.consumers, consumers), self.length_columns, self.rollout, self.shards, groups)

    def contains(self, other: Schema) -> bool:
        """Whether this schema is ``other`` grown: same size and length columns, a superset of the names."""
        return (
            (self.prompts_num, self.n_samples_per_prompt, self.length_columns, self.rollout, self.shards)
            == (other.prompts_num, other.n_samples_per_prompt, other.length_columns, other.rollout, other.shards)
            and set(other.columns) <= set(self.columns) and set(other.consumers) <= set(self.consumers)
            # a column the other holds per row stays per row (a grow adds only new columns as group columns)
            and set(other.group_columns) == set(self.group_columns) & set(other.columns)
        )


def fingerprint(meta: Mapping[str, str] | Mapping[bytes, bytes]) -> str:
    """The checked fields of a meta hash, as the scripts compare them: values joined by newlines."""
    text = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in meta.items()}
    return "\n".join(text.get(field, "<missing>") for field in CHECKED_FIELDS)
