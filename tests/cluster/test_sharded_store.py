"""The sharded data plane (broker/data/sharded_store.py): a put is two steps, write bytes then mark, and every
interleaving with clears and reads must leave no ready row without its bytes and no orphan bytes past
a whole clear.

The interleavings are driven step by step through the store's own parts (deterministic), and then
at random by threads hammering one dock (the stress test). Sharded docks are made with ``shards=3``,
so the same code runs on one server (fakeredis, Redis 7, Redis 6.2) and, on a cluster, over 3
primaries.
"""

from __future__ import annotations

import itertools
import random
import threading
import time

import pytest
import redis
import torch

from broker import BrokerError, FencedError, StoreFullError, TransferDock
from broker.control.keys import shard_pattern
from broker.data.sharded_store import ShardedStore
from tests.helpers import small_dock

_names = itertools.count()


@pytest.fixture(params=["fake", "real", "redis62", "cluster", "cluster62"])
def target(request):
    """A client (fakeredis) or URL of an empty store; the clusters are 3 primaries of Redis 7 and of 6.2."""
    if request.param == "fake":
        import fakeredis

        yield fakeredis.FakeRedis(server=fakeredis.FakeServer())
        return
    fixture = {"real": "real_url", "redis62": "redis62_url", "cluster": "cluster_url", "cluster62": "cluster62_url"}
    url = request.getfixturevalue(fixture[request.param])
    yield url


def _dock(target, **kwargs) -> TransferDock:
    return small_dock(target, f"sh{next(_names)}", 4, 2, ("prompts", "responses"), ("actor_train",), shards=3,
                      **kwargs)


def _shard_keys(dock: TransferDock) -> list[bytes]:
    """Every data shard key of the dock, on every primary (a cluster client's SCAN visits them all)."""
    return list(dock.client.scan_iter(match=shard_pattern(dock.name)))


def _rows(values: list[int]) -> dict[str, list[torch.Tensor]]:
    return {"prompts": [torch.tensor([v]) for v in values]}


def test_a_sharded_dock_spreads_groups_over_its_shards(target):
    dock = _dock(target)
    assert len(dock.schema.shards) == 3
    dock.put_experience(_rows(list(range(8))), list(range(8)))
    holders = {key for key in _shard_keys(dock)}
    assert len(holders) == 3  # 4 groups striped over 3 shards: every shard holds some
    batch, rows = dock.get_experience("actor_train", ["prompts"], 8)
    assert [t.item() for t in batch["prompts"]] == rows
    dock.close()


def test_a_clear_between_write_and_mark_refuses_the_mark(target):
    """The hazard of a two-step put: the clear lands after the bytes and before the marking."""
    dock = _dock(target)
    store = dock._session.store
    assert isinstance(store, ShardedStore)
    rows, runs = [0, 1, 2], [0, 3]
    epoch, gens = dock._session.scripts.fence_now(runs)
    written = store._write({"prompts": {str(r): _encoded(r) for r in rows}}, rows, epoch, gens)
    dock.clear([1])  # between the two steps
    marked = dock._session.scripts.mark(["prompts"], runs, {}, epoch, gens)
    assert marked.stale == (1,) and not marked.epoch_moved
    assert dock.status()["columns"]["prompts"]["ready"] == 0  # nothing marked: not even rows 0 and 2
    store._delete_fields(written, {1})
    # The put as a whole retries and succeeds; the reader sees every row with its bytes.
    dock.put_experience(_rows(rows), rows)
    batch, got = dock.get_experience("actor_train", ["prompts"], indexes=rows)
    assert [t.item() for t in batch["prompts"]] == rows
    dock.close()


def test_a_whole_clear_between_write_and_mark_refuses_every_row(target):
    dock = _dock(target)
    store = dock._session.store
    rows, runs = [0, 1], [0, 2]
    epoch, gens = dock._session.scripts.fence_now(runs)
    written = store._write({"prompts": {str(r): _encoded(r) for r in rows}}, rows, epoch, gens)
    dock.clear()
    marked = dock._session.scripts.mark(["prompts"], runs, {}, epoch, gens)
    assert marked.epoch_moved
    store._delete_fields(written, None)
    assert _shard_keys(dock) == []
    dock.close()


def test_a_put_that_died_between_the_steps_leaves_bytes_the_next_clear_removes(target):
    dock = _dock(target)
    store = dock._session.store
    dock.put_experience(_rows([10, 11]), [2, 3])
    rows, runs = [0, 1], [0, 2]
    epoch, gens = dock._session.scripts.fence_now(runs)
    store._write({"prompts": {str(r): _encoded(r) for r in rows}}, rows, epoch, gens)  # ... and dies
    status = dock.status()["columns"]["prompts"]
    assert status["ready"] == 2  # the dead put marked nothing
    batch, got = dock.get_experience("actor_train", ["prompts"], 4, timeout=None)
    assert batch is None  # rows 0 and 1 are not handed out: no reader asks for the dead put's bytes
    dock.clear()
    assert _shard_keys(dock) == []
    dock.close()


def test_a_put_refused_once_leaves_nothing_past_the_next_row_clear(target):
    """A put that read generation g, lost to a clear, and died: its bytes sit under g; the row clear
    after the next one deletes them (a clear deletes its generation and the one before)."""
    dock = _dock(target)
    store = dock._session.store
    rows, runs = [0], [0, 1]
    epoch, gens = dock._session.scripts.fence_now(runs)
    dock.clear([0])  # the put's generation ends before its bytes land
    store._write({"prompts": {"0": _encoded(0)}}, rows, epoch, gens)  # ... and it dies
    dock.put_experience(_rows([5]), [0])
    dock.clear([0])
    assert _shard_keys(dock) == []
    dock.close()


def test_a_refused_put_keeps_the_bytes_of_rows_another_put_owns(target):
    """Two puts of row 0 under the same generation write the same field; if one of them is refused
    because another of its rows moved, it must not delete row 0's field, which the other put marked."""
    dock = _dock(target)
    store = dock._session.store
    a_rows, a_runs = [0, 1], [0, 2]
    epoch, gens = dock._session.scripts.fence_now(a_runs)
    a_written = store._write({"prompts": {"0": _encoded(100), "1": _encoded(101)}}, a_rows, epoch, gens)
    dock.put_experience(_rows([200]), [0])  # put B of row 0 alone, same generation: marked
    dock.clear([1])
    marked = dock._session.scripts.mark(["prompts"], a_runs, {}, epoch, gens)
    assert marked.stale == (1,)
    store._delete_fields(a_written, {i for i, r in enumerate(a_rows) if r in marked.stale})
    batch, _ = dock.get_experience("actor_train", ["prompts"], indexes=[0])
    assert batch["prompts"][0].item() in (100, 200)  # B's field, or A's bytes under it: never gone
    dock.close()


@pytest.mark.parametrize("clear", ["rows", "whole"])
@pytest.mark.parametrize("fenced", [False, True])
def test_a_put_after_a_read_writes_under_what_the_read_saw_and_a_clear_between_is_caught(target, clear, fenced):
    """A stage reads rows, then puts its results into them without asking their generations first (it
    saw them at its read). Another process clearing them in between must not leave them ready without
    bytes: the guess is refused. A put naming plain rows then writes again under the new generations;
    a put naming the delivery is refused for good (the rows are no longer the stage's)."""
    stage = _dock(target)
    other = TransferDock.attach(target, stage.name)
    stage.put_experience(_rows([0, 1, 2, 3]), [0, 1, 2, 3])
    batch, rows = stage.get_experience("actor_train", ["prompts"], indexes=[0, 1])
    other.clear([0, 1] if clear == "rows" else None)
    results = {"responses": [torch.tensor([r + 100]) for r in rows]}
    if fenced:
        with pytest.raises(FencedError, match=r"rows \[0, 1\] were cleared"):
            stage.put_experience(results, rows)
        assert stage.status()["columns"]["responses"]["ready"] == 0
    else:
        stage.put_experience(results, list(rows))
        assert stage.status()["columns"]["responses"]["ready"] == 2
        got = stage.read_rows(["responses"], rows)["responses"]
        assert [t.item() for t in got] == [100, 101]
    other.clear()
    assert _shard_keys(stage) == []  # the refused put's bytes were deleted
    other.close()
    stage.close()


@pytest.mark.parametrize("cleared_again", [False, True])
def test_after_its_whole_clear_a_put_of_rows_it_read_writes_without_asking(target, monkeypatch, cleared_again):
    """A whole clear moves the epoch on and leaves every row's generation: rows this object read before it are
    put again (the next iteration's prompts) under the new epoch without asking first (a fence script call per
    put and partition). If another process cleared again in between, mark.lua refuses the guess and the put
    writes again under what is current, leaving no bytes behind."""
    dock = _dock(target)
    other = TransferDock.attach(target, dock.name)
    dock.put_experience(_rows([0, 1, 2, 3]), [0, 1, 2, 3])
    dock.clear([2, 3])  # rows 2 and 3 at generation 1, rows 0 and 1 at 0
    dock.put_experience(_rows([2, 3]), [2, 3])
    dock.get_experience("actor_train", ["prompts"], indexes=[0, 1, 2, 3])
    dock.clear()
    if cleared_again:
        other.clear()
    asked = []
    scripts = dock._session.scripts
    monkeypatch.setattr(scripts, "fence_now", lambda runs, real=scripts.fence_now: asked.append(runs) or real(runs))
    dock.put_experience(_rows([10, 11, 12, 13]), [0, 1, 2, 3])
    assert bool(asked) == cleared_again
    monkeypatch.undo()
    assert [t.item() for t in dock.read_rows(["prompts"], [0, 1, 2, 3])["prompts"]] == [10, 11, 12, 13]
    other.clear()
    assert _shard_keys(dock) == []
    other.close()
    dock.close()


def test_a_clear_of_rows_in_any_order_deletes_exactly_their_bytes(target):
    """Rows named out of order, with different generations: each row's own bytes go, no other's."""
    dock = _dock(target)
    dock.put_experience(_rows([0, 1, 2, 3]), [0, 1, 2, 3])
    dock.clear([1])
    dock.clear([1])
    dock.put_experience(_rows([1]), [1])  # row 1 now holds bytes under generation 2, row 3 under 0
    dock.clear([3, 1])
    held = sum(int(dock.client.hlen(key)) for key in _shard_keys(dock))
    assert held == 2  # rows 0 and 2
    assert dock.read_rows(["prompts"], [0, 1, 2, 3])["prompts"][1] is None
    dock.close()


def test_a_stale_slot_map_is_followed_and_the_rows_arrive_whole(request):
    """The data plane sends each node its commands straight from the client's slot map (broker/connection/fanout.py).
    When the map is out of date (a slot moved), the node answers MOVED and the batch goes again through
    the cluster pipeline, which follows it: puts and reads see nothing of it."""
    url = request.getfixturevalue("cluster_url")
    dock = small_dock(url, f"moved{next(_names)}", 6, 2, ("prompts",), ("actor_train",))
    client = dock.client
    cache = client.nodes_manager.slots_cache
    for tag in dock.schema.shards:  # every data shard's slot now points at a primary that does not serve it
        slot = client.keyslot("{" + tag + "}")
        right = cache[slot][0]
        cache[slot] = [next(n for n in client.get_primaries() if n.name != right.name)]
    dock.put_experience(_rows(list(range(12))), list(range(12)))
    batch, rows = dock.get_experience("actor_train", ["prompts"], 12)
    assert [t.item() for t in batch["prompts"]] == rows == list(range(12))
    dock.delete()
    dock.close()


def test_a_full_shard_fails_the_put_and_marks_nothing(request):
    """One primary at maxmemory: the HSET there fails, the put removes what the others took, and
    raises StoreFullError; nothing is marked."""
    url = request.getfixturevalue("cluster_url")
    dock = small_dock(url, f"full{next(_names)}", 6, 1, ("prompts",), ("actor_train",))
    client = dock.client
    assert len(dock.schema.shards) == 3
    full_tag = dock.schema.shards[1]
    node = client.nodes_manager.get_node_from_slot(client.keyslot("{" + full_tag + "}"))
    admin = redis.Redis(host=node.host, port=node.port)
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", used + 64 * 1024)
    try:
        big = [torch.zeros(128 * 1024, dtype=torch.uint8) for _ in range(6)]  # 128 KiB a row
        with pytest.raises(StoreFullError):
            dock.put_experience({"prompts": big}, list(range(6)))
        assert dock.status()["columns"]["prompts"]["ready"] == 0
        assert _shard_keys(dock) == []
    finally:
        admin.config_set("maxmemory", 0)
        admin.close()
    dock.put_experience({"prompts": big}, list(range(6)))  # room again: the same put goes through
    assert dock.status()["columns"]["prompts"]["ready"] == 6
    dock.delete()
    dock.close()


def _encoded(value: int) -> bytes:
    from broker.data.codec import encode_column

    return encode_column("prompts", [torch.tensor([value])], 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["real_url", "cluster_url"])
def test_stress_puts_clears_and_readers_never_see_a_ready_row_without_bytes(request, where):
    """Putters, a clearer of rows and of the whole dock, and readers, for a few seconds.

    Every row put holds its own index (and the put's number), so a reader can tell a row from
    another's bytes. No reader may get MissingDataError or a row holding another row's bytes, and
    after the putters stop, a whole clear leaves no data shard key at all.
    """
    url = request.getfixturevalue(where)
    name = f"stress{next(_names)}"
    prompts, n = 16, 2
    setup = small_dock(url, name, prompts, n, ("prompts",), ("actor_train",), shards=3)
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"puts": 0, "refused": 0, "reads": 0, "rows": 0, "clears": 0}
    lock = threading.Lock()

    def worker(body):
        def run():
            dock = TransferDock.attach(url, name)
            try:
                while not stop.is_set():
                    body(dock)
            except BaseException as exc:  # noqa: BLE001  # reported by the test
                errors.append(exc)
            finally:
                dock.close()
        return threading.Thread(target=run, daemon=True)

    put_number = itertools.count()

    def put(dock):
        rng = random.Random()
        g = rng.randrange(prompts)
        rows = list(range(g * n, (g + 1) * n))
        number = next(put_number)
        try:
            dock.put_experience({"prompts": [torch.tensor([r, number]) for r in rows]}, rows)
        except BrokerError as exc:
            if "were cleared during each" not in str(exc):
                raise
            with lock:
                counts["refused"] += 1
            return
        with lock:
            counts["puts"] += 1

    def clear(dock):
        rng = random.Random()
        if rng.random() < 0.2:
            dock.clear()
        else:
            dock.clear(rng.sample(range(prompts * n), 3))
        with lock:
            counts["clears"] += 1
        time.sleep(0.001)

    def read(dock):
        batch, rows = dock.get_experience("actor_train", ["prompts"], 2, timeout=0.2)
        if batch is None:
            return
        for row, value in zip(rows, batch["prompts"]):
            assert value is not None and int(value[0]) == row, (row, value)
        with lock:
            counts["reads"] += 1
            counts["rows"] += len(rows)

    threads = [worker(put), worker(put), worker(clear), worker(read), worker(read)]
    for t in threads:
        t.start()
    time.sleep(4.0)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert counts["puts"] > 50 and counts["reads"] > 10 and counts["clears"] > 50, counts
    setup.clear()
    assert _shard_keys(setup) == [], "orphan bytes outlived a whole clear"
    setup.delete()
    setup.close()
