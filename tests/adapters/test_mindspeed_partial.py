"""MindSpeed's partial rollout through the drop-in: GRPOTransferDock(max_age > 1) and the queue's topics."""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch

from broker.adapters.mindspeed import GRPOTransferDock, TransferQueueClient
from broker.api.batches import put_prompts_experience
from broker.ops.watch import format_table

_names = itertools.count()
ROLLOUT = ["prompts", "prompt_length", "responses", "response_length", "age"]


def batch_of(first_id: int, count: int, n: int, another: bool = False):
    """A dataloader batch of ``count`` prompts holding their ids, as MindSpeed's trainer puts it."""
    prompts = [torch.tensor([first_id + i, 0]) for i in range(count)]
    return put_prompts_experience({"prompts": prompts}, n, [], add_another_batch=another)


def respond(td, rows, done):
    real = [r for r in rows if r >= 0]
    td.put_experience({
        "responses": [torch.tensor([9, 9])] * len(real), "response_length": [torch.tensor([2])] * len(real),
        "rollout_completed": [torch.tensor([int(d)]) for r, d in zip(rows, done) if r >= 0],
    }, real)


@pytest.fixture
def td(client):
    dock = GRPOTransferDock(4, 2, max_age=2, GBS_train=2, url=client, name=f"pr{next(_names)}")
    yield dock
    dock.dock.delete()


def test_an_iteration_as_mindspeeds_trainer_runs_it(td):
    data, idx = batch_of(0, 2, 2)
    td.put_experience(data, idx, is_prompt=True)
    data, idx = batch_of(10, 2, 2, another=True)
    assert idx == [4, 5, 6, 7]
    td.put_experience(data, idx, is_prompt=True)
    assert td.get_incomplete_response_num() == 8
    # Rollout: 3 rows of the 8 asked for... all 8 are there; ask 3 twice with dp_size 2.
    batch, rows = td.get_experience("actor_rollout", ROLLOUT, 3, dp_size=2, get_n_samples=False)
    assert rows == [0, 1, 2] and batch["age"].flatten().tolist() == [0, 0, 0]
    assert batch["responses"].tolist() == [[-1], [-1], [-1]]
    respond(td, rows, [1, 1, 0])
    batch, rows = td.get_experience("actor_rollout", ROLLOUT, 8, dp_size=2, get_n_samples=False)
    # Fewer than asked (row 2 came back unfinished, 5 rows never rolled): 6 rows, padded to 6 for dp 2.
    assert rows == [2, 3, 4, 5, 6, 7]
    respond(td, rows, [0, 0, 1, 1, 0, 0])
    assert td.find_all_consumed_n_samples_groups("actor_rollout")[0] == 2
    assert td.get_update_ready() and td.all_consumed("actor_rollout")
    batch, rows = td.get_experience("actor_rollout", ROLLOUT, 4, dp_size=4, get_n_samples=False)
    assert rows == [2, 3, 6, 7]
    respond(td, rows, [0, 0, 0, 0])
    # Training: finished groups only, oldest (here lowest) first, GBS_train groups at most.
    batch, rows = td.get_experience("actor_train", ["prompts", "responses"], 4)
    assert rows == [0, 1, 4, 5] and batch["prompts"][:, 0].tolist() == [0, 0, 10, 10]
    assert td.get_experience("actor_train", ["prompts"], 2) == (None, None)
    assert td.all_consumed("actor_train")
    td.clear()
    status = td.dock.status()
    assert status["rollout"]["groups_by_age"] == {0: 0, 1: 2, 2: 0}
    assert "groups by age 0:0 1:2 2+:0" in format_table(status)
    # The next batch names [4, 8) as MindSpeed's trainer does; it lands in the free groups 0 and 2.
    data, idx = batch_of(20, 2, 2, another=True)
    td.put_experience(data, idx, is_prompt=True)
    batch, rows = td.get_experience("actor_rollout", ROLLOUT, 8, get_n_samples=False)
    assert rows == [2, 3, 6, 7, 0, 1, 4, 5]  # kept groups first (age 1), then the new ones
    assert batch["age"].flatten().tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert batch["prompts"][:, 0].tolist() == [1, 1, 11, 11, 20, 20, 21, 21]
    assert batch["responses"][0].tolist() == [9, 9]  # continued from where it stopped


def test_the_rollout_pads_a_short_batch_for_its_dp_ranks(td):
    data, idx = batch_of(0, 1, 2)
    td.put_experience(data, idx, is_prompt=True)
    batch, rows = td.get_experience("actor_rollout", ROLLOUT, 4, dp_size=4, get_n_samples=False)
    assert rows == [0, 1, -2, -2] and batch["prompts"].shape[0] == 4
    respond(td, rows, [1, 1, 1, 1])  # the padding rows are skipped
    assert td.get_incomplete_response_num() == 0


def test_mindspeeds_errors(td, client):
    with pytest.raises(ValueError, match="get_n_samples not supported"):
        td.get_experience("actor_rollout", ROLLOUT, 2)
    data, idx = batch_of(0, 1, 2)
    td.put_experience(data, idx, is_prompt=True)
    with pytest.raises(ValueError, match="rollout_completed status must be provided"):
        td.put_experience({"responses": [torch.tensor([1])] * 2}, [0, 1])
    with pytest.raises(ValueError, match="not supported for partial rollout stop signal"):
        td.find_all_consumed_n_samples_groups("actor_train")
    plain = GRPOTransferDock(2, 1, url=client, name=f"pr{next(_names)}")
    with pytest.raises(ValueError, match="needs partial rollout"):
        plain.get_update_ready()
    with pytest.raises(ValueError, match="max_age=2, GBS_train=2"):
        GRPOTransferDock(4, 2, max_age=3, GBS_train=2, url=client, name=td.dock.name)
    td.sort_every_n_samples_by_age()  # nothing to move


def test_it_pickles_with_its_partial_rollout(url):
    td = GRPOTransferDock(4, 2, max_age=2, GBS_train=2, url=url, name=f"pr{next(_names)}")
    again = pickle.loads(pickle.dumps(td))
    assert (again.max_age, again.GBS_train, again.enable_partial_rollout) == (2, 2, True)
    assert again.dock.rollout == td.dock.rollout
    td.dock.delete()


def test_the_queue_flow_with_partial_ready_data(client):
    queue = TransferQueueClient(client)
    topic = f"prq{next(_names)}"
    columns = ["prompts", "prompt_length", "responses", "response_length"]
    queue.add_topic(4, 2, columns, ["actor_rollout", "actor_train"], topic=topic, max_age=2, GBS_train=1)
    rows_of_prompts = {"prompts": [torch.tensor([g, 0]) for g in (0, 0, 1, 1)],
                       "prompt_length": [torch.tensor([2])] * 4}
    dummies = {"responses": [torch.tensor([-1])] * 4, "response_length": [torch.tensor([0])] * 4}
    queue.put_experience({**rows_of_prompts, **dummies}, [0, 1, 2, 3], unpad=False, topic=topic,
                         data_status="partial_ready")
    assert queue.get_incomplete_response_num(topic) == 4
    batch, rows = queue.get_experience("actor_rollout", ["prompts", "responses"], 4, get_n_samples=False,
                                       topic=topic, allow_partial_ready_data=True)
    assert rows == [0, 1, 2, 3]
    queue.clear_data_status(["responses"], rows, topic)  # MindSpeed's strict adapter does this too
    queue.put_experience({"responses": [torch.tensor([5])] * 2}, [0, 1], unpad=False, topic=topic,
                         data_status="ready")
    queue.put_experience({"responses": [torch.tensor([5])] * 2}, [2, 3], unpad=False, topic=topic,
                         data_status="partial_ready")
    assert queue.get_partial_rollout_stop_signal(topic=topic)
    assert queue.get_experience("actor_train", ["prompts"], 2, topic=topic)[1] == [0, 1]
    queue.refine_topic_for_partial_rollout(topic)
    queue.increment_ages(topic)
    status = queue._dock(topic).status()
    assert status["rollout"]["groups_by_age"] == {0: 0, 1: 1, 2: 0}
    assert status["columns"]["prompts"]["ready"] == 2
    with pytest.raises(ValueError, match="data_status"):
        queue.put_experience({"prompts": [torch.ones(1)]}, [0], unpad=False, topic=topic, data_status="done")


def test_an_iteration_on_a_partitioned_dock(client):
    """MindSpeed's loop on two partitions: each holds its share (one group) of GBS_train=2 (see
    broker/api/partitioned_generation.py)."""
    td = GRPOTransferDock(4, 2, max_age=2, GBS_train=2, url=client, name=f"pr{next(_names)}", partitions=2)
    assert [p.rollout.gbs_train for p in td.dock.partitions] == [1, 1]
    for first, another in ((0, False), (10, True)):
        data, idx = batch_of(first, 2, 2, another=another)
        td.put_experience(data, idx, is_prompt=True)
    assert td.get_incomplete_response_num() == 8
    batch, rows = td.get_experience("actor_rollout", ROLLOUT, 8, dp_size=2, get_n_samples=False)
    assert sorted(rows) == list(range(8)) and batch["age"].flatten().tolist() == [0] * 8
    groups = sorted({r // 2 for r in rows})
    finished = {groups[0], groups[1]}  # groups 0 and 1: partitions 0 and 1 (blocks of one group)
    respond(td, rows, [r // 2 in finished for r in rows])
    assert td.get_update_ready()
    batch, trained = td.get_experience("actor_train", ["prompts", "responses"], 4)
    assert sorted(trained) == [0, 1, 2, 3] and batch["responses"].shape == (4, 2)
    assert td.get_experience("actor_train", ["prompts"], 2) == (None, None)  # GBS_train groups at most
    td.clear()
    assert td.dock.status()["rollout"]["groups_by_age"] == {0: 0, 1: 2, 2: 0}
    batch, rows = td.get_experience("actor_rollout", ROLLOUT, 8, get_n_samples=False)
    assert sorted(rows) == [4, 5, 6, 7] and batch["age"].flatten().tolist() == [1] * 4
    td.dock.delete()
