"""TransferDock behaviour, on fakeredis and on a real redis-server (see conftest.py)."""

from __future__ import annotations

import pickle
import re
import threading
import time

import numpy as np
import pytest
import redis
import torch
from redis.cluster import RedisCluster

import broker.api.handout
from broker import (
    BrokerError,
    DecodeError,
    DockNotFoundError,
    ExperienceTimeoutError,
    InvalidExperienceError,
    MissingDataError,
    RowIndexError,
    SchemaError,
    TransferDock,
    UnknownColumnError,
    UnknownConsumerError,
)
from broker.control.keys import DockKeys
from broker.data.row_header import DTYPES
from tests.helpers import (
    bits,
    data_cell,
    data_where,
    fill,
    held_rows,
    random_tensor,
    server_keys,
)


def rows_of(n_rows: int, width: int = 3, offset: int = 0) -> list[torch.Tensor]:
    """Distinct per-row tensors of varying length: row i holds values 100*(i+offset)..."""
    return [torch.arange(width + i % 3, dtype=torch.int64) + 100 * (i + offset) for i in range(n_rows)]


# -- creation and schema ------------------------------------------------------------------------


def test_create_then_attach_with_same_schema(make_dock, client):
    dock = make_dock(name="grpo")
    again = make_dock(name="grpo", columns=("responses", "prompts"))  # order of names does not matter
    attached = TransferDock.attach(client, "grpo")
    for other in (again, attached):
        assert other.schema.prompts_num == dock.prompts_num
        assert set(other.columns) == set(dock.columns) and set(other.consumers) == set(dock.consumers)
    assert attached.capacity == 8


def test_create_with_different_schema_shows_the_difference(make_dock):
    make_dock(name="grpo")
    with pytest.raises(SchemaError) as info:
        make_dock(name="grpo", prompts_num=5, columns=("prompts", "scores"))
    message = str(info.value)
    assert "prompts_num: stored 4, requested 5" in message
    assert "stored only ['responses']" in message and "requested only ['scores']" in message


def test_attach_missing_dock_raises_not_found(client):
    with pytest.raises(DockNotFoundError, match="no dock named 'nope'"):
        TransferDock.attach(client, "nope")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"prompts_num": 0}, "prompts_num must be a positive int"),
        ({"n": 2.0}, "n_samples_per_prompt must be a positive int"),
        ({"columns": ()}, "columns must be a non-empty list"),
        ({"columns": "prompts"}, "columns must be a non-empty list"),
        ({"columns": ("a", "a")}, "duplicate column names"),
        ({"consumers": ("bad name",)}, "invalid consumer name"),
        ({"columns": ("x:y",)}, "invalid column name"),
        ({"name": "a}b"}, "invalid dock name"),
        ({"prompts_num": 1 << 20, "n": 1 << 10}, "exceeds the limit"),
    ],
)
def test_invalid_schema_is_refused(make_dock, kwargs, message):
    with pytest.raises(SchemaError, match=message):
        make_dock(**kwargs)


def test_unknown_policy_is_refused_alike_when_opening_and_sampling(make_dock):
    # One check, one error class: the dock's default policy and a call's are the same argument.
    with pytest.raises(InvalidExperienceError, match="policy must be one of"):
        make_dock(policy="lifo")
    with pytest.raises(InvalidExperienceError, match="policy must be one of"):
        make_dock().get_experience("actor_train", ["prompts"], 2, policy="lifo")


def test_client_decoding_responses_is_refused(backend, request):
    if backend == "fake":
        import fakeredis

        client = fakeredis.FakeRedis(decode_responses=True)
    elif backend == "cluster":
        client = RedisCluster.from_url(request.getfixturevalue("cluster_url"), decode_responses=True)
    else:
        client = redis.Redis.from_url(request.getfixturevalue("real_url"), decode_responses=True)
    with pytest.raises(BrokerError, match="decode_responses=False"):
        TransferDock(client, "x", prompts_num=1, n_samples_per_prompt=1, columns=["a"], consumers=["b"])


def test_corrupt_meta_raises_decode_error(client):
    client.hset(DockKeys("broken").meta, mapping={"format_version": "1", "prompts_num": "x"})
    with pytest.raises(DecodeError, match=r"td:\{broken\}:meta"):
        TransferDock.attach(client, "broken")
    client.hset(DockKeys("future").meta, mapping={"format_version": "7"})
    with pytest.raises(DecodeError, match="format version 7"):
        TransferDock.attach(client, "future")


# -- put and get round trips --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_every_dtype_and_shape_round_trips_bit_exactly_through_redis(make_dock, dtype):
    dock = make_dock(prompts_num=2, n=4, columns=("x",), consumers=("c",))
    shapes = [(), (0,), (5,), (2, 3), (0, 4), (1, 1, 2), (300,), (4, 0, 2)]
    tensors = [random_tensor(dtype, s, seed=i) for i, s in enumerate(shapes)]
    dock.put_experience({"x": tensors}, indexes=list(range(8)))
    batch, rows = dock.get_experience("c", ["x"], 8)
    assert rows == list(range(8))
    for sent, got in zip(tensors, batch["x"]):
        assert got.dtype == dtype and got.shape == sent.shape
        assert bits(got) == bits(sent)


def test_stacked_tensor_is_split_into_rows(make_dock):
    dock = make_dock()
    stacked = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    dock.put_experience({"prompts": stacked}, indexes=[6, 7, 4, 5])
    batch, rows = dock.get_experience("actor_train", ["prompts"], indexes=[4, 5, 6, 7])
    assert rows == [4, 5, 6, 7]
    assert [t.tolist() for t in batch["prompts"]] == [[6, 7, 8], [9, 10, 11], [0, 1, 2], [3, 4, 5]]


def test_numpy_input_and_index_types_are_accepted(make_dock):
    dock = make_dock()
    dock.put_experience({"prompts": np.ones((2, 3), dtype=np.float32)}, indexes=np.array([0, 1]))
    dock.put_experience({"prompts": [np.zeros(2, np.int8), np.zeros(0, np.int8)]}, indexes=torch.tensor([2, 3]))
    batch, _ = dock.get_experience("actor_train", ["prompts"], indexes=[1, 3])
    assert batch["prompts"][0].dtype == torch.float32 and batch["prompts"][1].shape == (0,)


def test_writing_a_row_again_replaces_it(make_dock):
    dock = make_dock()
    dock.put_experience({"prompts": [torch.tensor([1]), torch.tensor([2])]}, indexes=[0, 1])
    dock.put_experience({"prompts": [torch.tensor([9, 9])]}, indexes=[1])
    batch, _ = dock.get_experience("actor_train", ["prompts"], indexes=[0, 1])
    assert [t.tolist() for t in batch["prompts"]] == [[1], [9, 9]]
    assert dock.status()["columns"]["prompts"]["ready"] == 2


def test_status_counts_rows_and_groups(make_dock):
    dock = make_dock(prompts_num=3, n=2)
    dock.put_experience({"prompts": rows_of(3)}, indexes=[0, 1, 2])
    dock.get_experience("actor_rollout", ["prompts"], 2)
    status = dock.status()
    assert status["capacity"] == 6 and status["prompts_num"] == 3 and status["n_samples_per_prompt"] == 2
    assert status["columns"]["prompts"] == {"ready": 3, "groups_ready": 1}
    assert status["columns"]["responses"] == {"ready": 0, "groups_ready": 0}
    assert status["consumers"]["actor_rollout"] == {"consumed": 2, "leased": 0, "redelivered": 0, "dead": 0}
    assert status["consumers"]["actor_train"] == {"consumed": 0, "leased": 0, "redelivered": 0, "dead": 0}


@pytest.mark.one_partition("it reads a dock's raw keys")
def test_status_is_readable_with_redis_cli_commands(make_dock, client):
    dock = make_dock(name="grpo")
    dock.put_experience({"responses": rows_of(5)}, indexes=[0, 1, 2, 3, 7])
    assert client.bitcount("td:{grpo}:ready:responses") == 5
    assert held_rows(dock, "responses") == 5  # HLEN td:{grpo}:data:responses, or over the data shards
    assert client.getbit("td:{grpo}:ready:responses", 7) == 1
    assert client.getbit("td:{grpo}:ready:responses", 4) == 0
    assert client.bitcount("td:{grpo}:gready:responses") == 2


# -- sampling -----------------------------------------------------------------------------------


@pytest.mark.one_partition("global FIFO order (a partitioned dock's is per partition)")
def test_fifo_hands_out_lowest_whole_groups_first(make_dock):
    dock = make_dock(prompts_num=4, n=2)
    fill(dock, columns=["prompts"])
    first, rows = dock.get_experience("actor_rollout", ["prompts"], 4)
    assert rows == [0, 1, 2, 3]
    assert [t[0].item() for t in first["prompts"]] == [0, 1, 2, 3]
    _, rows = dock.get_experience("actor_rollout", ["prompts"], 2)
    assert rows == [4, 5]


def test_group_qualifies_only_when_all_rows_are_ready_in_every_column(make_dock):
    dock = make_dock(prompts_num=3, n=2)
    fill(dock, columns=["prompts"])
    dock.put_experience({"responses": rows_of(3)}, indexes=[0, 2, 3])  # group 0 half, group 1 full
    _, rows = dock.get_experience("actor_train", ["prompts", "responses"], 2)
    assert rows == [2, 3]
    assert dock.get_experience("actor_train", ["prompts", "responses"], 2) == (None, None)
    dock.put_experience({"responses": rows_of(1)}, indexes=[1])
    assert dock.get_experience("actor_train", ["prompts", "responses"], 2)[1] == [0, 1]


def test_not_enough_rows_returns_none_and_marks_nothing(make_dock, partitions):
    dock = make_dock(prompts_num=4, n=2)
    fill(dock, columns=["prompts"], rows=[0, 1, 2, 3])
    # Partitioned: the groups it took from partitions before it found too few are given back.
    assert dock.get_experience("actor_rollout", ["prompts"], 6) == (None, None)
    assert dock.status()["consumers"]["actor_rollout"]["consumed"] == 0
    rows = dock.get_experience("actor_rollout", ["prompts"], 4)[1]
    assert rows == [0, 1, 2, 3] if partitions == 1 else sorted(rows) == [0, 1, 2, 3]  # FIFO is per partition


def test_single_row_sampling_and_its_effect_on_groups(make_dock):
    dock = make_dock(prompts_num=2, n=2)
    fill(dock, columns=["prompts"], rows=[1, 2, 3])
    _, rows = dock.get_experience("actor_rollout", ["prompts"], 2, get_n_samples=False)
    assert rows == [1, 2]
    # Groups 0 and 1 each have a consumed row now, so no whole group is left for this consumer.
    dock.put_experience({"prompts": rows_of(1)}, indexes=[0])
    assert dock.get_experience("actor_rollout", ["prompts"], 2) == (None, None)
    assert dock.get_experience("actor_rollout", ["prompts"], 2, get_n_samples=False)[1] == [0, 3]
    assert dock.all_consumed("actor_rollout")


@pytest.mark.one_partition("global FIFO order")
def test_consumers_are_independent(make_dock):
    dock = make_dock()
    fill(dock, columns=["prompts"])
    a = dock.get_experience("actor_rollout", ["prompts"], 8)[1]
    b = dock.get_experience("actor_train", ["prompts"], 8)[1]
    assert a == b == list(range(8))


@pytest.mark.one_partition("one seeded sampler (a partitioned dock starts at a random partition)")
def test_random_policy_is_reproducible_with_a_seed_and_hands_out_whole_groups(make_dock):
    picks = []
    for name in ("r1", "r2"):
        dock = make_dock(name=name, prompts_num=32, n=4, policy="random", seed=1234)
        fill(dock, columns=["prompts"])
        picks.append([dock.get_experience("actor_rollout", ["prompts"], 8)[1] for _ in range(4)])
    assert picks[0] == picks[1]
    flat = [r for batch in picks[0] for r in batch]
    assert len(set(flat)) == len(flat) == 32
    assert flat[:8] != list(range(8)) or flat[8:16] != list(range(8, 16))  # not FIFO order
    for batch in picks[0]:
        groups = {r // 4 for r in batch}
        assert len(groups) == 2 and sorted(batch) == [r for g in sorted(groups) for r in range(4 * g, 4 * g + 4)]


def test_random_policy_override_per_call_and_row_mode(make_dock):
    dock = make_dock(prompts_num=16, n=2, seed=7)
    fill(dock, columns=["prompts"])
    _, rows = dock.get_experience("actor_rollout", ["prompts"], 5, get_n_samples=False, policy="random")
    assert len(set(rows)) == 5 and rows == sorted(rows) and rows != [0, 1, 2, 3, 4]
    _, rest = dock.get_experience("actor_rollout", ["prompts"], 27, get_n_samples=False, policy="random")
    assert sorted(rows + rest) == list(range(32))


def test_all_consumed_and_clear(make_dock):
    dock = make_dock(prompts_num=2, n=2)
    fill(dock)
    assert not dock.all_consumed("actor_train")
    dock.get_experience("actor_train", ["prompts", "responses"], 4)
    assert dock.all_consumed("actor_train") and not dock.all_consumed("actor_rollout")
    dock.clear()
    status = dock.status()
    assert all(c["ready"] == 0 for c in status["columns"].values())
    assert all(c["consumed"] == 0 for c in status["consumers"].values())
    assert dock.get_experience("actor_train", ["prompts"], 2) == (None, None)
    fill(dock)  # the schema survives a clear: the dock is reusable for the next global batch
    assert dock.get_experience("actor_train", ["prompts"], 2)[1] == [0, 1]


@pytest.mark.one_partition("it reads a dock's raw keys and global FIFO order")
def test_clear_some_rows_resets_their_status_and_groups(make_dock):
    dock = make_dock(prompts_num=3, n=2)
    fill(dock, columns=["prompts"])
    dock.get_experience("actor_train", ["prompts"], 4)  # groups 0, 1
    dock.get_experience("actor_rollout", ["prompts"], 2, get_n_samples=False)  # rows 0, 1
    dock.clear(indexes=[1, 2, 3])
    status = dock.status()
    assert status["columns"]["prompts"] == {"ready": 3, "groups_ready": 1}
    assert status["consumers"]["actor_train"]["consumed"] == 1  # row 0 is still handed out
    with pytest.raises(ExperienceTimeoutError):
        dock.get_experience("actor_rollout", ["prompts"], indexes=[1])
    dock.put_experience({"prompts": rows_of(3, offset=10)}, indexes=[1, 2, 3])
    # Group 1 was cleared completely, so it is offered again; group 0 still has row 0 handed out.
    assert dock.get_experience("actor_train", ["prompts"], 2)[1] == [2, 3]
    assert dock.get_experience("actor_train", ["prompts"], 2)[1] == [4, 5]
    assert dock.get_experience("actor_train", ["prompts"], 2) == (None, None)
    batch, rows = dock.get_experience("actor_train", ["prompts"], 1, get_n_samples=False)
    assert rows == [1] and batch["prompts"][0][0].item() == 1000


# -- explicit indexes and waiting ---------------------------------------------------------------


def test_explicit_indexes_mark_rows_consumed(make_dock):
    dock = make_dock(prompts_num=2, n=2)
    fill(dock)
    batch, rows = dock.get_experience("actor_train", ["responses", "prompts"], indexes=[3, 0])
    assert rows == [3, 0] and [t[0].item() for t in batch["prompts"]] == [3, 0]
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 2
    # Groups 0 and 1 were touched, so sampling whole groups finds none left.
    assert dock.get_experience("actor_train", ["prompts"], 2) == (None, None)


def test_explicit_indexes_time_out_naming_what_is_missing_and_mark_nothing(make_dock):
    dock = make_dock(prompts_num=4, n=2)
    fill(dock, columns=["prompts"])
    fill(dock, columns=["responses"], rows=[0, 1, 2])
    start = time.monotonic()
    with pytest.raises(ExperienceTimeoutError) as info:
        dock.get_experience("actor_train", ["prompts", "responses"], indexes=[1, 2, 3, 6], timeout=0.3)
    assert time.monotonic() - start >= 0.3
    assert info.value.missing == {"responses": [3, 6]}
    assert "responses: rows [3, 6]" in str(info.value)
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 0
    with pytest.raises(ExperienceTimeoutError):  # timeout=None: check once, never wait
        dock.get_experience("actor_train", ["responses"], indexes=[3])


def test_waiting_get_is_woken_by_a_put(make_dock, monkeypatch):
    # With the safety re-check pushed out of reach, only the put's notification can end the wait early.
    monkeypatch.setattr(broker.api.handout, "_RECHECK_SECONDS", 60.0)
    dock = make_dock(prompts_num=2, n=2)
    writer = threading.Timer(0.3, lambda: fill(dock, columns=["prompts"], rows=[0, 1]))
    writer.start()
    start = time.monotonic()
    batch, rows = dock.get_experience("actor_rollout", ["prompts"], 2, timeout=20)
    elapsed = time.monotonic() - start
    writer.join()
    assert rows == [0, 1]
    assert 0.25 <= elapsed < 10


def test_waiting_explicit_get_is_woken_by_a_put(make_dock, monkeypatch):
    monkeypatch.setattr(broker.api.handout, "_RECHECK_SECONDS", 60.0)
    dock = make_dock(prompts_num=2, n=2)
    writer = threading.Timer(0.3, lambda: fill(dock, columns=["prompts"], rows=[2]))
    writer.start()
    start = time.monotonic()
    _, rows = dock.get_experience("actor_rollout", ["prompts"], indexes=[2], timeout=20)
    writer.join()
    assert rows == [2] and time.monotonic() - start < 10


def test_waiting_get_returns_none_when_time_is_up(make_dock):
    dock = make_dock()
    start = time.monotonic()
    assert dock.get_experience("actor_rollout", ["prompts"], 2, timeout=0.4) == (None, None)
    assert time.monotonic() - start >= 0.4


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, indexes, error, message",
    [
        ({"nope": [torch.ones(1)]}, [0], UnknownColumnError, "no columns \\['nope'\\]"),
        ({}, [0], InvalidExperienceError, "non-empty dict"),
        ({"prompts": [torch.ones(1)]}, [], RowIndexError, "indexes is empty"),
        ({"prompts": [torch.ones(1)]}, [8], RowIndexError, r"rows \[8\] are outside the dock's range \[0, 8\)"),
        ({"prompts": [torch.ones(1)]}, [-1], RowIndexError, "outside"),
        ({"prompts": [torch.ones(1)] * 2}, [1, 1], RowIndexError, "more than once"),
        ({"prompts": [torch.ones(1)]}, [0.5], RowIndexError, "must be ints"),
        ({"prompts": [torch.ones(1)]}, "0", RowIndexError, "list of row numbers"),
        ({"prompts": [torch.ones(1)]}, [0, 1], InvalidExperienceError, "1 rows for 2 indexes"),
        ({"prompts": torch.ones(3, 2)}, [0, 1], InvalidExperienceError, r"shape \(3, 2\) has 3 rows for 2"),
        ({"prompts": torch.tensor(1.0)}, [0], InvalidExperienceError, "0-d tensor"),
        ({"prompts": "text"}, [0], InvalidExperienceError, "got str"),
        ({"prompts": [{1, 2}]}, [0], InvalidExperienceError, "row 0: a set cannot be stored"),
        ({"prompts": [torch.ones(1, dtype=torch.float8_e4m3fnuz)]}, [0], InvalidExperienceError, "float8_e4m3fnuz"),
    ],
)
def test_bad_put_raises_and_writes_nothing(make_dock, client, data, indexes, error, message):
    dock = make_dock()
    with pytest.raises(error, match=message):
        dock.put_experience(data, indexes)
    # Only the dock's schema and epoch, and the reply its creation keeps for a resend (lua/include/once.lua).
    made = (b":meta", b":epoch", b":partitions")  # and a partitioned dock's record
    assert [k for k in server_keys(client, "td:*") if not k.endswith(made) and b":reply:" not in k] == []


def test_put_with_one_bad_column_writes_no_column(make_dock, client):
    dock = make_dock()
    with pytest.raises(InvalidExperienceError, match="'responses'"):
        dock.put_experience({"prompts": [torch.ones(1)], "responses": [torch.ones(1).to(torch.float8_e4m3fnuz)]}, [0])
    assert dock.status()["columns"]["prompts"]["ready"] == 0
    assert held_rows(dock, "prompts") == 0


@pytest.mark.parametrize(
    "args, kwargs, error, message",
    [
        (("nobody", ["prompts"], 2), {}, UnknownConsumerError, "no consumer 'nobody'"),
        (("actor_train", ["prompts", "x"], 2), {}, UnknownColumnError, r"no columns \['x'\]"),
        (("actor_train", [], 2), {}, InvalidExperienceError, "non-empty list"),
        (("actor_train", "prompts", 2), {}, InvalidExperienceError, "non-empty list"),
        (("actor_train", ["prompts", "prompts"], 2), {}, InvalidExperienceError, "twice"),
        (("actor_train", ["prompts"], 3), {}, InvalidExperienceError, "multiple of n_samples_per_prompt=2"),
        (("actor_train", ["prompts"], 0), {}, InvalidExperienceError, "positive int"),
        (("actor_train", ["prompts"]), {}, InvalidExperienceError, "positive int, got None"),
        (("actor_train", ["prompts"], 10), {}, InvalidExperienceError, "exceeds the dock's 8 rows"),
        (("actor_train", ["prompts"], 2), {"timeout": -1}, InvalidExperienceError, "timeout"),
        (("actor_train", ["prompts"], 2), {"policy": "lifo"}, InvalidExperienceError, "policy"),
        (("actor_train", ["prompts"]), {"indexes": [9]}, RowIndexError, "outside"),
        (("actor_train", ["prompts"]), {"indexes": []}, RowIndexError, "empty"),
    ],
)
def test_bad_get_raises_and_marks_nothing(make_dock, args, kwargs, error, message):
    dock = make_dock()
    fill(dock)
    with pytest.raises(error, match=message):
        dock.get_experience(*args, **kwargs)
    assert all(c["consumed"] == 0 for c in dock.status()["consumers"].values())


def test_unknown_consumer_in_all_consumed(make_dock):
    with pytest.raises(UnknownConsumerError, match="its consumers are"):
        make_dock().all_consumed("nobody")


def test_bad_clear_indexes_raise_and_clear_nothing(make_dock):
    dock = make_dock()
    fill(dock)
    with pytest.raises(RowIndexError):
        dock.clear(indexes=[0, 99])
    assert dock.status()["columns"]["prompts"]["ready"] == 8


@pytest.mark.one_partition("it writes a dock's raw keys")
def test_corrupted_bytes_raise_decode_error_naming_key_and_field(make_dock, client):
    dock = make_dock(name="grpo")
    fill(dock)
    client.hset(*data_cell(dock, "responses", 3), b"\x80\x04garbage")
    with pytest.raises(DecodeError, match=data_where(dock, "responses") + " field 3"):
        dock.get_experience("actor_train", ["prompts", "responses"], indexes=[2, 3])


@pytest.mark.one_partition("it deletes a dock's raw keys")
def test_ready_row_without_bytes_raises_missing_data(make_dock, client):
    dock = make_dock(name="grpo")
    fill(dock)
    client.hdel(*data_cell(dock, "prompts", 1))
    with pytest.raises(MissingDataError, match=data_where(dock, "prompts") + ": marked ready but holds no bytes"):
        dock.get_experience("actor_train", ["prompts"], 2)


@pytest.mark.one_partition("it writes a dock's raw keys")
def test_a_data_key_of_the_wrong_type_is_reported_not_crashed_on(make_dock, client, request):
    dock = make_dock(name="grpo")
    prompts, _ = data_cell(dock, "prompts", 0)
    client.set(prompts, "oops")
    with pytest.raises(DecodeError, match=re.escape(prompts) + " holds a string, expected a hash"):
        dock.put_experience({"prompts": [torch.ones(1)], "responses": [torch.ones(1)]}, [0])
    assert dock.status()["columns"]["responses"]["ready"] == 0  # the failed put marked nothing


@pytest.mark.one_partition("it writes a dock's raw keys")
def test_status_keys_of_the_wrong_type_are_reported_not_crashed_on(make_dock, client):
    dock = make_dock(name="grpo")
    client.hset("td:{grpo}:consumed:actor_train", "a", "b")
    fill(dock)
    with pytest.raises(DecodeError, match=r"consumed:actor_train holds a hash, expected a string"):
        dock.get_experience("actor_train", ["prompts"], 2)
    with pytest.raises(DecodeError, match=r"consumed:actor_train holds a hash"):
        dock.clear(indexes=[0])


# -- scripts, pickling, connections -------------------------------------------------------------


def test_scripts_reload_after_the_server_forgets_them(make_dock, client):
    dock = make_dock()
    fill(dock, columns=["prompts"], rows=[0, 1])
    client.script_flush()
    fill(dock, columns=["prompts"], rows=[2, 3])  # EVALSHA inside MULTI
    client.script_flush()
    assert sorted(dock.get_experience("actor_train", ["prompts"], 4)[1]) == [0, 1, 2, 3]
    client.script_flush()
    dock.clear()
    assert dock.status()["columns"]["prompts"]["ready"] == 0


@pytest.mark.real
def test_dock_pickles_as_url_and_name(real_url):
    dock = TransferDock(real_url, "pickled", prompts_num=2, n_samples_per_prompt=2, columns=["a"], consumers=["c"])
    dock.put_experience({"a": [torch.ones(1)] * 2}, [0, 1])
    data = pickle.dumps(dock)
    assert len(data) < 500 and b"pickled" in data
    clone = pickle.loads(data)
    assert clone.status() == dock.status()
    assert clone.get_experience("c", ["a"], 2)[1] == [0, 1]
    dock.delete()


def test_dock_from_a_client_without_url_refuses_to_pickle():
    import fakeredis

    dock = TransferDock(fakeredis.FakeRedis(), "x", prompts_num=1, n_samples_per_prompt=1, columns=["a"],
                        consumers=["c"])
    with pytest.raises(BrokerError, match="open it from a URL"):
        pickle.dumps(dock)


@pytest.mark.real
def test_vanished_server_raises_connection_error(monkeypatch, no_retry_pauses):
    from broker.connection import default_retry
    from broker.ops.local_redis import RedisServer

    sockets = []
    open_socket = redis.Connection._connect
    monkeypatch.setattr(redis.Connection, "_connect", lambda self: sockets.append(1) or open_socket(self))
    with RedisServer() as server:
        dock = TransferDock(server.url, "gone", prompts_num=1, n_samples_per_prompt=1, columns=["a"], consumers=["c"])
        server.stop(kill=True)
        sockets.clear()
        with pytest.raises(BrokerError, match=f"127.0.0.1:{server.port}") as info:
            dock.put_experience({"a": [torch.ones(1)]}, [0])
        assert isinstance(info.value, ConnectionError)  # after the client's retries
    # One retry loop, not retries nested in retries (9 x 9 attempts took over a minute).
    assert len(sockets) == default_retry().get_retries() + 1


def test_invalid_url_is_reported():
    with pytest.raises(BrokerError, match="invalid Redis URL"):
        TransferDock("http://x", "a", prompts_num=1, n_samples_per_prompt=1, columns=["a"], consumers=["c"])


def test_many_threads_share_one_dock(make_dock):
    dock = make_dock(prompts_num=64, n=4)
    got: list[list[int]] = []
    lock = threading.Lock()

    def consume() -> None:
        while not dock.all_consumed("actor_train"):
            _, rows = dock.get_experience("actor_train", ["prompts", "responses"], 8, timeout=0.2)
            if rows:
                with lock:
                    got.append(rows)

    def produce() -> None:
        for g in range(64):
            rows = list(range(4 * g, 4 * g + 4))
            dock.put_experience({"prompts": rows_of(4, offset=4 * g), "responses": rows_of(4)}, rows)

    threads = [threading.Thread(target=consume) for _ in range(4)] + [threading.Thread(target=produce)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    flat = sorted(r for batch in got for r in batch)
    assert flat == list(range(256))
    for batch in got:
        assert len(batch) == 8 and all(r // 4 == batch[i - i % 4] // 4 for i, r in enumerate(batch))


# -- the hostile review's smaller findings ------------------------------------------------------


def test_a_name_with_a_trailing_newline_is_refused(make_dock, client):
    with pytest.raises(SchemaError, match="invalid dock name"):
        make_dock(name="grpo\n")
    with pytest.raises(SchemaError, match="invalid column name"):
        make_dock(columns=("prompts\n",))
    assert server_keys(client) == []


def test_numpy_integers_are_accepted_wherever_ints_are(make_dock):
    dock = make_dock(prompts_num=np.int64(2), n=np.int32(2))
    assert dock.capacity == 4 and type(dock.prompts_num) is int
    fill(dock)
    assert dock.get_experience("actor_train", ["prompts"], np.int64(2))[1] == [0, 1]
    with pytest.raises(SchemaError, match="prompts_num must be a positive int"):
        make_dock(prompts_num=np.bool_(True))


def test_experience_count_with_indexes_must_match_them(make_dock):
    dock = make_dock()
    fill(dock)
    with pytest.raises(InvalidExperienceError, match="experience_count=3 with 2 indexes"):
        dock.get_experience("actor_train", ["prompts"], 3, indexes=[0, 1])
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 0
    assert dock.get_experience("actor_train", ["prompts"], 2, indexes=[0, 1])[1] == [0, 1]
    assert dock.get_experience("actor_train", ["prompts"], np.int64(1), indexes=[2])[1] == [2]


def test_timeout_inf_waits_until_the_rows_come(make_dock):
    dock = make_dock(prompts_num=1, n=2)
    writer = threading.Timer(0.3, lambda: fill(dock))
    writer.start()
    assert dock.get_experience("actor_train", ["prompts"], 2, timeout=float("inf"))[1] == [0, 1]
    writer.join()
    with pytest.raises(InvalidExperienceError, match="timeout"):
        dock.get_experience("actor_train", ["prompts"], 2, timeout=float("nan"))


@pytest.mark.one_partition("one seeded sampler (a partitioned dock starts at a random partition)")
def test_seeded_random_picks_do_not_depend_on_waiting(make_dock):
    at_once = make_dock(name="at-once", prompts_num=16, n=1, policy="random", seed=3)
    fill(at_once)
    waited = make_dock(name="waited", prompts_num=16, n=1, policy="random", seed=3)
    # Empty calls and a wait that retries several times draw no seed...
    assert waited.get_experience("actor_train", ["prompts"], 4) == (None, None)
    writer = threading.Timer(0.5, lambda: fill(waited))
    writer.start()
    first = waited.get_experience("actor_train", ["prompts"], 4, timeout=10)[1]
    writer.join()
    # ...so the same seed picks the same rows, call after call.
    assert first == at_once.get_experience("actor_train", ["prompts"], 4)[1]
    assert waited.get_experience("actor_train", ["prompts"], 4)[1] == at_once.get_experience(
        "actor_train", ["prompts"], 4)[1]


def test_duplicate_check_costs_the_same_few_calls_whatever_the_length(make_dock):
    """One duplicate in 50,001 indexes took 23 s (a list.count per row); count the calls, not the time."""
    import sys

    dock = make_dock(prompts_num=1 << 16, n=1)

    def builtin_calls(rows: list[int]) -> int:
        calls = 0

        def profile(frame, event, arg):
            nonlocal calls
            calls += event == "c_call"

        sys.setprofile(profile)
        try:
            with pytest.raises(RowIndexError, match=r"rows listed more than once: \[7\]"):
                dock.put_experience({"prompts": [torch.ones(1)] * len(rows)}, rows)
        finally:
            sys.setprofile(None)
        return calls

    short, long = builtin_calls([7, *range(50)]), builtin_calls([7, *range(50_000)])
    assert long < short + 50, (short, long)


@pytest.mark.real
def test_docks_from_one_url_share_one_client_and_close_hands_it_back(real_url):
    admin = redis.Redis.from_url(real_url)
    url = real_url + "?client_name=share-test"  # names this test's connections in CLIENT LIST

    def connections() -> int:
        return sum(c["name"] == "share-test" for c in admin.client_list())

    before = connections()
    a = TransferDock(url, "share-a", prompts_num=1, n_samples_per_prompt=1, columns=["x"], consumers=["c"])
    b = TransferDock.attach(url, "share-a")
    with TransferDock(url, "share-b", prompts_num=1, n_samples_per_prompt=1, columns=["x"], consumers=["c"]) as c:
        assert a.client is b.client is c.client
        c.put_experience({"x": [torch.ones(1)]}, [0])
        a.put_experience({"x": [torch.ones(1)]}, [0])
    with pytest.raises(BrokerError, match="'share-b' at .* was closed"):
        c.status()
    a.close()
    a.close()  # harmless
    assert b.get_experience("c", ["x"], 1)[1] == [0]  # the client lives on with its last user
    assert connections() > before
    b.close()
    assert connections() == before
    with pytest.raises(DockNotFoundError):
        TransferDock.attach(url, "nope")  # a failed open hands its share back too
    assert connections() == before


@pytest.mark.real
def test_broker_status_of_many_docks_takes_one_connection_and_one_script_call_per_dock(real_url, capsys):
    from broker.cli import main

    client = redis.Redis.from_url(real_url)
    for i in range(300):
        with TransferDock(real_url, f"many-{i:03d}", prompts_num=2, n_samples_per_prompt=2, columns=["x"],
                          consumers=["c"]) as dock:
            dock.put_experience({"x": [torch.ones(1)]}, [i % 4])
    client.config_resetstat()
    assert main(["status", "--url", real_url]) == 0
    out = capsys.readouterr().out
    assert out.count("dock many-") == 300 and "many-299" in out
    stats = client.info("commandstats")
    assert client.info("stats")["total_connections_received"] <= 1  # 0 if this process already had one
    # Every dock's counts: one atomic script call each (a waiter left by an earlier test may add a few).
    scripts = sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("evalsha", "fcall_ro"))
    assert 300 <= scripts < 320
    assert "cmdstat_exec" not in stats  # no MULTI holding the server for all of them


@pytest.fixture(params=[1, 3], ids=["whole", "partitioned"])
def partitions(request) -> int:
    """Every dock test of this file also on a dock of three partitions (see tests/conftest.py)."""
    return request.param
