"""A large put cut into slices of whole groups, each written as a put of its own (see ``SlotStore.put``).

One MULTI holding a whole 0.3 GB batch keeps the server busy with it for the time of its EXEC (every
other client waits), and the server starts that work only once the last byte has arrived: the send and
the server's work follow each other instead of overlapping. Slices of at most ``SLICE_BYTES`` are each
one MULTI, sent back to back, so the server writes one slice while the next is on the wire.

A slice holds whole groups (rows ``[g*n, (g+1)*n)`` of the put): a reader sampling whole groups never
finds a group half written by one put. Each slice is a complete put of its rows: its own check (the
fence), marks, completion flags and request id, and with ``ack`` it ends the lease of its own rows:
a row is acked in the step that writes its result, and rows of a slice that did not land stay leased,
to be handed out again. What of a put in slices landed is said from each slice's ``Outcome`` (``said_landed``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TypeVar

from broker.control.keys import group_field
from broker.control.scripts import Finish, rows_of, runs_of
from broker.data.requests import PutRequest
from broker.data.store import few

V = TypeVar("V")

#: Bytes of row values above which a put on one slot is written in slices (see the module docstring).
#: 8 MiB: the server writes one in a few ms, a pause other clients barely see, and a put of 20-80 MB
#: already overlaps its send with the server's work (bench --large on Redis 7.0.15, against 32 MiB:
#: 64 rows 0.044 s against 0.069, 256 rows 0.140 against 0.197, 1024 rows 0.592 against 0.663); the
#: per-slice cost (three script calls) stays small beside 8 MiB of bytes.
SLICE_BYTES = 8 * 1024 * 1024
#: Bytes of the first slice at most (a group larger than that is the slice). It goes alone and the others only
#: once it landed (``SlotStore._put_sliced``: checked against the quota for the whole put, a refused put writes
#: nothing), so the rest of the put waits for its round trip: a small one lets the bytes flow sooner.
FIRST_SLICE_BYTES = 1024 * 1024


def row_bytes(put: PutRequest, n: int) -> list[int]:
    """Encoded bytes per row of ``put``, in ascending row order; a group column's field (data/groups.py)
    counts once, at the first row of its group in the put."""
    rows = rows_of(put.runs)
    fields = [str(r) for r in rows]
    sizes = [0] * len(rows)
    first_of_group: dict[int, int] | None = None
    for mapping in put.encoded.values():
        found = 0
        for i, value in enumerate(map(mapping.get, fields)):
            if value is not None:
                sizes[i] += len(value)
                found += 1
        if found == len(mapping):  # no group fields: a column of rows (a large put's every column, mostly)
            continue
        if first_of_group is None:
            first_of_group = {}
            for i, row in enumerate(rows):
                first_of_group.setdefault(row // n, i)
        for g, i in first_of_group.items():
            value = mapping.get(group_field(g))
            if value is not None:
                sizes[i] += len(value)
    return sizes


def slices(put: PutRequest, n: int, limit: int | None = None, first: int | None = None) -> list[PutRequest]:
    """``put`` cut into puts of whole groups of at most ``limit`` bytes each (default ``SLICE_BYTES``; a group
    larger than that is a slice of its own), the first of at most ``first`` (default ``FIRST_SLICE_BYTES``, at
    most ``limit``); ``[put]`` when it fits in one of ``limit``."""
    limit = SLICE_BYTES if limit is None else limit
    first = min(limit, FIRST_SLICE_BYTES if first is None else first)
    # Most puts are far below the limit: their total says so without the per-row sizes.
    if not _over(put, limit):
        return [put]
    sizes = row_bytes(put, n)
    rows = rows_of(put.runs)
    cuts = [0]  # positions in ``rows`` where a slice starts
    held = 0
    for i, row in enumerate(rows):
        new_group = i == 0 or row // n != rows[i - 1] // n
        if new_group and held and held + _group_bytes(rows, sizes, i, n) > (first if len(cuts) == 1 else limit):
            cuts.append(i)
            held = 0
        held += sizes[i]
    cuts.append(len(rows))
    if len(cuts) == 2:
        return [put]
    out = []
    for k in range(len(cuts) - 1):
        first, end = cuts[k], cuts[k + 1]
        out.append(_part(put, rows, first, end, n))
    return out


def _over(put: PutRequest, limit: int) -> bool:
    """Whether ``put``'s values hold more than ``limit`` bytes (counted until they do)."""
    total = 0
    for mapping in put.encoded.values():
        for value in mapping.values():
            total += len(value)
            if total > limit:
                return True
    return False


def _group_bytes(rows: list[int], sizes: list[int], i: int, n: int) -> int:
    """Bytes of the rows of ``rows[i]``'s group, from position ``i`` on."""
    group, total = rows[i] // n, 0
    while i < len(rows) and rows[i] // n == group:
        total += sizes[i]
        i += 1
    return total


def _part(put: PutRequest, rows: list[int], first: int, end: int, n: int) -> PutRequest:
    """The put of ``rows[first:end]`` alone (positions in ascending row order), with their groups' fields."""
    mine = rows[first:end]
    fields = [str(r) for r in mine] + [group_field(g) for g in sorted({r // n for r in mine})]
    finish = put.finish
    if finish is not None and finish.flags is not None:
        finish = Finish(finish.flags[first:end], finish.version)
    fence = put.fence
    if fence is not None:
        fence = dataclasses.replace(fence, generations=fence.generations[4 * first : 4 * end])
    return dataclasses.replace(
        put,
        encoded=_only(put.encoded, fields),
        tails=_only(put.tails, fields),
        runs=runs_of(rows[first:end]),
        lengths={c: values[first:end] for c, values in put.lengths.items()},
        finish=finish,
        fence=fence,
    )


def _only(per_column: dict[str, dict[str, V]], fields: list[str]) -> dict[str, dict[str, V]]:
    """Each column's values of ``fields`` (those it has)."""
    return {c: {f: mapping[f] for f in fields if f in mapping} for c, mapping in per_column.items()}


class Unknown:
    """The outcome of a slice not sent yet (``UNSENT``), or sent and whose reply has not come (``UNKNOWN``)."""


UNSENT, UNKNOWN = Unknown(), Unknown()

#: The outcome of one slice: its error, None if it landed, or not known (yet).
Outcome = BaseException | None | Unknown


def said_landed(parts: Sequence[PutRequest], outcomes: Sequence[Outcome], *, cut: bool) -> str:
    """What of a put in slices ``parts`` landed, by their ``outcomes``: the rows that did, whole, and (``cut``: the
    put was cut short) those whose slices' replies did not come."""
    landed = sorted(r for part, o in zip(parts, outcomes) if o is None for r in rows_of(part.runs))
    unknown = sorted(r for part, o in zip(parts, outcomes) if o is UNKNOWN for r in rows_of(part.runs))
    said = f"rows {few(landed)} of this put landed, whole, in its slices" if landed else "no slice of this put landed"
    if cut and unknown:
        said += f"; whether rows {few(unknown)} did is not known (their slices' replies did not come)"
    return said

