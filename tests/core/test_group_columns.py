"""Group columns (``group_columns=``, broker/data/groups.py): a column with one value per group of n rows is
stored once per group in one slot and served to each of its n rows as every reader expects; puts check the
rows of a group agree; forgets delete a group's bytes once no row of the group is ready in that column.

Over every backend of ``client`` (fakeredis, Redis 7, Redis 6.2, and a cluster, where a dock is sharded and
stores group columns per row: there the values are checked, not the layout).
"""

from __future__ import annotations

import threading

import pytest
import torch

from broker import InvalidExperienceError, Rollout, SchemaError, TransferDock
from broker.control.keys import DockKeys

MB = 1_000_000


def _one_slot(dock: TransferDock) -> bool:
    return not dock.schema.shards


def _fields(dock: TransferDock, column: str) -> set[bytes]:
    return set(dock.client.hkeys(DockKeys(dock.name).data(column)))


def _image(g: int, size: int = 16) -> torch.Tensor:
    return torch.arange(size, dtype=torch.int64).to(torch.uint8) ^ g


def _group_dock(make_dock, prompts_num: int = 3, n: int = 4, **kwargs) -> TransferDock:
    return make_dock(prompts_num, n, ("image", "responses"), ("actor_rollout", "actor_train"),
                     group_columns=["image"], **kwargs)


def _put_groups(dock: TransferDock, groups: list[int], size: int = 16) -> list[int]:
    """Put each group's image (one object given n times) and a response per row."""
    n = dock.n_samples_per_prompt
    rows = [g * n + j for g in groups for j in range(n)]
    images = {g: _image(g, size) for g in groups}
    dock.put_experience({"image": [images[r // n] for r in rows],
                         "responses": [torch.tensor([r]) for r in rows]}, rows)
    return rows


def test_a_4mb_image_of_a_group_of_8_is_stored_once_and_each_row_gets_its_own_tensor(make_dock, backend):
    groups, n = 3, 8
    dock = make_dock(groups, n, ("image", "responses"), ("actor_train",), group_columns=["image"])
    images = [torch.full((4 * MB,), g + 1, dtype=torch.uint8) for g in range(groups)]
    rows = list(range(groups * n))
    dock.put_experience({"image": [images[r // n] for r in rows], "responses": [torch.tensor([r]) for r in rows]},
                        rows)
    key = DockKeys(dock.name).data("image")
    if _one_slot(dock):
        assert _fields(dock, "image") == {f"g{g}".encode() for g in range(groups)}
        if backend in ("real", "redis62"):
            used = dock.client.memory_usage(key, samples=0)
            print(f"\nMEMORY USAGE {key} on {backend}: {used} bytes for {groups} groups of {n}: "
                  f"{used / groups:.0f} bytes per group, {used / (groups * 4 * MB):.3f} copies of the 4 MB image")
            assert used < 1.5 * groups * 4 * MB
    batch, got = dock.get_experience("actor_train", ["image"], n)
    assert got == list(range(n))
    tensors = batch["image"]
    assert all(torch.equal(t, images[0]) for t in tensors)
    assert len({t.data_ptr() for t in tensors}) == n  # each row its own memory
    tensors[0][0] = 0  # writable, and writing one row changes no other
    assert all(t[0].item() == 1 for t in tensors[1:])
    assert torch.equal(dock.read_rows(["image"], [n + 3])["image"][0], images[1])


def test_group_and_row_columns_read_together_through_whole_groups_and_single_rows(make_dock):
    dock = _group_dock(make_dock)
    n = dock.n_samples_per_prompt
    # A stacked tensor whose rows of a group hold equal values: compared by bytes.
    stacked = torch.stack([_image(r // n) for r in range(12)])
    dock.put_experience({"image": stacked, "responses": [torch.tensor([r, r]) for r in range(12)]}, list(range(12)))
    batch, rows = dock.get_experience("actor_train", ["responses", "image"], 8)
    assert rows == list(range(8))
    assert [t.tolist() for t in batch["responses"]] == [[r, r] for r in rows]
    assert all(torch.equal(t, _image(r // n)) for t, r in zip(batch["image"], rows))
    single = dock.read_rows(["image", "responses"], [9, 2, 8])
    assert [torch.equal(t, _image(r // n)) for t, r in zip(single["image"], [9, 2, 8])] == [True] * 3
    assert single["image"][0].data_ptr() != single["image"][2].data_ptr()
    # Explicit takes of rows from different groups, and rows never written, read as before.
    batch, rows = dock.get_experience("actor_rollout", ["image"], indexes=[11, 0])
    assert [torch.equal(t, _image(r // n)) for t, r in zip(batch["image"], rows)] == [True, True]
    if _one_slot(dock):
        assert _fields(dock, "image") == {b"g0", b"g1", b"g2"}


def test_rows_of_a_group_must_agree_or_nothing_is_written(make_dock):
    dock = _group_dock(make_dock)
    rows = [4, 5, 6, 7, 0]
    values = [_image(1), _image(1), _image(9), _image(1), _image(0)]
    with pytest.raises(InvalidExperienceError, match=r"'image'.*group 1.*row 4 and row 6.*\[4, 5, 6, 7\]"):
        dock.put_experience({"image": values, "responses": [torch.tensor([r]) for r in rows]}, rows)
    assert not any(mask.any() for mask in dock.ready_rows().values())
    assert not _fields(dock, "image") and not _fields(dock, "responses")
    # Equal values that are distinct objects are fine; a put of some rows of a group marks only those.
    dock.put_experience({"image": [_image(1), _image(1)]}, [5, 4])
    assert dock.ready_rows(["image"])["image"].nonzero().flatten().tolist() == [4, 5]


def test_a_group_column_must_be_a_column_and_no_response(make_dock):
    with pytest.raises(SchemaError, match="group_columns .'nope'. are not columns"):
        make_dock(2, 2, ("prompts",), ("actor_train",), group_columns=["nope"])
    with pytest.raises(SchemaError, match="response"):
        make_dock(2, 2, ("prompts", "responses"), ("actor_rollout", "actor_train"), group_columns=["responses"],
                  rollout=Rollout(response_columns=("responses",), max_age=2, gbs_train=1))
    with pytest.raises(SchemaError, match="list of column names"):
        make_dock(2, 2, ("prompts",), ("actor_train",), group_columns="prompts")


def test_a_clear_keeps_a_groups_bytes_while_any_of_its_rows_is_ready(make_dock):
    dock = _group_dock(make_dock)
    _put_groups(dock, [0, 1, 2])
    dock.clear([0, 1, 2, 5])
    assert torch.equal(dock.read_rows(["image"], [3])["image"][0], _image(0))
    assert dock.read_rows(["image"], [0])["image"] == [None]
    if _one_slot(dock):
        assert _fields(dock, "image") == {b"g0", b"g1", b"g2"}
    dock.clear([3])  # the last ready row of group 0
    assert dock.read_rows(["image"], [3])["image"] == [None]
    if _one_slot(dock):
        assert _fields(dock, "image") == {b"g1", b"g2"}
    # A group put only in part: clearing the rows that were put leaves nothing behind.
    dock.put_experience({"image": [_image(0)] * 2}, [0, 1])
    dock.clear([1, 0])
    if _one_slot(dock):
        assert _fields(dock, "image") == {b"g1", b"g2"}
    dock.drop_groups("actor_train", [2])
    if _one_slot(dock):
        assert _fields(dock, "image") == {b"g1"}
    assert torch.equal(dock.read_rows(["image"], [7])["image"][0], _image(1))
    dock.clear()
    assert not _fields(dock, "image")


def test_unready_refuses_a_group_column(make_dock):
    dock = _group_dock(make_dock)
    _put_groups(dock, [0])
    with pytest.raises(InvalidExperienceError, match="group columns"):
        dock.unready(["image"], [0])
    assert dock.unready(["responses"], [0]) == 1


def test_another_dock_object_attaches_with_the_group_columns_and_follows_a_grow(make_dock, client):
    dock = _group_dock(make_dock)
    other = TransferDock.attach(client, dock.name)
    assert other.schema.group_columns == ("image",)
    _put_groups(other, [1])
    assert torch.equal(dock.read_rows(["image"], [6])["image"][0], _image(1))
    # Grown by one object, a new group column is one for the other at its next call.
    with pytest.raises(SchemaError, match="per-row values already"):
        dock.grow(group_columns=["responses"])
    with pytest.raises(SchemaError, match="not columns"):
        dock.grow(group_columns=["system"])
    dock.grow(columns=["system"], group_columns=["system"])
    _put_groups(other, [0])  # its script finds the schema grown (its fingerprint holds group_columns): adopted
    assert other.schema.group_columns == ("image", "system")
    other.put_experience({"system": [torch.tensor([7, 7])] * 4}, [0, 1, 2, 3])
    if _one_slot(dock):
        assert _fields(dock, "system") == {b"g0"}
    assert [t.tolist() for t in dock.read_rows(["system"], [2, 3])["system"]] == [[7, 7], [7, 7]]


def test_a_dock_without_group_columns_keeps_the_meta_it_had(make_dock, client):
    dock = make_dock(2, 2, ("prompts",), ("actor_train",))
    meta = client.hgetall(DockKeys(dock.name).meta)
    assert b"group_columns" not in meta  # as docks made before group columns existed
    again = TransferDock.attach(client, dock.name)
    assert again.schema.group_columns == ()
    again.put_experience({"prompts": [torch.tensor([1])] * 4}, [0, 1, 2, 3])
    dock.clear([0])
    assert len(_fields(dock, "prompts")) == 3 or not _one_slot(dock)
    # The same schema with a group column is another schema.
    with pytest.raises(SchemaError, match="group_columns"):
        make_dock(2, 2, ("prompts",), ("actor_train",), name=dock.name, group_columns=["prompts"])


def test_a_partial_rollout_dock_with_a_group_prompt_column(make_dock):
    columns = ("prompts", "prompt_length", "responses", "response_length")
    rollout = Rollout(response_columns=("responses", "response_length"), max_age=2, gbs_train=2,
                      max_staleness=0, stale_policy="regenerate", prompt_columns=("prompts", "prompt_length"))
    dock = make_dock(2, 2, columns, ("actor_rollout", "actor_train"), length_columns=["prompt_length",
                     "response_length"], group_columns=["prompts", "prompt_length"], rollout=rollout)
    prompt = [torch.tensor([11, 12, 13]), torch.tensor([21, 22])]
    dock.put_experience({"prompts": [prompt[0]] * 2 + [prompt[1]] * 2,
                         "prompt_length": [torch.tensor([3])] * 2 + [torch.tensor([2])] * 2}, [0, 1, 2, 3],
                        is_prompt=True, version=0)
    assert _fields(dock, "prompts") == {b"g0", b"g1"}  # partial rollout keeps its bytes in one slot
    batch, rows = dock.get_experience("actor_rollout", ["prompts", "responses"], 4, get_n_samples=False)
    assert [t.tolist() for t in batch["prompts"]] == [prompt[r // 2].tolist() for r in rows]
    assert [t.tolist() for t in batch["responses"]] == [[-1]] * 4
    dock.put_experience({"responses": [torch.tensor([5])] * 4, "response_length": [torch.tensor([1])] * 4},
                        rows, rollout_completed=[1, 1, 0, 1], version=0)
    # A newer policy: group 0 is stale and regenerated, keeping its prompt (bytes and ready bits).
    dock.set_version(1)
    assert dock.get_experience("actor_train", ["prompts", "responses"], 2) == (None, None)
    assert _fields(dock, "prompts") == {b"g0", b"g1"}
    batch, rows = dock.get_experience("actor_rollout", ["prompts", "responses"], 4, get_n_samples=False)
    assert [t.tolist() for t in batch["prompts"]] == [prompt[r // 2].tolist() for r in rows]
    dock.put_experience({"responses": [torch.tensor([6])] * len(rows),
                         "response_length": [torch.tensor([1])] * len(rows)},
                        rows, rollout_completed=[1] * len(rows), version=1)
    batch, rows = dock.get_experience("actor_train", ["prompts", "responses"], 2)
    assert [t.tolist() for t in batch["prompts"]] == [prompt[r // 2].tolist() for r in rows]
    dock.clear(consumer="actor_train")  # the trained group is forgotten, and so is its prompt's one copy
    assert _fields(dock, "prompts") == {f"g{g}".encode() for g in (0, 1) if g * 2 not in rows}


@pytest.mark.parametrize("backend", ["real", "redis62"])
def test_puts_and_clears_of_one_group_at_once_never_leave_a_ready_row_without_its_bytes(make_dock, backend):
    dock = _group_dock(make_dock, prompts_num=1, n=4)
    keys = DockKeys(dock.name)
    errors: list[BaseException] = []

    def putter(rows: list[int]) -> None:
        try:
            for _ in range(300):
                dock.put_experience({"image": [_image(0, 64)] * len(rows)}, rows)
        except BaseException as exc:  # noqa: BLE001  # reported below
            errors.append(exc)

    def clearer() -> None:
        try:
            for i in range(300):
                dock.clear([i % 4, (i + 1) % 4] if i % 3 else [0, 1, 2, 3])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=putter, args=([0, 1],)), threading.Thread(target=putter, args=([2, 3],)),
               threading.Thread(target=clearer)]
    for t in threads:
        t.start()
    checks = 0
    while any(t.is_alive() for t in threads):
        pipe = dock.client.pipeline(transaction=True)  # one consistent look at both
        pipe.get(keys.ready("image"))
        pipe.hexists(keys.data("image"), "g0")
        ready, present = pipe.execute()
        if ready and ready[0] & 0xF0:
            assert present, f"rows ready in {ready!r} but group 0's bytes are gone"
        checks += 1
    for t in threads:
        t.join()
    assert not errors, errors
    assert checks > 0


def test_the_mindspeed_adapter_reads_and_writes_a_dock_made_with_group_prompts(client):
    from broker.adapters.mindspeed import DEFAULT_COLUMNS, DEFAULT_CONSUMERS, GRPOTransferDock
    from broker.api.batches import put_prompts_experience

    native = TransferDock(client, "ms_groups", 4, 2, DEFAULT_COLUMNS, DEFAULT_CONSUMERS,
                          length_columns=["prompt_length", "response_length"], group_columns=["prompts"])
    td = GRPOTransferDock(4, 2, url=client, name="ms_groups")  # attaches: the schema differs by the group column
    prompts = [torch.arange(g, g + 3 + g) for g in range(4)]
    data, indexes = put_prompts_experience({"prompts": prompts}, 2)  # each prompt repeated for its 2 rows
    td.put_experience(data, indexes)
    if _one_slot(native):
        assert _fields(native, "prompts") == {b"g0", b"g1", b"g2", b"g3"}
    batch, rows = td.get_experience("actor_rollout", ["prompts"], 8)
    assert sorted(rows) == list(range(8))
    # The adapter pads the rows into one tensor, as MindSpeed's does.
    assert [batch["prompts"][i].tolist() for i in range(8)] == [data["prompts"][r].tolist() for r in rows]


def test_a_put_of_part_of_a_group_cannot_change_what_its_other_rows_read(make_dock):
    """A group column holds one value per group: a put of some rows of a group must give the value the group's
    other ready rows read (a group filled row by row), else it is refused whole. A late fenced put from a
    delivery of part of a group (DP ranks split groups), whose other rows hold the next prompt or are leased to
    another worker, and a dropped row written anew beside its surviving group-mate, would each change what the
    other rows read. On data shards each row holds its own copy: nothing there to change."""
    dock = _group_dock(make_dock, prompts_num=2, n=3)
    if not _one_slot(dock):
        pytest.skip("on data shards a group column is stored per row")
    # A group filled row by row with equal values, as before.
    for r in range(3):
        dock.put_experience({"image": [_image(0)], "responses": [torch.tensor([r])]}, [r])
    # A delivery of part of group 0; the group's image then rewritten whole (the next prompt, say).
    batch, rows = dock.get_experience("actor_train", ["image"], indexes=[0])
    dock.put_experience({"image": [_image(7)] * 3}, [0, 1, 2])
    with pytest.raises(InvalidExperienceError, match=r"'image'.*rows 1, 2 of group 0 hold another.*was written"):
        dock.put_experience({"image": [_image(0)], "responses": [torch.tensor([0])]}, rows)
    assert [torch.equal(t, _image(7)) for t in dock.read_rows(["image"], [0, 1, 2])["image"]] == [True] * 3
    assert dock.read_rows(["responses"], [0])["responses"][0].tolist() == [0]  # the refused put wrote nothing
    # A row of the group dropped, then written anew beside its surviving group-mates: with their value only.
    dock.clear([0])
    with pytest.raises(InvalidExperienceError, match=r"rows 1, 2 of group 0"):
        dock.put_experience({"image": [_image(9)]}, [0])
    assert torch.equal(dock.read_rows(["image"], [1])["image"][0], _image(7))
    dock.put_experience({"image": [_image(7)]}, [0])
    # A group whose other rows are not ready in the column takes any value; the whole group, always.
    dock.put_experience({"image": [_image(4)] * 2}, [3, 4])
    dock.put_experience({"image": [_image(5)] * 3}, [3, 4, 5])
    assert [torch.equal(t, _image(5)) for t in dock.read_rows(["image"], [3, 4, 5])["image"]] == [True] * 3
