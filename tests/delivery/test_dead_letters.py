"""Rows whose bytes cannot be read: the good rows of their hand-out are never lost with them, and a row
that keeps failing becomes a dead letter that status, the exporter, redis-cli and `broker dead` show.

Before: a sampled get whose rows included one with undecodable bytes raised DecodeError after marking
all of them consumed (the good rows never delivered, all_consumed True); with a lease, the same batch
was redelivered without end.
"""

from __future__ import annotations

import struct
import uuid

import msgpack
import pytest
import torch

from broker import DecodeError, MissingDataError
from tests.helpers import cli_output, data_cell, empty_cluster, fill, small_dock

GARBAGE = b"\x80\x04garbage"


def corrupt(client, dock, row: int, column: str = "prompts") -> None:
    client.hset(*data_cell(dock, column, row), GARBAGE)


@pytest.mark.parametrize("stack", [False, True], ids=["list", "stacked"])
def test_a_corrupt_row_loses_no_good_row_and_dies_after_its_third_failed_delivery(make_dock, client, stack):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",))
    fill(dock)
    corrupt(client, dock, 2)
    for attempt in range(1, 4):
        with pytest.raises(DecodeError, match=f"row 2: .*field 2.*row 2 {attempt}"):
            dock.get_experience("actor_train", ["prompts"], 4, get_n_samples=False, stack=stack)
        consumed = dock.status()["consumers"]["actor_train"]
        # Given back every time, until the third failure leaves row 2 alone handed out, as a dead letter.
        assert consumed["consumed"] == (1 if attempt == 3 else 0)
        assert consumed["dead"] == (1 if attempt == 3 else 0)
    assert not dock.all_consumed("actor_train")
    batch, rows = dock.get_experience("actor_train", ["prompts"], 3, get_n_samples=False, stack=stack)
    assert rows == [0, 1, 3] and [t[0].item() for t in batch["prompts"]] == [0, 1, 3]  # the good rows
    assert isinstance(batch["prompts"], torch.Tensor) == stack
    assert dock.all_consumed("actor_train")  # the dead letter counts as handed out
    assert list(dock.dead_letters()["actor_train"]) == [2]
    assert "field 2" in dock.dead_letters("actor_train")["actor_train"][2]


def huge_header(payload: int) -> bytes:
    """A well-framed row whose header declares 2**40 float32s, over ``payload`` bytes."""
    header = msgpack.packb(["float32", [2**40]])
    start = -(-(8 + len(header)) // 16) * 16
    return struct.pack("<2sBBI", b"TD", 1, 0, len(header)) + header + bytes(start - 8 - len(header) + payload)


@pytest.mark.parametrize("backend", ["real", "redis62", "cluster"])
@pytest.mark.parametrize("stack", [False, True], ids=["list", "stacked"])
@pytest.mark.parametrize("floats", [1250, 9000], ids=["5KB", "36KB"])  # whole rows, and rows cut on jemalloc
@pytest.mark.parametrize("lease", [None, 30], ids=["unleased", "leased"])
def test_a_row_declaring_a_huge_shape_loses_no_good_row_and_dies_as_a_corrupt_one(
        request, backend, stack, floats, lease):
    """Before: as the first row of a stacked read, a header declaring 2**40 floats on 5 KB was taken for a
    cut row's head, and the read tried to allocate 16 TB: a torch RuntimeError after the rows were marked
    consumed (without a lease the 4 rows, good ones included, were lost; with one, every redelivery
    crashed again and the row never became a dead letter). Docks opened from a URL: their reads receive
    rows straight off the socket, where this was."""
    if backend == "cluster":
        empty_cluster(request.getfixturevalue("cluster_admin"))
    url = request.getfixturevalue({"real": "url", "redis62": "redis62_url", "cluster": "cluster_url"}[backend])
    dock = small_dock(url, f"huge{uuid.uuid4().hex[:8]}", 4, 1, ("prompts",))
    rows = torch.randn(4, floats)
    dock.put_experience({"prompts": rows}, [0, 1, 2, 3])
    dock.client.hset(*data_cell(dock, "prompts", 0), huge_header(4 * floats))
    for attempt in range(1, 4):
        with pytest.raises(DecodeError, match=f"row 0: .*needs {4 * 2**40} payload bytes.*row 0 {attempt}"):
            dock.get_experience("actor_train", ["prompts"], 4, stack=stack, lease=lease)
    assert dock.status()["consumers"]["actor_train"]["dead"] == 1
    batch, got = dock.get_experience("actor_train", ["prompts"], 3, stack=stack, lease=lease)
    assert got == [1, 2, 3] and all(torch.equal(batch["prompts"][i], rows[r]) for i, r in enumerate(got))
    dock.delete()


def test_with_a_lease_a_corrupt_batch_is_not_redelivered_for_ever(make_dock, client):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",))
    fill(dock)
    corrupt(client, dock, 1)
    failures = 0
    for _ in range(3):  # a worker that catches the error and asks again
        with pytest.raises(DecodeError):
            dock.get_experience("actor_train", ["prompts"], 4, get_n_samples=False, lease=30)
        failures += 1
    assert dock.get_experience("actor_train", ["prompts"], 4, get_n_samples=False, lease=30) == (None, None)
    batch, rows = dock.get_experience("actor_train", ["prompts"], 3, get_n_samples=False, lease=30)
    assert rows == [0, 2, 3]
    dock.ack("actor_train", rows)
    status = dock.status()["consumers"]["actor_train"]
    assert (status["leased"], status["redelivered"], status["dead"], failures) == (0, 0, 1, 3)
    assert dock.all_consumed("actor_train")


def test_in_group_sampling_a_dead_row_takes_its_group_along(make_dock, client):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",), dead_letter_after=1)
    fill(dock)
    corrupt(client, dock, 3)
    with pytest.raises(DecodeError, match=r"rows \[2, 3\] are dead letters now"):
        dock.get_experience("actor_train", ["prompts"], 4)
    assert dock.dead_letters("actor_train")["actor_train"] == {
        2: "row 3 of its group is a dead letter", 3: dock.dead_letters()["actor_train"][3]}
    assert dock.get_experience("actor_train", ["prompts"], 2)[1] == [0, 1]
    assert dock.all_consumed("actor_train")


def test_missing_bytes_give_the_hand_out_back_too(make_dock, client):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",))
    fill(dock)
    client.hdel(*data_cell(dock, "prompts", 1))
    with pytest.raises(MissingDataError, match="marked ready but holds no bytes"):
        dock.get_experience("actor_train", ["prompts"], 2)
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 0


def test_an_evicted_data_hash_loses_no_row_and_says_so(make_dock, client):
    """A whole data hash gone (what an evicting server does to it) marks nothing consumed: every delivery
    gives its rows back, and after dead_letter_after of them they are dead letters, listed with why."""
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",), dead_letter_after=2)
    fill(dock)
    for key in {data_cell(dock, "prompts", row)[0] for row in range(4)}:
        client.delete(key)
    for attempt, given_back in ((1, 4), (2, 0)):
        with pytest.raises(MissingDataError, match=f"{given_back} rows were given back.*row 0 {attempt}"):
            dock.get_experience("actor_train", ["prompts"], 4, get_n_samples=False)
        assert dock.status()["consumers"]["actor_train"]["consumed"] == (0 if attempt == 1 else 4)
    assert sorted(dock.dead_letters("actor_train")["actor_train"]) == [0, 1, 2, 3]


@pytest.mark.parametrize("stack", [False, True], ids=["list", "stacked"])
def test_an_explicit_take_of_a_corrupt_row_marks_nothing(make_dock, client, stack):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",))
    fill(dock)
    dock.get_experience("actor_train", ["prompts"], indexes=[0])
    corrupt(client, dock, 1)
    with pytest.raises(DecodeError, match="field 1"):
        dock.get_experience("actor_train", ["prompts"], indexes=[0, 1], stack=stack)
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 1  # row 0, taken before


def test_dead_letters_are_shown_and_dropped(make_dock, client):
    dock = make_dock(prompts_num=2, n=2, columns=("prompts",), dead_letter_after=1)
    fill(dock)
    corrupt(client, dock, 0)
    with pytest.raises(DecodeError):
        dock.get_experience("actor_train", ["prompts"], 2, get_n_samples=False)
    assert client.hgetall(dock.keys.dead("actor_train")).keys() == {b"0"}  # what redis-cli shows
    assert dock.drop_dead_letters() == [0]
    assert dock.dead_letters() == {"actor_rollout": {}, "actor_train": {}}
    assert dock.status()["consumers"]["actor_train"] == {"consumed": 0, "leased": 0, "redelivered": 0, "dead": 0}
    dock.put_experience({"prompts": [torch.tensor([0, 7])]}, [0])  # the producer writes it anew
    assert dock.get_experience("actor_train", ["prompts"], 4, get_n_samples=False)[1] == [0, 1, 2, 3]


@pytest.mark.real
def test_broker_dead_lists_and_drops(url):
    from broker import TransferDock

    dock = TransferDock(url, "dlq", 2, 2, ["prompts"], ["train"], dead_letter_after=1)
    fill(dock)
    import redis

    raw = redis.Redis.from_url(url)
    raw.hset(*data_cell(dock, "prompts", 3), GARBAGE)
    with pytest.raises(DecodeError):
        dock.get_experience("train", ["prompts"], 4, get_n_samples=False)
    listed = cli_output(["dead", "dlq", "--url", url])
    assert listed.startswith("train\t3\t") and "field 3" in listed
    assert "dropped 1 rows" in cli_output(["dead", "dlq", "--url", url, "--drop", "--yes"])
    assert cli_output(["dead", "dlq", "--url", url]).startswith("no dead letters")


@pytest.fixture(params=[1, 3], ids=["whole", "partitioned"])
def partitions(request) -> int:
    """Every dock test of this file also on a dock of three partitions (see tests/conftest.py)."""
    return request.param
