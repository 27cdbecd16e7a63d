"""DP-balanced batches (Karmarkar-Karp), MindSpeed's seqlen-balanced sampling and DP padding."""

from __future__ import annotations

import heapq
import random
import time

import pytest
import torch

from broker import InvalidExperienceError, RowIndexError
from broker.api.balance import balanced_order, imbalance, karmarkar_karp
from broker.api.dp_padding import PAD_INDEX


def skewed_lengths(count: int, seed: int = 0) -> list[int]:
    """Response lengths as RL rollouts give them: most short, a long tail up to the generation limit."""
    rng = random.Random(seed)
    return [min(int(rng.paretovariate(1.2) * 60), 4096) + rng.randint(20, 200) for _ in range(count)]


def test_karmarkar_karp_balances_a_skewed_batch_far_better_than_a_naive_split(record_property):
    lengths = skewed_lengths(256)
    naive = imbalance(lengths, 4)
    balanced = imbalance(lengths, 4, balanced_order(lengths, 4))
    record_property("naive_max_over_mean", round(naive, 4))
    record_property("kk_max_over_mean", round(balanced, 4))
    print(f"dp_size=4, 256 rows: naive split max/mean {naive:.3f}, Karmarkar-Karp {balanced:.3f}")
    assert balanced <= 1.05 < naive


@pytest.mark.parametrize("seed", range(5))
def test_partitions_are_equal_sized_and_cover_every_item_once(seed):
    costs = skewed_lengths(60, seed)
    parts = karmarkar_karp(costs, 6, equal_size=True)
    assert sorted(i for p in parts for i in p) == list(range(60))
    assert {len(p) for p in parts} == {10}


def test_unequal_sizes_and_too_few_items_are_refused():
    with pytest.raises(InvalidExperienceError, match="do not split into 4 partitions of equal size"):
        karmarkar_karp([1, 2, 3, 4, 5], 4, equal_size=True)
    with pytest.raises(InvalidExperienceError, match="cannot split 2 items into 3"):
        karmarkar_karp([1, 2], 3, equal_size=False)


LENGTHS = ("prompt_length", "response_length")


def length_dock(make_dock, prompts_num=8, n=2):
    return make_dock(prompts_num=prompts_num, n=n, columns=("prompts", *LENGTHS),
                     consumers=("actor_train", "ref_log_prob"), length_columns=LENGTHS)


def put_lengths(dock, prompt, response):
    rows = list(range(len(prompt)))
    dock.put_experience({
        "prompts": [torch.ones(p, dtype=torch.int32) for p in prompt],
        "prompt_length": torch.tensor(prompt).reshape(-1, 1),
        "response_length": [torch.tensor([r]) for r in response],
    }, rows)


def test_a_balanced_batch_gives_each_dp_rank_nearly_the_same_load(make_dock):
    dock = length_dock(make_dock, prompts_num=32, n=2)
    response = skewed_lengths(64, seed=3)
    prompt = [30] * 64
    put_lengths(dock, prompt, response)
    batch, rows = dock.get_experience("actor_train", ["prompts", *LENGTHS], 64, dp_size=4, balance=True)
    cost = [prompt[r] + response[r] for r in rows]
    assert imbalance(cost, 4) <= 1.05 < imbalance([prompt[r] + response[r] for r in range(64)], 4)
    for g in range(0, 64, 2):  # whole groups stay together, in order
        assert rows[g] % 2 == 0 and rows[g + 1] == rows[g] + 1
    # the batch follows the rows
    assert [int(x) for x in batch["response_length"]] == [response[r] for r in rows]
    assert [len(x) for x in batch["prompts"]] == [prompt[r] for r in rows]


def test_balancing_rows_when_groups_do_not_split_evenly(make_dock):
    dock = length_dock(make_dock, prompts_num=3, n=4)
    response = [500, 400, 300, 10, 20, 20, 20, 30, 30, 30, 10, 10]  # the first group alone is 4 chunks' worth
    put_lengths(dock, [1] * 12, response)
    _, rows = dock.get_experience("actor_train", ["prompts"], 12, dp_size=4, balance=["response_length"])
    assert sorted(rows) == list(range(12))
    assert imbalance([response[r] for r in rows], 4) < 1.6 < imbalance(response, 4)  # best: (500+10+10)/345


def test_a_dp_rank_that_dies_gets_only_its_own_rows_redone(make_dock):
    """``balance`` splits groups across DP ranks when whole groups do not balance; each rank puts (and acks)
    its own share. When one rank dies, only its rows come back: the other ranks' results are final."""
    dock = make_dock(prompts_num=3, n=4, columns=("prompts", "response_length", "values"),
                     consumers=("actor_rollout", "critic"), length_columns=("response_length",))
    response = [500, 400, 300, 10, 20, 20, 20, 30, 30, 30, 10, 10]
    put_lengths_of(dock, [1] * 12, response)
    since = time.monotonic()
    _, rows = dock.get_experience("critic", ["prompts"], 12, dp_size=4, balance=["response_length"], lease=1)
    shares = [rows[r * 3:(r + 1) * 3] for r in range(4)]  # what each rank gets: still the delivery
    dead = shares[1]
    others = [row for r, share in enumerate(shares) if r != 1 for row in share]
    assert {row // 4 for row in dead} & {row // 4 for row in others}  # a group split between ranks
    for r, share in enumerate(shares):
        if r != 1:  # ranks 0, 2, 3 put their results, which acks them; rank 1 dies
            dock.put_experience({"values": [torch.tensor([1000 + row]) for row in share]}, share)
    time.sleep(max(0.0, since + 1.05 - time.monotonic()))

    groups = len({row // 4 for row in dead})
    _, redo = dock.get_experience("critic", ["prompts"], 4 * groups, dp_size=4, balance=["response_length"], lease=30)
    assert sorted(redo) == sorted(dead)  # only the dead rank's rows
    assert dock.status()["consumers"]["critic"]["redelivered"] == 3
    assert [int(v) for v in dock.read_rows(["values"], others)["values"]] == [1000 + row for row in others]
    assert not dock.all_consumed("critic")
    dock.put_experience({"values": [torch.tensor([2000 + row]) for row in redo]}, redo)
    assert dock.all_consumed("critic")
    assert dock.get_experience("critic", ["prompts"], 4) == (None, None)
    values = dock.read_rows(["values"], list(range(12)))["values"]
    assert [int(v) for v in values] == [(2000 if row in dead else 1000) + row for row in range(12)]


def test_groups_back_in_part_are_balanced_as_rows(make_dock):
    """A batch holding groups that came back without their acked rows is not whole groups: n consecutive
    rows of it may be of two groups, so it is balanced row by row."""
    dock = make_dock(prompts_num=4, n=4, columns=("prompts", "response_length"), consumers=("critic",),
                     length_columns=("response_length",))
    heavy = {2, 3, 6, 7}  # the unacked rows of groups 0 and 1
    put_lengths_of(dock, [1] * 16, [100 if r in heavy else 1 for r in range(16)])
    _, rows = dock.get_experience("critic", ["prompts"], 16, lease=300)
    dock.ack("critic", [r for r in rows if r % 4 < 2], token=rows.token)  # half of each group
    dock.reclaim("critic", all_leases=True)
    _, redo = dock.get_experience("critic", ["prompts"], 16, dp_size=2, balance=["response_length"])
    assert sorted(redo) == [2, 3, 6, 7, 10, 11, 14, 15]
    assert len(heavy & set(redo[:4])) == 2  # 202 tokens per rank, not 400 and 4


def put_lengths_of(dock, prompt, response):
    """``put_lengths`` for a dock whose only length column is ``response_length``."""
    rows = list(range(len(prompt)))
    dock.put_experience({"prompts": [torch.ones(p, dtype=torch.int32) for p in prompt],
                         "response_length": [torch.tensor([r]) for r in response]}, rows)


def mindspeed_first_partition(costs: list[int], count: int) -> list[int]:
    """MindSpeed's get_seqlen_balanced_partitions(equal_size=True)[0], written from its description."""
    k = len(costs) // count
    heap = [(0, 0, b) for b in range(k)]
    members: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(costs)), key=lambda i: (costs[i], i), reverse=True):
        total, size, b = heapq.heappop(heap)
        members[b].append(i)
        if size + 1 == count:
            return sorted(members[b])
        heapq.heappush(heap, (total + costs[i], size + 1, b))
    raise AssertionError("unreachable")


@pytest.mark.parametrize("seed", range(4))
def test_seqlen_policy_picks_mindspeeds_balanced_batch(make_dock, seed):
    dock = length_dock(make_dock, prompts_num=12, n=2)
    rng = random.Random(seed)
    prompt, response = [rng.randint(5, 50) for _ in range(24)], skewed_lengths(24, seed)
    put_lengths(dock, prompt, response)
    group_cost = [sum(prompt[r] + response[r] for r in (2 * g, 2 * g + 1)) for g in range(12)]
    _, rows = dock.get_experience("actor_train", ["prompts"], 8, policy="seqlen")
    assert rows == [r for g in mindspeed_first_partition(group_cost, 4) for r in (2 * g, 2 * g + 1)]
    row_cost = [prompt[r] + response[r] for r in range(24)]
    _, rows = dock.get_experience("ref_log_prob", ["prompts"], 6, get_n_samples=False, policy="seqlen")
    assert rows == mindspeed_first_partition(row_cost, 6)


def test_seqlen_policy_falls_back_to_random_when_the_ready_rows_do_not_divide(make_dock):
    dock = length_dock(make_dock, prompts_num=5, n=1)
    put_lengths(dock, [1, 2, 3, 4, 5], [5, 4, 3, 2, 1])
    _, rows = dock.get_experience("actor_train", ["prompts"], 2, policy="seqlen")
    assert len(rows) == 2 and len(set(rows)) == 2


def test_dp_padding_repeats_the_last_row_as_minus_two_and_puts_skip_it(make_dock):
    dock = make_dock(prompts_num=3, n=1, columns=("prompts", "responses"))
    dock.put_experience({"prompts": torch.arange(6).reshape(3, 2)}, [0, 1, 2])
    batch, rows = dock.get_experience("actor_train", ["prompts"], 3, dp_size=2, dp_padding=True)
    assert rows == [0, 1, 2, PAD_INDEX]
    assert torch.equal(batch["prompts"][3], batch["prompts"][2])
    dock.put_experience({"responses": torch.tensor([[1], [2], [3], [99]])}, rows)
    back, _ = dock.get_experience("actor_rollout", ["responses"], 3)
    assert [int(x) for x in back["responses"]] == [1, 2, 3]
    dock.put_experience({"responses": torch.tensor([[7]])}, [PAD_INDEX])  # only padding: nothing to do
    with pytest.raises(RowIndexError, match=r"rows \[-1\] are outside"):
        dock.put_experience({"responses": torch.tensor([[7]])}, [-1])  # only -2 is padding natively


def test_leased_padded_rows_ack_without_the_padding(make_dock):
    dock = make_dock(prompts_num=3, n=1)
    dock.put_experience({"prompts": torch.arange(3).reshape(3, 1)}, [0, 1, 2])
    _, rows = dock.get_experience("actor_train", ["prompts"], 3, dp_size=4, dp_padding=True, lease=30)
    assert list(rows) == [0, 1, 2, PAD_INDEX] and rows.token
    assert dock.ack("actor_train", rows) == 3
    assert dock.all_consumed("actor_train")


@pytest.mark.parametrize("kwargs, message", [
    ({"dp_size": 0}, "dp_size must be a positive int"),
    ({"dp_size": 2, "balance": True}, "has no length columns to balance by"),
    ({"dp_size": 2, "balance": ["prompts"]}, "not length columns"),
    ({"dp_size": 2, "balance": "prompt_length"}, "balance must be True, False or a list"),
    ({"dp_padding": "yes"}, "dp_padding"),
])
def test_bad_balancing_arguments_are_refused_and_hand_out_nothing(make_dock, kwargs, message):
    dock = make_dock(prompts_num=2, n=1)
    dock.put_experience({"prompts": torch.ones(2, 1)}, [0, 1])
    with pytest.raises(InvalidExperienceError, match=message):
        dock.get_experience("actor_train", ["prompts"], 2, **kwargs)
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 0


@pytest.mark.parametrize("value, message", [
    (torch.ones(2, 2), "rows of 2 values"),
    ([torch.tensor([1.5]), torch.tensor([2])], "integers in"),
    ([torch.tensor([-1]), torch.tensor([2])], "integers in"),
    (["a", "b"], "one integer"),
])
def test_a_length_column_must_hold_one_integer_per_row(make_dock, value, message):
    dock = length_dock(make_dock, prompts_num=1, n=2)
    with pytest.raises(InvalidExperienceError, match=message):
        dock.put_experience({"prompts": torch.ones(2, 2), "response_length": value}, [0, 1])
    assert dock.status()["columns"]["prompts"]["ready"] == 0


def test_a_length_column_of_one_value_rows_keeps_every_value_exact(make_dock):
    dock = length_dock(make_dock, prompts_num=1, n=2)
    same = [torch.tensor([3001]), torch.tensor([2**31 + 5])]  # one dtype: read in one go
    mixed = [torch.tensor([3001]), torch.tensor([1.0], dtype=torch.float16)]  # float16 would round 3001
    dock.put_experience({"prompts": torch.ones(2, 2), "prompt_length": same, "response_length": mixed}, [0, 1])
    assert dock._handouts._row_costs([0, 1], ["prompt_length"]) == [3001, 2**31 + 5]
    assert dock._handouts._row_costs([0, 1], ["response_length"]) == [3001, 1]


def test_clearing_rows_zeroes_their_lengths(make_dock, client):
    dock = length_dock(make_dock, prompts_num=2, n=1)
    put_lengths(dock, [3, 4], [10, 20])
    dock.clear([1])
    assert dock._handouts._row_costs([0, 1], list(LENGTHS)) == [13, 0]
    dock.clear()
    assert not client.exists(dock.keys.lengths("prompt_length"))


def test_explicit_rows_are_balanced_as_rows_not_as_groups(make_dock):
    dock = length_dock(make_dock, prompts_num=2, n=2)
    put_lengths(dock, [0, 0, 0, 0], [10, 10, 1, 1])  # as groups of two: 20 against 2
    _, rows = dock.get_experience("actor_train", ["prompts"], indexes=[0, 1, 2, 3], dp_size=2, balance=True)
    assert imbalance([[10, 10, 1, 1][r] for r in rows], 2) == 1.0
