"""Writes fenced like reads: a worker whose delivery is no longer current cannot write its late result.

A delivery is the rows one ``get_experience`` handed out (``HandedRows``, ``LeasedRows``). A put of a
stage's results into them, or a drop of the groups a filter rejected, lands only while no clear or drop
took the rows since and, under a lease, while the lease is still that delivery's. Each scenario below
is the reviewer's: a slow (not dead) worker, its lease run out, the rows redone by another worker or
cleared and refilled by the driver with the next prompt, then the slow worker's late write.
"""

from __future__ import annotations

import time

import pytest
import torch

from broker import FencedError, HandedRows, InvalidExperienceError, LeasedRows, Rollout, TransferDock
from broker.control.scripts.functions import uses_functions
from tests.helpers import server_keys

#: "slot": the bytes in the dock's slot (a put is one MULTI); "sharded": over data shards (a put is two steps).
STORES = {"slot": 0, "sharded": 2}


@pytest.fixture(params=list(STORES))
def store(request) -> int:
    return STORES[request.param]


def stage_dock(make_dock, shards: int, **kwargs) -> TransferDock:
    return make_dock(prompts_num=2, n=2, columns=("prompts", "responses"), consumers=("rollout", "train"),
                     shards=shards, **kwargs)


def prompts(dock: TransferDock, ids: list[int], rows: list[int]) -> None:
    """The producer: prompt ``ids[i]`` into ``rows[i]``, named by a plain list (not fenced)."""
    dock.put_experience({"prompts": [torch.tensor([p]) for p in ids]}, list(rows))


def answers(prompt_ids: list[int], worker: int) -> list[torch.Tensor]:
    """A response names the prompt it answers and the worker that wrote it."""
    return [torch.tensor([p, worker]) for p in prompt_ids]


def pairs(dock: TransferDock, rows: list[int]) -> list[tuple[int, int]]:
    """(prompt, prompt the response answers) of each row: the pairing the trainer would learn from."""
    got = dock.read_rows(["prompts", "responses"], rows)
    return [(p.item(), None if r is None else r[0].item()) for p, r in zip(got["prompts"], got["responses"])]


def test_a_put_whose_lease_ran_out_and_went_to_another_worker_is_refused(make_dock, client, store):
    dock = stage_dock(make_dock, store, name="lease-moved")
    other = TransferDock.attach(client, "lease-moved")
    prompts(dock, [111, 111], [0, 1])
    batch, slow = dock.get_experience("rollout", ["prompts"], 2, lease=0.1)
    time.sleep(0.2)  # the slow worker's lease runs out...
    _, redo = other.get_experience("rollout", ["prompts"], 2, lease=30)  # ...and the rows go to another
    assert redo == slow
    with pytest.raises(FencedError, match="no longer leased to this delivery"):
        dock.put_experience({"responses": answers([111, 111], worker=1)}, slow)
    assert dock.status()["columns"]["responses"]["ready"] == 0  # nothing written, nothing marked
    other.put_experience({"responses": answers([111, 111], worker=2)}, redo)
    got = dock.read_rows(["responses"], [0, 1])["responses"]
    assert [t.tolist() for t in got] == [[111, 2], [111, 2]]
    assert dock.status()["consumers"]["rollout"]["leased"] == 0  # the put acked its rows


@pytest.mark.parametrize("lease", [None, 30.0])
@pytest.mark.parametrize("clear", ["whole", "rows"])
def test_a_late_put_after_the_driver_cleared_and_refilled_the_rows_is_refused(make_dock, store, lease, clear):
    """'prompt 222 is trained on the reward computed for prompt 111': never again, with or without a lease."""
    dock = stage_dock(make_dock, store)
    prompts(dock, [111, 111, 7, 7], [0, 1, 2, 3])
    batch, slow = dock.get_experience("rollout", ["prompts"], indexes=[0, 1], lease=lease)
    assert [t.item() for t in batch["prompts"]] == [111, 111]
    dock.clear() if clear == "whole" else dock.clear([0, 1])
    prompts(dock, [222, 222], [0, 1])  # the driver's next batch, in the same rows
    with pytest.raises(FencedError, match="cleared or dropped since this delivery handed them out"):
        dock.put_experience({"responses": answers([111, 111], worker=1)}, slow)
    assert pairs(dock, [0, 1]) == [(222, None), (222, None)]
    assert dock.get_experience("train", ["prompts", "responses"], 2) == (None, None)


def test_a_lease_past_its_deadline_that_nobody_took_is_still_its_holders(make_dock, store):
    """As for an ack: the deadline says when the rows may go to someone else, not that they have."""
    dock = stage_dock(make_dock, store)
    prompts(dock, [5, 5], [0, 1])
    _, rows = dock.get_experience("rollout", ["prompts"], 2, lease=0.05)
    time.sleep(0.1)
    dock.put_experience({"responses": answers([5, 5], worker=1)}, rows)
    assert dock.ack("rollout", rows) == 0  # the put acked them already
    assert pairs(dock, [0, 1]) == [(5, 5), (5, 5)]


def test_a_leased_put_acks_its_rows_and_a_redo_never_replaces_a_judged_result(make_dock, store):
    """What the pipeline soak found once writes were fenced: a put that lands on a lease past its deadline
    (nobody took it back yet) was acked only after it; another rollout worker sampling in between got the
    rows back, redid them and replaced the response the filter had already judged, so the trainer got a
    reward computed for a response no longer there. A worker killed between its put and its ack opened
    the same window for a whole lease. The put now acks its rows in the same step."""
    dock = make_dock(prompts_num=1, n=2, columns=("prompts", "responses", "rewards"),
                     consumers=("rollout", "filter", "train"), shards=store)
    prompts(dock, [111, 111], [0, 1])
    _, slow = dock.get_experience("rollout", ["prompts"], 2, lease=0.1)
    time.sleep(0.2)  # past the lease; nobody took the rows back
    dock.put_experience({"responses": answers([111, 111], worker=1)}, slow)  # lands, and acks
    batch, judged = dock.get_experience("filter", ["prompts", "responses"], 2, lease=30)
    dock.put_experience({"rewards": [t[1:2] for t in batch["responses"]]}, judged)
    assert dock.get_experience("rollout", ["prompts"], 2, lease=30) == (None, None)  # nothing to redo
    batch, _ = dock.get_experience("train", ["responses", "rewards"], 2)
    assert [(r.tolist(), w.item()) for r, w in zip(batch["responses"], batch["rewards"])] == [([111, 1], 1)] * 2
    assert dock.status()["consumers"]["rollout"] == {"consumed": 2, "leased": 0, "redelivered": 0, "dead": 0}


def test_ack_false_keeps_the_lease_for_a_result_written_in_several_puts(make_dock, store):
    dock = make_dock(prompts_num=1, n=2, columns=("prompts", "responses", "rewards"),
                     consumers=("rollout", "train"), shards=store)
    prompts(dock, [1, 1], [0, 1])
    _, rows = dock.get_experience("rollout", ["prompts"], 2, lease=30)
    dock.put_experience({"responses": answers([1, 1], worker=1)}, rows, ack=False)
    assert dock.status()["consumers"]["rollout"]["leased"] == 2
    dock.put_experience({"rewards": [torch.tensor([1.0])] * 2}, rows)  # the last one acks
    assert dock.status()["consumers"]["rollout"]["leased"] == 0
    with pytest.raises(FencedError):
        dock.put_experience({"rewards": [torch.tensor([2.0])] * 2}, rows)


def test_put_before_ack_a_put_after_it_is_refused(make_dock, store):
    dock = stage_dock(make_dock, store)
    prompts(dock, [5, 5], [0, 1])
    _, rows = dock.get_experience("rollout", ["prompts"], 2, lease=30)
    assert dock.ack("rollout", rows) == 2
    with pytest.raises(FencedError, match="no longer leased"):
        dock.put_experience({"responses": answers([5, 5], worker=1)}, rows)


def test_part_of_a_delivery_is_fenced_by_it_and_a_plain_list_is_not(make_dock, store):
    dock = stage_dock(make_dock, store)
    prompts(dock, [1, 1, 2, 2], [0, 1, 2, 3])
    _, rows = dock.get_experience("rollout", ["prompts"], 4, lease=30)
    assert isinstance(rows, LeasedRows) and isinstance(rows[2:], LeasedRows)  # a DP rank's chunk
    dock.put_experience({"responses": answers([1, 1], worker=1)}, rows[:2])
    dock.clear([2, 3])
    with pytest.raises(FencedError):
        dock.put_experience({"responses": answers([2, 2], worker=1)}, rows[2:])
    prompts(dock, [3, 3], rows[2:])  # the producer names plain rows: a new prompt, not a result
    assert pairs(dock, [0, 1, 2, 3]) == [(1, 1), (1, 1), (3, None), (3, None)]


def test_a_write_must_name_rows_of_its_delivery(make_dock, store):
    dock = stage_dock(make_dock, store)
    prompts(dock, [1, 1, 2, 2], [0, 1, 2, 3])
    _, rows = dock.get_experience("rollout", ["prompts"], 2, lease=30)
    with pytest.raises(InvalidExperienceError, match="rows 3 were not handed out in the delivery"):
        dock.put_experience({"responses": answers([1, 2], worker=1)}, [1, 3], delivery=rows)
    with pytest.raises(InvalidExperienceError, match="delivery must be the rows get_experience returned"):
        dock.put_experience({"responses": answers([1], worker=1)}, [1], delivery=[1])
    assert dock.status()["columns"]["responses"]["ready"] == 0


def test_a_delivery_survives_pickling_and_reordering(make_dock):
    import pickle

    dock = stage_dock(make_dock, 0)
    prompts(dock, [1, 1, 2, 2], [0, 1, 2, 3])
    _, rows = dock.get_experience("rollout", ["prompts"], 4, lease=30)
    copy = pickle.loads(pickle.dumps(rows))
    assert copy == rows and isinstance(copy, LeasedRows) and copy.token == rows.token
    _, unleased = dock.get_experience("train", ["prompts"], 4)
    assert type(pickle.loads(pickle.dumps(unleased))) is HandedRows
    dock.put_experience({"responses": answers([2, 2, 1, 1], worker=1)}, [3, 2, 1, 0], delivery=copy)
    assert pairs(dock, [0, 1, 2, 3]) == [(1, 1), (1, 1), (2, 2), (2, 2)]


def test_a_late_unfinished_partial_put_never_overwrites_a_finished_response(make_dock):
    """Partial rollout: A's late put of [1, 2] (unfinished) once replaced B's finished [1, 2, 3, 4, 99]
    and the row stayed finished."""
    rollout = Rollout(response_columns=("responses",), max_age=2, gbs_train=1)
    dock = make_dock(1, 2, ("prompts", "responses"), ("actor_rollout", "actor_train"), rollout=rollout)
    dock.put_experience({"prompts": [torch.tensor([1])] * 2}, [0, 1], is_prompt=True)
    _, slow = dock.get_experience("actor_rollout", ["prompts", "responses"], 2, get_n_samples=False, lease=0.1)
    time.sleep(0.2)
    _, fast = dock.get_experience("actor_rollout", ["prompts", "responses"], 2, get_n_samples=False, lease=30)
    assert fast == slow
    dock.put_experience({"responses": [torch.tensor([1, 2, 3, 4, 99])] * 2}, fast, rollout_completed=[1, 1])
    with pytest.raises(FencedError):
        dock.put_experience({"responses": [torch.tensor([1, 2])] * 2}, slow, rollout_completed=[0, 0])
    batch, rows = dock.get_experience("actor_train", ["responses"], 2)
    assert [t.tolist() for t in batch["responses"]] == [[1, 2, 3, 4, 99]] * 2
    assert dock.status()["rollout"]["finished_rows"] == 2


def test_a_sharded_put_holds_its_lease_while_its_bytes_travel(make_dock):
    """Between claim.lua and mark.lua the rows cannot go to another worker, whose put would write the
    same fields: the claim holds the lease for the put's time bound."""
    dock = stage_dock(make_dock, 2)
    prompts(dock, [1, 1], [0, 1])
    _, rows = dock.get_experience("rollout", ["prompts"], 2, lease=0.1)
    runs = [0, 2]
    from broker.api.delivery import fence_of

    dock._session.scripts.claim(runs, fence_of(rows, [0, 1]), 5_000)  # the put's first step...
    time.sleep(0.2)  # ...its bytes take longer than the lease had left
    assert dock.get_experience("rollout", ["prompts"], 2, lease=30) == (None, None)
    dock.put_experience({"responses": answers([1, 1], worker=1)}, rows)
    assert pairs(dock, [0, 1]) == [(1, 1), (1, 1)]


# -- drop_groups ------------------------------------------------------------------------------------


def test_a_late_filter_cannot_drop_a_group_the_driver_refilled(make_dock, client):
    dock = stage_dock(make_dock, 0, name="late-filter")
    prompts(dock, [111, 111, 7, 7], [0, 1, 2, 3])
    _, judged = dock.get_experience("rollout", ["prompts"], 2, lease=0.1)  # the filter's groups: group 0
    time.sleep(0.2)
    dock.clear([0, 1])
    prompts(dock, [222, 222], [0, 1])  # refilled before the filter decided: the new prompt was never judged
    with pytest.raises(FencedError):
        dock.drop_groups("rollout", [0], delivery=judged)
    assert pairs(dock, [0, 1]) == [(222, None), (222, None)]
    assert dock.status()["discarded"] == {}


def test_a_filter_whose_lease_went_to_another_worker_cannot_drop_the_group(make_dock, client):
    dock = stage_dock(make_dock, 0, name="moved-filter")
    other = TransferDock.attach(client, "moved-filter")
    prompts(dock, [1, 1], [0, 1])
    _, judged = dock.get_experience("rollout", ["prompts"], 2, lease=0.1)
    time.sleep(0.2)
    _, again = other.get_experience("rollout", ["prompts"], 2, lease=30)
    with pytest.raises(FencedError, match="no longer leased"):
        dock.drop_groups("rollout", [0], delivery=judged)
    assert other.drop_groups("rollout", [0], delivery=again) == 1
    assert dock.status()["discarded"] == {"rollout": 1}


def test_a_drop_must_name_groups_of_its_delivery(make_dock):
    dock = stage_dock(make_dock, 0)
    prompts(dock, [1, 1, 2, 2], [0, 1, 2, 3])
    _, rows = dock.get_experience("rollout", ["prompts"], 2, lease=30)
    with pytest.raises(InvalidExperienceError, match="not handed out in the delivery"):
        dock.drop_groups("rollout", [1], delivery=rows)
    with pytest.raises(InvalidExperienceError, match="leased to consumer 'rollout'"):
        dock.drop_groups("train", [0], delivery=rows)
    assert dock.drop_groups("rollout", [0], delivery=rows) == 1


def test_a_delivery_of_a_dock_deleted_and_made_again_does_not_land_on_the_new_one(make_dock, client, store):
    """Before: a dock made again under the same name started its epoch at 0 again, as the deleted one had,
    with its rows' generations: a late put of a delivery (without a lease) of the old dock matched them and
    landed on the new dock's prompts. Epochs now start at the server's time in microseconds."""
    dock = stage_dock(make_dock, store, name="again")
    prompts(dock, [111, 111], [0, 1])
    _, slow = dock.get_experience("rollout", ["prompts"], 2)
    epoch = slow.epoch
    dock.delete()
    dock = stage_dock(make_dock, store, name="again")
    prompts(dock, [222, 222], [0, 1])
    assert dock.get_experience("rollout", ["prompts"], 2)[1].epoch != epoch
    with pytest.raises(FencedError):
        dock.put_experience({"responses": answers([111, 111], worker=1)}, slow)
    assert pairs(dock, [0, 1]) == [(222, None), (222, None)]


def test_a_late_put_is_fenced_off_right_after_the_server_lost_its_scripts(make_dock, client, store):
    """A restart, a failover or SCRIPT FLUSH empties the script cache, and FUNCTION FLUSH (or a restart that
    kept no functions, a replica promoted without them) the function library that Redis 7 runs them from:
    the first put after it meets NOSCRIPT (or an unknown function) and is sent again. Its bytes must not land
    before the check ran (they would overwrite the next prompt's row). The bar is plain commands, so it
    holds whatever the server lost. Before, on Redis 7 the bar was a function too: lost with the library, the
    late put's bytes replaced the redo's ([222, 222] became [111, 111]) while the put raised FencedError."""
    dock = stage_dock(make_dock, store)
    prompts(dock, [111, 111], [0, 1])
    _, slow = dock.get_experience("rollout", ["prompts"], 2, lease=30)
    dock.put_experience({"responses": answers([7, 7], worker=9)}, [0, 1])  # rows that hold bytes
    dock.clear()
    prompts(dock, [222, 222], [0, 1])
    dock.put_experience({"responses": answers([222, 222], worker=2)}, [0, 1])
    client.script_flush()
    if uses_functions(client):
        client.function_flush()
    with pytest.raises(FencedError):
        dock.put_experience({"responses": answers([111, 111], worker=1)}, slow)
    assert pairs(dock, [0, 1]) == [(222, 222), (222, 222)]
    assert not server_keys(client, "*aside*")
