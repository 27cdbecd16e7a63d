"""The MindSpeed-RL drop-in: the examples of MindSpeed's own unit tests, its worker loop, bad input.

The first tests port the inputs and assertions of MindSpeed-RL's tests/ut/utils/test_transfer_queue.py
(TestGRPOTransferDock, TestTransferQueue); they run on fakeredis and on real Redis servers.
"""

from __future__ import annotations

import itertools
import multiprocessing
import random
import time

import pytest
import torch
from tensordict import TensorDict

from broker import ExperienceTimeoutError, RowIndexError
from broker.adapters.mindspeed import (
    DEFAULT_COLUMNS,
    DEFAULT_CONSUMERS,
    GRPOTransferDock,
    Metric,
    TransferQueueClient,
    get_transfer_queue_client,
)
from broker.adapters.mindspeed.padding import padding_dict_to_tensor_dict, remove_padding_tensor_dict_to_dict
from broker.api.batches import put_prompts_experience
from tests.helpers import server_keys, worker_processes

_names = itertools.count()


@pytest.fixture(params=[1, 4], ids=["whole", "partitioned"])
def partitions(request) -> int:
    """The tests taking ``td`` run on a dock of one partition and of four (see tests/conftest.py)."""
    return request.param


@pytest.fixture
def td(client, partitions):
    """MindSpeed's dock."""
    dock = GRPOTransferDock(prompts_num=16, n_samples_per_prompt=1, metrics=Metric(), url=client,
                            name=f"ms{next(_names)}", partitions=partitions)
    yield dock
    dock.clear()


@pytest.fixture
def tq(client):
    queue = TransferQueueClient(client)
    topic = f"ut_transfer_queue_{random.randint(1000, 9999)}"
    queue.add_topic(prompts_num=2, n_samples_per_prompt=1, experience_columns=["prompts"],
                    experience_consumers=["actor_rollout"], metrics=Metric(), topic=topic)
    queue.register_consumer_columns_dict({"actor_rollout": ["prompts"]}, topic=topic)
    yield queue, topic
    queue.clear_topic(topic)
    queue.delete_topic(topic)


# -- MindSpeed's TestGRPOTransferDock -----------------------------------------------------------

def test_init_has_mindspeeds_columns_and_consumers(td):
    assert "grpo_metrics" in td.get_consumer_status()
    assert td.experience_columns == list(DEFAULT_COLUMNS) and td.experience_consumers == list(DEFAULT_CONSUMERS)
    assert td.get_experience_len() == 16


def test_get_experience(td):
    prompts = [torch.randn(1, 8) for _ in range(4)]
    put_indexes = random.sample(range(16), 4)
    td.put_experience(data_dict=TensorDict.from_dict({"prompts": torch.stack(prompts)}), indexes=put_indexes)
    get_indexes = random.sample(put_indexes, 2)
    batch, indexes = td.get_experience(consumer="actor_rollout", experience_columns=["prompts"], indexes=get_indexes)
    assert indexes == get_indexes and len(batch["prompts"]) == 2


def test_put_experience(td):
    prompts = [torch.randn(1, 8) for _ in range(4)]
    put_indexes = random.sample(range(16), 4)
    td.put_experience(data_dict=TensorDict.from_dict({"prompts": torch.stack(prompts)}), indexes=put_indexes)
    for k, index in enumerate(put_indexes):
        batch, out = td.get_experience(consumer="actor_rollout", experience_columns=["prompts"], indexes=[index])
        assert out[0] == index
        assert torch.equal(batch["prompts"][0], prompts[k])


# -- MindSpeed's TestTransferQueue --------------------------------------------------------------

def test_put_get(tq):
    queue, topic = tq
    prompts = torch.stack([torch.randn(1, 8) for _ in range(2)])
    queue.put_experience({"prompts": prompts}, indexes=[0, 1], topic=topic)
    batch, indexes = queue.get_experience(consumer="actor_rollout", experience_columns=["prompts"], indexes=[1],
                                          topic=topic)
    assert indexes == [1] and torch.equal(batch["prompts"][0], prompts[1])


def test_all_consumed(tq):
    queue, topic = tq
    queue.put_experience({"prompts": torch.stack([torch.randn(1, 8) for _ in range(2)])}, indexes=[0, 1], topic=topic)
    _, indexes = queue.get_experience(consumer="actor_rollout", experience_columns=["prompts"], experience_count=2,
                                      topic=topic)
    assert indexes == [0, 1]
    assert queue.all_consumed(consumer="actor_rollout", topic=topic, get_n_samples=True)


def test_consumer_columns(tq):
    queue, topic = tq
    queue.register_consumer_columns_dict({"actor_rollout": ["prompts"]}, topic=topic)
    assert queue.get_columns(consumer="actor_rollout", topic=topic) == ["prompts"]


def test_dp_padding(tq):
    queue, topic = tq
    queue.put_experience({"prompts": torch.stack([torch.randn(1, 8)])}, indexes=[0], topic=topic)
    batch, indexes = queue.get_experience(consumer="actor_rollout", experience_columns=["prompts"],
                                          experience_count=2, indexes=[0], topic=topic, dp_size=2,
                                          require_dp_padding=True)
    assert len(indexes) == 2 and indexes[1] == -2 and batch["prompts"].shape[0] == 2


def test_metrics_accumulate(tq):
    queue, topic = tq
    queue.update_metrics(key="metric/test", value=[1.0], cumulate=True, topic=topic)
    queue.update_metrics(key="metric/test", value=[2.0], cumulate=True, topic=topic)
    assert queue.get_metrics(topic).metric["metric/test"] == [1.0, 2.0]


def test_multimodal_put_get(client):
    queue, topic = TransferQueueClient(client), f"multimodal_{random.randint(1000, 9999)}"
    queue.add_topic(prompts_num=2, n_samples_per_prompt=1, experience_columns=["pixel_values", "image_num", "labels"],
                    experience_consumers=["actor_rollout"], topic=topic)
    queue.put_experience({"pixel_values": torch.randn(2, 3), "image_num": torch.tensor([[1], [1]], dtype=torch.int32),
                          "labels": ["a", "b"]}, indexes=[0, 1], topic=topic)
    batch, indexes = queue.get_experience(consumer="actor_rollout",
                                          experience_columns=["pixel_values", "image_num", "labels"],
                                          indexes=[0, 1], topic=topic)
    assert indexes == [0, 1] and list(batch["labels"]) == ["a", "b"]
    assert batch["pixel_values"].shape == (2, 3) and batch["image_num"].shape == (2, 1)
    assert queue.get_mm_labels(topic, [1]) == ["b"]


# -- beyond MindSpeed's own tests -----------------------------------------------------------------

def test_what_comes_back_is_mindspeeds_padded_format(td):
    rows = [torch.tensor([1, 2, 3]), torch.tensor([4])]
    td.put_experience({"prompts": rows, "prompt_length": [torch.tensor([3]), torch.tensor([1])]}, [0, 1])
    batch, indexes = td.get_experience("actor_rollout", ["prompts", "prompt_length"], indexes=[0, 1])
    assert isinstance(batch, TensorDict) and indexes == [0, 1]
    assert batch["prompts"].tolist() == [[1, 2, 3], [4, 0, 0]]
    assert batch["prompts"].dtype == torch.int32  # int64 is stored as int32, as MindSpeed's dock does
    assert batch["original_length"].tolist() == [3, 1, 1, 1]
    back = remove_padding_tensor_dict_to_dict(batch)
    assert [r.tolist() for r in back["prompts"]] == [[1, 2, 3], [4]]


def test_a_padded_int64_batch_is_stored_as_int32_and_none_columns_are_skipped(td):
    padded = padding_dict_to_tensor_dict({"prompts": [torch.tensor([1, 2, 3]), torch.tensor([2**40 + 4])]})
    assert padded["prompts"].dtype == torch.int64  # what MindSpeed's workers hand over
    td.put_experience(padded, [0, 1])
    td.put_experience({"responses": [torch.tensor([7]), torch.tensor([8])], "labels": None}, [0, 1])
    batch, _ = td.get_experience("actor_rollout", ["prompts", "responses"], indexes=[0, 1])
    assert batch["prompts"].dtype == torch.int32
    assert batch["prompts"].tolist() == [[1, 2, 3], [4, 0, 0]]  # wrapped to int32, as MindSpeed's .to(int32)
    assert batch["original_length"].tolist() == [3, 1, 1, 1]
    assert not td.get_experience_status()["labels"].any()


def test_sampling_returns_none_at_once_and_never_waits(td):
    assert td.get_experience("actor_train", ["prompts"], 4) == (None, None)


def test_a_missing_explicit_row_ends_with_a_clear_error_not_a_hang(client):
    td = GRPOTransferDock(2, 1, url=client, name=f"ms{next(_names)}", timeout=0.2)
    with pytest.raises(ExperienceTimeoutError, match=r"prompts: rows \[1\]"):
        td.get_experience("actor_train", ["prompts"], indexes=[1])
    assert not td.get_consumer_status()["actor_train"].any()


@pytest.mark.one_partition("seqlen balances a batch within the partition it takes it from")
def test_seqlen_balance_hands_out_a_batch_of_average_length(td):
    lengths = [5, 100, 7, 90, 6, 95, 8, 99, 4, 97, 9, 96, 3, 98, 2, 94]  # alternating short and long
    td.put_experience({"prompts": [torch.ones(1)] * 16, "prompt_length": [torch.tensor([0])] * 16,
                       "response_length": [torch.tensor([x]) for x in lengths]}, list(range(16)))
    _, rows = td.get_experience("actor_train", ["prompts"], 4, use_batch_seqlen_balance=True)
    total = sum(lengths[r] for r in rows)
    assert abs(total - sum(lengths) / 4) < 0.1 * sum(lengths) / 4


def test_puts_skip_negative_indexes_as_mindspeed_does(td):
    padded = padding_dict_to_tensor_dict({"responses": [torch.tensor([1]), torch.tensor([2]), torch.tensor([2])]})
    td.put_experience(padded, [3, 4, -2])
    assert td.get_experience_status()["responses"].nonzero().flatten().tolist() == [3, 4]
    with pytest.raises(RowIndexError):
        td.put_experience({"responses": [torch.tensor([1])]}, [16])


def test_prefetch_and_metrics_are_shared_between_objects_on_one_dock(client):
    name = f"ms{next(_names)}"
    a, b = GRPOTransferDock(4, 2, url=client, name=name), GRPOTransferDock(4, 2, url=client, name=name)
    assert a.prefetch_request_index(3) == [0, 1, 2] and b.prefetch_request_index(3) == [3, 4, 5]
    assert b.get_cur_index() == 6 and a.prefetch_request_index(3) == [6, 7] and b.prefetch_request_index(1) is None
    a.update_metrics(value={"x": 1, "y": [2]})
    b.update_metrics("y", [3], cumulate=True)
    assert a.get_metrics().metric == {"x": 1, "y": [2, 3]}
    b.clear()
    assert a.get_metrics().metric == {} and a.get_cur_index() == 0


def test_a_second_process_with_more_columns_grows_the_dock(client):
    name = f"ms{next(_names)}"
    first = GRPOTransferDock(2, 1, url=client, name=name)
    first.put_experience({"prompts": [torch.tensor([1]), torch.tensor([2])]}, [0, 1])
    second = GRPOTransferDock(2, 1, addition_columns=["values"], addition_consumers=["critic"], url=client, name=name)
    second.put_experience({"values": [torch.tensor([0.5]), torch.tensor([0.25])]}, [0, 1])
    batch, _ = first.get_experience("critic", ["prompts", "values"], 2)  # the old object follows the growth
    assert batch["values"].flatten().tolist() == [0.5, 0.25]
    with pytest.raises(ValueError, match="holds 2 prompts x 1 samples, not 4 x 1"):
        GRPOTransferDock(4, 1, url=client, name=name)


# -- bad input: MindSpeed's ValueErrors, nothing changed in Redis ---------------------------------

def snapshot(client) -> dict[bytes, bytes]:
    return {k: client.dump(k) for k in server_keys(client) if b":reply:" not in k}


@pytest.mark.parametrize("call, message", [
    (lambda td: td.get_experience("nobody", ["prompts"], 4), "nobody not in TD experience_consumers"),
    (lambda td: td.get_experience("actor_train", ["nothing"], 4), "nothing not in TD experience_column"),
    (lambda td: td.get_experience("actor_train", ["prompts"], 32), "experience_count 32 exceeds the dock.s 16 rows"),
    (lambda td: td.get_experience("actor_train", ["prompts"], 3), "need be divisible by experience_count: 3"),
    (lambda td: td.get_experience("actor_train", ["prompts"], None), "experience_count must be a positive int"),
    (lambda td: td.put_experience({"prompts": [torch.ones(1)]}, None), "indexes must be provided"),
    (lambda td: td.put_experience({"prompts": [torch.ones(1)]}, []), "indexes must be provided"),
    (lambda td: td.put_experience({"nothing": [torch.ones(1)]}, [0]), "nothing not in TD experience_column"),
    (lambda td: td.put_experience({"prompts": [{1}]}, [0]), "a set cannot be stored"),
    (lambda td: td.put_experience("prompts", [0]), "a dict or a TensorDict"),
    (lambda td: td.prefetch_request_index(0), "experience_num must be a positive int"),
    (lambda td: td.update_metrics("x", "fast"), "a number or a list of numbers"),
])
def test_bad_input_to_the_dock_raises_value_error_and_changes_nothing(td, client, call, message):
    td.put_experience({"prompts": [torch.ones(1)] * 16}, list(range(16)))
    td.update_metrics("kept", 1)
    before = snapshot(client)
    with pytest.raises(ValueError, match=message):
        call(td)
    assert snapshot(client) == before


@pytest.mark.parametrize("call, message", [
    (lambda q, t: q.add_topic(2, 1, ["prompts"], ["actor_rollout"], topic=t), "already exists"),
    (lambda q, t: q.add_topic(2, 1, ["prompts"], ["actor_rollout"], topic=""), "Topic must be non-empty"),
    (lambda q, t: q.get_experience("actor_rollout", ["prompts"], 1, topic="nope"), "Unknown topic 'nope'"),
    (lambda q, t: q.get_experience("actor_rollout", ["prompts"], topic=t), "Either experience_count or indexes"),
    (lambda q, t: q.get_experience("nobody", None, 1, topic=t), "no experience columns registered for consumer"),
    (lambda q, t: q.put_experience({"prompts": [torch.ones(1)]}, [], topic=t), "No indexes provided"),
    (lambda q, t: q.all_updated("nothing", topic=t), "Column 'nothing' not recognized"),
    (lambda q, t: q.add_topic(2, 1, ["prompts"], ["actor_rollout"], timeout="abc", topic=t + "x"), "timeout"),
    (lambda q, t: q.add_topic(2, 1, ["prompts"], ["actor_rollout"], timeout=float("nan"), topic=t + "x"), "timeout"),
    (lambda q, t: q.add_topic(2, 1, ["prompts"], ["actor_rollout"], timeout=-1, topic=t + "x"), "timeout"),
    (lambda q, t: q.add_topic(2, 1, "prompts", ["actor_rollout"], topic=t + "x"), "list of names"),
    (lambda q, t: q.create_timing_item(""), "non-empty string"),
    (lambda q, t: q.get_timing("nope"), "Unknown timing name"),
])
def test_bad_input_to_the_queue_raises_value_error_and_changes_nothing(tq, client, call, message):
    queue, topic = tq
    before = snapshot(client)
    with pytest.raises(ValueError, match=message):
        call(queue, topic)
    assert snapshot(client) == before


@pytest.mark.parametrize("kwargs, message", [
    ({"addition_columns": "xyz"}, "addition_columns must be a list of names"),
    ({"addition_consumers": "critic"}, "addition_consumers must be a list of names"),
    ({"timeout": float("nan")}, "timeout must be"),
    ({"timeout_interval": -1}, "timeout_interval must be"),
])
def test_bad_arguments_of_the_dock_are_refused_before_it_is_made(client, kwargs, message):
    """``addition_columns="xyz"`` made columns x, y and z; a NaN or negative timeout was taken."""
    with pytest.raises(ValueError, match=message):
        GRPOTransferDock(prompts_num=2, n_samples_per_prompt=1, url=client, name="refused", **kwargs)
    assert server_keys(client, "td:{refused}:*") == []


def test_a_topic_follows_another_clients_resize_and_delete_and_add(client):
    """The second client kept its cached dock: RowIndexError and "open the dock again" for ever after."""
    first, second = TransferQueueClient(client), TransferQueueClient(client)
    topic = f"follow_{random.randint(1000, 9999)}"
    first.add_topic(2, 1, ["prompts"], ["actor_rollout"], topic=topic)
    second.put_experience({"prompts": [torch.ones(1)] * 2}, [0, 1], topic=topic)  # caches the 2-row topic
    first.clear_and_resize_topic(4, 2, topic=topic)
    assert second.get_max_len(topic) == 8
    first.clear_and_resize_topic(4, 2, topic=topic)
    second.put_experience({"prompts": [torch.ones(1)] * 8}, list(range(8)), topic=topic)  # rows 2..7: new
    _, rows = second.get_experience("actor_rollout", ["prompts"], 8, topic=topic)
    assert sorted(rows) == list(range(8))
    first.delete_topic(topic)
    first.add_topic(3, 1, ["prompts", "responses"], ["actor_rollout"], topic=topic)
    second.put_experience({"responses": [torch.ones(1)] * 3}, [0, 1, 2], topic=topic)
    assert second.all_updated("responses", topic=topic)
    first.delete_topic(topic)
    with pytest.raises(ValueError, match="Unknown topic"):
        second.put_experience({"responses": [torch.ones(1)]}, [0], topic=topic)


def test_pickling_needs_a_url_and_carries_the_resolved_one(client, url, monkeypatch):
    """``url=None`` pickled without its URL: a Ray worker whose $REDIS_URL differs made the dock on another
    server. A client object cannot cross processes: a clear error, not pickle's TypeError about a lock."""
    import pickle

    from broker import BrokerError

    monkeypatch.setenv("REDIS_URL", url)
    td = GRPOTransferDock(prompts_num=2, n_samples_per_prompt=1, name="pickled")
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # the worker's: nothing listens there
    again = pickle.loads(pickle.dumps(td))
    assert again.dock.status()["capacity"] == 2
    for made_from_client in (TransferQueueClient(client),
                             GRPOTransferDock(prompts_num=2, n_samples_per_prompt=1, url=client, name="pickled")):
        with pytest.raises(BrokerError, match="cannot be pickled.*make it from a URL"):
            pickle.dumps(made_from_client)
    td.dock.delete()


def test_partial_rollout_needs_gbs_train_and_partial_data_needs_partial_rollout(client):
    with pytest.raises(ValueError, match="GBS for update must be provided"):
        GRPOTransferDock(2, 1, max_age=2, url=client, name=f"ms{next(_names)}")
    queue = TransferQueueClient(client)
    queue.add_topic(2, 1, ["prompts"], ["actor_rollout"], topic="pr")
    with pytest.raises(ValueError, match="partial_ready"):
        queue.put_experience({"prompts": [torch.ones(1)]}, [0], topic="pr", data_status="partial_ready")
    with pytest.raises(ValueError, match="allow_partial_ready_data"):
        queue.get_experience("actor_rollout", ["prompts"], 1, topic="pr", allow_partial_ready_data=True)


def test_the_factory_and_timings(client, monkeypatch):
    assert isinstance(get_transfer_queue_client(), TransferQueueClient)
    queue = TransferQueueClient(client)
    queue.create_timing_item("reward")
    queue.accumulate_timing("reward", 0.25)
    assert queue.get_timing("reward") == 0.25 and set(queue.get_timings()) == {"put", "get", "dispatch", "reward"}
    queue.reset_timings()
    assert queue.get_timing("reward") == 0.0


def test_clear_and_resize_topic_keeps_columns_and_registrations(tq):
    queue, topic = tq
    queue.clear_and_resize_topic(4, 2, topic)
    assert queue.get_max_len(topic) == 8 and queue.get_columns("actor_rollout", topic) == ["prompts"]


def test_reset_consumer_status_offers_rows_again(tq):
    queue, topic = tq
    queue.put_experience({"prompts": torch.ones(2, 1)}, [0, 1], topic=topic)
    queue.get_experience("actor_rollout", experience_count=2, topic=topic)
    queue.reset_consumer_status("actor_rollout", topic, indexes=[1])
    _, rows = queue.get_experience("actor_rollout", experience_count=1, topic=topic)
    assert rows == [1]
    queue.reset_consumer_status("actor_rollout", topic)
    assert not queue.all_consumed("actor_rollout", topic)


# -- MindSpeed's worker loop, in several processes ------------------------------------------------

STAGES = {  # consumer: (columns read, what it writes from them)
    "actor_rollout": ["prompts", "prompt_length"],
    "ref_log_prob": ["prompts", "responses"],
    "rule_reward": ["responses", "response_length"],
    "compute_advantage": ["rm_scores", "response_length"],
    "actor_train": ["prompts", "responses", "ref_log_prob", "rm_scores", "advantages"],
}


def compute(stage: str, data: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """Each stage's output is a function of its input, so the trainer can check every byte."""
    if stage == "actor_rollout":
        responses = [p.flip(0) * 10 + 1 for p in data["prompts"]]
        return {"responses": responses, "response_length": [torch.tensor([len(r)]) for r in responses]}
    if stage == "ref_log_prob":
        return {"ref_log_prob": [r.float() * 0.5 for r in data["responses"]]}
    if stage == "rule_reward":
        return {"rm_scores": [r.sum(dim=0, keepdim=True).float() for r in data["responses"]]}
    if stage == "compute_advantage":
        return {"advantages": [s - 1 for s in data["rm_scores"]]}
    return {}


def run_stage(url: str, name: str, stage: str, out: multiprocessing.Queue) -> None:
    td = GRPOTransferDock(8, 2, url=url, name=name)
    seen, bad = [], []
    while not td.all_consumed(stage):
        batch, indexes = td.get_experience(stage, STAGES[stage], 4)
        if batch is None:
            continue
        data = remove_padding_tensor_dict_to_dict(batch)
        seen += indexes
        if stage == "actor_train":
            for i, row in enumerate(indexes):
                prompt, response = data["prompts"][i], data["responses"][i]
                ok = (torch.equal(response, prompt.flip(0).to(torch.int32) * 10 + 1)
                      and torch.equal(data["ref_log_prob"][i], response.float() * 0.5)
                      and torch.equal(data["advantages"][i], data["rm_scores"][i] - 1)
                      and int(prompt[0]) == row // 2)
                if not ok:
                    bad.append(row)
        else:
            td.put_experience(padding_dict_to_tensor_dict(compute(stage, data)), indexes)
    out.put((stage, seen, bad))


@pytest.mark.slow
def test_mindspeeds_worker_loop_runs_through_the_adapter_in_many_processes(url):
    name = f"ms{next(_names)}"
    driver = GRPOTransferDock(8, 2, url=url, name=name)
    prompts = [torch.arange(g, g + 3 + g % 4) for g in range(8)]  # prompt g starts with g
    data, indexes = put_prompts_experience({"prompts": prompts}, 2)
    driver.put_experience(data, indexes)
    ctx = worker_processes()
    out = ctx.Queue()
    procs = [ctx.Process(target=run_stage, args=(url, name, stage, out)) for stage in STAGES for _ in range(2)]
    for p in procs:
        p.start()
    results = [out.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(60)
    for stage in STAGES:
        seen = [r for s, rows, _ in results if s == stage for r in rows]
        assert sorted(seen) == list(range(16)), stage  # every row, once, per stage
    assert all(not bad for _, _, bad in results)


def test_reset_all_deletes_every_topic_of_the_client(client):
    queue = TransferQueueClient(client)
    for topic in ("a", "b"):
        queue.add_topic(2, 1, ["prompts"], ["actor_rollout"], topic=topic)
    GRPOTransferDock(2, 1, url=client, name="not_a_topic")
    queue.reset_all()
    for topic in ("a", "b"):
        with pytest.raises(ValueError, match=f"Unknown topic '{topic}'"):
            queue.get_experience("actor_rollout", ["prompts"], 1, topic=topic)
    assert client.exists("td:{not_a_topic}:meta")  # another dock on the server stays


@pytest.mark.parametrize("indexes", [[0.5], ["1"], "01", 3])
def test_indexes_that_are_not_ints_are_refused_not_rounded(td, client, indexes):
    before = snapshot(client)
    with pytest.raises(RowIndexError):
        td.put_experience({"prompts": [torch.ones(1)]}, indexes)
    with pytest.raises(RowIndexError):
        td.get_experience("actor_train", ["prompts"], indexes=indexes)
    assert snapshot(client) == before


def test_incomplete_response_num_counts_as_mindspeeds_does_without_partial_rollout(td):
    assert td.get_incomplete_response_num() == 0
    td.put_experience({"prompts": [torch.ones(2)] * 3}, [0, 5, 9])
    assert td.get_incomplete_response_num() == 3  # prompts written; no response marked finished


def test_the_queue_counts_prompts_without_responses(client):
    queue = TransferQueueClient(client)
    queue.add_topic(4, 1, ["prompts", "responses"], ["actor_rollout"], topic="inc")
    queue.put_experience({"prompts": [torch.ones(1)] * 3}, [0, 1, 2], topic="inc")
    queue.put_experience({"responses": [torch.ones(1)]}, [1], topic="inc")
    assert queue.get_incomplete_response_num(topic="inc") == 2


# -- writes fenced without the callers changing code ------------------------------------------------


def _stage(td, consumer="rule_reward", count=2):
    """A MindSpeed stage's get: the prompts of ``count`` rows and the indexes, as its workers call it."""
    batch, index = td.get_experience(consumer=consumer, experience_columns=["prompts"], experience_count=count,
                                     get_n_samples=False)
    return [p[0].item() for p in batch["prompts"]], index


def _scores(td, index):
    return [None if s is None else s.item() for s in td.dock.read_rows(["rm_scores"], list(index))["rm_scores"]]


def test_a_late_put_after_the_driver_cleared_and_refilled_is_dropped(td, caplog):
    td.put_experience({"prompts": torch.tensor([[111.0], [111.0]])}, indexes=[0, 1])
    prompts, index = _stage(td)
    td.clear()
    td.put_experience({"prompts": torch.tensor([[222.0], [222.0]])}, indexes=[0, 1])  # the next batch
    td.put_experience({"rm_scores": torch.tensor([[1.0], [1.0]])}, indexes=index)  # the slow worker's result
    assert "dropped" in caplog.text and "cleared" in caplog.text
    assert _scores(td, [0, 1]) == [None, None]  # prompt 222 is not paired with prompt 111's score


def test_with_a_lease_a_late_worker_writes_nothing_and_the_redo_counts(client):
    name = f"ms{next(_names)}"
    slow = GRPOTransferDock(2, 1, url=client, name=name, lease=0.1)
    fast = GRPOTransferDock(2, 1, url=client, name=name, lease=30)
    slow.put_experience({"prompts": torch.tensor([[1.0], [2.0]])}, indexes=[0, 1])
    _, index = _stage(slow)
    time.sleep(0.2)  # the slow worker's lease runs out; the rows go to another worker
    _, again = _stage(fast)
    assert sorted(again) == sorted(index)
    fast.put_experience({"rm_scores": torch.tensor([[20.0], [20.0]])}, indexes=again)
    slow.put_experience({"rm_scores": torch.tensor([[10.0], [10.0]])}, indexes=index)  # dropped
    assert _scores(fast, [0, 1]) == [20.0, 20.0]
    assert fast.all_consumed("rule_reward")  # the put acked the redone rows
    slow.clear()


def test_with_a_lease_the_next_get_acks_what_a_consumer_that_writes_nothing_was_handed(client):
    name = f"ms{next(_names)}"
    trainer = GRPOTransferDock(4, 1, url=client, name=name, lease=0.2)
    trainer.put_experience({"prompts": torch.tensor([[1.0], [2.0], [3.0], [4.0]])}, indexes=[0, 1, 2, 3])
    _stage(trainer, "actor_train")
    _stage(trainer, "actor_train")  # the first batch is trained: this get acks it
    assert trainer.all_consumed("actor_train")  # ... and the loop's check acks the second
    time.sleep(0.3)
    assert trainer.all_consumed("actor_train")  # nothing came back after the lease
    assert trainer.dock.status()["consumers"]["actor_train"]["redelivered"] == 0
    # A trainer that dies holding a batch: it comes back to the next one after the lease.
    trainer.clear()
    trainer.put_experience({"prompts": torch.tensor([[1.0], [2.0]])}, indexes=[0, 1])
    dead = GRPOTransferDock(4, 1, url=client, name=name, lease=0.1)
    _stage(dead, "actor_train")
    time.sleep(0.2)
    assert sorted(_stage(trainer, "actor_train")[1]) == [0, 1]
    trainer.clear()
