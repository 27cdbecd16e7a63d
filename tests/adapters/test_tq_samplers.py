"""TransferQueue's samplers on the broker (broker.transfer_queue.sampler).

Our own tests of each sampler's choices and of the cache hook the client mirrors in Redis; then, where
the ``transferqueue`` wheel is installed, TransferQueue's samplers and ours driven through the same
random sequences of calls (hypothesis), as a controller drives them: same rows, same cache.
Pure Python: no Redis.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from broker.errors import BrokerError, GetMetaError, InvalidExperienceError
from broker.transfer_queue.sampler import (
    BaseSampler,
    CachedResult,
    GRPOGroupNSampler,
    RankAwareSampler,
    SeqlenBalancedSampler,
    SequentialSampler,
)
from broker.transfer_queue.sampler.seqlen_balanced_sampler import get_seqlen_balanced_partitions


class Lengths:
    """What SeqlenBalancedSampler reads lengths from (TransferQueue passes its DataPartitionStatus)."""

    def __init__(self, lengths: Mapping[int, int]) -> None:
        self.lengths = dict(lengths)

    def get_custom_meta(self, global_indices: list[int]) -> dict[int, dict[str, Any]]:
        return {i: {"total_lengths": self.lengths[i]} for i in global_indices if i in self.lengths}


# -- BaseSampler ----------------------------------------------------------------------------------

def test_base_sampler_is_abstract_and_calling_a_sampler_samples():
    with pytest.raises(TypeError, match="abstract"):
        BaseSampler()  # type: ignore[abstract]

    class FirstTwo(BaseSampler):
        def sample(self, ready_indexes: list[int], batch_size: int, *args: Any, **kwargs: Any
                   ) -> tuple[list[int], list[int]]:
            return ready_indexes[:2], []

    assert FirstTwo()([5, 6, 7], 3) == ([5, 6], []) and FirstTwo()._states == {}


def test_the_cache_hook_reads_and_writes_each_samplers_own_format():
    grpo, ranked = GRPOGroupNSampler(), RankAwareSampler()
    grpo.remember("p", "t", 0, 3, [1, 2], [1])
    ranked.remember("p", "t", 1, 0, [4, 5])
    assert grpo._states == {"p": {"t": {0: {3: ([1, 2], [1])}}}}  # (sampled, consumed), as TransferQueue's
    assert ranked._states == {"p": {"t": {1: {0: [4, 5]}}}}  # the sampled list, as TransferQueue's
    assert grpo.cached("p", "t", 0, 3) == ([1, 2], [1]) and ranked.cached("p", "t", 1, 0) == ([4, 5], [4, 5])
    assert grpo.cached("p", "t", 0, 4) is None and grpo.cached("q", "t", 0, 3) is None
    assert grpo.has_cached_result("p", "t", {"dp_rank": 0, "batch_index": 3})
    assert not grpo.has_cached_result("p", "t", {"batch_index": 3})  # no dp_rank: never cached
    ranked._states["rng"] = random.Random(0)  # users keep their own things in _states too
    assert list(ranked.cached_results()) == [CachedResult("p", "t", 1, 0, [4, 5], [4, 5])]
    assert list(grpo.cached_results(partition_id="q")) == []
    grpo.forget("p", "t", 0, 3)
    grpo.forget("p", "t", 9, 9)  # nothing there: nothing to do
    assert grpo.cached("p", "t", 0, 3) is None


def test_clear_cache_and_checkpoints():
    s = RankAwareSampler()
    s.sample([1, 2, 3], 2, 0, 0, "t", "p")
    s.sample([1, 2, 3], 2, 0, 0, "t", "q")
    saved = copy.deepcopy(s.save_checkpoint())
    s.clear_cache("p")
    s.clear_cache("never")
    assert list(s._states) == ["q"]
    fresh = RankAwareSampler()
    fresh.load_checkpoint(saved)
    assert fresh.sample([9, 9], 2, 0, 0, "t", "p") == ([1, 2], [1, 2])


# -- SequentialSampler ------------------------------------------------------------------------------

@pytest.mark.parametrize("ready, size, expected", [
    ([10, 5, 15, 20], 3, [10, 5, 15]), ([0, 1], 5, [0, 1]), ([], 3, []), ([0, 1, 2], 0, []),
    ([0, 1, 2, 3], -1, [0, 1, 2]),
])
def test_sequential_sampler_takes_the_first_rows_in_the_order_given(ready, size, expected):
    s = SequentialSampler()
    assert s.sample(ready, size, task_name="ignored", dp_rank=3) == (expected, expected) and s._states == {}


# -- GRPOGroupNSampler ------------------------------------------------------------------------------

@pytest.mark.parametrize("n, ready, size, expected", [
    (3, [0, 1, 3, 4, 5, 6, 7, 9, 10, 11], 6, [3, 4, 5, 9, 10, 11]),  # the docstring's example
    (3, [0, 1, 3, 4, 6, 7], 6, []),  # no whole group
    (4, [10, 11, 12, 5, 6, 7, 8, 9], 8, [5, 6, 7, 8, 9, 10, 11, 12]),  # sorted first
    (2, [1, 2, 3, 4], 4, [1, 2, 3, 4]),  # groups are runs, not aligned to n
    (4, list(range(16)), 20, []),  # fewer groups than asked: nothing
    (2, [0, 1], 0, []),
])
def test_grpo_sampler_takes_whole_runs_of_n_or_nothing(n, ready, size, expected):
    assert GRPOGroupNSampler(n).sample(ready, size) == (expected, expected)


def test_grpo_sampler_refuses_bad_sizes_as_value_errors():
    with pytest.raises(InvalidExperienceError, match="n_samples_per_prompt must be positive, got 0"):
        GRPOGroupNSampler(0)
    with pytest.raises(InvalidExperienceError, match=r"batch_size \(7\) must be a multiple of n_samples_per_prompt"):
        GRPOGroupNSampler(4).sample(list(range(8)), 7)


def test_grpo_sampler_caches_per_rank_and_batch_and_keeps_the_first_result():
    s = GRPOGroupNSampler(2)
    first = s.sample([0, 1, 2, 3], 2, "t", "p", dp_rank=0, batch_index=0)
    assert first == ([0, 1], [0, 1])
    assert s.sample([2, 3], 2, "t", "p", dp_rank=0, batch_index=0) == first  # same key: same rows
    assert s.sample([2, 3], 2, "t", "p", dp_rank=1, batch_index=0) == ([2, 3], [2, 3])
    assert s.sample([4], 2, "t", "p", dp_rank=0, batch_index=1) == ([], [])  # nothing found: nothing cached
    assert s.cached("p", "t", 0, 1) is None
    assert s.sample([0, 1], 2, "t", "p") == ([0, 1], [0, 1]) and s.cached("p", "t", None, None) is None


# -- RankAwareSampler -------------------------------------------------------------------------------

def test_rank_aware_sampler_hands_one_dp_group_the_same_rows():
    s = RankAwareSampler()
    assert s.sample([0, 1, 2, 3], 2, 0, 0, "t", "p") == ([0, 1], [0, 1])
    assert s.sample([2, 3], 2, 0, 0, "t", "p") == ([0, 1], [0, 1])  # another rank of DP group 0
    assert s.sample([2, 3], 2, 1, 0, "t", "p") == ([2, 3], [2, 3])  # DP group 1
    assert s.sample([4], 2, 0, 1, "t", "p") == ([], [])  # too few: nothing, nothing cached
    assert s._states == {"p": {"t": {0: {0: [0, 1]}, 1: {0: [2, 3]}}}}
    with pytest.raises(InvalidExperienceError, match="dp_rank -1 must be greater than or equal to 0"):
        s.sample([0], 1, -1, 0, "t", "p")


# -- SeqlenBalancedSampler --------------------------------------------------------------------------

def test_seqlen_sampler_balances_whole_groups_over_the_ranks_and_caches_every_share():
    s = SeqlenBalancedSampler(n_samples_per_prompt=2, dp_size=2)
    lengths = Lengths({0: 50, 1: 50, 2: 5, 3: 5, 4: 40, 5: 40, 6: 10, 7: 10})  # groups: 100, 10, 80, 20
    mine = s.sample(list(range(8)), 4, "t", "p", dp_rank=1, batch_index=0, partition=lengths)
    # Karmarkar-Karp on [100, 10, 80, 20]: {100, 10} and {80, 20}, the heavier share (group 0) first
    assert s.cached("p", "t", 0, 0) == ([0, 1, 2, 3], [0, 1, 2, 3]) and mine == ([4, 5, 6, 7], [4, 5, 6, 7])
    # rank 0 comes later, with other rows ready: it gets the share decided for it
    assert s.sample([8, 9], 4, "t", "p", dp_rank=0, batch_index=0, partition=lengths)[0] == [0, 1, 2, 3]
    assert s.sample([], 4, "t", "p", dp_rank=5, batch_index=0) == ([], [])  # no such rank: nothing
    assert s._balanced_cache == {("p", "t", 0): [[0, 1, 2, 3], [4, 5, 6, 7]]}


def test_seqlen_sampler_without_lengths_cuts_the_rows_in_order():
    s = SeqlenBalancedSampler(n_samples_per_prompt=1, dp_size=3)
    assert s.sample(list(range(10)), 2, "t", "p", dp_rank=2) == ([4, 5], [4, 5])
    assert [s.cached("p", "t", r, 0) for r in range(3)] == [([0, 1], [0, 1]), ([2, 3], [2, 3]), ([4, 5], [4, 5])]


def test_seqlen_sampler_rows_without_a_length_weigh_one():
    s = SeqlenBalancedSampler(n_samples_per_prompt=1, dp_size=2)
    got = s.sample([0, 1, 2, 3], 2, "t", "p", partition=Lengths({0: 3}))
    assert got[0] == [0, 1] and s.cached("p", "t", 1, 0) == ([2, 3], [2, 3])  # costs 3, 1, 1, 1


def test_seqlen_sampler_refuses_what_it_cannot_split():
    with pytest.raises(InvalidExperienceError, match="dp_size must be positive"):
        SeqlenBalancedSampler(dp_size=0)
    s = SeqlenBalancedSampler(n_samples_per_prompt=4, dp_size=2)
    with pytest.raises(InvalidExperienceError, match="must be a multiple of n_samples_per_prompt"):
        s.sample(list(range(20)), 3)
    with pytest.raises(InvalidExperienceError, match="cannot split 1 items into 2 partitions"):
        s.sample(list(range(8)), 2, partition=Lengths({}))  # one group for two ranks
    assert s._states == {}
    with pytest.raises(InvalidExperienceError, match="dp_rank must be an int >= 0, got -1"):
        s.sample(list(range(8)), 4, dp_rank=-1)
    assert s.sample([0, 1, 2], 4) == ([], [])  # too few rows: nothing


def test_seqlen_sampler_checkpoints_and_loads_transfer_queues_balanced_cache():
    s = SeqlenBalancedSampler(n_samples_per_prompt=1, dp_size=2)
    s.sample([0, 1, 2, 3], 1, "t", "p", batch_index=7)
    state = copy.deepcopy(s.save_checkpoint())
    assert state["_balanced_cache"] == {("p", "t", 7): [[0], [1]]}
    s.clear_cache("p")
    assert s._balanced_cache == {} and s.cached("p", "t", 1, 7) is None
    other = SeqlenBalancedSampler(n_samples_per_prompt=1, dp_size=2)
    other.load_checkpoint({"_states": {}, "_balanced_cache": {("p", "t", 7): [[0], [1]]}})  # shares only
    assert other.sample([5, 6], 1, "t", "p", dp_rank=1, batch_index=7) == ([1], [1])


def test_a_share_mirrored_into_another_process_is_handed_out_there_unchanged():
    """What the client does across processes: rank 0's sampler decides the batch; the results are
    written where rank 1's sampler (another process, another object) reads them before sampling."""
    rank0 = SeqlenBalancedSampler(n_samples_per_prompt=2, dp_size=2)
    rank1 = SeqlenBalancedSampler(n_samples_per_prompt=2, dp_size=2)
    lengths = Lengths({i: (i * 37) % 11 + 1 for i in range(8)})
    rank0.sample(list(range(8)), 4, "t", "p", dp_rank=0, batch_index=0, partition=lengths)
    for c in rank0.cached_results("p", "t"):  # the mirror: Redis, in the client
        rank1.remember(c.partition_id, c.task_name, c.dp_rank, c.batch_index, c.sampled, c.consumed)
    assert rank1.sample([], 4, "t", "p", dp_rank=1, batch_index=0, partition=lengths) == rank0.cached("p", "t", 1, 0)


def test_get_seqlen_balanced_partitions():
    # 141 against 115, the best two sets of three there are; the heavier first
    assert get_seqlen_balanced_partitions([100, 90, 50, 10, 5, 1], 2, equal_size=True) == [[1, 2, 5], [0, 3, 4]]
    assert get_seqlen_balanced_partitions([50, 50, 50, 50], 2, True) == [[0, 3], [1, 2]]
    with pytest.raises(InvalidExperienceError):
        get_seqlen_balanced_partitions([10, 20, 30], 2, equal_size=True)


# -- errors at sampling: ValueErrors as TransferQueue's samplers raise, RuntimeErrors as its get_meta does -----------

def test_errors_at_sampling_are_what_transfer_queues_sampler_and_its_get_meta_raise():
    """TransferQueue's samplers raise ValueError (or fail an assert); its get_meta, which runs them in the
    controller, raises RuntimeError for either. Ours run in the caller's get_meta: one error is both."""
    calls = [
        lambda: GRPOGroupNSampler(4).sample(list(range(8)), 7),  # not a multiple of n
        lambda: RankAwareSampler().sample([0, 1], 1, -1, 0, "t", "p"),  # a negative rank
        lambda: SeqlenBalancedSampler(2, 2).sample(list(range(8)), 4, dp_rank=-1),
        lambda: SeqlenBalancedSampler(2, 2).sample(list(range(4)), 1, partition=Lengths({})),  # 1 group, 2 ranks
    ]
    for call in calls:
        with pytest.raises(GetMetaError) as info:
            call()
        assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)
    with pytest.raises(InvalidExperienceError) as made:  # made in the caller's process there too: a ValueError
        GRPOGroupNSampler(0)
    assert not isinstance(made.value, RuntimeError)


# -- the same calls through TransferQueue's samplers and ours -----------------------------------------

def normalised(states: Any) -> Any:
    """``_states`` with its tuples as lists, to compare TransferQueue's and ours."""
    if isinstance(states, dict):
        return {k: normalised(v) for k, v in states.items()}
    if isinstance(states, (list, tuple)):
        return [normalised(v) for v in states]
    return states


SAMPLERS = ["SequentialSampler", "GRPOGroupNSampler", "RankAwareSampler", "SeqlenBalancedSampler"]


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    """A sampler, and a controller's sequence of calls: who asks for which batch, and rows arriving."""
    name = draw(st.sampled_from(SAMPLERS))
    n = draw(st.integers(1, 3))
    dp_size = draw(st.integers(1, 3))
    calls = draw(st.lists(st.fixed_dictionaries({
        "dp_rank": st.integers(-1 if name == "RankAwareSampler" else 0, dp_size),
        "batch_index": st.integers(0, 2),
        "batch_size": st.integers(0, 7) | st.integers(0, 3).map(lambda k: k * n * dp_size),
        "task_name": st.sampled_from(["t", "u"]),
        "partition_id": st.sampled_from(["p", "q"]),
        "arrive": st.integers(0, 8),  # rows put before the call
        "gap": st.booleans(),  # a row of the new ones missing (not ready yet)
        "shuffle": st.booleans(),  # ready indexes not in order
        "clear": st.booleans() if draw(st.booleans()) else st.just(False),
    }), min_size=1, max_size=12))
    return {"name": name, "n": n, "dp_size": dp_size, "calls": calls, "with_lengths": draw(st.booleans()),
            "seed": draw(st.integers(0, 2**16)), "lengths": draw(st.lists(st.integers(0, 6), min_size=64, max_size=64))}


def build(module: Any, scenario: dict[str, Any]) -> Any:
    cls = getattr(module, scenario["name"])
    if scenario["name"] == "GRPOGroupNSampler":
        return cls(n_samples_per_prompt=scenario["n"])
    if scenario["name"] == "SeqlenBalancedSampler":
        return cls(n_samples_per_prompt=scenario["n"], dp_size=scenario["dp_size"])
    return cls()


@settings(max_examples=400, deadline=None)
@given(scenario=scenarios())
def test_samplers_choose_what_transfer_queues_choose(scenario):
    their = pytest.importorskip("transfer_queue.sampler")
    theirs, ours = build(their, scenario), build(
        __import__("broker.transfer_queue.sampler", fromlist=["x"]), scenario)
    rng = random.Random(scenario["seed"])
    lengths = Lengths(dict(enumerate(scenario["lengths"])))
    produced: list[int] = []
    consumed: dict[tuple[str, str], set[int]] = {}
    for call in scenario["calls"]:
        new = list(range(len(produced), len(produced) + call["arrive"]))
        if call["gap"] and new:
            new.pop(rng.randrange(len(new)))
        produced += new
        if call["clear"]:
            theirs.clear_cache(call["partition_id"])
            ours.clear_cache(call["partition_id"])
        done = consumed.setdefault((call["partition_id"], call["task_name"]), set())
        ready = sorted(set(produced) - done)
        if call["shuffle"]:
            rng.shuffle(ready)
        kwargs = {k: call[k] for k in ("dp_rank", "batch_index", "task_name", "partition_id")}
        if scenario["with_lengths"]:
            kwargs["partition"] = lengths
        try:
            expected = theirs.sample(list(ready), call["batch_size"], **kwargs)
        except (ValueError, AssertionError) as exc:  # TransferQueue's own assert on a batch it cannot split
            with pytest.raises(InvalidExperienceError) as info:
                ours.sample(list(ready), call["batch_size"], **kwargs)
            assert isinstance(info.value, BrokerError) and isinstance(info.value, ValueError), exc
            event(f"{scenario['name']}: refused")
        else:
            got = ours.sample(list(ready), call["batch_size"], **kwargs)
            assert (list(got[0]), list(got[1])) == (list(expected[0]), list(expected[1]))
            done.update(got[1])
            event(f"{scenario['name']}: {'rows' if got[0] else 'nothing'}")
        assert normalised(ours._states) == normalised(theirs._states)
        config = {"dp_rank": call["dp_rank"], "batch_index": call["batch_index"]}
        assert ours.has_cached_result(call["partition_id"], call["task_name"], config) == \
            theirs.has_cached_result(call["partition_id"], call["task_name"], config)
    if scenario["name"] == "SeqlenBalancedSampler":
        assert normalised(ours.save_checkpoint()) == normalised(theirs.save_checkpoint())


@settings(max_examples=300, deadline=None)
@given(costs=st.lists(st.integers(0, 20) | st.floats(0, 100, allow_nan=False), min_size=1, max_size=40),
       k=st.integers(1, 6), equal_size=st.booleans())
def test_balanced_partitions_are_transfer_queues(costs, k, equal_size):
    their = pytest.importorskip("transfer_queue.sampler.seqlen_balanced_sampler")
    try:
        expected = their.get_seqlen_balanced_partitions(costs, k, equal_size)
    except AssertionError:
        if len(costs) < k or (equal_size and len(costs) % k):
            with pytest.raises(InvalidExperienceError):
                get_seqlen_balanced_partitions(costs, k, equal_size)
        else:  # TransferQueue also refuses a partition left empty (zero costs): ours returns it
            expected = [sorted(p) for p in their.karmarkar_karp(costs, k, equal_size)]
            assert get_seqlen_balanced_partitions(costs, k, equal_size) == expected
        return
    assert get_seqlen_balanced_partitions(costs, k, equal_size) == expected
