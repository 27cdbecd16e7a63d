"""Partial rollout and the staleness bound on a partitioned dock: what is per partition (broker/api/
partitioned_generation.py). The shared contract runs in test_partial_rollout.py and test_staleness.py, which
take ``partitions``; here: the batch cut into shares, the stop signal, reservations in proportion, the rollout
consumer over partitions, and staleness against each partition's own version."""

from __future__ import annotations

import pytest
import torch

from broker import BrokerError, Rollout, SchemaError, TransferDock
from broker.api.partition_map import PartitionMap
from broker.api.partitioned_generation import shares

COLUMNS = ["prompts", "prompt_length", "responses", "response_length"]
CONSUMERS = ["actor_rollout", "reward", "actor_train"]
N = 2


#: Docks a test made, closed after it (``closed``).
_made: list[TransferDock] = []


@pytest.fixture(autouse=True)
def closed():
    yield
    while _made:
        _made.pop().close()


def _partial(client, name="pr", prompts=6, partitions=3, gbs_train=3, max_age=3, **kwargs):
    """Groups g of partition g % 3 (blocks of one group: six groups over three partitions)."""
    rollout = Rollout(response_columns=("responses", "response_length"), max_age=max_age, gbs_train=gbs_train,
                      **kwargs)
    _made.append(TransferDock(client, name, prompts, N, COLUMNS, CONSUMERS, length_columns=["prompt_length",
                              "response_length"], rollout=rollout, partitions=partitions))
    return _made[-1]


def _prompts(dock, groups):
    rows = [g * N + j for g in groups for j in range(N)]
    dock.put_experience({"prompts": [torch.tensor([r // N]) for r in rows],
                         "prompt_length": [torch.tensor([1])] * len(rows)}, rows, is_prompt=True)


def _respond(dock, rows, finished):
    dock.put_experience({"responses": [torch.tensor([7])] * len(rows),
                         "response_length": [torch.tensor([1])] * len(rows)}, rows,
                        rollout_completed=[int(r // N in finished) for r in rows])


def _generate(dock, finished):
    """The rollout takes every unfinished row and finishes the groups ``finished``."""
    _, rows = dock.get_experience("actor_rollout", ["prompts", "responses"], dock.capacity, get_n_samples=False)
    _respond(dock, rows, finished)


def test_the_batch_is_cut_into_shares_kept_by_the_partitions():
    assert shares(8, PartitionMap(3, 6, N)) == [3, 3, 2]
    assert shares(3, PartitionMap(3, 6, N)) == [1, 1, 1]
    assert shares(4, PartitionMap(2, 5, N)) == [2, 2]  # 3 groups and 2: 2.4 and 1.6
    assert shares(3, PartitionMap(2, 5, N)) == [2, 1]
    assert sum(shares(1000, PartitionMap(7, 1000, N, 16))) == 1000


def test_a_partitioned_dock_keeps_its_rollout_settings_and_refuses_what_cannot_be_cut(client):
    dock = _partial(client, gbs_train=4)
    assert dock.rollout.gbs_train == 4 and [p.rollout.gbs_train for p in dock.partitions] == [2, 1, 1]
    again = TransferDock.attach(client, "pr")
    assert again.rollout == dock.rollout
    with pytest.raises(SchemaError, match="gbs_train"):
        _partial(client, gbs_train=5)  # another batch: another schema
    with pytest.raises(SchemaError, match="gbs_train=2 is below partitions=3"):
        _partial(client, name="small", gbs_train=2)
    assert dock.status()["rollout"]["groups_by_age"] == {0: 0, 1: 0, 2: 0, 3: 0}


def test_each_partition_gives_its_share_of_the_batch_and_the_stop_signal_waits_for_all(client):
    dock = _partial(client)  # gbs_train 3: one group per partition
    _prompts(dock, range(6))
    _generate(dock, finished={0, 3, 1})  # partitions 0 and 1 finished theirs (two in 0); partition 2 none
    assert not dock.get_update_ready(require_max_age_all_finished=False)
    # Three groups are finished, but partition 2's share is not: the batch is not whole, the trainer waits.
    assert dock.get_experience("actor_train", ["prompts"], 3 * N) == (None, None)
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 0  # what it took is given back
    _generate(dock, finished={2, 4, 5})
    assert dock.get_update_ready(require_max_age_all_finished=False)
    batch, rows = dock.get_experience("actor_train", ["prompts"], 3 * N)
    assert sorted({r // N % 3 for r in rows}) == [0, 1, 2]  # a group of each partition
    assert dock.get_experience("actor_train", ["prompts"], N) == (None, None)  # every share taken
    assert dock.all_consumed("actor_train")
    dock.clear(consumer="actor_train")  # the iteration's end: trained rows forgotten, the rest aged
    status = dock.status()
    assert status["rollout"]["finished_groups"] == 3 and status["rollout"]["groups_by_age"][1] == 3
    assert sorted({r // N % 3 for r in dock.get_experience("actor_train", ["prompts"], 3 * N)[1]}) == [0, 1, 2]


def test_stages_take_the_same_groups_of_every_partition(client):
    dock = _partial(client)
    _prompts(dock, range(6))
    _generate(dock, finished=set(range(6)))
    _, judged = dock.get_experience("reward", ["prompts"], 3 * N)
    _, trained = dock.get_experience("actor_train", ["prompts"], 3 * N)
    assert sorted(judged) == sorted(trained)  # each partition's part of the iteration's batch


def test_reservations_go_to_the_partitions_in_proportion_or_not_at_all(client):
    dock = _partial(client, prompts=12, gbs_train=6)  # two groups per partition and iteration, four held

    def partition(g):
        return dock.partition_map.local_group(g)[0]

    first = dock.reserve_groups(6, "prompts")
    assert first is not None and sorted(partition(g) for g in first) == [0, 0, 1, 1, 2, 2]
    ones = [dock.reserve_groups(1, "prompts") for _ in range(3)]  # one at a time, round the partitions
    assert sorted(partition(g) for [g] in ones) == [0, 1, 2]
    _prompts(dock, first + [g for [g] in ones])
    # One group free in each partition: four groups would take two from one of them.
    assert dock.reserve_groups(4, "prompts") is None  # the other partitions' claims are given back ...
    last = dock.reserve_groups(3, "prompts")  # ... so what was free is free
    assert last is not None and sorted(partition(g) for g in last) == [0, 1, 2]


def test_reservations_of_one_group_each_give_every_partition_its_share(client):
    """A trainer refilling one group at a time (as test_partial_kill.py's): any gbs_train of them hold each
    partition's share, here 2 and 1, else a partition could not finish its share and the stop signal waits."""
    dock = _partial(client, prompts=12, partitions=2, gbs_train=3)
    assert [p.rollout.gbs_train for p in dock.partitions] == [2, 1]
    for _ in range(2):
        got = [dock.reserve_groups(1, "prompts") for _ in range(3)]
        assert sorted(dock.partition_map.local_group(g)[0] for [g] in got) == [0, 0, 1]


def test_the_rollout_takes_unfinished_rows_of_every_partition_with_their_ages(client):
    dock = _partial(client)
    _prompts(dock, [0, 1, 2])
    batch, rows = dock.get_experience("actor_rollout", ["prompts", "responses", "age"], 12, get_n_samples=False,
                                      stack=True)
    assert sorted(rows) == list(range(6)) and batch["age"].flatten().tolist() == [0] * 6
    assert batch["responses"].flatten().tolist() == [-1] * 6  # placeholders
    _respond(dock, rows, finished={0})
    dock.get_experience("actor_train", ["prompts"], N)
    dock.clear(consumer="actor_train")  # group 0 trained; groups 1 and 2 age
    batch, rows = dock.get_experience("actor_rollout", ["prompts", "age"], 12, get_n_samples=False)
    assert sorted(rows) == [2, 3, 4, 5] and [a.item() for a in batch["age"]] == [1] * 4
    with pytest.raises(BrokerError, match="nope"):
        dock.get_experience("actor_rollout", ["prompts", "nope"], 2, get_n_samples=False)


def test_finished_rows_and_unready_speak_in_the_docks_rows(client):
    dock = _partial(client)
    _prompts(dock, [1, 2])
    _generate(dock, finished={2})
    assert dock.finished_rows().nonzero().flatten().tolist() == [4, 5]
    assert dock.get_incomplete_response_num() == 2
    assert dock.unready(["prompts"], [2, 5]) == 2
    assert dock.ready_rows(["prompts"])["prompts"].nonzero().flatten().tolist() == [3, 4]


def _bounded(client, name="sb", policy="drop"):
    rollout = Rollout(response_columns=("responses",), prompt_columns=("prompts",), max_staleness=0,
                      stale_policy=policy, gbs_train=3)
    _made.append(TransferDock(client, name, 6, N, ["prompts", "responses"], CONSUMERS, rollout=rollout,
                              partitions=3))
    return _made[-1]


def _versioned(dock, groups, version):
    rows = [g * N + j for g in groups for j in range(N)]
    dock.put_experience({"prompts": [torch.tensor([g]) for g in groups for _ in range(N)]}, rows)
    dock.put_experience({"responses": [torch.tensor([version])] * len(rows)}, rows, version=version)


def test_staleness_holds_per_partition_against_the_version_it_has_seen(client):
    dock = _bounded(client)
    _versioned(dock, range(6), version=0)
    # A set_version between two partitions: partition 0 is at version 1, the others still at 0. Partition 0's
    # groups are stale there and dropped; the others' are what they were just before the version moved.
    dock.partitions[0].set_version(1)
    assert dock.version() == 0
    _, rows = dock.get_experience("actor_train", ["prompts"], 4 * N)
    assert sorted({r // N for r in rows}) == [1, 2, 4, 5]
    assert dock.get_experience("actor_train", ["prompts"], N) == (None, None)  # every partition visited
    assert dock.status()["discarded"] == {"stale": 2} and dock.partitions[0].status()["discarded"] == {"stale": 2}
    dock.set_version(1)  # every partition now: the groups left are stale everywhere
    assert dock.get_experience("reward", ["prompts"], N) == (None, None)
    assert dock.status()["discarded"] == {"stale": 6}
    _versioned(dock, [0, 3], version=0)
    _, rows = dock.get_experience("reward", ["prompts"], N, max_staleness=5)  # the call's own bound
    assert rows is not None and rows[0] // N in (0, 3)


def test_regenerated_groups_go_back_to_the_rollout_of_their_partition(client):
    dock = _bounded(client, policy="regenerate")
    _versioned(dock, [0, 1], version=0)
    dock.set_version(1)
    assert dock.get_experience("actor_train", ["prompts"], N) == (None, None)
    assert dock.status()["discarded"] == {"regenerated": 2}
    _, rows = dock.get_experience("actor_rollout", ["prompts"], 4, get_n_samples=False)
    assert sorted(rows) == [0, 1, 2, 3]


def test_admission_counts_each_partitions_batches_of_its_share(client):
    rollout = Rollout(response_columns=("responses",), max_staleness=1, gbs_train=2)
    dock = TransferDock(client, "adm", 8, 1, ["prompts", "responses"], CONSUMERS, rollout=rollout, partitions=2)
    _made.append(dock)
    # Each partition: four rows, batches of one row (its share); at version 0 with staleness 1, two of them.
    handed = [dock.prefetch_request_index(1) for _ in range(4)]
    assert sorted(r for [r] in handed) == [0, 1, 2, 3]  # the partitions hold rows {0, 1, 4, 5} and {2, 3, 6, 7}
    assert dock.prefetch_request_index(1) is None
    dock.set_version(1)
    assert sorted(r for _ in range(2) for r in dock.prefetch_request_index(1)) == [4, 6]
