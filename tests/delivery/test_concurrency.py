"""Many processes sharing one dock on a real redis-server or a Redis Cluster: every row reaches each consumer
exactly once.

Run alone with: .venv/bin/python -m pytest tests/delivery/test_concurrency.py -v
"""

from __future__ import annotations

import multiprocessing as mp
import random
import time

import pytest
import torch

from broker import TransferDock
from tests.helpers import worker_processes

PROMPTS, N = 64, 8
COLUMNS = ["prompts", "responses"]
CONSUMERS = ["actor_train", "ref_log_prob"]


def _row_value(column: str, row: int) -> torch.Tensor:
    """Content that names its own cell, so a reader can check it got the right bytes."""
    return torch.tensor([row, COLUMNS.index(column)] + [row] * (row % 5), dtype=torch.int32)


def _produce(dock: TransferDock, seed: int, start: mp.Barrier) -> None:
    """Write groups in a shuffled order, each column separately, the way pipeline stages do."""
    start.wait()
    rng = random.Random(seed)
    groups = list(range(PROMPTS))
    rng.shuffle(groups)
    for column in COLUMNS:
        for start in range(0, PROMPTS, 4):
            rows = [r for g in groups[start : start + 4] for r in range(g * N, g * N + N)]
            dock.put_experience({column: [_row_value(column, r) for r in rows]}, indexes=rows)
            time.sleep(0.005)  # let readers in between puts, as a real producer's compute would


def _consume(dock: TransferDock, consumer: str, count: int, start: mp.Barrier, out: mp.Queue) -> None:
    """Take batches until the consumer has seen every row; report each batch and any bad content."""
    batches, errors = [], []
    start.wait()
    while not dock.all_consumed(consumer):
        batch, rows = dock.get_experience(consumer, COLUMNS, count, timeout=0.5)
        if rows is None:
            continue
        batches.append(rows)
        for column in COLUMNS:
            for row, value in zip(rows, batch[column]):
                if not torch.equal(value, _row_value(column, row)):
                    errors.append((column, row))
    out.put((consumer, batches, errors))


@pytest.mark.real
@pytest.mark.parametrize("processes_per_consumer", [3])
def test_many_processes_consume_every_row_exactly_once_in_whole_groups(dock_url, processes_per_consumer):
    dock = TransferDock(dock_url, "exactly-once", prompts_num=PROMPTS, n_samples_per_prompt=N,
                        columns=COLUMNS, consumers=CONSUMERS)
    dock.clear()
    ctx = worker_processes()  # as Ray and torch.multiprocessing give: a fresh interpreter per worker
    out = ctx.Queue()
    # Everyone starts together, so no process gets the whole dock before the others have booted.
    start = ctx.Barrier(1 + len(CONSUMERS) * processes_per_consumer)
    # The dock goes to each process pickled, as (URL, name): the same path a Ray actor takes.
    procs = [ctx.Process(target=_produce, args=(dock, 7, start))]
    for consumer in CONSUMERS:
        procs += [
            ctx.Process(target=_consume, args=(dock, consumer, 2 * N, start, out))
            for _ in range(processes_per_consumer)
        ]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=120) for _ in range(len(procs) - 1)]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            p.kill()

    for consumer in CONSUMERS:
        mine = [bs for c, bs, _ in results if c == consumer]
        assert len(mine) == processes_per_consumer
        batches = [b for bs in mine for b in bs]
        rows = sorted(r for b in batches for r in b)
        assert rows == list(range(PROMPTS * N)), f"{consumer}: rows lost or handed out twice"
        for b in batches:
            groups = sorted({r // N for r in b})
            assert b == [r for g in groups for r in range(g * N, g * N + N)], f"{consumer}: partial group in {b}"
        # Several processes really took part, so the exclusion was tested, not a single reader.
        assert sum(1 for bs in mine if bs) >= 2
    assert all(not errors for _, _, errors in results)
    done = {"consumed": PROMPTS * N, "leased": 0, "redelivered": 0, "dead": 0}
    assert dock.status()["consumers"] == {c: done for c in CONSUMERS}
    dock.delete()


@pytest.fixture(params=[1, 3], ids=["whole", "partitioned"])
def partitions(request) -> int:
    """Every dock test of this file also on a dock of three partitions (see tests/conftest.py)."""
    return request.param
