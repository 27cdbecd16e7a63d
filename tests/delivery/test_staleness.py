"""Versions and the staleness bound: stale groups are never handed out, and are dropped or regenerated,
counted; admission control; DAPO's group filtering."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from broker import InvalidExperienceError, Rollout, VersionError
from broker.errors import RowIndexError

COLUMNS = ("prompts", "responses", "rewards")
CONSUMERS = ("actor_rollout", "reward", "actor_train")


def bounded(make_dock, max_staleness=1, policy="drop", prompts_num=4, n=2, gbs_train=2, name=None):
    rollout = Rollout(response_columns=("responses",), prompt_columns=("prompts",), max_staleness=max_staleness,
                      stale_policy=policy, gbs_train=gbs_train)
    return make_dock(prompts_num, n, COLUMNS, CONSUMERS, rollout=rollout, name=name)


def generate(dock, groups, version):
    n = dock.n_samples_per_prompt
    rows = [g * n + j for g in groups for j in range(n)]
    dock.put_experience({"prompts": [torch.tensor([g]) for g in groups for _ in range(n)]}, rows)
    dock.put_experience({"responses": [torch.tensor([version])] * len(rows)}, rows, version=version)
    return rows


def test_versions_only_grow(make_dock):
    dock = bounded(make_dock)
    assert dock.version() == 0
    dock.set_version(3)
    dock.set_version(3)
    with pytest.raises(VersionError, match="at version 3"):
        dock.set_version(2)
    with pytest.raises(InvalidExperienceError):
        dock.set_version(-1)
    with pytest.raises(InvalidExperienceError):
        dock.put_experience({"prompts": [torch.tensor([1])]}, [0], version="1")
    dock.clear()
    assert dock.version() == 3  # a whole clear keeps the trainer's version


def test_stale_groups_are_never_handed_out_and_are_dropped_and_counted(make_dock):
    dock = bounded(make_dock, max_staleness=1)
    generate(dock, [0], version=0)
    generate(dock, [1], version=1)
    generate(dock, [2], version=2)
    dock.set_version(2)  # fresh: versions >= 1
    batch, rows = dock.get_experience("actor_train", ["prompts", "responses"], 4)
    assert sorted(rows) == [2, 3, 4, 5]
    assert {t.item() for t in batch["responses"]} == {1, 2}
    status = dock.status()
    assert status["discarded"] == {"stale": 1} and status["stale_groups"] == 0
    assert status["columns"]["prompts"]["ready"] == 4  # group 0 is forgotten: its rows are free
    # The rollout consumer is not bound: it regenerates, it does not train. (Lowest first: per partition.)
    assert dock.get_experience("actor_rollout", ["prompts"], 2, get_n_samples=False)[1] in ([2, 3], [4, 5])
    # A per-call bound overrides the dock's.
    generate(dock, [3], version=0)
    assert dock.get_experience("reward", ["prompts"], 2, max_staleness=5)[1] is not None


def test_a_group_is_as_old_as_its_oldest_row(make_dock):
    dock = bounded(make_dock, max_staleness=0)
    dock.put_experience({"prompts": [torch.tensor([0])] * 2}, [0, 1])
    dock.put_experience({"responses": [torch.tensor([5])]}, [1], version=5)  # a fast worker
    dock.put_experience({"responses": [torch.tensor([4])]}, [0], version=4)  # a slow one, later
    dock.set_version(5)
    assert dock.get_experience("actor_train", ["prompts", "responses"], 2) == (None, None)
    assert dock.status()["discarded"] == {"stale": 1}


def test_regenerate_keeps_the_prompt_and_offers_the_group_to_rollout_again(make_dock):
    dock = bounded(make_dock, max_staleness=0, policy="regenerate")
    generate(dock, [0], version=0)
    dock.get_experience("reward", ["prompts", "responses"], 2)  # the reward stage saw it before
    dock.set_version(1)
    assert dock.get_experience("actor_train", ["prompts", "responses"], 2) == (None, None)
    status = dock.status()
    assert status["discarded"] == {"regenerated": 1}
    assert status["columns"]["prompts"]["ready"] == 2 and status["consumers"]["reward"]["consumed"] == 0
    assert status["columns"]["responses"]["ready"] == 0  # nothing but the rollout may take it now
    batch, rows = dock.get_experience("actor_rollout", ["prompts"], 2, get_n_samples=False)
    assert rows == [0, 1] and [t.tolist() for t in batch["prompts"]] == [[0], [0]]
    dock.put_experience({"responses": [torch.tensor([1])] * 2}, rows, version=1)
    assert dock.get_experience("actor_train", ["prompts", "responses"], 2)[1] == [0, 1]


@pytest.mark.one_partition("it calls a dock's scripts")
def test_two_samplers_finding_one_stale_group_count_it_once(make_dock):
    dock = bounded(make_dock, max_staleness=0)
    generate(dock, [0], version=0)
    dock.set_version(1)
    assert dock.keys is not None
    # What a second client finding the same group would send, after the first discarded it.
    dock.get_experience("actor_train", ["prompts", "responses"], 2)
    assert dock._session.scripts.discard([0], regenerate=False, field="stale", max_staleness=0).value == 0
    assert dock.status()["discarded"] == {"stale": 1}


def test_drop_groups_frees_rows_and_counts_them_per_consumer(make_dock, partitions):
    dock = bounded(make_dock, max_staleness=None)
    generate(dock, [0, 1, 2], version=0)
    _, rows = dock.get_experience("reward", ["prompts", "responses"], 6, lease=30)
    assert dock.drop_groups("reward", [0, 2]) == 2
    assert dock.drop_groups("reward", [0]) == 1  # dropping an empty group again counts again: it is the caller's
    status = dock.status()
    assert status["discarded"] == {"reward": 3}
    assert status["columns"]["prompts"]["ready"] == 2
    assert status["consumers"]["reward"]["leased"] == 2  # group 1's lease stays
    assert dock.ack("reward", rows) == 2
    # Free: groups 0 and 2 (dropped), 3 (never written); lowest first, and on two partitions ({0, 2} and
    # {1, 3}) each partition's lowest.
    assert dock.reserve_groups(2, "prompts") == ([0, 2] if partitions == 1 else [0, 3])
    with pytest.raises(RowIndexError):
        dock.drop_groups("reward", [9])
    dock.clear()
    assert dock.status()["discarded"] == {}


@pytest.mark.one_partition("admission counts one dock's batches (a partition's: test_partitioned_rollout.py)")
def test_admission_refuses_rollout_that_could_not_train_in_time(make_dock):
    dock = bounded(make_dock, max_staleness=1, prompts_num=8, n=1, gbs_train=2)
    # Batches of 2 rows: at version 0 with staleness 1, batches 0 and 1 (4 rows) may be generated.
    assert dock.prefetch_request_index(3) == [0, 1, 2]
    assert dock.prefetch_request_index(2) is None  # row 4 would be batch 2 > 0 + 1
    assert dock.prefetch_request_index(1) == [3]
    dock.set_version(1)
    assert dock.prefetch_request_index(2) == [4, 5]
    assert dock.prefetch_request_index(1) is None
    # Dropped rows will never train: admission counts them out.
    dock.put_experience({"prompts": [torch.tensor([0])]}, [0])
    dock.drop_groups("reward", [0, 1])
    assert dock.prefetch_request_index(2) == [6, 7]


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_fast_and_slow_rollout_with_a_trainer_bumping_versions(make_dock, policy):
    """No trained row is older than the bound, none is lost, and every discarded group is counted:
    dropped groups are gone, regenerated ones come back to the rollout and are trained later."""
    k, groups_total = 1, 24
    dock = bounded(make_dock, max_staleness=k, policy=policy, prompts_num=groups_total, n=2, gbs_train=2)
    n = dock.n_samples_per_prompt
    rows = list(range(groups_total * n))
    dock.put_experience({"prompts": [torch.tensor([r // n]) for r in rows]}, rows)
    stop = threading.Event()
    trained: list[tuple[int, int, int]] = []  # (group, version of the data, version at training)

    def rollout(delay: float) -> None:
        while not stop.is_set():
            batch, got = dock.get_experience("actor_rollout", ["prompts"], n, timeout=0.05)
            if batch is None:
                continue
            version = dock.version()
            time.sleep(delay)  # generating with the weights of `version`
            dock.put_experience({"responses": [torch.tensor([version])] * n}, got, version=version)

    workers = [threading.Thread(target=rollout, args=(d,)) for d in (0.001, 0.05)]
    for w in workers:
        w.start()
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline:
            batch, got = dock.get_experience("actor_train", ["prompts", "responses"], 2 * n, timeout=0.05)
            if batch is not None:
                now = dock.version()
                trained += [(p.item(), t.item(), now) for p, t in zip(batch["prompts"], batch["responses"])]
                dock.set_version(now + 1)
                dock.clear(consumer="actor_train")
            status = dock.status()
            left = status["columns"]["prompts"]["groups_ready"]
            if left < 2:  # what is left cannot make a batch of two groups
                break
    finally:
        stop.set()
        for w in workers:
            w.join()
    assert trained and all(made >= at - k for _, made, at in trained), [t for t in trained if t[1] < t[2] - k]
    discarded = status["discarded"]
    groups_trained = sorted({g for g, _, _ in trained})
    assert len(trained) == len(groups_trained) * n, "a group was trained twice"
    if policy == "drop":
        assert discarded.get("stale", 0) + len(groups_trained) + left == groups_total
    else:
        assert "stale" not in discarded and len(groups_trained) + left == groups_total
        assert discarded.get("regenerated", 0) > 0, "nothing went stale: the test did not test the policy"


# -- versions carried exactly ------------------------------------------------------------------------
# Lua formats numbers with 14 significant digits: a microsecond timestamp used as a version (16 digits)
# made every group look stale to sampling but not to the discard, so the trainer waited for ever;
# set_version(10**17) stored "1e+17", which version() could not read; 2**53 + 1 was stored as 2**53.

MICROSECONDS = 1_732_000_000_123_457  # a version taken from time.time_ns() // 1000


def test_a_microsecond_timestamp_is_a_version_like_any_other(make_dock):
    dock = bounded(make_dock, max_staleness=2)
    generate(dock, [0], version=MICROSECONDS - 3)  # stale: older than the bound
    generate(dock, [1], version=MICROSECONDS - 1)
    generate(dock, [2], version=MICROSECONDS)
    dock.set_version(MICROSECONDS)
    assert dock.version() == MICROSECONDS
    assert dock.status()["stale_groups"] == 1
    batch, rows = dock.get_experience("actor_train", ["prompts", "responses"], 4)
    assert sorted(rows) == [2, 3, 4, 5]
    assert {t.item() for t in batch["responses"]} == {MICROSECONDS - 1, MICROSECONDS}
    status = dock.status()
    assert status["discarded"] == {"stale": 1} and status["stale_groups"] == 0
    with pytest.raises(VersionError, match=f"at version {MICROSECONDS}; versions only grow, got {MICROSECONDS - 1}"):
        dock.set_version(MICROSECONDS - 1)


@pytest.mark.parametrize("version", [2**53, 10**17])
def test_a_version_that_cannot_be_carried_exactly_is_refused_at_the_call(make_dock, version):
    dock = bounded(make_dock)
    with pytest.raises(InvalidExperienceError, match=r"below 2\*\*53"):
        dock.set_version(version)
    with pytest.raises(InvalidExperienceError, match=r"below 2\*\*53"):
        dock.put_experience({"responses": [torch.tensor([1])]}, [0], version=version)
    dock.set_version(2**53 - 1)
    assert dock.version() == 2**53 - 1


@pytest.fixture(params=[1, 2], ids=["whole", "partitioned"])
def partitions(request) -> int:
    """Every test of this file also on a dock of two partitions (see tests/conftest.py), whose batch
    (gbs_train=2) is a share of one group each."""
    return request.param
