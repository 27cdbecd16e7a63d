"""Leases: rows handed out with a deadline come back to the consumer unless acked in time."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from broker import FencedError, InvalidExperienceError, LeasedRows, TransferDock, UnknownConsumerError
from tests.helpers import fill, held_rows, worker_processes


def test_leased_rows_stay_out_until_acked(make_dock):
    dock = make_dock(prompts_num=2, n=2)
    fill(dock, columns=["prompts"])
    _, rows = dock.get_experience("actor_train", ["prompts"], 4, lease=30)
    assert rows == [0, 1, 2, 3]
    assert dock.status()["consumers"]["actor_train"] == {"consumed": 4, "leased": 4, "redelivered": 0, "dead": 0}
    assert not dock.all_consumed("actor_train")  # a lease is still out: a worker may yet die
    assert dock.ack("actor_train", [0, 1], token=rows.token) == 2
    assert not dock.all_consumed("actor_train")
    assert dock.ack("actor_train", rows) == 2  # acking twice is harmless
    assert dock.status()["consumers"]["actor_train"] == {"consumed": 4, "leased": 0, "redelivered": 0, "dead": 0}
    assert dock.all_consumed("actor_train")


@pytest.mark.one_partition("global FIFO order")
def test_expired_lease_is_offered_again_to_the_same_consumer_only(make_dock):
    dock = make_dock(prompts_num=3, n=2)
    fill(dock, columns=["prompts"])
    _, first = dock.get_experience("actor_train", ["prompts"], 2, lease=0.2)
    _, second = dock.get_experience("actor_train", ["prompts"], 2, lease=30)
    assert (first, second) == ([0, 1], [2, 3])
    dock.get_experience("actor_rollout", ["prompts"], 6)
    time.sleep(0.3)
    # The expired group is given back first (FIFO), the one under a live lease is not.
    _, again = dock.get_experience("actor_train", ["prompts"], 2)
    assert again == [0, 1]
    assert dock.get_experience("actor_train", ["prompts"], 4) == (None, None)
    status = dock.status()["consumers"]
    assert status["actor_train"] == {"consumed": 4, "leased": 2, "redelivered": 2, "dead": 0}
    assert status["actor_rollout"] == {"consumed": 6, "leased": 0, "redelivered": 0, "dead": 0}


def test_expired_single_rows_come_back_without_freeing_a_group_still_out(make_dock):
    dock = make_dock(prompts_num=2, n=2)
    fill(dock, columns=["prompts"])
    dock.get_experience("actor_train", ["prompts"], 1, get_n_samples=False)  # row 0, for good
    dock.get_experience("actor_train", ["prompts"], 1, get_n_samples=False, lease=0.1)  # row 1
    time.sleep(0.2)
    # Row 1 is free again, but group 0 still has row 0 out, so no whole group is offered.
    assert dock.get_experience("actor_train", ["prompts"], 4) == (None, None)
    assert dock.get_experience("actor_train", ["prompts"], 1, get_n_samples=False)[1] == [1]


def test_late_ack_after_the_rows_were_given_back_changes_nothing(make_dock):
    dock = make_dock(prompts_num=2, n=2)
    fill(dock, columns=["prompts"])
    _, late = dock.get_experience("actor_train", ["prompts"], 2, lease=0.1)  # rows 0, 1
    time.sleep(0.2)
    # Another call gives the expired rows back (and finds too few for its own request)...
    assert dock.get_experience("actor_train", ["prompts", "responses"], 2) == (None, None)
    assert dock.status()["consumers"]["actor_train"] == {"consumed": 0, "leased": 0, "redelivered": 2, "dead": 0}
    # ...then the slow worker's ack arrives: too late, the rows are out for redoing (at-least-once).
    assert dock.ack("actor_train", late) == 0
    assert dock.get_experience("actor_train", ["prompts"], 2)[1] == [0, 1]


def test_late_ack_does_not_release_the_lease_of_the_worker_now_holding_the_rows(make_dock):
    dock = make_dock(prompts_num=1, n=2)
    fill(dock, columns=["prompts"])
    _, slow = dock.get_experience("actor_train", ["prompts"], 2, lease=0.1)  # worker A stalls
    time.sleep(0.2)
    _, fresh = dock.get_experience("actor_train", ["prompts"], 2, lease=0.5)  # the rows go to worker B
    assert fresh == slow == [0, 1] and fresh.token != slow.token
    assert dock.ack("actor_train", slow) == 0  # A's ack names A's lease, which is over
    assert dock.status()["consumers"]["actor_train"] == {"consumed": 2, "leased": 2, "redelivered": 2, "dead": 0}
    assert not dock.all_consumed("actor_train")
    time.sleep(0.6)  # B dies without acking: its rows must come back
    _, third = dock.get_experience("actor_train", ["prompts"], 2, lease=30)
    assert third == [0, 1]
    assert dock.ack("actor_train", third) == 2
    assert dock.all_consumed("actor_train")


def test_stale_ack_from_before_a_clear_does_not_hide_new_rows(make_dock):
    dock = make_dock(prompts_num=2, n=1)
    fill(dock, columns=["prompts"])
    _, old = dock.get_experience("actor_train", ["prompts"], 1, lease=60)  # row 0
    dock.clear()
    fill(dock, columns=["prompts"])
    assert dock.ack("actor_train", old) == 0  # the ack of the previous batch
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 0
    assert dock.get_experience("actor_train", ["prompts"], 2)[1] == [0, 1]


def test_stale_ack_from_before_a_clear_does_not_release_the_next_batch_lease(make_dock):
    dock = make_dock(prompts_num=1, n=2)
    fill(dock, columns=["prompts"])
    _, old = dock.get_experience("actor_train", ["prompts"], 2, lease=60)
    dock.clear()
    fill(dock, columns=["prompts"])
    _, new = dock.get_experience("actor_train", ["prompts"], 2, lease=60)  # the same row numbers
    assert new == old == [0, 1]
    assert dock.ack("actor_train", old) == 0
    assert dock.status()["consumers"]["actor_train"]["leased"] == 2
    assert not dock.all_consumed("actor_train")  # the new rows are still out with their holder
    assert dock.ack("actor_train", new) == 2
    assert dock.all_consumed("actor_train")


def test_ack_needs_the_lease_it_releases(make_dock):
    dock = make_dock(prompts_num=1, n=2)
    fill(dock, columns=["prompts"])
    _, rows = dock.get_experience("actor_train", ["prompts"], 2, lease=30)
    with pytest.raises(InvalidExperienceError, match="lease token"):
        dock.ack("actor_train", [0, 1])  # a plain list cannot say whose lease it releases
    with pytest.raises(InvalidExperienceError, match="actor_train.*actor_rollout"):
        dock.ack("actor_rollout", rows)  # a lease of another consumer
    assert dock.ack("actor_train", [1], token=rows.token) == 1  # part of a lease, naming its token
    assert dock.ack("actor_train", rows) == 1  # the rest; row 1 again is harmless
    assert dock.ack("actor_train", rows) == 0
    assert dock.all_consumed("actor_train")
    _, unleased = dock.get_experience("actor_rollout", ["prompts"], 2)
    assert not isinstance(unleased, LeasedRows)  # rows taken for good carry no lease
    with pytest.raises(InvalidExperienceError, match="lease token"):
        dock.ack("actor_rollout", unleased)


def test_half_acked_groups_come_back_without_their_acked_rows(make_dock):
    dock = make_dock(prompts_num=2, n=2)
    fill(dock, columns=["prompts"])
    _, rows = dock.get_experience("actor_train", ["prompts"], 4, lease=0.1)  # groups 0 and 1
    dock.ack("actor_train", [0, 2], token=rows.token)  # half of each group done, then the worker dies
    time.sleep(0.2)
    _, again = dock.get_experience("actor_train", ["prompts"], 4, lease=30)
    assert again == [1, 3]  # still two groups, each without its acked row: that result is final
    assert dock.status()["consumers"]["actor_train"] == {"consumed": 4, "leased": 2, "redelivered": 2, "dead": 0}
    dock.ack("actor_train", again)
    assert dock.all_consumed("actor_train")
    assert dock.get_experience("actor_train", ["prompts"], 2) == (None, None)


def _expired(lease: float, since: float) -> None:
    """Sleep until a lease of ``lease`` seconds taken at ``since`` (time.monotonic) ran out."""
    time.sleep(max(0.0, since + lease + 0.05 - time.monotonic()))


def _values(dock: TransferDock, column: str, rows: list[int]) -> list[list[int]]:
    return [v.tolist() for v in dock.read_rows([column], rows)[column]]


def test_acked_results_of_a_group_stay_when_the_worker_holding_the_rest_dies(make_dock):
    """A stage that judges rows one by one puts (and so acks) part of a leased group, then dies: the group
    comes back with only its unacked rows, so the results already put are never redone nor overwritten."""
    dock = make_dock(prompts_num=2, n=4, columns=("prompts", "responses"))
    fill(dock, columns=["prompts"])
    since = time.monotonic()
    _, rows = dock.get_experience("actor_rollout", ["prompts"], 4, lease=0.5)
    assert rows == [0, 1, 2, 3]
    dock.put_experience({"responses": [torch.tensor([100 + r]) for r in rows[:2]]}, rows[:2])  # fenced, acks
    assert dock.status()["consumers"]["actor_rollout"]["leased"] == 2
    _expired(0.5, since)  # the worker dies holding rows 2 and 3

    _, redo = dock.get_experience("actor_rollout", ["prompts"], 8, lease=30)  # group 0's rest, and group 1
    assert redo == [2, 3, 4, 5, 6, 7]
    assert dock.status()["consumers"]["actor_rollout"] == {"consumed": 8, "leased": 6, "redelivered": 2, "dead": 0}
    assert _values(dock, "responses", [0, 1]) == [[100], [101]]  # the acked results, untouched
    dock.put_experience({"responses": [torch.tensor([200 + r]) for r in redo[:2]]}, redo[:2])  # the redo lands
    assert not dock.all_consumed("actor_rollout")  # group 1 is still out
    dock.put_experience({"responses": [torch.tensor([200 + r]) for r in redo[2:]]}, redo[2:])
    assert dock.all_consumed("actor_rollout")
    assert _values(dock, "responses", list(range(8))) == [[100], [101], [202], [203], [204], [205], [206], [207]]
    assert dock.get_experience("actor_rollout", ["prompts"], 4) == (None, None)  # nothing is handed out twice
    assert dock.get_experience("actor_rollout", ["prompts"], 1, get_n_samples=False) == (None, None)
    assert dock.status()["consumers"]["actor_rollout"] == {"consumed": 8, "leased": 0, "redelivered": 2, "dead": 0}


def test_clear_after_a_partial_ack_and_a_reclaim_starts_the_consumer_afresh(make_dock):
    dock = make_dock(prompts_num=2, n=4, columns=("prompts", "responses"))
    fill(dock, columns=["prompts"])
    _, rows = dock.get_experience("actor_rollout", ["prompts"], 8, lease=300)
    dock.put_experience({"responses": [torch.tensor([1])] * 3}, rows[1:4])  # acks rows 1..3 of group 0
    assert dock.reclaim("actor_rollout", all_leases=True) == 0  # the driver restarted the workers
    assert dock.status()["consumers"]["actor_rollout"] == {"consumed": 3, "leased": 0, "redelivered": 5, "dead": 0}

    # A clear of the acked rows: once written again, group 0 is whole and goes out whole.
    dock.clear(indexes=[1, 2, 3])
    fill(dock, columns=["prompts"], rows=[1, 2, 3])
    _, again = dock.get_experience("actor_rollout", ["prompts"], 8, lease=300)
    assert again == list(range(8))
    dock.put_experience({"responses": [torch.tensor([2])] * 2}, again[4:6])  # part of group 1, then a crash
    assert dock.reclaim("actor_rollout", all_leases=True) == 0
    assert dock.get_experience("actor_rollout", ["prompts"], 8, lease=300)[1] == [0, 1, 2, 3, 6, 7]
    assert dock.reclaim("actor_rollout", all_leases=True) == 0

    # A whole clear: nothing of the consumer is left, the remnant mark included; the next batch is whole.
    dock.clear()
    assert dock.status()["consumers"]["actor_rollout"] == {"consumed": 0, "leased": 0, "redelivered": 0, "dead": 0}
    assert not dock.client.exists(dock.keys.group_remnant("actor_rollout"))
    fill(dock, columns=["prompts"])
    _, fresh = dock.get_experience("actor_rollout", ["prompts"], 8, lease=300)
    assert fresh == list(range(8))
    assert dock.ack("actor_rollout", fresh) == 8
    assert dock.all_consumed("actor_rollout")


def test_reset_consumer_after_a_partial_ack_offers_every_row_again(make_dock):
    dock = make_dock(prompts_num=1, n=4)
    fill(dock, columns=["prompts"])
    _, rows = dock.get_experience("actor_train", ["prompts"], 4, lease=300)
    dock.ack("actor_train", rows[:1])
    dock.reclaim("actor_train", all_leases=True)
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 1  # the acked row stays handed out
    assert dock.reset_consumer("actor_train") == 1
    assert not dock.client.exists(dock.keys.group_remnant("actor_train"))
    assert dock.get_experience("actor_train", ["prompts"], 4)[1] == [0, 1, 2, 3]


def test_expired_explicit_rows_are_reclaimed_without_any_sampling_call(make_dock):
    dock = make_dock(prompts_num=1, n=2)
    fill(dock, columns=["prompts"])
    dock.get_experience("actor_train", ["prompts"], indexes=[0, 1], lease=0.1)  # its worker dies
    time.sleep(0.2)
    # A guarantee-order worker loop never samples: all_consumed itself gives the rows back.
    assert not dock.all_consumed("actor_train")
    assert dock.status()["consumers"]["actor_train"] == {"consumed": 0, "leased": 0, "redelivered": 2, "dead": 0}
    _, rows = dock.get_experience("actor_train", ["prompts"], indexes=[0, 1], lease=30)
    dock.ack("actor_train", rows)
    assert dock.all_consumed("actor_train")


@pytest.mark.one_partition("global FIFO order")
def test_reclaiming_all_leases_gives_back_live_ones_at_once_and_fences_their_holder(make_dock):
    """A driver that restarted a consumer's whole worker group gives back its rows without waiting out the
    leases; the old holder, if it was alive after all, acks nothing and writes nothing."""
    dock = make_dock(prompts_num=3, n=2, columns=("prompts", "responses"))
    fill(dock, columns=["prompts"])
    _, dead = dock.get_experience("actor_rollout", ["prompts"], 4, lease=300)
    _, acked = dock.get_experience("actor_rollout", ["prompts"], 2, lease=300)
    dock.ack("actor_rollout", acked)
    assert dock.reclaim("actor_rollout") == 4  # nothing expired yet
    assert dock.reclaim("actor_rollout", all_leases=True) == 0
    assert dock.status()["consumers"]["actor_rollout"] == {"consumed": 2, "leased": 0, "redelivered": 4, "dead": 0}
    assert dock.ack("actor_rollout", dead) == 0
    with pytest.raises(FencedError):
        dock.put_experience({"responses": [torch.tensor([1])] * 4}, list(dead), delivery=dead)
    _, again = dock.get_experience("actor_rollout", ["prompts"], 4, lease=300)
    assert sorted(again) == [0, 1, 2, 3]


def test_retaking_explicit_rows_moves_their_lease_to_the_new_call(make_dock):
    dock = make_dock(prompts_num=1, n=2)
    fill(dock, columns=["prompts"])
    _, first = dock.get_experience("actor_train", ["prompts"], indexes=[0, 1], lease=30)
    _, second = dock.get_experience("actor_train", ["prompts"], indexes=[1], lease=30)
    assert dock.ack("actor_train", first) == 1  # row 0 only: row 1 is now the second call's
    assert dock.ack("actor_train", second) == 1
    dock.get_experience("actor_train", ["prompts"], indexes=[0], lease=30)
    dock.get_experience("actor_train", ["prompts"], indexes=[0])  # taken again for good: no lease left
    assert dock.status()["consumers"]["actor_train"]["leased"] == 0


def test_explicit_rows_can_be_leased(make_dock):
    dock = make_dock(prompts_num=2, n=2)
    fill(dock, columns=["prompts"])
    _, rows = dock.get_experience("actor_train", ["prompts"], indexes=[3, 1], lease=30)
    assert dock.status()["consumers"]["actor_train"]["leased"] == 2
    dock.ack("actor_train", rows)
    assert dock.status()["consumers"]["actor_train"]["leased"] == 0


def test_clear_drops_leases(make_dock):
    dock = make_dock(prompts_num=2, n=2)
    fill(dock, columns=["prompts"])
    dock.get_experience("actor_train", ["prompts"], 4, lease=30)
    dock.clear(indexes=[0, 1])
    assert dock.status()["consumers"]["actor_train"]["leased"] == 2
    dock.clear()
    assert dock.status()["consumers"]["actor_train"] == {"consumed": 0, "leased": 0, "redelivered": 0, "dead": 0}


@pytest.mark.parametrize("lease", [0, -1, "5", 10**9])
def test_bad_lease_is_refused(make_dock, lease):
    dock = make_dock()
    fill(dock)
    with pytest.raises(InvalidExperienceError, match="lease"):
        dock.get_experience("actor_train", ["prompts"], 2, lease=lease)
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 0


def test_bad_ack_is_refused(make_dock):
    dock = make_dock()
    with pytest.raises(UnknownConsumerError):
        dock.ack("nobody", [0])
    with pytest.raises(IndexError):
        dock.ack("actor_train", [99], token="x")


# -- a worker killed while holding rows ---------------------------------------------------------

PROMPTS, N, BATCH = 16, 4, 8


def _stage_worker(dock: TransferDock, victim: bool, holding: mp.Event, log: mp.Queue) -> None:
    """A pipeline stage: square the prompt, write the result, ack. The victim freezes holding rows."""
    while not dock.all_consumed("stage"):
        batch, rows = dock.get_experience("stage", ["prompts"], BATCH, lease=1.0, timeout=0.5)
        if rows is None:
            continue
        if victim:
            # Only an Event, no queue: a process killed while a queue's feeder holds its lock would
            # leave that queue locked for every other process.
            holding.set()
            time.sleep(3600)  # killed here, rows in hand
        results = [p * p for p in batch["prompts"]]
        dock.put_experience({"results": results}, indexes=rows)
        dock.ack("stage", rows)
        log.put(("done", os.getpid(), rows))


@pytest.mark.real
def test_killed_worker_rows_are_redelivered_and_every_row_gets_one_result(dock_url):
    dock = TransferDock(dock_url, "fault", prompts_num=PROMPTS, n_samples_per_prompt=N,
                        columns=["prompts", "results"], consumers=["stage"])
    capacity = PROMPTS * N
    dock.put_experience({"prompts": torch.arange(capacity).reshape(capacity, 1)}, indexes=list(range(capacity)))
    ctx = worker_processes()
    holding, log = ctx.Event(), ctx.Queue()
    victim_log = ctx.Queue()  # its own, kept referenced until the victim has started
    victim = ctx.Process(target=_stage_worker, args=(dock, True, holding, victim_log))
    victim.start()
    assert holding.wait(120), f"the victim never took rows (exit code {victim.exitcode})"
    held = sorted(int(r) for r in dock.client.zrange("td:{fault}:leases:stage", 0, -1))
    assert len(held) == BATCH
    os.kill(victim.pid, signal.SIGKILL)
    victim.join(10)
    workers = [ctx.Process(target=_stage_worker, args=(dock, False, holding, log)) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        for w in workers:
            w.join(300)
            assert w.exitcode == 0, dock.status()["consumers"]
    finally:
        for w in workers:
            w.kill()
    done = []
    while not log.empty():
        kind, _, rows = log.get()
        done += rows
    assert set(done) == set(range(capacity))  # every row processed, the victim's included
    assert set(held) <= set(done)
    status = dock.status()
    assert status["columns"]["results"]["ready"] == capacity
    assert status["consumers"]["stage"] == {"consumed": capacity, "leased": 0, "redelivered": len(held), "dead": 0}
    batch, _ = dock.get_experience("stage", ["prompts", "results"], indexes=list(range(capacity)))
    assert all(torch.equal(r, p * p) for p, r in zip(batch["prompts"], batch["results"]))
    # One result per row: the results hash (or hashes, on data shards) has exactly one field per row.
    assert held_rows(dock, "results") == capacity
    dock.delete()


@pytest.fixture(params=[1, 3], ids=["whole", "partitioned"])
def partitions(request) -> int:
    """Every dock test of this file also on a dock of three partitions (see tests/conftest.py)."""
    return request.param
