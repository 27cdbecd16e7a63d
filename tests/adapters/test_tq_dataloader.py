"""broker.transfer_queue's StreamingDataset / StreamingDataLoader (TransferQueue's data loader) on a real Redis:
micro-batches in order and matching their metas, DP ranks that never share rows while the ranks of one DP group
get the same rows in other processes, finite mode stopping, worker processes with their own clients, and leases:
a loader killed mid-batch loses nothing."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import uuid
from typing import Any

import pytest
import torch

tensordict = pytest.importorskip("tensordict")
from tensordict import NonTensorStack, TensorDict  # noqa: E402

import broker.transfer_queue as tq  # noqa: E402
from broker import BrokerError, InvalidExperienceError  # noqa: E402
from broker.transfer_queue.dataloader import chunk_batch_fn, default_fetch_batch_fn  # noqa: E402
from broker.transfer_queue.metadata import BatchMeta  # noqa: E402
from tests.helpers import dense  # noqa: E402

#: Children are forked: they start at once, with this process's modules (each opens its own client from the conf).
FORK = multiprocessing.get_context("fork")


@pytest.fixture
def conf(url):
    """A system of its own on the real server, RankAwareSampler as the tutorials use; its conf, with the URL."""
    got = tq.init({"broker": {"url": url, "namespace": "dl" + uuid.uuid4().hex[:8]},
                   "controller": {"sampler": "RankAwareSampler", "polling_mode": True}})
    yield got
    tq.get_client().system.delete()
    tq.close()


def put_rows(count: int, start: int = 0, partition: str = "train") -> dict[int, int]:
    """Put ``count`` samples whose ``x`` is ``start``, ``start + 1``, ...; returns global index -> x."""
    xs = list(range(start, start + count))
    data = TensorDict({
        "x": torch.tensor(xs).unsqueeze(1),
        "ragged": torch.nested.as_nested_tensor([torch.arange(x % 3 + 1) for x in xs], layout=torch.jagged),
        "text": NonTensorStack(*[f"s{x}" for x in xs]),
    }, batch_size=count)
    meta = tq.get_client().put(data, partition_id=partition)
    return dict(zip(meta.global_indexes, xs))


def dataset(conf: Any, dp_rank: int = 0, **kw: Any) -> tq.StreamingDataset:
    args: dict[str, Any] = {"batch_size": 4, "micro_batch_size": 3, "data_fields": ["x", "ragged", "text"],
                            "partition_id": "train", "task_name": "train_actor", "dp_rank": dp_rank,
                            "should_check_consumption_status": True}
    args.update(kw)
    return tq.StreamingDataset(conf, **args)


def check_matches_meta(td: TensorDict, meta: BatchMeta, xs: dict[int, int]) -> list[int]:
    """Assert each row of ``td`` is the sample its meta names; returns the meta's global indexes."""
    rows = list(meta.global_indexes)
    assert td.batch_size[0] == len(rows)
    assert dense(td["x"]).view(-1).tolist() == [xs[r] for r in rows]
    assert td["ragged"].is_nested
    assert [t.tolist() for t in td["ragged"].unbind(0)] == [list(range(xs[r] % 3 + 1)) for r in rows]
    assert list(td["text"]) == [f"s{xs[r]}" for r in rows]
    return rows


def test_micro_batches_in_order_each_with_the_meta_of_its_rows(conf):
    xs = put_rows(12)
    loader = tq.StreamingDataLoader(dataset(conf))
    got = [check_matches_meta(td, meta, xs) for td, meta in loader]
    # batches of 4 rows cut into 3 + 1, in the order the rows were put
    order = sorted(xs)
    assert got == [order[0:3], order[3:4], order[4:7], order[7:8], order[8:11], order[11:12]]
    assert tq.get_client().check_consumption_status("train_actor", "train")


def test_finite_mode_stops_and_reset_and_step_replay_or_move(conf):
    xs = put_rows(8)
    put_rows(4, start=100, partition="val")
    loader = tq.StreamingDataLoader(dataset(conf, micro_batch_size=4))
    first = [meta.global_indexes for _, meta in loader]
    assert sorted(r for rows in first for r in rows) == sorted(xs)
    assert [meta.global_indexes for _, meta in loader] == []  # all consumed: the next pass ends at once
    loader.reset()  # the buffered batches again, not fetched again
    assert [meta.global_indexes for _, meta in loader] == first
    loader.step("val")
    assert loader.get_buffer() == []
    assert [dense(td["x"]).view(-1).tolist() for td, _ in loader] == [[100, 101, 102, 103]]


def test_streaming_mode_yields_rows_as_they_are_put(conf):
    loader = tq.StreamingDataLoader(dataset(conf, batch_size=2, micro_batch_size=2,
                                            should_check_consumption_status=False))
    seen: list[int] = []
    xs = put_rows(2)
    for td, meta in loader:
        seen += check_matches_meta(td, meta, xs)
        if len(seen) == 2:
            xs.update(put_rows(2, start=10))  # put while the loader is running: it picks them up
        if len(seen) == 4:
            break
    assert sorted(seen) == sorted(xs)


def ranks_rows(url: str, namespace: str, dp_rank: int, num_workers: int, out: Any) -> None:
    """In a process of its own: one rank's batches, by global index."""
    loader = tq.StreamingDataLoader(
        tq.StreamingDataset({"broker": {"url": url, "namespace": namespace}}, batch_size=2, micro_batch_size=2,
                            data_fields=["x"], partition_id="train", task_name="train_actor", dp_rank=dp_rank,
                            should_check_consumption_status=True),
        num_workers=num_workers, prefetch_factor=2 if num_workers else None)
    out.put((dp_rank, [list(meta.global_indexes) for _, meta in loader]))


def test_dp_ranks_never_share_rows_and_the_ranks_of_a_group_get_the_same_across_processes(conf):
    xs = put_rows(24)
    url, namespace = conf["broker"]["url"], conf["broker"]["namespace"]
    out = FORK.Queue()
    # two DP groups of two ranks, each rank a process; one rank of each group fetches in two worker processes
    ranks = [(0, 0), (0, 2), (1, 2), (1, 0)]
    procs = [FORK.Process(target=ranks_rows, args=(url, namespace, rank, workers, out)) for rank, workers in ranks]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    by_group: dict[int, list[list[list[int]]]] = {}
    for rank, batches in results:
        by_group.setdefault(rank, []).append(batches)
    assert sorted(by_group) == [0, 1]
    for copies in by_group.values():
        assert copies[0] == copies[1]  # the same batches, in the same order, for both ranks of the group
        assert all(len(b) == 2 for b in copies[0])
    group_rows = [[r for b in copies[0] for r in b] for copies in by_group.values()]
    assert not set(group_rows[0]) & set(group_rows[1])  # the groups never share a row
    assert sorted(group_rows[0] + group_rows[1]) == sorted(xs)  # and between them they get every row once


def test_worker_processes_each_open_a_client_and_fetch_their_share_once(conf):
    xs = put_rows(20)
    loader = tq.StreamingDataLoader(dataset(conf, micro_batch_size=2), num_workers=2, prefetch_factor=2)
    got = [(meta.global_indexes, check_matches_meta(td, meta, xs)) for td, meta in loader]
    rows = [r for r, _ in got]
    flat = [r for b in rows for r in b]
    assert sorted(flat) == sorted(xs)  # every row once: the workers fetch batches 0, 2, ... and 1, 3, ...
    assert all(len(b) == 2 for b in rows)
    # a batch's micro-batches come together: each pair of micro-batches is one batch of 4 consecutive rows
    assert all(sorted(rows[i] + rows[i + 1]) == list(range(min(rows[i]), min(rows[i]) + 4))
               for i in range(0, len(rows), 2))
    # another loader of the same DP rank, fetching in this process, is handed the same batches in the same order
    again = tq.StreamingDataLoader(dataset(conf, micro_batch_size=2))
    assert [meta.global_indexes for _, meta in again] == rows


def slow_to_fetch_the_first_batch(**kw: Any) -> tuple[Any, BatchMeta]:
    if kw["batch_index"] == 0:
        time.sleep(0.5)
    return default_fetch_batch_fn(**kw)


def test_workers_claim_batches_in_turn(conf):
    xs = put_rows(12)
    # worker 0 is slow to ask for batch 0; worker 1 still waits for it before it asks for batch 1, so no later
    # batch takes the first rows (and waits behind an earlier one, leased, in the DataLoader's order)
    loader = tq.StreamingDataLoader(dataset(conf, batch_size=2, micro_batch_size=2,
                                            fetch_batch_fn=slow_to_fetch_the_first_batch), num_workers=2)
    assert [r for _, meta in loader for r in meta.global_indexes] == sorted(xs)


def test_a_collate_fn_is_applied_to_each_micro_batch(conf):
    put_rows(8)
    loader = tq.StreamingDataLoader(dataset(conf, micro_batch_size=2), num_workers=1,
                                    collate_fn=lambda item: (dense(item[0]["x"]).view(-1).tolist(), item[1]))
    got = [(x, meta) for x, meta in loader]
    assert [len(x) for x, _ in got] == [2, 2, 2, 2]
    assert all(isinstance(meta, BatchMeta) for _, meta in got)


def test_acks_release_each_micro_batch_when_the_next_is_asked_for(conf):
    put_rows(8)
    loader = tq.StreamingDataLoader(dataset(conf, micro_batch_size=2, lease=60))
    dock = tq.get_client().system.dock
    leases = tq.get_client().system.keys.leases("train_actor")

    def leased() -> int:
        return int(dock.client.zcard(leases))

    it = iter(loader)
    _, first = next(it)
    assert leased() == 4  # the whole batch is out under the lease
    _, second = next(it)
    assert leased() == 2  # asking for the second micro-batch acked the first
    assert loader.ack() == 2  # e.g. after a break: everything handed so far
    assert leased() == 0
    assert loader.ack(first) == 0  # acking twice releases nothing


def test_without_auto_ack_only_explicit_acks_release(conf):
    put_rows(8)
    loader = tq.StreamingDataLoader(dataset(conf, micro_batch_size=2, lease=60, auto_ack=False))
    metas = [meta for _, meta in loader]
    assert [m.size for m in metas] == [2, 2, 2, 2]
    assert loader.ack(metas[1]) == 2
    assert loader.ack() == 6
    assert loader.ack() == 0


def killed_mid_batch(conf: dict[str, Any], lease: float, out: Any) -> None:
    """A trainer that takes every row in one batch, acks its first micro-batch (by asking for the second),
    reports both, then hangs."""
    loader = tq.StreamingDataLoader(tq.StreamingDataset(
        conf, batch_size=12, micro_batch_size=2, data_fields=["x"], partition_id="train", task_name="train_actor",
        dp_rank=0, lease=lease))
    it = iter(loader)
    _, first = next(it)
    _, second = next(it)
    out.put((first.global_indexes, second.global_indexes))
    time.sleep(600)


def test_a_leased_loader_killed_mid_batch_loses_nothing(conf):
    xs = put_rows(12)
    lease = 2.0
    out = FORK.Queue()
    child = FORK.Process(target=killed_mid_batch, args=(dict(conf), lease, out))
    child.start()
    acked, unacked = out.get(timeout=120)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    time.sleep(lease + 0.5)  # its lease has run out: its unacked rows are the task's again
    # no other row is ready, so nothing but the loader itself gives the expired lease back
    loader = tq.StreamingDataLoader(dataset(conf, dp_rank=1, batch_size=2, micro_batch_size=2), num_workers=1)
    rest = [r for _, meta in loader for r in meta.global_indexes]
    assert set(unacked) <= set(rest)  # the rows of the micro-batch it held come back, and those it had not
    assert sorted(acked + rest) == sorted(xs)  # reached yet: nothing is lost, nothing acked is repeated


def test_a_dataset_pickles_without_its_client_and_needs_to_know_where_the_system_is(conf, monkeypatch):
    import pickle

    put_rows(4)
    ds = dataset(conf, micro_batch_size=4)
    assert len([m for _, m in tq.StreamingDataLoader(ds)]) == 1  # the dataset has a client now
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._tq_client is None and copy._conf["broker"]["url"] == conf["broker"]["url"]
    # with no URL in the conf, the system this process's init attached to
    plain = tq.StreamingDataset({}, 1, 1, ["x"], "train", "t", 0)
    assert plain._conf["broker"]["namespace"] == conf["broker"]["namespace"]
    tq.get_client().system.delete()
    tq.close()
    monkeypatch.delenv("REDIS_URL", raising=False)
    with pytest.raises(BrokerError, match="broker.url"):
        tq.StreamingDataset({}, 1, 1, ["x"], "train", "t", 0)
    tq.init(dict(conf))  # for the fixture's teardown


def test_arguments_are_checked_by_name(conf):
    for bad, name in [({"micro_batch_size": 0}, "micro_batch_size"), ({"data_fields": []}, "data_fields"),
                      ({"dp_rank": -1}, "dp_rank"), ({"lease": 0}, "lease"), ({"batch_size": 0}, "batch_size")]:
        with pytest.raises(InvalidExperienceError, match=name):
            dataset(conf, **bad)
    with pytest.raises(ValueError):  # TransferQueue raises ValueError: ours is one
        dataset(conf, micro_batch_size=0)


# -- chunk_batch_fn, as TransferQueue's tests drive theirs --------------------------------------------------------


def test_chunk_batch_fn_dense():
    td = TensorDict({"a": torch.arange(6).reshape(3, 2), "b": torch.arange(3).reshape(3, 1)}, batch_size=(3,))
    chunks = chunk_batch_fn(td, BatchMeta(global_indexes=[0, 1, 2], partition_ids=["p"] * 3), micro_batch_size=2)
    assert [c[0].batch_size for c in chunks] == [torch.Size([2]), torch.Size([1])]
    assert torch.equal(dense(chunks[0][0]["a"]), torch.tensor([[0, 1], [2, 3]]))
    assert torch.equal(dense(chunks[1][0]["b"]), torch.tensor([[2]]))
    assert [c[1].global_indexes for c in chunks] == [[0, 1], [2]]


def test_chunk_batch_fn_mixed_dense_and_jagged_and_strided():
    values = [torch.tensor([1, 2]), torch.tensor([3, 4, 5]), torch.tensor([6])]
    td = TensorDict({"a": torch.nested.as_nested_tensor(values, layout=torch.jagged), "b": torch.arange(3)},
                    batch_size=(3,))
    chunks = chunk_batch_fn(td, BatchMeta(global_indexes=[0, 1, 2], partition_ids=["p"] * 3), micro_batch_size=2)
    assert chunks[0][0]["a"].is_nested and chunks[1][0]["a"].is_nested
    assert [t.tolist() for t in chunks[0][0]["a"].unbind(0)] == [[1, 2], [3, 4, 5]]
    assert chunks[1][0]["a"].unbind(0)[0].tolist() == [6]
    assert torch.equal(chunks[1][0]["b"], torch.tensor([2]))
    strided = torch.nested.as_nested_tensor([torch.ones(2, 2), torch.zeros(2, 2)], layout=torch.strided)
    two = chunk_batch_fn(TensorDict({"a": strided}, batch_size=(2,)),
                         BatchMeta(global_indexes=[5, 6], partition_ids=["p"] * 2), micro_batch_size=1)
    assert two[1][0]["a"].is_nested and torch.equal(two[1][0]["a"][0], torch.zeros(2, 2))


def test_chunk_batch_fn_metas_name_their_rows_when_the_cut_is_uneven():
    td = TensorDict({"a": torch.arange(7)}, batch_size=(7,))
    chunks = chunk_batch_fn(td, BatchMeta(global_indexes=list(range(10, 17)), partition_ids=["p"] * 7), 3)
    assert [c[0]["a"].tolist() for c in chunks] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [c[1].global_indexes for c in chunks] == [[10, 11, 12], [13, 14, 15], [16]]
    with pytest.raises(InvalidExperienceError, match="exceeds"):
        chunk_batch_fn(td, BatchMeta(global_indexes=list(range(7)), partition_ids=["p"] * 7), 8)


def test_chunk_batch_fn_refuses_what_is_not_a_tensordict_as_a_type_error():
    meta = BatchMeta(global_indexes=[0, 1], partition_ids=["p"] * 2)
    with pytest.raises(TypeError, match="TensorDict, got dict"):  # TransferQueue's raises TypeError
        chunk_batch_fn({"a": torch.arange(2)}, meta, 1)
    with pytest.raises(InvalidExperienceError):  # and the broker's error, a ValueError, as its other checks
        chunk_batch_fn([1, 2], meta, 1)


def test_the_conf_init_returns_keeps_the_sampler_instance_it_was_given(url):
    """A StreamingDataset opens a client per loader from the conf ``init`` returned; the loaders of a DP group
    share the batches a SeqlenBalancedSampler cached only if that conf holds the instance, not its name (the
    stored conf's: the drop-in's init returned that for a while, and a second rank's loader never got a batch)."""
    sampler = tq.SeqlenBalancedSampler(n_samples_per_prompt=2, dp_size=2)
    got = tq.init({"broker": {"url": url, "namespace": "dl" + uuid.uuid4().hex[:8]},
                   "controller": {"sampler": sampler, "polling_mode": True}})
    try:
        assert got["controller"]["sampler"] is sampler
    finally:
        tq.get_client().system.delete()
        tq.close()
