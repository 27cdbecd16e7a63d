"""``TransferDock.take``: explicit rows handed out without reading them, as a compare-and-set
(``exclusive``) and shared under a name (the ranks of one data-parallel group); lua/take.lua."""

from __future__ import annotations

import random
import threading
import time

import pytest

from broker import ExperienceTimeoutError, InvalidExperienceError, LeasedRows
from tests.helpers import fill, small_dock


def test_an_exclusive_take_of_a_row_already_handed_out_marks_nothing(client):
    dock = small_dock(client, "ex", prompts=4, n=2)
    fill(dock)
    assert dock.take("actor_train", [3, 1], ["prompts"], exclusive=True) == [3, 1]
    assert dock.take("actor_train", [1, 2], ["prompts"], exclusive=True) is None
    assert dock.consumed_rows()["actor_train"].nonzero().flatten().tolist() == [1, 3]  # 2 not marked
    # Without exclusive, the same rows are marked again (a take is repeatable).
    assert dock.take("actor_train", [1, 2], ["prompts"]) == [1, 2]


def test_a_take_of_unwritten_rows_names_the_cells_and_marks_nothing(client):
    dock = small_dock(client, "miss", prompts=4, n=2)
    fill(dock, ["prompts"], rows=[0, 1])
    with pytest.raises(ExperienceTimeoutError, match="responses: rows"):
        dock.take("actor_train", [0, 1], ["prompts", "responses"])
    assert not dock.consumed_rows()["actor_train"].any()


def test_a_named_take_gives_later_callers_the_first_callers_rows_in_its_order(client):
    dock = small_dock(client, "named", prompts=4, n=2)
    fill(dock)
    first = dock.take("actor_train", [5, 2, 4], ["prompts"], name="task/rank0/batch0")
    assert first == [5, 2, 4]
    again = dock.take("actor_train", [0, 1], ["prompts"], name="task/rank0/batch0")
    assert again == [5, 2, 4]
    assert dock.consumed_rows()["actor_train"].nonzero().flatten().tolist() == [2, 4, 5]
    assert dock.take("actor_train", [0], ["prompts"], name="task/rank0/batch1") == [0]


def test_bad_arguments_are_refused(client):
    dock = small_dock(client, "bad", prompts=2, n=2)
    with pytest.raises(InvalidExperienceError, match="name"):
        dock.take("actor_train", [0], ["prompts"], name="")
    with pytest.raises(InvalidExperienceError, match="exclusive"):
        dock.take("actor_train", [0], ["prompts"], exclusive="yes")  # type: ignore[arg-type]


def test_a_leased_take_comes_back_once_its_lease_runs_out(client):
    dock = small_dock(client, "lease", prompts=2, n=2)
    fill(dock)
    rows = dock.take("actor_train", [0, 1], ["prompts"], lease=0.2, exclusive=True)
    assert isinstance(rows, LeasedRows)
    assert dock.take("actor_train", [0], ["prompts"], exclusive=True) is None
    time.sleep(0.3)
    assert dock.take("actor_train", [0], ["prompts"], exclusive=True) == [0]  # given back, taken again


@pytest.mark.parametrize("backend", ["real"], indirect=True)
def test_callers_racing_for_the_same_rows_each_get_a_row_once(client):
    """Many threads choose rows from the bitmaps and take them exclusively, retrying on refusal:
    every row is handed out exactly once."""
    dock = small_dock(client, "race", prompts=64, n=1, columns=["x"], consumers=["c"])
    fill(dock)
    got: list[list[int]] = []
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while True:
            free = (~dock.consumed_rows()["c"]).nonzero().flatten().tolist()
            if not free:
                return
            choice = rng.sample(free, min(3, len(free)))
            rows = dock.take("c", choice, ["x"], exclusive=True)
            if rows is not None:
                with lock:
                    got.append(list(rows))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handed = sorted(r for rows in got for r in rows)
    assert handed == list(range(64))
