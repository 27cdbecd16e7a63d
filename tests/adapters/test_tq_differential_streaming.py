"""TransferQueue's samplers and its ``StreamingDataset`` / ``StreamingDataLoader`` side by side with the drop-in's:
the same calls on the real transferqueue 0.1.11 and on broker.transfer_queue, the answers compared through
``seen`` (tests/adapters/test_tq_differential.py: values, dtypes, layouts, metas without their global indexes, errors by
their built-in bases).

A sampler is chosen as TransferQueue's users choose it: ``controller.sampler`` in the conf given to ``init`` (an
OmegaConf conf allowing objects, a class or an instance, as its tutorials pass ``RankAwareSampler``), with
``polling_mode`` on as its streaming tutorial asks. So the cases are grouped by sampler and both systems are
started again (``close`` then ``init``) when the sampler changes: four times in all. Each case then drives
``get_meta(..., sampling_config=...)`` (with ``task_name`` and ``partition_id`` in the config, as TransferQueue's
StreamingDataset passes them: its controller hands the config to the sampler as its only keywords) or iterates a
loader over rows a producer put, and returns what came out: which rows (by their values: global indexes are each
system's own numbering), grouped in which micro-batches, in which order, with which shapes, layouts and metas.

Cases the drop-in does not answer as TransferQueue are ``KNOWN``, each saying why: strict xfails, so one that
starts to agree fails until it is moved to ``CASES``. Marked ``once`` like the module it builds on (Ray, and four
starts of TransferQueue: about two minutes).
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.once, pytest.mark.slow, pytest.mark.real]

tensordict = pytest.importorskip("tensordict")
omegaconf = pytest.importorskip("omegaconf")
from omegaconf import OmegaConf  # noqa: E402
from tensordict import NonTensorStack, TensorDict  # noqa: E402

from tests.adapters.test_tq_differential import answer, both, same  # noqa: E402, F401 - both: the module's Ray and systems

#: How each sampler is named in the conf: a class (as TransferQueue's tutorials pass RankAwareSampler) or an
#: instance, of the module under test (``transfer_queue`` or ``broker.transfer_queue``).
SAMPLERS: dict[str, Callable[[Any], Any]] = {
    "SequentialSampler": lambda tq: tq.SequentialSampler,
    "RankAwareSampler": lambda tq: tq.RankAwareSampler,
    "GRPOGroupNSampler": lambda tq: tq.GRPOGroupNSampler(n_samples_per_prompt=2),
    "SeqlenBalancedSampler": lambda tq: tq.SeqlenBalancedSampler(n_samples_per_prompt=2, dp_size=2),
}

FIELDS = ["x", "ragged", "text"]


@pytest.fixture(scope="module")
def systems(both, real_url):  # noqa: F811 - both is the fixture imported above
    """(TransferQueue, the drop-in, switch): ``switch(sampler)`` starts both again with that sampler (unless it is
    the one running) and returns the conf each ``init`` returned, which their StreamingDatasets take."""
    real, ours = both
    running: dict[str, Any] = {}

    def switch(sampler: str) -> tuple[Any, Any]:
        if running.get("sampler") != sampler:
            ours.get_client().system.delete()
            ours.close()
            real.close()

            def conf(tq: Any, **more: Any) -> Any:
                return OmegaConf.create({"controller": {"sampler": SAMPLERS[sampler](tq), "polling_mode": True},
                                         **more}, flags={"allow_objects": True})

            # TransferQueue first: with Ray running, the drop-in's init publishes its conf as an actor of the name
            # TransferQueue's controller takes, if that name is free, and TransferQueue's init would attach to it
            theirs = real.init(conf(real))
            mine = ours.init(conf(ours, broker={"url": real_url, "namespace": "dls" + uuid.uuid4().hex[:8],
                                                "get_meta_timeout": 0.5}))
            running.update(sampler=sampler, confs=(theirs, mine))
        return running["confs"]

    yield real, ours, switch


# -- what the cases share ----------------------------------------------------------------------------------------


def produce(tq: Any, p: str, xs: list[int], lengths: list[int] | None = None) -> Any:
    """A producer's put of samples whose ``x`` is each of ``xs`` (with a jagged and a text field made from it);
    ``lengths``: their ``total_lengths`` custom meta (what SeqlenBalancedSampler balances). Returns the meta."""
    data = TensorDict({
        "x": torch.tensor(xs).unsqueeze(1),
        "ragged": torch.nested.as_nested_tensor([torch.arange(x % 3 + 1) for x in xs], layout=torch.jagged),
        "text": NonTensorStack(*[f"s{x}" for x in xs]),
    }, batch_size=len(xs))
    meta = tq.get_client().put(data, partition_id=p)
    if lengths is not None:
        meta.update_custom_meta([{"total_lengths": n} for n in lengths])
        tq.get_client().set_custom_meta(meta)
    return meta


def produce_y(tq: Any, meta: Any, positions: list[int]) -> None:
    """Field ``y`` put into the samples at ``positions`` of ``meta`` only: the others are not ready in it."""
    chosen = meta.select_samples(positions)
    tq.get_client().put(TensorDict({"y": torch.ones(len(positions), 1)}, batch_size=len(positions)), metadata=chosen)


def config(p: str, dp_rank: int | None = None, batch_index: int | None = None) -> dict[str, Any]:
    """A sampling_config as TransferQueue's StreamingDataset makes it (task ``t``)."""
    out: dict[str, Any] = {"task_name": "t", "partition_id": p}
    if dp_rank is not None:
        out["dp_rank"] = dp_rank
    if batch_index is not None:
        out["batch_index"] = batch_index
    return out


def fetch(tq: Any, p: str, count: int, fields: list[str] | None = None, **sampling: Any) -> Any:
    """One ``get_meta`` of task ``t``, and the data it names: ``(meta, TensorDict)``, or the empty meta alone."""
    client = tq.get_client()
    meta = client.get_meta(fields or ["x"], count, p, task_name="t", sampling_config=sampling or None)
    return (meta, client.get_data(meta)) if meta.size else meta


def xs(item: Any) -> list[int]:
    """The ``x`` values of a micro-batch ``(TensorDict, BatchMeta)``, in its order."""
    return [int(t.reshape(-1)[0]) for t in item[0]["x"].unbind(0)]


def loader_module(tq: Any) -> Any:
    """The module of the system's StreamingDataset, for its ``default_fetch_batch_fn`` and ``chunk_batch_fn``."""
    return sys.modules[tq.StreamingDataset.__module__]


#: Seconds a loader of a case may go without a batch before it gives up (TransferQueue's polls every second).
PATIENCE = 8.0


class Patient:
    """The system's ``default_fetch_batch_fn``, raising TimeoutError once no batch came for ``PATIENCE`` seconds:
    a loader waiting for rows that never come (one side of a difference) ends the case instead of hanging it."""

    def __init__(self, tq: Any):
        self.fetch = loader_module(tq).default_fetch_batch_fn
        self.since: float | None = None

    def __call__(self, **kw: Any) -> Any:
        got = self.fetch(**kw)
        now = time.monotonic()
        if got[0] is not None:
            self.since = None
        elif self.since is None:
            self.since = now
        elif now - self.since > PATIENCE:
            raise TimeoutError(f"no batch {kw['batch_index']} of dp_rank {kw['sampling_config'].get('dp_rank')} "
                               f"within {PATIENCE} s")
        return got


def dataset(tq: Any, conf: Any, p: str, **kw: Any) -> Any:
    args: dict[str, Any] = {"batch_size": 4, "micro_batch_size": 2, "data_fields": FIELDS, "partition_id": p,
                            "task_name": "t", "dp_rank": 0, "should_check_consumption_status": True,
                            "fetch_batch_fn": Patient(tq)}
    args.update(kw)
    return tq.StreamingDataset(conf, **args)


def done(*datasets: Any) -> None:
    """Close the clients the datasets opened in this process (TransferQueue's hold ZMQ sockets)."""
    for ds in datasets:
        client = getattr(ds, "_tq_client", None)
        if client is not None:
            client.close()
            ds._tq_client = None


def drain(tq: Any, conf: Any, p: str, loader_kw: dict[str, Any] | None = None, **kw: Any) -> list[Any]:
    """Every micro-batch of a finite loader over ``p``."""
    ds = dataset(tq, conf, p, **kw)
    try:
        return list(tq.StreamingDataLoader(ds, **(loader_kw or {})))
    finally:
        done(ds)


def lockstep(tq: Any, conf: Any, p: str, ranks: list[int], rounds: int, **kw: Any) -> list[list[Any]]:
    """Loaders of the given DP ranks in this process, each asked for its next micro-batch in turn."""
    sets = [dataset(tq, conf, p, dp_rank=r, **kw) for r in ranks]
    try:
        its = [iter(tq.StreamingDataLoader(ds)) for ds in sets]
        return [[next(it) for it in its] for _ in range(rounds)]
    finally:
        done(*sets)


# -- the cases: (sampler, fn(tq, conf, partition)) ---------------------------------------------------------------

Case = Callable[[Any, Any, str], Any]


def sequential_in_put_order(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(6)))
    return [fetch(tq, p, 4, FIELDS), fetch(tq, p, 4), fetch(tq, p, 2, FIELDS)]  # 4, then too few: empty, then 2


def sequential_ignores_ranks(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(6)))
    return [fetch(tq, p, 2, **config(p, 0, 0)), fetch(tq, p, 2, **config(p, 0, 0)), fetch(tq, p, 2, **config(p, 1, 0))]


def sequential_ready_in_every_field(tq: Any, conf: Any, p: str) -> Any:
    produce_y(tq, produce(tq, p, list(range(5))), [1, 3, 4])
    return [fetch(tq, p, 2, ["x", "y"]), fetch(tq, p, 2, ["x", "y"]), fetch(tq, p, 1, ["x", "y"]), fetch(tq, p, 2)]


def sequential_loaders_of_one_rank_share_nothing(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(8)))
    return [[xs(item) for item in step] for step in lockstep(tq, conf, p, [0, 0], 2)]


def sequential_two_workers(tq: Any, conf: Any, p: str) -> Any:
    """Two worker processes: each row once, in micro-batches of two consecutive rows (the order of the
    batches is the workers' race in TransferQueue, so it is left out)."""
    produce(tq, p, list(range(12)))
    got = drain(tq, conf, p, {"num_workers": 2, "prefetch_factor": 1})
    return sorted(xs(item) for item in got)


def rank_aware_groups(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(10)))
    return [fetch(tq, p, 2, FIELDS, **config(p, 0, 0)), fetch(tq, p, 2, **config(p, 0, 0)),
            fetch(tq, p, 2, **config(p, 1, 0)), fetch(tq, p, 2, **config(p, 0, 1)), fetch(tq, p, 2, **config(p, 1, 0)),
            fetch(tq, p, 4, **config(p, 1, 1)), fetch(tq, p, 2, **config(p, 1, 1))]


def rank_aware_cached_batch_when_nothing_is_ready(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(4)))
    return [fetch(tq, p, 4, **config(p, 0, 0)), fetch(tq, p, 4, **config(p, 0, 0)), fetch(tq, p, 4, **config(p, 1, 0))]


def rank_aware_negative_rank(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(4)))
    return fetch(tq, p, 2, **config(p, -1, 0))


def loader_finite(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(8)))
    ds = dataset(tq, conf, p)
    loader = tq.StreamingDataLoader(ds)
    try:
        got = list(loader)
        return [got, loader.get_buffer(), list(loader), tq.get_client().check_consumption_status("t", p)]
    finally:
        done(ds)


def loader_two_puts(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, [5, 7])
    produce(tq, p, [1, 2, 9, 4])
    return drain(tq, conf, p, batch_size=3, micro_batch_size=3, data_fields=["x", "text"])


def loader_reset_and_step(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(4)))
    produce(tq, p + "-val", [100, 101, 102, 103])
    ds = dataset(tq, conf, p, micro_batch_size=4)
    loader = tq.StreamingDataLoader(ds)
    try:
        first = [xs(i) for i in loader]
        again = [xs(i) for i in loader]
        loader.reset()
        replay = [xs(i) for i in loader]
        loader.step(p + "-val")
        emptied = len(loader.get_buffer())
        moved = [xs(i) for i in loader]
        return [first, again, replay, emptied, moved, ds.partition_id, ds.batch_index]
    finally:
        done(ds)


def loader_streaming(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, [0, 1])
    ds = dataset(tq, conf, p, batch_size=2, should_check_consumption_status=False)
    got = []
    try:
        for item in tq.StreamingDataLoader(ds):
            got.append(item)
            if len(got) == 1:
                produce(tq, p, [10, 11])  # while the loader runs: it picks them up
            if len(got) == 2:
                break
        return got
    finally:
        done(ds)


def loader_dp_groups(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(12)))
    return [[xs(item) for item in step] for step in lockstep(tq, conf, p, [0, 0, 1], 2, batch_size=2)]


def loader_collate_fn(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(8)))
    return drain(tq, conf, p, {"collate_fn": lambda item: (xs(item), item[1].size, sorted(item[0].keys()))})


def loader_one_worker(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(12)))
    return drain(tq, conf, p, {"num_workers": 1, "prefetch_factor": 2})


def loader_persistent_worker(tq: Any, conf: Any, p: str) -> Any:
    """A persistent worker keeps its dataset: the second pass, over consumed rows, ends at once."""
    produce(tq, p, list(range(8)))
    ds = dataset(tq, conf, p)
    loader = tq.StreamingDataLoader(ds, num_workers=1, persistent_workers=True)
    try:
        return [[xs(item) for item in loader], [xs(item) for item in loader], len(loader.get_buffer())]
    finally:
        del loader
        done(ds)


def loader_spawned_worker(tq: Any, conf: Any, p: str) -> Any:
    """A worker started by spawn: the dataset (its conf, its fetch_batch_fn) goes to it pickled."""
    produce(tq, p, list(range(8)))
    return drain(tq, conf, p, {"num_workers": 1, "multiprocessing_context": "spawn"})


def dataset_without_a_loader(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(6)))
    ds = dataset(tq, conf, p, batch_size=3)
    try:
        return list(ds)
    finally:
        done(ds)


def loader_has_no_len(tq: Any, conf: Any, p: str) -> Any:
    return len(tq.StreamingDataLoader(dataset(tq, conf, p)))


def loader_process_batch_fn(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(8)))
    return drain(tq, conf, p, process_batch_fn=lambda td, meta, micro_batch_size: [(td, meta, micro_batch_size)])


def loader_fetch_batch_fn(tq: Any, conf: Any, p: str) -> Any:
    """What a fetch_batch_fn is asked, and when (a finite loader over two batches)."""
    produce(tq, p, list(range(8)))
    calls = []

    def fetch_batch_fn(**kw: Any) -> Any:
        got = loader_module(tq).default_fetch_batch_fn(**kw)
        calls.append(({k: v for k, v in kw.items() if k != "tq_client"}, got[0] is not None))
        return got

    got = drain(tq, conf, p, fetch_batch_fn=fetch_batch_fn)
    return [[xs(item) for item in got], calls]


def loader_micro_batch_larger_than_the_batch(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(4)))
    return drain(tq, conf, p, micro_batch_size=5)


def loader_bad_arguments(tq: Any, conf: Any, p: str) -> Any:
    out = []
    for bad in ({"micro_batch_size": 0}, {"data_fields": []}, {"dp_rank": -1}):
        try:
            dataset(tq, conf, p, **bad)
            out.append("made")
        except Exception as exc:  # noqa: BLE001 - compared by its bases
            out.append(exc)
    return out


def chunks(tq: Any, conf: Any, p: str) -> Any:
    """``chunk_batch_fn``, TransferQueue's default process_batch_fn, as a custom process_batch_fn calls it."""
    chunk = loader_module(tq).chunk_batch_fn
    meta = tq.BatchMeta(global_indexes=[0, 1, 2, 3], partition_ids=[p] * 4)
    data = TensorDict({"a": torch.arange(8).reshape(4, 2),
                       "r": torch.nested.as_nested_tensor([torch.arange(n + 1) for n in range(4)],
                                                          layout=torch.jagged)}, batch_size=4)
    out = [chunk(data, meta, micro_batch_size=2), chunk(data, meta, 4)]
    for bad in ((data.to_dict(), meta, 2), (data, meta, 0), (data, meta, 5), (TensorDict({}, []), meta, 1)):
        try:
            out.append(chunk(*bad))
        except Exception as exc:  # noqa: BLE001 - compared by its bases
            out.append(exc)
    return out


def grpo_whole_groups(tq: Any, conf: Any, p: str) -> Any:
    meta = produce(tq, p, list(range(8)))
    produce_y(tq, meta, [0, 1, 3, 4, 5, 6])  # 2 and 7 not ready in y: the groups are (0, 1), (3, 4), (5, 6)
    first = fetch(tq, p, 4, ["x", "y"], **config(p, 0, 0))
    short = fetch(tq, p, 4, ["x", "y"], **config(p, 0, 1))
    produce_y(tq, meta, [2, 7])
    return [first, short, fetch(tq, p, 2, ["x", "y"], **config(p, 0, 1)), fetch(tq, p, 2, ["x", "y"]),
            fetch(tq, p, 2, ["x", "y"])]


def grpo_cached_per_rank_and_batch(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(8)))
    return [fetch(tq, p, 4, **config(p, 0, 0)), fetch(tq, p, 4, **config(p, 0, 0)),
            fetch(tq, p, 2, **config(p, 1, 0)), fetch(tq, p, 2, **config(p, 1, 0)), fetch(tq, p, 2)]


def grpo_batch_not_a_multiple_of_n(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(4)))
    return fetch(tq, p, 3, **config(p, 0, 0))


def grpo_loaders(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(16)))
    return lockstep(tq, conf, p, [0, 1, 0], 2)


def seqlen_too_few_groups(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(6)), [1] * 6)
    return [fetch(tq, p, 4, **config(p, 0, 0)), fetch(tq, p, 4, **config(p, 1, 0))]  # 8 rows for both: 6 ready


def seqlen_equal_lengths(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(6)), [1] * 6)
    return [fetch(tq, p, 2, **config(p, 0, 0)), fetch(tq, p, 2, **config(p, 1, 0))]


def seqlen_balanced_shares(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(8)), [10, 10, 10, 10, 1, 1, 1, 1])  # groups of 20, 20, 2, 2 tokens
    return [fetch(tq, p, 4, **config(p, 1, 0)), fetch(tq, p, 4, **config(p, 0, 0))]


def seqlen_loaders(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(16)), [9, 9, 1, 1, 1, 1, 9, 9, 2, 2, 2, 2, 8, 8, 3, 3])
    return [[xs(item) for item in step] for step in lockstep(tq, conf, p, [0, 1], 4)]


def seqlen_negative_rank(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(8)), [10, 10, 10, 10, 1, 1, 1, 1])
    return fetch(tq, p, 4, **config(p, -1, 0))


def rank_aware_bare_config(tq: Any, conf: Any, p: str) -> Any:
    """A sampling_config of dp_rank and batch_index alone, as a user calling get_meta may write it."""
    produce(tq, p, list(range(4)))
    return fetch(tq, p, 2, dp_rank=0, batch_index=0)


def grpo_bare_config(tq: Any, conf: Any, p: str) -> Any:
    """The same batch of one rank asked in two partitions, the sampling_config naming neither partition nor task."""
    produce(tq, p, list(range(4)))
    produce(tq, p + "-b", [10, 11, 12, 13])
    return [fetch(tq, p, 2, dp_rank=0, batch_index=0), fetch(tq, p + "-b", 2, dp_rank=0, batch_index=0)]


def loader_uneven_cut(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(8)))
    return drain(tq, conf, p, micro_batch_size=3)


def loader_rank_aware_two_workers(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(12)))
    return [xs(item) for item in drain(tq, conf, p, {"num_workers": 2, "prefetch_factor": 2})]


def loader_second_rank_of_a_group_late(tq: Any, conf: Any, p: str) -> Any:
    """Rank 1 of DP group 0 starts after rank 0 took every row."""
    produce(tq, p, list(range(8)))
    first = [xs(item) for item in drain(tq, conf, p)]
    return [first, [xs(item) for item in drain(tq, conf, p)]]


def loader_another_group_late(tq: Any, conf: Any, p: str) -> Any:
    """DP group 1 starts after group 0 took every row: nothing is left for it."""
    produce(tq, p, list(range(8)))
    first = [xs(item) for item in drain(tq, conf, p)]
    return [first, [xs(item) for item in drain(tq, conf, p, dp_rank=1)]]


def loader_batch_size_zero(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(2)))
    return drain(tq, conf, p, batch_size=0, micro_batch_size=1)


def seqlen_one_group_for_two_ranks(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(4)), [1] * 4)
    return fetch(tq, p, 1, **config(p, 0, 0))  # 2 rows for both ranks: one group of 2, which does not split


def seqlen_rank_beyond_dp_size(tq: Any, conf: Any, p: str) -> Any:
    produce(tq, p, list(range(8)), [10, 10, 10, 10, 1, 1, 1, 1])
    return [fetch(tq, p, 4, **config(p, 2, 0)), fetch(tq, p, 4, **config(p, 0, 0)), fetch(tq, p, 4, **config(p, 1, 0))]


#: Each case: (the sampler the systems run, the case). Grouped by sampler: the systems start again between groups.
CASES: dict[str, tuple[str, Case]] = {
    "sequential: rows in put order, then too few": ("SequentialSampler", sequential_in_put_order),
    "sequential: ranks and batches ignored": ("SequentialSampler", sequential_ignores_ranks),
    "sequential: rows ready in every field asked": ("SequentialSampler", sequential_ready_in_every_field),
    "sequential: two loaders of one rank share nothing": (
        "SequentialSampler", sequential_loaders_of_one_rank_share_nothing),
    "sequential: two workers, each row once": ("SequentialSampler", sequential_two_workers),
    "rank-aware: the ranks of a group get its rows": ("RankAwareSampler", rank_aware_groups),
    "rank-aware: a group's batch when no row is ready": (
        "RankAwareSampler", rank_aware_cached_batch_when_nothing_is_ready),
    "rank-aware: a negative dp_rank": ("RankAwareSampler", rank_aware_negative_rank),
    "loader: a finite pass, then an empty one": ("RankAwareSampler", loader_finite),
    "loader: rows of two puts, fields chosen": ("RankAwareSampler", loader_two_puts),
    "loader: reset replays, step moves": ("RankAwareSampler", loader_reset_and_step),
    "loader: streaming picks up rows put meanwhile": ("RankAwareSampler", loader_streaming),
    "loader: two ranks of a group and another group": ("RankAwareSampler", loader_dp_groups),
    "loader: another group after the first took every row": ("RankAwareSampler", loader_another_group_late),
    "loader: a collate_fn": ("RankAwareSampler", loader_collate_fn),
    "loader: one worker, prefetching": ("RankAwareSampler", loader_one_worker),
    "loader: a persistent worker, two passes": ("RankAwareSampler", loader_persistent_worker),
    "loader: a spawned worker": ("RankAwareSampler", loader_spawned_worker),
    "loader: a dataset iterated without a loader": ("RankAwareSampler", dataset_without_a_loader),
    "loader: no len()": ("RankAwareSampler", loader_has_no_len),
    "loader: a process_batch_fn": ("RankAwareSampler", loader_process_batch_fn),
    "loader: a micro-batch larger than the batch": ("RankAwareSampler", loader_micro_batch_larger_than_the_batch),
    "loader: bad arguments": ("RankAwareSampler", loader_bad_arguments),
    "chunk_batch_fn": ("RankAwareSampler", chunks),
    "grpo: whole groups of consecutive ready rows": ("GRPOGroupNSampler", grpo_whole_groups),
    "grpo: cached per rank and batch": ("GRPOGroupNSampler", grpo_cached_per_rank_and_batch),
    "grpo: a batch_size not a multiple of n": ("GRPOGroupNSampler", grpo_batch_not_a_multiple_of_n),
    "grpo: loaders of two groups": ("GRPOGroupNSampler", grpo_loaders),
    "seqlen: too few groups for every rank": ("SeqlenBalancedSampler", seqlen_too_few_groups),
    "seqlen: shares balanced by total_lengths": ("SeqlenBalancedSampler", seqlen_balanced_shares),
    "seqlen: equal lengths": ("SeqlenBalancedSampler", seqlen_equal_lengths),
    "seqlen: loaders of two ranks": ("SeqlenBalancedSampler", seqlen_loaders),
    "seqlen: one group for two ranks": ("SeqlenBalancedSampler", seqlen_one_group_for_two_ranks),
    "seqlen: a rank beyond dp_size": ("SeqlenBalancedSampler", seqlen_rank_beyond_dp_size),
}

#: Cases the drop-in does not answer as TransferQueue, and why: (the sampler, why, the case). Strict xfails.
KNOWN: dict[str, tuple[str, str, Case]] = {
    "rank-aware: a sampling_config without task_name and partition_id": (
        "RankAwareSampler", "the drop-in's get_meta hands every sampler the task_name and partition_id of its own "
        "arguments; TransferQueue's controller passes the sampling_config alone, so its RankAwareSampler lacks "
        "two arguments (a RuntimeError from get_meta)", rank_aware_bare_config),
    "loader: an uneven cut": (
        "RankAwareSampler", "each micro-batch's meta names exactly its rows; TransferQueue cuts the meta with "
        "BatchMeta.chunk, remainder first (rows 3 + 1, metas 2 + 2)", loader_uneven_cut),
    "loader: two workers under RankAwareSampler": (
        "RankAwareSampler", "worker w of W fetches batches w, w + W, ...; TransferQueue's workers each start at "
        "batch 0, so under RankAwareSampler a rank gets each batch W times", loader_rank_aware_two_workers),
    "loader: a group's second rank after the first took every row": (
        "RankAwareSampler", "a rank gets the batches its DP group took already even when no row is left; "
        "TransferQueue's finite loader checks consumption first and ends with nothing",
        loader_second_rank_of_a_group_late),
    "loader: a fetch_batch_fn's calls": (
        "RankAwareSampler", "the drop-in asks fetch_batch_fn for the next batch before it checks consumption (its "
        "DP group may have taken it, see above), so a finite loader calls it once more at its end than "
        "TransferQueue's", loader_fetch_batch_fn),
    "loader: batch_size 0": (
        "RankAwareSampler", "refused when the dataset is made (a ValueError); TransferQueue's takes it and polls "
        "empty batches for ever (here until the case's patience runs out: a TimeoutError)", loader_batch_size_zero),
    "grpo: a sampling_config without task_name and partition_id": (
        "GRPOGroupNSampler", "as for RankAwareSampler: TransferQueue's GRPOGroupNSampler then caches the batch "
        "under partition '' and task '', for every partition; the drop-in under the call's own",
        grpo_bare_config),
    "seqlen: a negative dp_rank": (
        "SeqlenBalancedSampler", "refused (a ValueError and RuntimeError); TransferQueue's hands rank -1 the last "
        "rank's share, by Python's negative indexing", seqlen_negative_rank),
}


def alike(mine: Any, theirs: Any) -> bool:
    """``same``, at every depth of a list or dict answer (a case may return errors among other answers)."""
    if isinstance(theirs, list) and isinstance(mine, list):
        return len(mine) == len(theirs) and all(alike(m, t) for m, t in zip(mine, theirs))
    if isinstance(theirs, dict) and isinstance(mine, dict):
        return mine.keys() == theirs.keys() and all(alike(mine[k], theirs[k]) for k in theirs)
    return same(mine, theirs)


def _params() -> list[Any]:
    known = [pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=why))
             for name, (_, why, _) in KNOWN.items()]
    every = [pytest.param(name) for name in CASES] + known
    order = list(SAMPLERS)
    return sorted(every, key=lambda param: order.index(_case(param.values[0])[0]))  # stable: by sampler


def _case(name: str) -> tuple[str, Case]:
    if name in CASES:
        return CASES[name]
    sampler, _, case = KNOWN[name]
    return sampler, case


@pytest.mark.parametrize("name", _params())
def test_the_drop_in_streams_and_samples_as_transfer_queue(systems, name):
    real, dropin, switch = systems
    sampler, case = _case(name)
    theirs_conf, mine_conf = switch(sampler)
    partition = "p-" + uuid.uuid4().hex[:8]  # each system its own, the same name on both
    theirs = answer(real, lambda tq, p: case(tq, theirs_conf, p), partition)
    mine = answer(dropin, lambda tq, p: case(tq, mine_conf, p), partition)
    assert alike(mine, theirs), f"{name}:\n  TransferQueue: {theirs!r:.1500}\n  the drop-in:   {mine!r:.1500}"
