"""The dock's row status masks and callers' settings (``ready_rows``, ``consumed_rows``, ``finished_rows``,
``set_setting``, ``setting``): what adapters read and keep through the public API instead of the dock's keys."""

from __future__ import annotations

import pytest
import redis
import torch

from broker import (
    BrokerError,
    InvalidExperienceError,
    Rollout,
    TransferDock,
    UnknownColumnError,
    UnknownConsumerError,
)


def mask(capacity: int, rows: list[int]) -> list[bool]:
    return [r in rows for r in range(capacity)]


def test_ready_rows_are_the_rows_written_per_column(make_dock):
    dock = make_dock(prompts_num=8, n=2)  # 16 rows: two bytes of bitmap, the second one short
    dock.put_experience({"prompts": [torch.tensor([r]) for r in (0, 2, 9)]}, [0, 2, 9])
    ready = dock.ready_rows()
    assert list(ready) == ["prompts", "responses"]
    assert ready["prompts"].dtype == torch.bool and ready["prompts"].tolist() == mask(16, [0, 2, 9])
    assert not ready["responses"].any() and len(ready["responses"]) == 16  # no bitmap yet: all False
    assert list(dock.ready_rows(["responses", "prompts"])) == ["responses", "prompts"]
    dock.clear([2])
    assert dock.ready_rows(["prompts"])["prompts"].tolist() == mask(16, [0, 9])


def test_consumed_rows_are_the_rows_handed_to_each_consumer(make_dock):
    dock = make_dock()
    dock.put_experience({"prompts": [torch.tensor([r]) for r in range(8)]}, list(range(8)))
    _, rows = dock.get_experience("actor_train", ["prompts"], indexes=[1, 4])
    _, leased = dock.get_experience("actor_train", ["prompts"], indexes=[6], lease=30)
    consumed = dock.consumed_rows()
    assert list(consumed) == ["actor_rollout", "actor_train"]
    assert consumed["actor_train"].tolist() == mask(8, [1, 4, 6])  # leased rows count as handed out
    assert not consumed["actor_rollout"].any()
    assert list(dock.consumed_rows(["actor_train"])) == ["actor_train"]
    dock.reset_consumer("actor_train", [4])
    assert dock.consumed_rows(["actor_train"])["actor_train"].tolist() == mask(8, [1, 6])


def test_finished_rows_are_the_rows_of_finished_groups(make_dock):
    dock = make_dock(columns=("prompts", "responses"), consumers=("actor_rollout", "actor_train"),
                     rollout=Rollout(response_columns=("responses",), max_age=2, gbs_train=2))
    rows = [0, 1, 2, 3]
    dock.put_experience({"prompts": [torch.tensor([r]) for r in rows]}, rows, is_prompt=True)
    _, got = dock.get_experience("actor_rollout", ["prompts", "responses"], 4, get_n_samples=False)
    assert not dock.finished_rows().any()
    dock.put_experience({"responses": [torch.tensor([7])] * 4}, got, rollout_completed=[1, 1, 1, 0])
    finished = dock.finished_rows()
    assert finished.dtype == torch.bool and finished.tolist() == mask(8, [0, 1])  # group 1 has a row to go


def test_masks_refuse_unknown_names_and_docks_without_partial_rollout(make_dock):
    dock = make_dock()
    with pytest.raises(UnknownColumnError, match="nothing"):
        dock.ready_rows(["nothing"])
    with pytest.raises(InvalidExperienceError, match="experience_columns"):
        dock.ready_rows("prompts")
    with pytest.raises(UnknownConsumerError, match="nobody"):
        dock.consumed_rows(["nobody"])
    with pytest.raises(InvalidExperienceError, match="consumers must be a list"):
        dock.consumed_rows("actor_train")
    with pytest.raises(InvalidExperienceError, match="partial rollout"):
        dock.finished_rows()


def test_a_setting_is_kept_with_the_dock_for_every_process(make_dock, client):
    dock = make_dock()
    assert dock.setting("tq_timeout") is None
    dock.set_setting("tq_timeout", "2.5")
    other = TransferDock.attach(client, dock.name)  # another process's object
    assert other.setting("tq_timeout") == "2.5"
    other.set_setting("tq_timeout", "7.0")
    assert dock.setting("tq_timeout") == "7.0"
    # A setting is not schema: both objects go on writing and reading rows.
    dock.put_experience({"prompts": [torch.tensor([1])]}, [0])
    assert other.get_experience("actor_train", ["prompts"], indexes=[0])[1] == [0]


@pytest.mark.parametrize("name, value, message", [
    ("columns", "[]", "dock's own fields"),
    ("dead_letter_after", "1", "dock's own fields"),
    ("", "x", "non-empty str"),
    (3, "x", "non-empty str"),
    ("tq_timeout", 2.5, "value is a str"),
])
def test_a_setting_never_replaces_the_docks_own_fields(make_dock, name, value, message):
    dock = make_dock()
    with pytest.raises(InvalidExperienceError, match=message):
        dock.set_setting(name, value)
    assert dock.refresh() == dock.schema  # the schema is untouched


def test_redis_errors_of_these_calls_are_broker_errors(make_dock, client):
    dock = make_dock()
    client.hset(dock.keys.ready("prompts"), "not", "a bitmap")  # a key of the wrong type, written by hand
    with pytest.raises(BrokerError) as info:
        dock.ready_rows(["prompts"])
    assert not isinstance(info.value, redis.RedisError)
    dock.close()
    for call in (dock.consumed_rows, dock.ready_rows, lambda: dock.setting("x"), lambda: dock.set_setting("x", "y")):
        with pytest.raises(BrokerError, match="closed"):
            call()
