"""A dock's keys to a file and back (broker/api/snapshot.py), on a dock with partial rollout: what a run's
checkpoint holds of the dock when its rows outlive an iteration. The TransferQueue adapter's checkpoints
(tests/adapters/test_tq_checkpoint.py) run on the same code with the adapter's keys added."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch

from broker import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointRestoreError,
    FencedError,
)
from broker.api.snapshot import DockSnapshot, verify_file, write_file
from tests.delivery.test_partial_rollout import CONSUMERS, ROLLOUT_COLUMNS, partial, prompts, respond
from tests.helpers import raw_state, restored_from, server_keys


@pytest.fixture(params=["real", "redis62", "cluster"])
def backend(request) -> str:
    """COPY, DUMP and RESTORE on every real server (fakeredis has no COPY)."""
    return request.param


def mid_run(dock) -> None:
    """A dock as a partial-rollout run leaves it between iterations: groups of two ages, partial responses,
    rows consumed by some stages, a version and a dropped group."""
    prompts(dock, [0, 1, 2])
    _, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 6, get_n_samples=False)
    respond(dock, rows, [1, 1, 1, 0, 0, 1], tokens=(5, 6))
    dock.get_experience("reward", ["prompts", "responses"], 2)
    dock.set_version(3)
    dock.clear(consumer="actor_train")  # ages the groups kept
    prompts(dock, [3])


def staged(dock) -> list[bytes]:
    return server_keys(dock.client, dock.keys.base + "ckpt:*")


def test_a_restore_brings_back_the_dock_as_it_was_saved(make_dock, tmp_path):
    dock = partial(make_dock)
    mid_run(dock)
    before, status = raw_state(dock), dock.status()
    info = DockSnapshot(dock).save(tmp_path / "dock.msgpack")
    assert raw_state(dock) == before and staged(dock) == []  # the save changed nothing, and left no copies
    assert info["keys"] == len(before) - 1  # every key but the meta, which goes in the info
    verify_file(tmp_path / "dock.msgpack", info["file"])
    # What a run does after the checkpoint, undone by the restore: more generated, trained, cleared.
    _, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 8, get_n_samples=False)
    respond(dock, rows, [1] * len(rows))
    dock.get_experience("actor_train", ["responses"], 2)
    dock.set_version(4)
    dock.clear(consumer="actor_train")
    dock.clear()
    reached = dock.client.get(dock.keys.epoch)

    DockSnapshot(dock).restore(tmp_path / "dock.msgpack", info)

    # Every key as saved, but the epoch: forward past the saved one and the one the run had reached.
    assert raw_state(dock) == restored_from(before, dock) and staged(dock) == []
    assert int(dock.client.get(dock.keys.epoch)) > int(reached)
    again = dock.status()
    assert (again["rollout"], again["version"], again["columns"]) == (status["rollout"], status["version"],
                                                                      status["columns"])
    # The dock goes on from there: the rollout gets the unfinished rows with their partial responses.
    batch, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 8, get_n_samples=False)
    unfinished = {r: t.tolist() for r, t in zip(rows, batch["responses"])}
    assert unfinished and all(t in ([5, 6], [-1]) for t in unfinished.values())


def test_a_file_that_is_not_the_saves_changes_nothing(make_dock, tmp_path):
    dock = partial(make_dock)
    mid_run(dock)
    file = tmp_path / "dock.msgpack"
    info = DockSnapshot(dock).save(file)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointCorruptError, match="not the file the save wrote"):
        verify_file(file, info["file"])
    with pytest.raises(CheckpointNotFoundError):
        verify_file(tmp_path / "gone", info["file"])
    before = raw_state(dock)
    with pytest.raises(CheckpointCorruptError, match="not the file the save wrote"):
        DockSnapshot(dock).restore(file, info)
    # Files that pass the check (their own size and hash given) but are not a save's: refused, nothing changed.
    # Another dock's keys:
    other = partial(make_dock)
    foreign = msgpack.packb({"k": other.keys.meta + "x", "t": "string", "at": -1, "dump": b"x"})
    # A file cut in the middle of a record, after whole ones were staged (the staged keys go). Cut a few bytes into
    # the record after the first half: half the file alone may end on a record's end (the records' sizes follow
    # the dock's name, and so whatever tests made docks before this one).
    cut = data[: _record_start_after(data, len(data) // 2) + 3]
    for bad, message in ((foreign, "not one of the dock's"), (cut, "middle of a record")):
        file.write_bytes(bad)
        with pytest.raises(CheckpointCorruptError, match=message):
            DockSnapshot(dock).restore(file, {**info, "file": write_file(file, bad)})
        assert raw_state(dock) == before and staged(dock) == []


def test_a_dock_with_data_shards_is_refused(make_dock, tmp_path):
    dock = make_dock(2, 2, ("prompts",), CONSUMERS, shards=2)
    with pytest.raises(CheckpointError, match="data shards"):
        DockSnapshot(dock).save(tmp_path / "dock.msgpack")
    # Nor is a checkpoint restored into one: the bytes on its shards would outlive its keys, read by nobody.
    plain = make_dock(2, 2, ("prompts",), CONSUMERS, name="sharded-later", shards=0)
    info = DockSnapshot(plain).save(tmp_path / "dock.msgpack")
    plain.delete()
    dock = make_dock(2, 2, ("prompts",), CONSUMERS, name="sharded-later", shards=2)
    dock.put_experience({"prompts": [torch.tensor([1])] * 2}, [0, 1])
    before = raw_state(dock)
    with pytest.raises(CheckpointError, match="data shards"):
        DockSnapshot(dock).restore(tmp_path / "dock.msgpack", info)
    assert raw_state(dock) == before and staged(dock) == []
    assert [t.item() for t in dock.read_rows(["prompts"], [0, 1])["prompts"]] == [1, 1]


def test_an_older_server_refuses_a_newer_ones_payloads_and_keeps_its_dock(url, redis62_url, tmp_path):
    from tests.helpers import small_dock

    name = "snap-old"
    newer = small_dock(url, name, 2, 2, ("prompts",), CONSUMERS)
    older = small_dock(redis62_url, name, 2, 2, ("prompts",), CONSUMERS)
    try:
        newer.put_experience({"prompts": [torch.tensor([1])] * 2}, [0, 1])
        newer.get_experience("reward", ["prompts"], 2)  # a bitmap: a DUMP payload, in 7.0's RDB format
        info = DockSnapshot(newer).save(tmp_path / "dock.msgpack")
        if info["rdb_version"] is None or info["rdb_version"] <= 9:
            pytest.skip(f"the newer server dumps RDB format {info['rdb_version']}, which 6.2 reads")
        before = raw_state(older)
        with pytest.raises(CheckpointRestoreError, match="RDB format"):
            DockSnapshot(older).restore(tmp_path / "dock.msgpack", info)
        assert raw_state(older) == before and staged(older) == []
    finally:
        newer.delete()
        older.delete()


def test_a_restored_dock_has_the_quota_and_count_of_its_checkpoint(make_dock, tmp_path):
    """The count of a quota is of the rows: a restore brings back the checkpoint's, not one kept since."""
    dock = make_dock(shards=0)
    dock.put_experience({"prompts": torch.ones(2, 8)}, [0, 1])
    info = DockSnapshot(dock).save(tmp_path / "dock.msgpack")
    dock.set_quota(1 << 20)
    dock.put_experience({"prompts": torch.ones(2, 8)}, [2, 3])
    DockSnapshot(dock).restore(tmp_path / "dock.msgpack", info)
    assert "quota" not in dock.status()
    held = dock.set_quota(1 << 20)
    info = DockSnapshot(dock).save(tmp_path / "quota.msgpack")
    dock.put_experience({"prompts": torch.ones(2, 64)}, [2, 3])
    dock.set_quota(None)
    DockSnapshot(dock).restore(tmp_path / "quota.msgpack", info)
    assert dock.status()["quota"] == {"bytes": 1 << 20, "stored_bytes": held} and held > 0
    assert dock.set_quota(1 << 20) == held  # the count is right: a fresh count agrees


# -- forward, never back: no delivery from before a restore names rows again --------------------------------


def stage_dock(make_dock):
    """Two groups of two rows: a stage ("rollout") answers the prompts, the trainer ("train") learns from them."""
    return make_dock(2, 2, ("prompts", "responses"), ("rollout", "train"), shards=0)


def ask(dock, prompt: int, rows=(0, 1)) -> None:
    """The driver: prompt ``prompt`` into ``rows``, named by a plain list (not fenced)."""
    dock.put_experience({"prompts": [torch.tensor([prompt])] * len(rows)}, list(rows))


def late_answer(dock, delivery, prompt: int):
    """A slow worker's result for ``prompt``, put into the rows it was handed: refused, or it lands."""
    return dock.put_experience({"responses": [torch.tensor([prompt, 99])] * len(delivery)}, delivery)


def pairs(dock, rows=(0, 1)) -> list[tuple[int, int | None]]:
    """(prompt, prompt the response answers) of each row: the pairing the trainer would learn from."""
    got = dock.read_rows(["prompts", "responses"], list(rows))
    return [(p.item(), None if r is None else r[0].item()) for p, r in zip(got["prompts"], got["responses"])]


@pytest.mark.parametrize("lease", [None, 30.0])
@pytest.mark.parametrize("clear", ["whole", "rows"])
def test_a_delivery_handed_out_after_the_save_is_fenced_off_by_the_restore(make_dock, tmp_path, lease, clear):
    """The finding: restored, the epoch and generations were the saved ones, which the next clear counted up
    to those of a delivery handed out after the save; its late put landed on the next prompt's rows and the
    trainer got (prompt 3, response 2)."""
    dock = stage_dock(make_dock)
    ask(dock, 1)
    info = DockSnapshot(dock).save(tmp_path / "dock.msgpack")
    # The run goes on past the checkpoint: the next iteration's prompt, handed to a (slow) worker.
    dock.clear() if clear == "whole" else dock.clear([0, 1])
    ask(dock, 2)
    _, slow = dock.get_experience("rollout", ["prompts"], indexes=[0, 1], lease=lease)
    # The run dies, and resumes from the checkpoint: its driver clears and refills as the loop does.
    epoch = int(dock.client.get(dock.keys.epoch))
    DockSnapshot(dock).restore(tmp_path / "dock.msgpack", info)
    restored = int(dock.client.get(dock.keys.epoch))
    dock.clear() if clear == "whole" else dock.clear([0, 1])
    ask(dock, 3)
    with pytest.raises(FencedError, match="cleared or dropped since this delivery handed them out"):
        late_answer(dock, slow, 2)
    assert pairs(dock) == [(3, None), (3, None)]
    # The resumed run's own worker is handed the rows afresh, and its put lands.
    _, rows = dock.get_experience("rollout", ["prompts"], 2, lease=lease)
    late_answer(dock, rows, 3)
    assert pairs(dock) == [(3, 3), (3, 3)]
    assert restored > max(epoch, slow.epoch)  # forward, never back


@pytest.mark.parametrize("lease", [None, 30.0])
def test_a_delivery_handed_out_before_the_save_is_fenced_off_by_the_restore(make_dock, tmp_path, lease):
    """The checkpoint holds the rows as handed out (and leased) to a worker of the run that died: that worker's
    late put must not land on the resumed run's rows, before a clear or after it."""
    dock = stage_dock(make_dock)
    ask(dock, 1)
    _, slow = dock.get_experience("rollout", ["prompts"], indexes=[0, 1], lease=lease)
    info = DockSnapshot(dock).save(tmp_path / "dock.msgpack")
    DockSnapshot(dock).restore(tmp_path / "dock.msgpack", info)
    with pytest.raises(FencedError):
        late_answer(dock, slow, 1)
    assert pairs(dock) == [(1, None), (1, None)]
    assert int(dock.client.get(dock.keys.epoch)) > slow.epoch
    dock.clear()
    ask(dock, 3)
    with pytest.raises(FencedError):
        late_answer(dock, slow, 1)
    assert pairs(dock) == [(3, None), (3, None)]


def test_restored_leases_come_back_when_they_run_out_and_an_old_ack_releases_none(make_dock, tmp_path):
    """A lease the checkpoint holds is no delivery's after the restore: an ack from before it releases nothing
    (its put was refused: the rows must be redone), and the rows come back when the lease runs out, to a worker
    of the resumed run, whose put and ack land as usual."""
    dock = stage_dock(make_dock)
    ask(dock, 1)
    _, slow = dock.get_experience("rollout", ["prompts"], indexes=[0, 1], lease=1.0)
    info = DockSnapshot(dock).save(tmp_path / "dock.msgpack")
    DockSnapshot(dock).restore(tmp_path / "dock.msgpack", info)
    assert dock.status()["consumers"]["rollout"]["leased"] == 2  # the checkpoint's lease, with its deadline
    with pytest.raises(FencedError):
        late_answer(dock, slow, 1)
    assert dock.ack("rollout", slow) == 0
    assert dock.get_experience("rollout", ["prompts"], 2, lease=30) == (None, None)  # still leased
    time.sleep(1.1)
    _, redo = dock.get_experience("rollout", ["prompts"], 2, lease=30)
    assert sorted(redo) == [0, 1]
    late_answer(dock, redo, 1)  # acks its lease
    assert pairs(dock) == [(1, 1), (1, 1)]
    assert dock.status()["consumers"]["rollout"]["leased"] == 0


def _record_start_after(data: bytes, at: int) -> int:
    """Where the first record of a save's file that starts at or after byte ``at`` starts."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(data)
    for _ in unpacker:
        if unpacker.tell() >= at:
            return unpacker.tell()
    raise AssertionError("no record starts after the file's middle")
