"""Partial rollout on the native dock: placeholders, oldest first, completion flags, group gating,
the GBS_train cap, iteration clears that age groups, the stop signal, and leases through all of it."""

from __future__ import annotations

import time

import pytest
import torch

from broker import BrokerError, InvalidExperienceError, Rollout, SchemaError
from broker.errors import RowIndexError

COLUMNS = ("prompts", "prompt_length", "responses", "response_length", "rewards")
CONSUMERS = ("actor_rollout", "reward", "actor_train")
ROLLOUT_COLUMNS = ["prompts", "responses", "age"]
#: Why a test holds for a dock of one partition only (on a partitioned dock: test_partitioned_rollout.py).
WHOLE_ORDER = "oldest or lowest first over the whole dock (a partitioned dock's is per partition)"


def partial(make_dock, prompts_num=4, n=2, max_age=3, gbs_train=2, name=None, **kwargs):
    rollout = Rollout(response_columns=("responses", "response_length"), max_age=max_age, gbs_train=gbs_train,
                      **kwargs)
    return make_dock(prompts_num, n, COLUMNS, CONSUMERS, length_columns=["prompt_length", "response_length"],
                     rollout=rollout, name=name)


def prompts(dock, groups):
    """Put one prompt per group (its number, repeated per row) with is_prompt=True."""
    n = dock.n_samples_per_prompt
    rows = [g * n + j for g in groups for j in range(n)]
    dock.put_experience({"prompts": [torch.tensor([r // n]) for r in rows],
                         "prompt_length": [torch.tensor([1])] * len(rows)}, rows, is_prompt=True)
    return rows


def respond(dock, rows, done, tokens=(7,)):
    """The rollout's put: a response per row, finished where ``done`` says."""
    dock.put_experience({"responses": [torch.tensor(list(tokens))] * len(rows),
                         "response_length": [torch.tensor([len(tokens)])] * len(rows)},
                        rows, rollout_completed=[int(d) for d in done])


def test_prompts_get_placeholders_and_the_rollout_may_get_fewer_rows(make_dock):
    dock = partial(make_dock)
    prompts(dock, [0, 1])
    assert dock.get_incomplete_response_num() == 4
    batch, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 8, get_n_samples=False)
    assert sorted(rows) == [0, 1, 2, 3]  # fewer than asked: rollout takes what is there (of every partition)
    assert [t.tolist() for t in batch["responses"]] == [[-1]] * 4
    assert [t.tolist() for t in batch["age"]] == [[0]] * 4
    # Handed to the rollout, the responses are no longer ready for anyone.
    assert dock.status()["columns"]["responses"]["ready"] == 0
    assert dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 2, get_n_samples=False) == (None, None)


@pytest.mark.one_partition(WHOLE_ORDER)
def test_unfinished_rows_come_back_with_their_partial_response_and_finished_groups_open(make_dock):
    dock = partial(make_dock)
    prompts(dock, [0, 1])
    _, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 4, get_n_samples=False)
    respond(dock, rows, [1, 1, 1, 0], tokens=(5, 6))
    status = dock.status()["rollout"]
    assert (status["finished_rows"], status["finished_groups"], status["unfinished_rows"]) == (3, 1, 1)
    # Only the finished group is visible to the other consumers.
    batch, got = dock.get_experience("reward", ["prompts", "responses"], 2)
    assert got == [0, 1] and [t.tolist() for t in batch["responses"]] == [[5, 6], [5, 6]]
    assert dock.get_experience("reward", ["prompts", "responses"], 2) == (None, None)
    # The unfinished row is the rollout's again, with what it generated so far.
    batch, again = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 4, get_n_samples=False)
    assert again == [3] and batch["responses"][0].tolist() == [5, 6]
    respond(dock, again, [1])
    assert dock.get_experience("reward", ["prompts", "responses"], 2)[1] == [2, 3]


def test_a_response_put_must_say_whether_it_is_finished(make_dock):
    dock = partial(make_dock)
    prompts(dock, [0])
    with pytest.raises(InvalidExperienceError, match="rollout_completed"):
        dock.put_experience({"responses": [torch.tensor([1])] * 2}, [0, 1])
    with pytest.raises(InvalidExperienceError, match="one flag per row"):
        dock.put_experience({"responses": [torch.tensor([1])] * 2}, [0, 1], rollout_completed=[1])
    with pytest.raises(InvalidExperienceError, match="0 or 1"):
        dock.put_experience({"responses": [torch.tensor([1])] * 2}, [0, 1], rollout_completed=[1, 2])
    with pytest.raises(InvalidExperienceError, match="get_n_samples not supported"):
        dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 2)
    plain = make_dock(name=None)
    with pytest.raises(InvalidExperienceError, match="no partial rollout"):
        plain.put_experience({"responses": [torch.tensor([1])]}, [0], rollout_completed=[1])
    assert dock.status()["columns"]["responses"]["ready"] == 2  # the placeholders, untouched


def test_settings_are_checked_and_stored_with_the_schema(make_dock):
    with pytest.raises(SchemaError, match="GBS for update"):
        partial(make_dock, gbs_train=0)
    with pytest.raises(SchemaError, match="not columns"):
        make_dock(4, 2, COLUMNS, CONSUMERS, rollout=Rollout(response_columns=("nope",), max_age=2, gbs_train=1))
    with pytest.raises(SchemaError, match="not a consumer"):
        make_dock(4, 2, COLUMNS, ("reward",), rollout=Rollout(response_columns=("responses",), max_age=2,
                                                              gbs_train=1))
    dock = partial(make_dock, name="same")
    with pytest.raises(SchemaError, match="rollout"):
        partial(make_dock, name="same", max_age=4)
    assert partial(make_dock, name="same").rollout == dock.rollout


@pytest.mark.one_partition(WHOLE_ORDER)
def test_other_consumers_take_at_most_gbs_train_groups_oldest_first(make_dock):
    dock = partial(make_dock, prompts_num=4, gbs_train=2)
    prompts(dock, [0, 1, 2, 3])
    _, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 8, get_n_samples=False)
    respond(dock, rows, [1, 1, 0, 0, 1, 1, 1, 1])  # groups 0, 2, 3 finish
    assert dock.get_update_ready() and dock.all_consumed("actor_rollout")
    assert dock.get_experience("actor_train", ["prompts"], 2)[1] == [0, 1]
    assert dock.get_experience("actor_train", ["prompts"], 2)[1] == [4, 5]
    assert dock.get_experience("actor_train", ["prompts"], 2) == (None, None)  # the cap: GBS_train groups
    assert dock.all_consumed("actor_train")
    dock.clear(consumer="actor_train")
    status = dock.status()["rollout"]
    # Groups 1 (unfinished) and 3 (finished, not trained) are kept and one iteration older.
    assert status["groups_by_age"] == {0: 0, 1: 2, 2: 0, 3: 0}
    assert status["finished_groups"] == 1
    # The next iteration: a new prompt in a freed group is younger than the kept ones.
    assert dock.reserve_groups(2, "prompts") == [0, 2]
    prompts(dock, [0, 2])
    batch, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 3, get_n_samples=False)
    assert rows == [2, 3, 0]  # group 1's unfinished rows first (age 1), then the lowest new row
    assert [t.item() for t in batch["age"]] == [1, 1, 0]
    # The trainer takes the old finished group 3 before a new one.
    respond(dock, rows + [1], [1, 1, 1, 1])
    assert dock.get_experience("actor_train", ["prompts"], 2)[1] == [2, 3]
    assert dock.get_experience("actor_train", ["prompts"], 2)[1] == [6, 7]


def test_the_stop_signal_waits_for_the_oldest_groups(make_dock):
    dock = partial(make_dock, prompts_num=4, gbs_train=1, max_age=2)
    prompts(dock, [0, 1])
    _, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 4, get_n_samples=False)
    respond(dock, rows, [1, 1, 0, 0])
    dock.get_experience("actor_train", ["prompts"], 2)
    dock.clear(consumer="actor_train")  # group 1 is now of age 1 = max_age - 1, unfinished
    prompts(dock, [2])
    _, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 2, get_n_samples=False)
    assert rows == [2, 3]  # the old group first
    _, new_rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 2, get_n_samples=False)
    respond(dock, new_rows, [1, 1])  # a new group finishes: enough groups, but not the oldest
    assert dock.get_update_ready(require_max_age_all_finished=False)
    assert not dock.get_update_ready()
    respond(dock, rows, [1, 1])
    assert dock.get_update_ready()


def test_the_first_clear_ages_nothing_and_a_whole_clear_resets_everything(make_dock):
    dock = partial(make_dock)
    prompts(dock, [0, 1])
    _, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 4, get_n_samples=False)
    respond(dock, rows, [0, 0, 0, 0])
    dock.clear(consumer="actor_train")  # nothing trained yet
    assert dock.status()["rollout"]["groups_by_age"] == {0: 2, 1: 0, 2: 0, 3: 0}
    for _ in range(5):  # no trained rows, no ageing; then force ageing with a trained group
        dock.clear(consumer="actor_train")
    dock.clear()
    status = dock.status()
    assert status["rollout"] == {"finished_rows": 0, "finished_groups": 0, "unfinished_rows": 0,
                                 "groups_by_age": {0: 0, 1: 0, 2: 0, 3: 0}, "groups_waiting": {1: 0, 2: 0, 3: 0}}
    assert dock.reserve_groups(4, "prompts") == [0, 1, 2, 3]


def test_groups_older_than_max_age_stay_in_the_oldest_bucket(make_dock):
    dock = partial(make_dock, prompts_num=3, gbs_train=1, max_age=2)
    prompts(dock, [0, 1, 2])
    _, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 6, get_n_samples=False)
    respond(dock, rows, [1, 1, 0, 0, 0, 0])  # only group 0 finishes; 1 and 2 never do
    for expected in ({0: 0, 1: 2, 2: 0}, {0: 0, 1: 0, 2: 2}, {0: 0, 1: 0, 2: 2}):
        assert dock.get_experience("actor_train", ["prompts"], 2)[1] == [0, 1]
        dock.clear(consumer="actor_train")
        assert dock.status()["rollout"]["groups_by_age"] == expected
        prompts(dock, dock.reserve_groups(1, "prompts"))  # group 0 again, new
        _, fresh = dock.get_experience("actor_rollout", ["prompts"], 6, get_n_samples=False)
        assert fresh == [2, 3, 4, 5, 0, 1]  # the old groups first
        respond(dock, fresh, [0, 0, 0, 0, 1, 1])


@pytest.mark.one_partition(WHOLE_ORDER)
def test_reserve_groups_never_hands_a_group_twice(make_dock):
    dock = partial(make_dock, prompts_num=8)
    got = [dock.reserve_groups(3, "prompts"), dock.reserve_groups(3, "prompts")]
    assert got == [[0, 1, 2], [3, 4, 5]]
    assert dock.reserve_groups(3, "prompts") is None  # two left: nothing is claimed
    assert dock.reserve_groups(2, "prompts") == [6, 7]
    with pytest.raises(InvalidExperienceError):
        dock.reserve_groups(0, "prompts")


@pytest.mark.one_partition("it calls a dock's scripts")
def test_a_reservation_is_given_back_only_while_nothing_forgot_its_groups(make_dock):
    """What reserve_groups gives back when its replicas fall short (lua/unreserve.lua): its own claims, not a
    claim another writer made after a clear freed the groups."""
    dock = partial(make_dock, prompts_num=4)
    scripts = dock._session.scripts
    mine = scripts.reserve(2, "prompts")
    assert mine is not None and mine.groups == (0, 1)
    assert scripts.unreserve(mine) == 2
    assert dock.reserve_groups(1, "prompts") == [0]  # free again
    dock.clear()
    first = scripts.reserve(1, "prompts")
    assert first is not None and first.groups == (0,)
    dock.clear()  # forgets group 0: its claim is gone, and another writer claims it
    assert dock.reserve_groups(1, "prompts") == [0]
    assert scripts.unreserve(first) == 0  # not the other writer's claim
    assert dock.reserve_groups(1, "prompts") == [1]
    prompts(dock, [1])
    _, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 2, get_n_samples=False)
    respond(dock, rows, [1, 1])
    second = scripts.reserve(1, "prompts")
    assert second is not None and second.groups == (2,)
    dock.drop_groups("actor_train", [2])  # a drop of the claimed group forgets it too
    assert dock.reserve_groups(1, "prompts") == [2]
    assert scripts.unreserve(second) == 0


def test_a_rollout_worker_killed_mid_generation_loses_nothing(make_dock):
    dock = partial(make_dock)
    prompts(dock, [0, 1])
    _, first = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 4, get_n_samples=False, lease=30)
    respond(dock, first, [int(r < 2) for r in first], tokens=(3, 4))  # partial responses of group 1
    _, dying = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 2, get_n_samples=False, lease=0.2)
    assert sorted(dying) == [2, 3]  # ... and this worker dies before it puts anything
    assert dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 2, get_n_samples=False) == (None, None)
    time.sleep(0.3)
    batch, back = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 2, get_n_samples=False, lease=30)
    assert sorted(back) == [2, 3] and [t.tolist() for t in batch["responses"]] == [[3, 4], [3, 4]]
    respond(dock, back, [1, 1])
    assert dock.ack("actor_rollout", back) == 0  # the put ended the lease: nothing left to release
    assert dock.ack("actor_rollout", first) == 0
    status = dock.status()
    assert status["consumers"]["actor_rollout"]["leased"] == 0
    assert status["consumers"]["actor_rollout"]["redelivered"] == 2
    assert status["rollout"]["finished_groups"] == 2


def test_iteration_clear_keeps_what_other_consumers_did(make_dock):
    dock = partial(make_dock, prompts_num=4, gbs_train=1)
    prompts(dock, [0, 1])
    _, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 4, get_n_samples=False)
    respond(dock, rows, [1, 1, 1, 1])
    assert dock.get_experience("reward", ["prompts"], 2)[1] == [0, 1]
    assert dock.get_experience("reward", ["prompts"], 2) == (None, None)  # the cap, for every consumer
    dock.get_experience("actor_train", ["prompts"], 2)
    dock.clear(consumer="actor_train")
    status = dock.status()
    assert status["consumers"]["reward"]["consumed"] == 0  # group 0 was trained and forgotten
    assert dock.get_experience("reward", ["prompts"], 2)[1] == [2, 3]  # group 1 kept, now the reward's
    assert status["columns"]["prompts"]["ready"] == 2


def test_explicit_indexes_are_refused_to_the_rollout_consumer(make_dock):
    dock = partial(make_dock)
    prompts(dock, [0])
    with pytest.raises(InvalidExperienceError, match="explicit indexes"):
        dock.get_experience("actor_rollout", ["prompts"], indexes=[0, 1], get_n_samples=False)
    with pytest.raises(RowIndexError):
        dock.drop_groups("reward", [4])


@pytest.mark.one_partition(WHOLE_ORDER)
def test_stages_in_parallel_hold_the_same_groups_when_an_old_group_finishes_late(make_dock):
    dock = partial(make_dock, prompts_num=4, gbs_train=2)
    prompts(dock, [0, 1, 2, 3])
    _, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 8, get_n_samples=False)
    respond(dock, rows, [1, 1, 1, 1, 0, 0, 0, 0])  # groups 0 and 1 finish, 2 and 3 wait for later
    dock.get_experience("actor_train", ["prompts"], 4)
    dock.clear(consumer="actor_train")  # groups 2 and 3 are now of age 1
    prompts(dock, dock.reserve_groups(2, "prompts"))  # new prompts in groups 0 and 1
    _, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 8, get_n_samples=False)
    assert rows == [4, 5, 6, 7, 0, 1, 2, 3]
    respond(dock, rows, [0, 0, 0, 0, 1, 1, 1, 1])  # the new groups finish first
    assert dock.get_experience("reward", ["prompts"], 4)[1] == [0, 1, 2, 3]  # the iteration's batch
    respond(dock, *dock.get_experience("actor_rollout", ["prompts"], 2, get_n_samples=False)[1:], [1, 1])
    # The old group 2 has finished now; the trainer still takes the groups the reward stage took.
    assert dock.get_experience("actor_train", ["prompts"], 4)[1] == [0, 1, 2, 3]
    assert dock.get_experience("actor_train", ["prompts"], 2) == (None, None)
    dock.clear(consumer="actor_train")
    # Next iteration: a new batch, oldest first.
    assert dock.get_experience("reward", ["prompts"], 2)[1] == [4, 5]


@pytest.mark.one_partition("it writes a dock's raw keys")
def test_generation_keys_holding_garbage_raise_broker_errors(make_dock):
    dock = partial(make_dock)
    dock.client.hset(dock.keys.group_finished, "x", 1)  # not a bitmap
    with pytest.raises(BrokerError):
        dock.get_update_ready()
    dock.client.delete(dock.keys.group_finished)
    dock.client.hset(dock.keys.finished, "x", 1)
    with pytest.raises(BrokerError):
        dock.get_incomplete_response_num()
    dock.client.set(dock.keys.version, "seven")
    with pytest.raises(BrokerError, match="not an integer"):
        dock.version()


@pytest.fixture(params=[1, 2], ids=["whole", "partitioned"])
def partitions(request) -> int:
    """Every test of this file also on a dock of two partitions (see tests/conftest.py), whose batch
    (gbs_train=2) is a share of one group each."""
    return request.param
