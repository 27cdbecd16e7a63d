"""broker.transfer_queue's low-level client: get_meta's modes and samplers applied atomically across processes,
leases (a reader that dies loses nothing; a late writer is fenced), statuses, custom meta and clears."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import torch

pytest.importorskip("tensordict")
from tensordict import TensorDict  # noqa: E402

import broker.transfer_queue as tq  # noqa: E402
from broker import BrokerError, FencedError  # noqa: E402
from broker.transfer_queue.sampler import BaseSampler, GRPOGroupNSampler, SequentialSampler  # noqa: E402
from tests.helpers import worker_processes  # noqa: E402


def conf(url: str, namespace: str, **controller: Any) -> dict[str, Any]:
    return {"broker": {"url": url, "namespace": namespace, "get_meta_timeout": 0.5}, "controller": controller}


@pytest.fixture(params=[1, 3])
def partitions(request) -> int:
    """Every test of the client also on a system cut into three sub-systems (``broker.partitions``): the
    partitions these tests use ("p" and "q", "train" and "val") live in different ones."""
    return int(request.param)


@pytest.fixture
def client(url, partitions):
    namespace = "c" + uuid.uuid4().hex[:8]
    tq.init({**conf(url, namespace), "broker": {**conf(url, namespace)["broker"], "partitions": partitions}})
    yield tq.get_client()
    tq.get_client().systems.delete()
    tq.close()


def rows(n: int, start: int = 0) -> TensorDict:
    return TensorDict({"x": torch.arange(start, start + n), "y": torch.ones(n, 2)}, batch_size=n)


def test_insert_then_put_then_fetch_then_get(client):
    meta = client.get_meta(["x", "y"], 4, "p", mode="insert")
    assert meta.size == 4 and not meta.is_ready
    put = client.put(rows(4), meta)
    assert put.is_ready and put.global_indexes == meta.global_indexes
    got = client.get_meta(["x"], 3, "p", task_name="train")
    assert got.size == 3 and got.is_ready
    data = client.get_data(got)
    assert data["x"].tolist() == [0, 1, 2]
    rest = client.get_meta(["x"], 1, "p", task_name="train")
    assert client.get_data(rest)["x"].tolist() == [3]
    assert client.check_consumption_status("train", "p")
    everything = client.get_meta([], None, "p", mode="force_fetch")
    assert everything.size == 4


def test_a_put_fills_in_the_meta_it_was_given_and_returns_it_as_transfer_queue_does(client):
    """verl's tqbridge ignores what put returns and reads the new fields from its own meta: TransferQueue's put
    adds the data's fields to the meta given, in place, marks its samples produced, and returns that object.
    An insert-mode meta names every field asked for (a placeholder schema where none exists yet), and
    get_data of a meta naming no field is an empty TensorDict. The drop-in returned a new meta, left the one
    given as it was, named no field in an insert-mode meta, and raised for a meta without fields."""
    meta = client.get_meta(["x", "y", "later"], 2, "p", mode="insert")
    assert meta.field_names == ["later", "x", "y"] and meta.production_status.tolist() == [0, 0]
    assert meta.field_schema["later"] == {"dtype": None, "shape": None, "is_nested": False, "is_non_tensor": False}
    returned = client.put(rows(2), meta)
    assert returned is meta and meta.is_ready and meta.field_schema["x"]["dtype"] == torch.int64
    assert meta.field_schema["later"]["dtype"] is None  # not put: its placeholder stays, as there
    made = client.put(rows(2, start=5), partition_id="q")  # no meta: an insert's, filled in
    assert made.field_names == ["x", "y"] and made.is_ready
    empty = client.kv_retrieve_meta(["a", "b"], "r", create=True)
    assert empty.field_names == [] and client.get_data(empty).batch_size == torch.Size([0])


def test_too_few_ready_rows_time_out_or_come_back_empty_in_polling_mode(url):
    namespace = "poll" + uuid.uuid4().hex[:6]
    tq.init(conf(url, namespace))
    try:
        c = tq.get_client()
        c.put(rows(2), partition_id="p")
        with pytest.raises(TimeoutError, match="3 samples with fields"):
            c.get_meta(["x"], 3, "p", task_name="t")
        assert not c.check_consumption_status("t", "p")  # nothing was marked
    finally:
        tq.get_client().system.delete()
        tq.close()
    tq.init(conf(url, namespace + "b", polling_mode=True))
    try:
        assert tq.get_client().get_meta(["x"], 3, "p", task_name="t").size == 0
    finally:
        tq.get_client().system.delete()
        tq.close()


def _fetch_all(url: str, namespace: str, sampler: Any, batch: int, out: Any) -> None:
    tq.init(conf(url, namespace, sampler=sampler))
    client = tq.get_client()
    got: list[list[int]] = []
    while True:
        try:
            meta = client.get_meta(["x"], batch, "p", task_name="train")
        except TimeoutError:
            break
        got.append(list(meta.global_indexes))
    out.put(got)
    tq.close()


@pytest.mark.parametrize("sampler, batch", [(SequentialSampler(), 3), (GRPOGroupNSampler(n_samples_per_prompt=4), 8)])
def test_processes_fetching_at_once_never_share_a_row_and_never_split_a_group(client, url, sampler, batch):
    client.put(rows(48), partition_id="p")
    namespace, base = client.systems.namespace, client.systems.route("p").base  # "p"'s first global index
    ctx = worker_processes()
    out = ctx.Queue()
    procs = [ctx.Process(target=_fetch_all, args=(url, namespace, sampler, batch, out)) for _ in range(3)]
    for p in procs:
        p.start()
    batches = [b for _ in procs for b in out.get(timeout=120)]
    for p in procs:
        p.join(timeout=60)
    assert sorted(r for b in batches for r in b) == list(range(base, base + 48))  # each row once, to one process
    if isinstance(sampler, GRPOGroupNSampler):  # each batch is two whole groups of 4 consecutive rows
        for b in batches:
            groups = [sorted(b[i:i + 4]) for i in range(0, len(b), 4)]
            assert all(g == list(range(g[0], g[0] + 4)) for g in groups), b


class EveryOther(BaseSampler):
    """A user's sampler: every other ready row."""

    def sample(self, ready_indexes, batch_size, *args, **kwargs):
        chosen = sorted(ready_indexes)[::2][:batch_size]
        if len(chosen) < batch_size:
            return [], []
        return chosen, chosen


def test_a_users_sampler_subclass_chooses(url):
    namespace = "own" + uuid.uuid4().hex[:6]
    tq.init({**conf(url, namespace), "controller": {"sampler": EveryOther()}})
    try:
        c = tq.get_client()
        c.put(rows(6), partition_id="p")
        assert c.get_meta(["x"], 2, "p", task_name="t").global_indexes == [0, 2]
        assert c.get_meta(["x"], 2, "p", task_name="t").global_indexes == [1, 4]
    finally:
        tq.get_client().system.delete()
        tq.close()


class Failing(BaseSampler):
    """A user's sampler with a bug."""

    def sample(self, ready_indexes, batch_size, *args, **kwargs):
        return [ready_indexes[0] / 0], []


def test_a_users_sampler_that_fails_is_a_runtime_error_as_transfer_queues_controller_answers_and_takes_nothing(url):
    """TransferQueue runs samplers in its controller: get_meta raises RuntimeError whatever the sampler raised.
    Here the sampler runs in the caller's get_meta: its error is wrapped the same way, naming it, and no row is
    consumed."""
    namespace = "bad" + uuid.uuid4().hex[:6]
    tq.init({**conf(url, namespace), "controller": {"sampler": Failing()}})
    try:
        c = tq.get_client()
        c.put(rows(2), partition_id="p")
        with pytest.raises(RuntimeError, match="sampler Failing failed: ZeroDivisionError") as info:
            c.get_meta(["x"], 1, "p", task_name="t")
        assert isinstance(info.value, BrokerError) and isinstance(info.value.__cause__, ZeroDivisionError)
        assert not c.get_consumption_status("t", "p")[1].any()
    finally:
        tq.get_client().system.delete()
        tq.close()


def test_ranks_of_one_dp_group_get_the_same_rows_across_clients(url):
    namespace = "rank" + uuid.uuid4().hex[:6]
    tq.init(conf(url, namespace, sampler="RankAwareSampler"))
    try:
        c = tq.get_client()
        c.put(rows(8), partition_id="p")
        first = c.get_meta(["x"], 2, "p", task_name="t", sampling_config={"dp_rank": 0, "batch_index": 0})
        # Another process's client: a sampler of its own, the choice shared through Redis.
        from broker.transfer_queue import RankAwareSampler
        from broker.transfer_queue.client import TransferQueueClient

        other = TransferQueueClient(c.system, RankAwareSampler(), get_meta_timeout=0.5)
        same = other.get_meta(["x"], 2, "p", task_name="t", sampling_config={"dp_rank": 0, "batch_index": 0})
        rank1 = other.get_meta(["x"], 2, "p", task_name="t", sampling_config={"dp_rank": 1, "batch_index": 0})
        assert same.global_indexes == first.global_indexes
        assert not set(rank1.global_indexes) & set(first.global_indexes)
    finally:
        tq.get_client().system.delete()
        tq.close()


def test_a_leased_reader_that_never_acks_loses_nothing_and_cannot_write_late(client):
    client.put(rows(4), partition_id="p")
    meta = client.get_meta(["x"], 4, "p", task_name="t", lease=1.5)
    with pytest.raises(TimeoutError):
        client.get_meta(["x"], 1, "p", task_name="t")  # all four are out, leased (the wait is 0.5 s)
    time.sleep(1.2)  # the reader "died": its lease ran out
    again = client.get_meta(["x"], 4, "p", task_name="t", lease=5)
    assert sorted(again.global_indexes) == sorted(meta.global_indexes)
    with pytest.raises(FencedError):  # the first reader's late result does not land
        client.put(TensorDict({"z": torch.zeros(4)}, batch_size=4), meta)
    done = client.put(TensorDict({"z": torch.ones(4)}, batch_size=4), again)  # lands, and acks the lease
    assert done.is_ready
    with pytest.raises(TimeoutError):
        client.get_meta(["x"], 1, "p", task_name="t")  # acked: not handed out again, though 5 s have not passed


def test_an_ack_without_a_result_releases_the_lease(client):
    client.put(rows(2), partition_id="p")
    meta = client.get_meta(["x"], 2, "p", task_name="t", lease=0.6)
    assert client.ack(meta) == 2
    time.sleep(0.7)
    with pytest.raises(TimeoutError):
        client.get_meta(["x"], 1, "p", task_name="t")


def test_batches_of_several_leases_concatenated_are_put_and_acked_each_by_its_own(client):
    """``BatchMeta.concat`` of two leased metas raised (their deliveries "conflict" as extra_info values); now
    the concatenation keeps both: a put writes each part fenced by its own lease and acks it, an ack ends
    each, and a part whose lease ran out (its row handed to another reader) is refused (FencedError)."""
    client.put(rows(7), partition_id="p")
    first = client.get_meta(["x"], 2, "p", task_name="t", lease=30)
    second = client.get_meta(["x"], 2, "p", task_name="t", lease=30)
    both = tq.BatchMeta.concat([first, second])
    assert both.size == 4 and len(both.extra_info["broker_delivery"]) == 2
    done = client.put(TensorDict({"z": torch.arange(4.0)}, batch_size=4), both)
    assert done.is_ready and client.get_data(both)["z"].tolist() == [0.0, 1.0, 2.0, 3.0]
    third = client.get_meta(["x"], 1, "p", task_name="t", lease=30)
    fourth = client.get_meta(["x"], 1, "p", task_name="t", lease=0.5)
    fifth = client.get_meta(["x"], 1, "p", task_name="t", lease=30)
    assert client.ack(tq.BatchMeta.concat([third, both.select_samples([0])], validate=False)) == 1  # both's: acked
    time.sleep(0.7)  # fourth's lease ran out: its row goes to the next reader
    again = client.get_meta(["x"], 1, "p", task_name="t", lease=30)
    assert again.global_indexes == fourth.global_indexes
    with pytest.raises(FencedError):  # fourth's part is no longer its reader's
        client.put(TensorDict({"z": torch.ones(2)}, batch_size=2), tq.BatchMeta.concat([fourth, fifth]))
    client.put(TensorDict({"z": torch.ones(2)}, batch_size=2), tq.BatchMeta.concat([again, fifth]))
    time.sleep(0.1)
    with pytest.raises(TimeoutError):
        client.get_meta(["x"], 1, "p", task_name="t")  # every row acked: none comes back


def test_results_written_by_key_are_acked_with_the_meta_of_their_lease(client):
    """The KV way: ``kv_batch_put`` writes by key and knows no lease; the reader acks the rows with the
    BatchMeta its leased ``get_meta`` gave (``client.ack``). Without that ack the rows come back."""
    tq.kv_batch_put(["a", "b"], "p", rows(2))
    meta = client.get_meta(["x"], 2, "p", task_name="t", lease=0.6)
    keys = tq.kv_list("p")["p"]
    tq.kv_batch_put(sorted(keys), "p", TensorDict({"score": torch.ones(2)}, batch_size=2))
    assert client.ack(meta) == 2
    time.sleep(0.7)
    with pytest.raises(TimeoutError):
        client.get_meta(["x"], 1, "p", task_name="t")
    unacked = client.get_meta(["x"], 2, "p", task_name="u", lease=0.5)
    time.sleep(0.7)
    assert sorted(client.get_meta(["x"], 2, "p", task_name="u").global_indexes) == sorted(unacked.global_indexes)


def test_statuses_custom_meta_reset_and_clears(client):
    meta = client.put(rows(3), partition_id="p")
    ids, produced = client.get_production_status(["x", "y"], "p")  # a column per field, as TransferQueue's
    assert ids.tolist() == meta.global_indexes and produced.tolist() == [[1, 1]] * 3
    assert client.get_production_status(["x", "absent"], "p") == (None, None)  # a field it never had
    assert client.get_production_status(["x"], "no-such-partition") == (None, None)
    assert client.get_consumption_status("t", "no-such-partition") == (None, None)
    meta.update_custom_meta([{"len": 5}, {"len": 6}, {"len": 7}])
    client.set_custom_meta(meta)
    fetched = client.get_meta(["x"], 3, "p", task_name="t")
    assert [m["len"] for m in fetched.custom_meta] == [5, 6, 7]
    assert client.check_consumption_status("t", "p")
    assert client.reset_consumption("p", "t")
    assert not client.check_consumption_status("t", "p")
    client.clear_samples(fetched.select_samples([0]))
    assert client.get_consumption_status("t", "p")[0].tolist() == meta.global_indexes[1:]
    client.clear_partition("p")
    assert client.get_partition_list() == []


def test_bad_calls_are_clear_errors(client):
    with pytest.raises(BrokerError, match="mode must be one of"):
        client.get_meta(["x"], 1, "p", mode="steal")
    with pytest.raises(BrokerError, match="needs a task_name"):
        client.get_meta(["x"], 1, "p")
    with pytest.raises(BrokerError, match="batch_size must be an int"):
        client.get_meta(["x"], 0, "p", task_name="t")
    with pytest.raises(BrokerError, match="data has 2 rows, metadata 3"):
        client.put(rows(2), client.get_meta(["x"], 3, "p", mode="insert"))


def test_metrics_enabled_serves_this_process_calls(url):
    import urllib.request

    from broker.api import metrics

    namespace = "m" + uuid.uuid4().hex[:6]
    tq.init({**conf(url, namespace), "metrics": {"enabled": True, "port": 0}})
    try:
        tq.kv_batch_put(["a"], "p", rows(1))
        endpoint = tq.get_metrics_endpoint()
        assert endpoint is not None
        text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
        assert f'broker_client_rows_total{{dock="tq.{namespace}",op="put"}} 1.0' in text
    finally:
        tq.get_client().system.delete()
        tq.close()
        metrics.disable()


def test_a_partition_made_again_does_not_hand_a_dp_group_the_batches_recorded_before(url):
    namespace = "again" + uuid.uuid4().hex[:6]
    tq.init(conf(url, namespace, sampler="RankAwareSampler"))
    try:
        c = tq.get_client()
        config = {"dp_rank": 0, "batch_index": 0}
        c.put(rows(2), partition_id="p")
        first = c.get_meta(["x"], 2, "p", task_name="t", sampling_config=config)
        c.clear_partition("p")
        time.sleep(0.01)  # a new creation time
        c.put(rows(2, start=20), partition_id="q")  # takes the rows p had: the old record names q's rows now
        c.put(rows(2, start=10), partition_id="p")
        from broker.transfer_queue import RankAwareSampler
        from broker.transfer_queue.client import TransferQueueClient

        fresh = TransferQueueClient(c.system, RankAwareSampler(), get_meta_timeout=0.5)  # no cache of its own
        again = fresh.get_meta(["x"], 2, "p", task_name="t", sampling_config=config)
        assert fresh.get_data(again)["x"].tolist() == [10, 11], (first.global_indexes, again.global_indexes)
    finally:
        tq.get_client().system.delete()
        tq.close()
