"""Group columns: one value per group of n rows, stored once and served to each of the group's rows.

A dock's rows are grouped by prompt (group g = rows ``[g*n, (g+1)*n)``). A column declared in
``group_columns`` (the prompt's tokens, an image, a long system prompt) holds one value per group: in one
slot (``SlotStore``) the column's data hash has one field per group, ``group_field(g)`` (``g7``), beside
no row fields. Callers still give and get one value per row:

- a put gives a value for each of its rows (``[img] * n`` costs nothing); the rows of one group in one
  put must hold equal values (``fold``), and the group's field is (re)written from them. A put of some
  rows of a group also gives its value to lua/put.lua, which refuses it unless it equals what the group's
  other ready rows read (a late put from part of a group must not change what they read: they may hold the
  next prompt, or be another worker's); a put of the whole group may change it;
- a read asks for each group's field once (``read_fields``) and hands every row its group's bytes
  (``expand``), which decoding turns into one tensor per row, each its own memory;
- ready, consumed and leases stay per row; a forget deletes a group's field once no row of the group
  is ready in that column (lua/include/forget.lua says why no ready row ever lacks its bytes).

On data shards (``ShardedStore``) a group column is stored per row like any other column: its fields
carry the rows' generations, which a put and a clear of different rows of one group would contend on.
Puts still check that a group's rows hold equal values there, so a dock means the same on either store.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from broker.connection import Framed
from broker.control.keys import group_field
from broker.control.scripts import rows_of
from broker.data.requests import PutRequest
from broker.errors import InvalidExperienceError


def fold(column: str, rows: Sequence[int], n: int, encoded: Sequence[bytes | Framed]) -> dict[str, bytes | Framed]:
    """The group fields of a put: per group of ``rows``, its one value, from ``encoded`` (one per row, in
    the order of ``rows``). InvalidExperienceError naming the column, group and rows if the rows of a group
    differ (the caller has sent nothing yet). Equal objects are found cheaply: the same ``bytes`` object
    (a value given n times is encoded once, see ``api/puts.py``) compares by identity first."""
    out: dict[str, bytes | Framed] = {}
    first: dict[int, int] = {}  # group -> position of its first row in ``rows``
    for i, (row, value) in enumerate(zip(rows, encoded)):
        g = row // n
        at = first.setdefault(g, i)
        if at == i:
            out[group_field(g)] = value
            continue
        if value is not encoded[at] and value != encoded[at]:
            mine = sorted(rows[j] for j in range(len(rows)) if rows[j] // n == g)
            raise InvalidExperienceError(
                f"column {column!r} is a group column (one value per group of {n} rows), but the rows of group {g} "
                f"given differ: row {rows[at]} and row {row} (rows of that group in this put: {mine}); nothing "
                "was written"
            )
    return out


def per_row(rows: Sequence[int], n: int, folded: dict[str, bytes | Framed]) -> dict[str, bytes | Framed]:
    """Row fields (the row in decimal) holding their group's value: a group column on data shards."""
    return {str(row): folded[group_field(row // n)] for row in rows}


def read_fields(rows: Sequence[int], n: int) -> tuple[list[str], list[int]]:
    """The group fields to read for ``rows``, each once, and for each row the position of its group's field."""
    fields: list[str] = []
    at: dict[int, int] = {}
    positions = []
    for row in rows:
        g = row // n
        if g not in at:
            at[g] = len(fields)
            fields.append(group_field(g))
        positions.append(at[g])
    return fields, positions


def expand(values: Sequence[bytes | None], positions: Sequence[int]) -> list[bytes | None]:
    """Each row's value from its group's (``read_fields``): decoding makes a separate tensor of each."""
    return [values[i] for i in positions]


def partial_values(put: PutRequest, group_columns: frozenset[str], n: int) -> list[tuple[int, int, bytes | Framed]]:
    """For each group of which ``put`` (on one slot) writes some rows only, in each group column it writes: the
    column's position, the group and its value, which lua/put.lua compares with what the group's other rows read."""
    if not group_columns.intersection(put.encoded):
        return []
    count = collections.Counter(row // n for row in rows_of(put.runs))
    partial = sorted(g for g, k in count.items() if k < n)
    return [(i, g, mapping[group_field(g)]) for i, (col, mapping) in enumerate(put.encoded.items())
            if col in group_columns for g in partial]
