"""Sampling latency: p50/p99 of one ``get_experience`` on docks of growing size, all 16 columns ready.

Each call asks, like a stage would, for ``read_columns`` of the columns and one whole group, with
the fifo and the random policy. Cells hold one int32 each, so the figure is the cost of choosing
and marking rows plus one small read, not of moving payload. The server's own time per sampling
script comes from ``INFO commandstats`` (differences, so a shared server's counters are left alone).

With ages in play (``ages_latency``): the same sizes and columns, on a partial-rollout dock whose groups
are spread over every age bucket. Sampling for anyone then goes oldest first through one bitmap per age
(see lua/sample.lua's tiers), so this is what partial rollout adds to the figure above, measured in the
same run for a ratio: a trainer taking one finished group, and the rollout consumer taking unfinished rows.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from broker import Rollout
from broker.api.checks import POLICIES as ALL_POLICIES
from broker.api.dock import TransferDock
from broker.bench.broker_dock import delete_dock
from broker.bench.docks import dock_target
from broker.bench.servers import command_stats
from broker.ops.clients import Client, connect, disconnect

#: The benchmark's dock has no length columns, so "seqlen" would be the random policy again.
POLICIES = tuple(p for p in ALL_POLICIES if p != "seqlen")

#: The dock with ages in play: MindSpeed's consumer names and a max_age of 4 (age bitmaps 0 .. 4).
ROLLOUT, TRAINER = "actor_rollout", "actor_train"
MAX_AGE = 4


def percentiles(seconds: list[float]) -> dict[str, float]:
    """p50, p99 and max in milliseconds."""
    a = np.asarray(seconds) * 1000.0
    return {"p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)), "max_ms": float(a.max())}


def _evalsha(client: Client) -> tuple[int, int]:
    """Calls and microseconds the server (every primary of a cluster) has charged to the broker's scripts so
    far: EVALSHA, or FCALL where they run as functions."""
    stats = command_stats(client, ["evalsha", "fcall"])
    return stats["evalsha"][0] + stats["fcall"][0], stats["evalsha"][1] + stats["fcall"][1]


def _server_time(before: tuple[int, int], after: tuple[int, int], gets: int) -> dict[str, float]:
    """Server time per script call (a get runs the sampling script, then the fence) and per get."""
    usec = after[1] - before[1]
    return {"server_script_us": usec / max(after[0] - before[0], 1), "server_us_per_get": usec / max(gets, 1)}


def _fill(dock: TransferDock, columns: list[str], chunk: int = 8192) -> None:
    for col in columns:
        for start in range(0, dock.capacity, chunk):
            stop = min(start + chunk, dock.capacity)
            dock.put_experience({col: torch.arange(start, stop, dtype=torch.int32).reshape(-1, 1)},
                                indexes=list(range(start, stop)))


def sampling_latency(url: str, name: str, sizes: tuple[int, ...] = (4096, 16384, 65536), n: int = 8,
                     columns: int = 16, read_columns: int = 4, calls: int = 300, ages: bool = True) -> dict[str, Any]:
    """Latency per dock size (rows) and policy, with the growth from the smallest to the largest size.

    With ``ages``, each size is measured again with ages in play right after (see ``ages_latency``;
    sizes too small for it are left out), with its ratio to the plain fifo figure of the same size.
    """
    cols = [f"c{i:02d}" for i in range(columns)]
    client, _ = connect(url)  # shared with the docks of the URL; handed back below
    out: dict[str, Any] = {"columns": columns, "read_columns": read_columns, "rows_per_call": n, "calls": calls,
                           "sizes": {}}
    try:
        for rows in sizes:
            dock = TransferDock(dock_target(url), f"{name}-{rows}", prompts_num=rows // n, n_samples_per_prompt=n,
                                columns=cols, consumers=list(POLICIES))
            try:
                dock.clear()
                t0 = time.perf_counter()
                _fill(dock, cols)
                fill = time.perf_counter() - t0
                per_size: dict[str, Any] = {"fill_seconds": fill}
                for policy in POLICIES:
                    times = []
                    dock.get_experience(policy, cols[:read_columns], n, policy=policy)  # warm: script load, connection
                    count = min(calls, rows // n - 1)
                    before = _evalsha(client)
                    for _ in range(count):
                        t0 = time.perf_counter()
                        _, got = dock.get_experience(policy, cols[:read_columns], n, policy=policy)
                        times.append(time.perf_counter() - t0)
                        if got is None:
                            raise RuntimeError(f"sampling from a full dock of {rows} rows returned nothing")
                    after = _evalsha(client)
                    per_size[policy] = {**percentiles(times), **_server_time(before, after, count)}
                out["sizes"][str(rows)] = per_size
            finally:
                delete_dock(dock)
            if ages:
                aged = ages_latency(url, f"{name}-ages-{rows}", rows, n=n, columns=columns,
                                    read_columns=read_columns, calls=calls)
                if aged is not None:
                    plain = out["sizes"][str(rows)]["fifo"]  # tiers make every pick oldest, i.e. lowest, first
                    for kind in ("trainer", "rollout"):
                        aged[f"{kind}_over_plain"] = {q: aged[kind][f"{q}_ms"] / plain[f"{q}_ms"]
                                                      for q in ("p50", "p99")}
                    out.setdefault("ages", {"max_age": MAX_AGE, "consumers": [TRAINER, ROLLOUT], "sizes": {}})
                    out["ages"]["sizes"][str(rows)] = aged
    finally:
        disconnect(url)
    small, large = out["sizes"][str(sizes[0])], out["sizes"][str(sizes[-1])]
    out["growth"] = {
        "rows_factor": sizes[-1] / sizes[0],
        **{f"{p}_p50_factor": large[p]["p50_ms"] / small[p]["p50_ms"] for p in POLICIES},
        **{f"{p}_script_factor": large[p]["server_script_us"] / max(small[p]["server_script_us"], 1e-9)
           for p in POLICIES},
    }
    return out



def _rows_of(groups: list[int] | range, n: int) -> list[int]:
    return [g * n + j for g in groups for j in range(n)]


def _cohorts(groups: int, max_age: int) -> list[list[int]] | None:
    """Groups 0 .. groups-2 cut into max_age + 1 consecutive cohorts, the first to be the oldest; the last
    group is kept for ageing. None if a cohort would hold fewer than 4 groups."""
    if groups - 1 < 4 * (max_age + 1):
        return None
    return [list(map(int, c)) for c in np.array_split(np.arange(groups - 1), max_age + 1)]


def _put_prompts(dock: TransferDock, columns: list[str], rows: list[int], chunk: int = 8192) -> None:
    for start in range(0, len(rows), chunk):
        part = rows[start : start + chunk]
        data = torch.tensor(part, dtype=torch.int32).reshape(-1, 1)
        dock.put_experience({c: data for c in columns}, indexes=part, is_prompt=True)


def _roll_out(dock: TransferDock, prompt: str, response: str, finished: set[int], chunk: int = 8192) -> list[int]:
    """The rollout consumer takes every unfinished row, then puts a response for each, finished as told."""
    _, handed = dock.get_experience(ROLLOUT, [prompt], dock.capacity, get_n_samples=False)
    handed = sorted(handed or [])
    for start in range(0, len(handed), chunk):
        part = handed[start : start + chunk]
        dock.put_experience({response: torch.tensor(part, dtype=torch.int32).reshape(-1, 1)}, indexes=part,
                            rollout_completed=[int(r in finished) for r in part])
    return handed


def _aged_dock(url: str, name: str, rows: int, n: int, cols: list[str], response: str,
               max_age: int) -> tuple[TransferDock, dict[str, Any]] | None:
    """A full partial-rollout dock with its groups spread over every age, in the middle of an iteration.

    The groups are put and rolled out in max_age + 1 cohorts, one per iteration, each iteration ended by
    ``clear(consumer=TRAINER)`` (which ages only when the trainer took something: it takes one spare
    group, finished for that purpose). Nothing is finished until the end ("kept unfinished", so the
    cohorts age); then the two oldest cohorts finish entirely, and in the younger ones half the groups
    finish and the other half have every other row finished. Last, the trainer takes the two oldest
    cohorts, as it would at the start of the iteration. So both consumers measured walk two age bitmaps
    with nothing left for them before they find rows in the third, as in a steady state where old groups
    are finished and waiting for the trainer while the rollout works on younger ones.
    None if the dock is too small for a cohort of at least 4 groups per age.
    """
    groups = rows // n
    cohorts = _cohorts(groups, max_age)
    if cohorts is None:
        return None
    spare = groups - 1
    cohorts[-1].append(spare)  # after the last clear the spare group is one of the youngest
    prompt_cols = [c for c in cols if c != response]
    rollout = Rollout(consumer=ROLLOUT, response_columns=(response,), max_age=max_age, gbs_train=groups)
    dock = TransferDock(dock_target(url), name, prompts_num=groups, n_samples_per_prompt=n, columns=cols,
                        consumers=[ROLLOUT, TRAINER], rollout=rollout)
    try:
        dock.clear()
        trainer_groups: list[int] = []
        unfinished_rows = 0
        pre_taken: list[int] = []
        for i, cohort in enumerate(cohorts):
            last = i == len(cohorts) - 1
            put = cohort if last else [*cohort, spare]
            _put_prompts(dock, prompt_cols, _rows_of(put, n))
            if not last:
                _roll_out(dock, cols[0], response, set(_rows_of([spare], n)))
                _, got = dock.get_experience(TRAINER, [cols[0]], n)  # the only finished group
                if got != _rows_of([spare], n):
                    raise RuntimeError(f"ageing the bench dock: the trainer got rows {got}, not the spare group")
                dock.clear(consumer=TRAINER)
                continue
            finished: set[int] = set()
            for c, members in enumerate(cohorts):
                age = max_age - c
                if age >= max_age - 1:
                    finished.update(_rows_of(members, n))
                    pre_taken += members
                    continue
                half = len(members) - len(members) // 2
                finished.update(_rows_of(members[:half], n))
                trainer_groups += members[:half]
                rest = _rows_of(members[half:], n)
                finished.update(rest[::2])
                unfinished_rows += len(rest[1::2])
            _roll_out(dock, cols[0], response, finished)
        _, got = dock.get_experience(TRAINER, [cols[0]], len(pre_taken) * n)
        if sorted(got or []) != sorted(_rows_of(pre_taken, n)):
            raise RuntimeError("the trainer's first take on the bench dock was not the two oldest cohorts")
        by_age = dock.status()["rollout"]["groups_by_age"]
        return dock, {"groups_by_age": {str(a): c for a, c in by_age.items()}, "trainer_groups": len(trainer_groups),
                      "unfinished_rows": unfinished_rows, "first_age_rows": set(_rows_of(cohorts[2], n))}
    except BaseException:
        delete_dock(dock)
        raise


def _timed(client: Client, call: Any, count: int, what: str, expect: set[int]) -> dict[str, float]:
    """p50/p99 and server time of ``count`` calls after a warm one, whose rows must lie in ``expect``."""
    warm = call()  # warm: script load, connection
    if not warm or not set(warm) <= expect:
        raise RuntimeError(f"{what} picked rows {warm}, not from the oldest age left for it")
    times = []
    before = _evalsha(client)
    for _ in range(count):
        t0 = time.perf_counter()
        got = call()
        times.append(time.perf_counter() - t0)
        if got is None:
            raise RuntimeError(f"{what} returned nothing")
    after = _evalsha(client)
    return {**percentiles(times), **_server_time(before, after, count), "calls": count}


def ages_latency(url: str, name: str, rows: int, n: int = 8, columns: int = 16, read_columns: int = 4,
                 calls: int = 300, max_age: int = MAX_AGE) -> dict[str, Any] | None:
    """Latency of sampling with ages in play at one dock size; None if the dock is too small for it.

    ``trainer``: one finished group, ``get_n_samples=True``, as the plain mode; ``rollout``: ``n``
    unfinished rows for the rollout consumer, ``get_n_samples=False``. Both read ``read_columns`` columns,
    the response column among them.
    """
    cols = [f"c{i:02d}" for i in range(columns)]
    response = cols[1]
    t0 = time.perf_counter()
    made = _aged_dock(url, name, rows, n, cols, response, max_age)
    if made is None:
        return None
    dock, state = made
    first = state.pop("first_age_rows")
    client, _ = connect(url)  # shared with the docks of the URL; handed back below
    try:
        out: dict[str, Any] = {"setup_seconds": time.perf_counter() - t0, **state}

        def trainer() -> list[int] | None:
            return dock.get_experience(TRAINER, cols[:read_columns], n)[1]

        def rollout() -> list[int] | None:
            return dock.get_experience(ROLLOUT, cols[:read_columns], n, get_n_samples=False)[1]

        out["trainer"] = _timed(client, trainer, min(calls, state["trainer_groups"] - 1),
                                f"a trainer's sample from a dock of {rows} rows with ages", first)
        out["rollout"] = _timed(client, rollout, min(calls, state["unfinished_rows"] // n - 1),
                                f"a rollout sample from a dock of {rows} rows with ages", first)
        return out
    finally:
        disconnect(url)
        delete_dock(dock)
