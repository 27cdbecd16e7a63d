"""broker.transfer_queue under concurrency: the races TransferQueue's users run into, on a real Redis 7 and on a
Redis Cluster, each run for a few seconds by threads of one process sharing its client (as verl's async
workers do). A race test fails on the code before its fix; each says what it saw then.

- a schema grown by another client (each new field or task name grows the system's dock) is followed
  within the call: no put fails, and none leaves a key listed without its data;
- a kv_batch_get racing clears and puts returns the key's own bytes or raises, never another key's bytes or
  a field as None;
- a kv_put racing a kv_clear of its key never lands on the row the clear gave a new key: neither its fields
  nor its tags show under the new key;
- a put that fails after its keys got rows leaves none of the keys it made listed;
- a checkpoint taken while puts and clears run holds none of them half done;
- on a system cut into sub-systems (``broker.partitions``), a partition cleared and made again over and over
  leaves the reads of the others (in its sub-system and in another) whole.
"""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Callable

import pytest
import torch

tensordict = pytest.importorskip("tensordict")
from tensordict import TensorDict  # noqa: E402

import broker.transfer_queue as tq  # noqa: E402
from broker import QuotaExceededError  # noqa: E402
from tests.helpers import dense, empty_cluster  # noqa: E402

pytestmark = [pytest.mark.real, pytest.mark.slow]

#: How long each race runs: the races below showed up within a second or two before their fixes.
SECONDS = 3.0


@pytest.fixture(params=["real", "cluster"])
def system(request):
    if request.param == "real":
        url = request.getfixturevalue("url")
    else:
        empty_cluster(request.getfixturevalue("cluster_admin"))
        url = request.getfixturevalue("cluster_url")
    tq.init({"broker": {"url": url, "namespace": "race" + uuid.uuid4().hex[:8], "get_meta_timeout": 0.2}})
    yield tq
    tq.get_client().system.delete()
    tq.close()


def race(*loops: Callable[[Callable[[], bool]], None], seconds: float = SECONDS) -> None:
    """Run each loop in its own thread until ``seconds`` pass (a loop runs while ``going()``); a loop's error
    fails the test after all stopped."""
    stop = time.monotonic() + seconds
    errors: list[BaseException] = []

    def body(loop: Callable[[Callable[[], bool]], None]) -> None:
        try:
            loop(lambda: time.monotonic() < stop and not errors)
        except BaseException as exc:  # noqa: BLE001 - reported below, with the others stopped
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(loop,)) for loop in loops]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    assert not errors, f"a loop raised: {errors[0]!r}"


def test_puts_go_on_while_other_clients_grow_the_schema(system):
    """Before: 69 and 73 of ~480 puts per writer raised SchemaError (the meta no longer held the schema the
    dock was opened with), and the keys of puts that failed after their rows were given stayed listed
    without data."""
    failed: Counter[str] = Counter()
    first: dict[str, str] = {}  # each kind's first traceback: where a rare failure came from
    done = Counter()

    def writer(w: int) -> Callable[[Callable[[], bool]], None]:
        def loop(going: Callable[[], bool]) -> None:
            i = 0
            while going():
                keys = [f"w{w}-{i}-{j}" for j in range(4)]
                i += 1
                try:
                    tq.kv_batch_put(keys, "g", TensorDict({"a": torch.full((4, 3), i)}, batch_size=4), [{"i": i}] * 4)
                    done[w] += 1
                except Exception as exc:  # noqa: BLE001 - counted: the test says how many and which
                    failed[type(exc).__name__] += 1
                    first.setdefault(type(exc).__name__, "".join(traceback.format_exception(exc))[-1500:])
        return loop

    def grower(going: Callable[[], bool]) -> None:
        client, k = tq.get_client(), 0
        while going():
            k += 1
            client.get_meta(["a"], 1, "g", task_name=f"task{k}")  # a new task: the dock grows a consumer
            tq.kv_put(f"grow{k}", "g2", {f"f{k}": torch.ones(2)})  # a new field: it grows a column

    race(writer(0), writer(1), grower)
    assert not failed, f"puts failed: {dict(failed)} (and {sum(done.values())} went through); first: {first}"
    assert min(done.values()) > 0
    listed = tq.kv_list("g")["g"]
    assert len(listed) == 4 * sum(done.values())
    got = tq.kv_batch_get(list(listed), "g", ["a"])  # every key listed has its data
    assert dense(got["a"]).shape == (len(listed), 3)


def test_a_get_racing_clears_and_puts_returns_the_keys_own_bytes_or_raises(system):
    """Before: in 6 s, 11 reads returned k2's [222, 222] under k, and 801 returned the tensor field v as
    NonTensorStack([None]), with no error (the key -> row lookup and the read were two steps, nothing
    checking the row between them)."""
    wrong: Counter[str] = Counter()
    right = Counter()
    tq.kv_put("k", "p", {"v": torch.tensor([111, 111]), "s": "k"})

    def churn(going: Callable[[], bool]) -> None:
        while going():
            tq.kv_clear(["k"], "p")
            tq.kv_put("k2", "p", {"v": torch.tensor([222, 222]), "s": "k2"})
            tq.kv_clear(["k2"], "p")
            tq.kv_put("k", "p", {"v": torch.tensor([111, 111]), "s": "k"})

    def reader(going: Callable[[], bool]) -> None:
        while going():
            try:
                got = tq.kv_batch_get(["k"], "p")
            except KeyError:  # k is cleared at the moment, or cleared while read: TransferQueue raises too
                continue
            if not list(got.keys()):  # k made again, its put not landed yet: no field yet, as there
                continue
            v, s = got["v"], got["s"]
            if isinstance(v, torch.Tensor) and dense(v)[0].tolist() == [111, 111] and list(s) == ["k"]:
                right["k"] += 1
            else:
                wrong[f"v={v!r:.60} s={s!r:.40}"] += 1

    race(churn, reader, reader)
    assert not wrong, f"wrong values read under k ({sum(right.values())} right): {dict(wrong)}"
    assert right["k"] > 0


@pytest.fixture(params=["real", "cluster"])
def cut_system(request):
    """A system cut into three sub-systems (``broker.partitions``): "val" and "p" share sub-system 1, "train" is
    in sub-system 0 (broker/transfer_queue/systems.py)."""
    if request.param == "real":
        url = request.getfixturevalue("url")
    else:
        empty_cluster(request.getfixturevalue("cluster_admin"))
        url = request.getfixturevalue("cluster_url")
    tq.init({"broker": {"url": url, "namespace": "cut" + uuid.uuid4().hex[:8], "get_meta_timeout": 0.2,
                        "partitions": 3}})
    yield tq
    tq.get_client().systems.delete()
    tq.close()


def test_a_partition_cleared_and_made_again_leaves_the_others_read_whole_on_a_cut_system(cut_system):
    """clear_partition of "val" and its puts again, in a loop, while "p" (the same sub-system) and "train" (another)
    are read by key and by get_meta: every read returns its own partition's bytes, never "val"'s."""
    wrong: Counter[str] = Counter()
    right = Counter()
    client = tq.get_client()
    for partition, value in (("p", 1), ("train", 2)):
        tq.kv_batch_put([f"k{i}" for i in range(4)], partition,
                        TensorDict({"v": torch.full((4, 2), value)}, batch_size=4))

    def churn(going: Callable[[], bool]) -> None:
        while going():
            tq.kv_batch_put([f"k{i}" for i in range(4)], "val", TensorDict({"v": torch.full((4, 2), 9)}, batch_size=4))
            client.clear_partition("val")

    def reader(partition: str, value: int) -> Callable[[Callable[[], bool]], None]:
        def read(going: Callable[[], bool]) -> None:
            while going():
                got = dense(tq.kv_batch_get([f"k{i}" for i in range(4)], partition)["v"])
                meta = client.get_meta(["v"], 4, partition, mode="force_fetch")
                by_meta = dense(client.get_data(meta)["v"])
                for what, t in (("key", got), ("meta", by_meta)):
                    if t.tolist() == [[value] * 2] * 4:
                        right[partition] += 1
                    else:
                        wrong[f"{partition} by {what}: {t.tolist()!r:.60}"] += 1
        return read

    race(churn, reader("p", 1), reader("train", 2))
    assert not wrong, f"wrong values read ({dict(right)} right): {dict(wrong)}"
    assert right["p"] > 0 and right["train"] > 0
    assert client.get_partition_list()[:2] == ["p", "train"]


def test_a_put_racing_a_clear_of_its_key_never_lands_on_a_new_keys_row(system):
    """Before: 276 of 716 new keys showed k's field v (TransferQueue itself: 175 of 400), and new keys showed
    k's tags: the put looked k's row up, the clear gave that row to a new key, and the put wrote it."""
    made: list[str] = []

    def clearer(going: Callable[[], bool]) -> None:
        i = 0
        while going():
            tq.kv_clear(["k"], "p")
            tq.kv_put(f"n{i}", "p", {"w": torch.tensor([i])}, {"who": f"n{i}"})
            made.append(f"n{i}")
            i += 1

    def putter(going: Callable[[], bool]) -> None:
        while going():
            tq.kv_put("k", "p", {"v": torch.tensor([7, 7])}, {"who": "k"})

    race(clearer, putter, putter)
    listing = tq.kv_list("p")["p"]
    assert len(made) > 50 and all(n in listing for n in made)
    foreign_tags = [n for n in made if listing[n] != {"who": n}]
    state = tq.get_client().system.snapshot("p", keys=made)
    (with_v,) = state.produced_each(state.rows_of_keys(), ["v"])
    foreign_fields = [n for n, has in zip(made, with_v) if has]
    assert not foreign_tags, f"{len(foreign_tags)} of {len(made)} new keys hold k's tags: {foreign_tags[:5]}"
    assert not foreign_fields, f"{len(foreign_fields)} of {len(made)} new keys hold k's field v: {foreign_fields[:5]}"
    for n in made[:: max(1, len(made) // 20)]:  # and their bytes are their own
        assert dense(tq.kv_batch_get([n], "p")["w"]).tolist() == [[int(n[1:])]]


def test_a_put_that_fails_after_its_keys_got_rows_lists_none_of_the_keys_it_made(system):
    """Before: the keys of a put that failed after tq_rows.lua gave them rows stayed listed, without data."""
    tq.kv_put("old", "p", {"x": torch.zeros(4)}, {"t": 1})
    tq.get_client().system.dock.set_quota(64 * 1024)
    big = TensorDict({"x": torch.zeros(2, 64 * 1024)}, batch_size=2)
    with pytest.raises(QuotaExceededError):
        tq.kv_batch_put(["old", "new"], "p", big, [{"t": 2}, {"t": 3}])
    assert tq.kv_list("p") == {"p": {"old": {"t": 1}}}  # the key it made is gone; the one it found is as it was
    assert dense(tq.kv_batch_get(["old"], "p")["x"]).tolist() == [[0.0] * 4]


def test_a_checkpoint_taken_while_puts_and_clears_run_holds_none_half_done(system, tmp_path):
    """Before: each of four saves taken during a loop of kv_batch_puts held 4-16 keys listed without their tags
    (or without data): a put's rows, fields and tags are three steps, and the copy fell between them."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        i = 0
        try:
            while not stop.is_set():
                keys = [f"w{w}-{i}-{j}" for j in range(8)]
                i += 1
                tq.kv_batch_put(keys, "g", TensorDict({"a": torch.full((8, 64), i), "b": torch.ones(8, 3)},
                                                      batch_size=8), [{"i": i}] * 8)
                if i % 3 == 0:
                    tq.kv_clear(keys[:4], "g")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    saved = []
    try:
        for n in range(3):
            time.sleep(0.4)
            tq.save_checkpoint(tmp_path / f"ck{n}")
            saved.append(tmp_path / f"ck{n}")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors[0]
    system = tq.get_client().system
    for path in saved:
        tq.load_checkpoint(path)
        listing = tq.kv_list("g")["g"]
        state = system.snapshot("g", keys=list(listing))
        rows = state.rows_of_keys()
        a, b = state.produced_each(rows, ["a", "b"])
        without_data = [k for k, ok in zip(listing, a & b) if not ok]
        without_tags = [k for k, tags in listing.items() if "i" not in tags]
        without_key = set(system.partition_rows("g")) - set(rows)
        assert listing and not without_data and not without_tags and not without_key, (
            f"{path.name}: {len(listing)} keys; without data {without_data[:5]}, without tags {without_tags[:5]}, "
            f"rows without a key {sorted(without_key)[:5]}")
