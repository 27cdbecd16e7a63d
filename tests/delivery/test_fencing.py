"""Reads fenced against clears: a clear landing between handing rows out and reading their bytes.

Handing rows out is a script, reading their bytes an HMGET: two round trips. ``after_script`` runs a
clear (and a refill) exactly there, deterministically, on every backend; the stress test at the end
does the same with real processes and no help.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch

from broker import ExperienceTimeoutError, FencedError, InvalidExperienceError, TransferDock
from broker.control.scripts.base import ScriptsBase
from tests.helpers import worker_processes


@contextlib.contextmanager
def after_script(name: str, action: Callable[[], None], times: int = 1) -> Iterator[list[int]]:
    """Run ``action`` right after the next ``times`` runs of Lua script ``name`` (e.g. "sample"), by either
    path (a function of the loaded library, or EVALSHA)."""
    original = ScriptsBase._call
    fired: list[int] = []

    def call(self, script, keys, args):
        reply = original(self, script, keys, args)
        if script == name and len(fired) < times:
            fired.append(1)
            action()
        return reply

    ScriptsBase._call = call
    try:
        yield fired
    finally:
        ScriptsBase._call = original


def batch_rows(batch_id: int, rows: list[int]) -> list[torch.Tensor]:
    """Row r of batch b holds [b, r]: a read names the batch and row its bytes came from."""
    return [torch.tensor([batch_id, r]) for r in rows]


def put_batch(dock: TransferDock, batch_id: int, rows: list[int] | None = None) -> None:
    rows = list(range(dock.capacity)) if rows is None else rows
    dock.put_experience({"prompts": batch_rows(batch_id, rows)}, indexes=rows)


def origins(batch: dict, rows: list[int]) -> list[tuple[int, int]]:
    """(batch, row) of every row read, checking each row's bytes are its own."""
    out = []
    for row, value in zip(rows, batch["prompts"]):
        assert value[1].item() == row, f"row {row} holds the bytes of row {value[1].item()}"
        out.append((value[0].item(), row))
    return out


def drain(dock: TransferDock, consumer: str, count: int, **kwargs) -> list[tuple[int, int]]:
    got = []
    while True:
        batch, rows = dock.get_experience(consumer, ["prompts"], count, **kwargs)
        if rows is None:
            return got
        got += origins(batch, rows)


def test_clear_and_refill_between_sampling_and_reading_hands_out_no_row_twice(make_dock):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",))
    put_batch(dock, 0)

    def next_batch() -> None:
        dock.clear()
        put_batch(dock, 1)

    with after_script("sample", next_batch) as fired:
        got = drain(dock, "actor_train", 2)
    assert fired
    # The first call's rows were cleared before it read them: it sampled again, from batch 1.
    assert sorted(got) == [(1, r) for r in range(4)]
    assert dock.all_consumed("actor_train")


def test_clear_of_some_rows_between_sampling_and_reading_gives_the_others_back(make_dock):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",))
    put_batch(dock, 0)

    def refill_group_1() -> None:
        dock.clear(indexes=[2, 3])
        put_batch(dock, 1, rows=[2, 3])

    with after_script("sample", refill_group_1):
        batch, rows = dock.get_experience("actor_train", ["prompts"], 4)
    assert rows == [0, 1, 2, 3]
    assert origins(batch, rows) == [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert dock.get_experience("actor_train", ["prompts"], 2) == (None, None)
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 4


def test_clear_between_sampling_and_reading_is_no_data_not_missing_data(make_dock):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",))
    put_batch(dock, 0)
    with after_script("sample", dock.clear):
        assert dock.get_experience("actor_train", ["prompts"], 2) == (None, None)
    put_batch(dock, 1)
    assert sorted(drain(dock, "actor_train", 2)) == [(1, r) for r in range(4)]


def test_clear_between_sampling_and_reading_releases_the_lease_of_the_rows_given_back(make_dock):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",))
    put_batch(dock, 0)

    def refill_group_0() -> None:
        dock.clear(indexes=[0, 1])
        put_batch(dock, 1, rows=[0, 1])

    with after_script("sample", refill_group_0):
        batch, rows = dock.get_experience("actor_train", ["prompts"], 2, lease=30)
    assert origins(batch, rows) == [(1, 0), (1, 1)]
    assert dock.status()["consumers"]["actor_train"] == {"consumed": 2, "leased": 2, "redelivered": 0, "dead": 0}
    assert dock.ack("actor_train", rows) == 2
    assert drain(dock, "actor_train", 2) == [(0, 2), (0, 3)]
    assert dock.all_consumed("actor_train")


def test_clear_and_refill_between_taking_explicit_rows_and_reading_them(make_dock):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",))
    put_batch(dock, 0)

    def next_batch() -> None:
        dock.clear()
        put_batch(dock, 1)

    with after_script("take", next_batch):
        batch, rows = dock.get_experience("actor_train", ["prompts"], indexes=[1, 0])
    assert origins(batch, rows) == [(1, 1), (1, 0)]
    # The rows are marked for batch 1, which is what the caller got: sampling does not repeat them.
    assert drain(dock, "actor_train", 1, get_n_samples=False) == [(1, 2), (1, 3)]


def test_clear_between_taking_explicit_rows_and_reading_them_names_the_rows_gone(make_dock):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",))
    put_batch(dock, 0)
    with after_script("take", lambda: dock.clear(indexes=[3])):
        with pytest.raises(ExperienceTimeoutError) as info:
            dock.get_experience("actor_train", ["prompts"], indexes=[2, 3])
    assert info.value.missing == {"prompts": [3]}
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 1  # row 2, marked by the take


def test_a_rewrite_between_sampling_and_reading_is_read_not_refused(make_dock):
    """Writing a row again is not a clear: the reader gets the row's newest bytes, handed out once."""
    dock = make_dock(prompts_num=1, n=2, columns=("prompts",))
    put_batch(dock, 0)
    with after_script("sample", lambda: put_batch(dock, 5)):
        batch, rows = dock.get_experience("actor_train", ["prompts"], 2)
    assert origins(batch, rows) == [(5, 0), (5, 1)]
    assert dock.get_experience("actor_train", ["prompts"], 2) == (None, None)


@pytest.mark.one_partition("its error names the partition's rows first (the dock's after them: test_partitions.py)")
@pytest.mark.parametrize("stack", [False, True])
def test_read_rows_naming_a_delivery_refuses_rows_a_clear_took_since(make_dock, stack):
    """``read_rows(..., delivery=rows)`` reads what the delivery handed out, or raises FencedError once a clear
    took any of its rows: their bytes may be another batch's by then (what the TransferQueue adapter's
    kv_batch_get reads keys with)."""
    dock = make_dock(prompts_num=3, n=2, columns=("prompts",))
    put_batch(dock, 0)
    _, rows = dock.get_experience("actor_train", ["prompts"], 4)
    again = dock.read_rows(["prompts"], rows[::-1], stack=stack, delivery=rows)  # any order, any part of it
    assert [v.tolist() for v in again["prompts"]] == [[0, r] for r in rows[::-1]]
    dock.clear([rows[1]])
    put_batch(dock, 1, [rows[1]])  # the row refilled: its bytes are another batch's
    with pytest.raises(FencedError, match=rf"rows \[{rows[1]}\] were cleared"):
        dock.read_rows(["prompts"], rows, stack=stack, delivery=rows)
    kept = dock.read_rows(["prompts"], [rows[0]], stack=stack, delivery=rows)  # a row no clear took
    assert kept["prompts"][0].tolist() == [0, rows[0]]
    with pytest.raises(InvalidExperienceError, match="not handed out in the delivery"):
        dock.read_rows(["prompts"], [rows[0], next(r for r in range(6) if r not in rows)], delivery=rows)


@pytest.mark.one_partition("it calls one dock's release script")
def test_a_resent_release_gives_back_nothing_another_worker_took_meanwhile(make_dock, client):
    """A release whose reply is lost runs again (redis-py resends it): it must not give back twice."""
    dock = make_dock(prompts_num=4, n=2, columns=("prompts",), name="resend")
    other = TransferDock.attach(client, "resend")
    put_batch(dock, 0)
    taken_by_other: list[int] = []

    with after_script("sample", lambda: dock.clear(indexes=[2, 3])):
        inner = ScriptsBase._call

        def call(self, script, keys, args):
            reply = inner(self, script, keys, args)
            if script == "release" and not taken_by_other:
                # The release ran; its reply is lost. Before the resend, another worker takes the rows.
                taken_by_other.extend(other.get_experience("actor_train", ["prompts"], 2)[1])
                reply = inner(self, script, keys, args)
            return reply

        ScriptsBase._call = call
        try:
            batch, rows = dock.get_experience("actor_train", ["prompts"], 4)
        finally:
            ScriptsBase._call = inner
    assert taken_by_other == [0, 1]  # given back by the release, then taken by the other worker
    assert rows == [4, 5, 6, 7]
    # Every row written was handed out exactly once: nothing left, nothing given back twice.
    assert dock.get_experience("actor_train", ["prompts"], 2) == (None, None)
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 6


# -- the same race with real processes ------------------------------------------------------------

ROUNDS_SECONDS = 4.0
#: Put-and-clear rounds the driver makes at least, however long they take: a loaded machine made only 93
#: in ROUNDS_SECONDS once, and the test then failed on its own check that the race ran.
MIN_ROUNDS = 101


def _consumer(url: str, name: str, out: mp.Queue, stop: mp.Event, ready: mp.Queue) -> None:
    torch.set_num_threads(1)
    dock = TransferDock.attach(url, name)
    ready.put(True)
    seen: list[tuple[int, int]] = []
    errors: list[str] = []
    while not stop.is_set():
        try:
            batch, rows = dock.get_experience("reader", ["prompts"], 2, timeout=0.05)
        except Exception as exc:  # reported, so the test shows what escaped
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        if rows is not None:
            seen += [(int(v[0]), int(v[1])) if int(v[1]) == r else (-1, r) for r, v in zip(rows, batch["prompts"])]
    out.put((seen, errors[:5], len(errors)))


@pytest.mark.real
@pytest.mark.slow
def test_put_clear_loop_against_consumer_processes_never_repeats_or_mixes_rows(dock_url):
    """A driver puts batch b, clears, puts b + 1, ... while 4 processes read: each (batch, row) at most once.

    On a cluster the dock's bytes are on data shards: the put is two steps, which a clear may split."""
    dock = TransferDock(dock_url, "race", prompts_num=4, n_samples_per_prompt=2, columns=["prompts"],
                        consumers=["reader"])
    ctx = worker_processes()
    out, stop, ready = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_consumer, args=(dock_url, "race", out, stop, ready)) for _ in range(4)]
    for p in procs:
        p.start()
    batches = 0
    try:
        for _ in procs:  # a loaded machine starts them late: the race runs only once all of them read
            ready.get(timeout=120)
        end = time.monotonic() + ROUNDS_SECONDS
        while time.monotonic() < end or batches < MIN_ROUNDS:
            put_batch(dock, batches)
            batches += 1
            time.sleep(0.002)
            dock.clear()
    finally:
        stop.set()
        results = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
    seen = Counter(pair for got, _, _ in results for pair in got)
    errors = [e for _, sample, _ in results for e in sample]
    assert not errors, errors
    assert all(b >= 0 for b, _ in seen), "a row held another row's bytes"
    repeats = {pair: k for pair, k in seen.items() if k > 1}
    assert not repeats, f"{len(repeats)} (batch, row) pairs handed out more than once, e.g. {list(repeats)[:5]}"
    assert batches >= MIN_ROUNDS and len(seen) > 100  # the race really ran


@pytest.fixture(params=[1, 3], ids=["whole", "partitioned"])
def partitions(request) -> int:
    """Every dock test of this file also on a dock of three partitions (see tests/conftest.py)."""
    return request.param
