"""A dock's byte quota (``TransferDock.set_quota``, lua/include/quota.lua): a put past it raises QuotaExceededError
and writes nothing, and the count the scripts keep equals what the dock holds after any mix of puts, rewrites,
clears, drops and regenerations, from many threads at once. On every backend."""

from __future__ import annotations

import threading

import pytest
import torch

from broker import InvalidExperienceError, QuotaExceededError, Rollout
from tests.helpers import small_dock as any_dock

ROW = torch.zeros(64, dtype=torch.float32)  # 256 bytes of payload, plus the codec's prefix


def small_dock(*args, **kwargs):
    """A dock on one slot (a cluster's docks spread their bytes over data shards by default: no quota there)."""
    return any_dock(*args, shards=0, **kwargs)


def stored(dock) -> int:
    """The count the scripts keep in the dock's meta."""
    return int(dock.client.hget(dock.keys.meta, "stored_bytes") or 0)


def recount(dock, quota: int | None) -> int:
    """What the dock holds, counted afresh over every field (set_quota counts it; the quota stays)."""
    return dock.set_quota(quota)


def rows_of(n: int, value: torch.Tensor = ROW) -> dict[str, list[torch.Tensor]]:
    return {"prompts": [value.clone() for _ in range(n)]}


def one_row_bytes(dock) -> int:
    dock.put_experience(rows_of(1), [0])
    size = recount(dock, None)
    dock.clear()
    return size


def test_a_put_past_the_quota_writes_nothing_and_a_clear_makes_room(client):
    dock = small_dock(client, "quota-a", prompts=4, n=2)
    size = one_row_bytes(dock)
    assert dock.set_quota(3 * size) == 0
    dock.put_experience(rows_of(2), [0, 1])
    with pytest.raises(QuotaExceededError, match=r"quota-a.*past its quota of \d+ bytes; nothing was written"):
        dock.put_experience(rows_of(3, torch.ones(64)), [1, 2, 3])  # row 1 rewritten: 4 rows' worth
    assert dock.status()["columns"]["prompts"]["ready"] == 2
    assert torch.equal(dock.read_rows(["prompts"], [1])["prompts"][0], ROW)  # not rewritten
    assert stored(dock) == 2 * size == recount(dock, 3 * size)
    dock.put_experience(rows_of(2, torch.ones(64)), [1, 2])  # row 1 rewritten at its size: up to the quota
    assert stored(dock) == 3 * size
    dock.clear([0, 1], consumer=None)
    assert stored(dock) == size
    dock.put_experience(rows_of(2), [4, 5])
    dock.clear()
    assert stored(dock) == 0
    assert dock.set_quota(None) == 0 and dock.client.hget(dock.keys.meta, "quota_bytes") is None
    dock.put_experience(rows_of(8), list(range(8)))  # no quota: nothing counted, nothing refused


def test_a_quota_below_what_the_dock_holds_refuses_puts_until_clears_bring_it_under(client):
    dock = small_dock(client, "quota-b", prompts=4, n=2)
    dock.put_experience(rows_of(4), [0, 1, 2, 3])
    held = dock.set_quota(100)
    assert held > 100
    with pytest.raises(QuotaExceededError):
        dock.put_experience(rows_of(1), [4])
    dock.clear()
    dock.put_experience({"prompts": [torch.zeros(0, dtype=torch.uint8)]}, [0])
    assert 0 < stored(dock) <= 100


def test_the_count_is_exact_after_rewrites_drops_regenerations_and_group_columns(client):
    """Rows of changing sizes rewritten (a long row cut in head and tail on jemalloc servers, then rewritten
    short), a group column, rows dropped and regenerated under partial rollout: the count the scripts keep
    equals a fresh count over every field, at every step."""
    rollout = Rollout(response_columns=("responses",), max_age=3, gbs_train=2, prompt_columns=("prompts",))
    dock = small_dock(client, "quota-c", prompts=4, n=2, columns=("prompts", "responses", "images"),
                      consumers=("actor_rollout", "actor_train"), group_columns=["images"], rollout=rollout)
    dock.set_quota(1 << 30)
    long = torch.zeros(8200, dtype=torch.float32)  # 32,800 bytes: cut to the allocator's classes on jemalloc

    def check(step: str) -> None:
        assert stored(dock) == recount(dock, 1 << 30), step

    dock.put_experience({"prompts": [long] * 4, "images": [torch.ones(100)] * 4}, [0, 1, 2, 3], is_prompt=True)
    check("prompts put")
    dock.put_experience({"prompts": [ROW] * 2}, [0, 1], is_prompt=True)
    check("long rows rewritten short")
    _, rows = dock.get_experience("actor_rollout", ["prompts", "responses"], 4, get_n_samples=False)
    dock.put_experience({"responses": [torch.ones(3)] * len(rows)}, rows, rollout_completed=[0] * len(rows))
    check("partial responses")
    dock.drop_groups("actor_train", [0])
    check("a group dropped")
    dock.clear(consumer="actor_rollout")
    check("a consumer's clear")
    dock.clear()
    assert stored(dock) == 0


@pytest.mark.real
def test_rows_cut_to_the_allocators_classes_are_counted_head_and_tail(url):
    """A dock opened from its URL on a jemalloc server stores a 32 KiB row as a head and a tail (data/fit.py).
    A row rewritten short left its old tail behind until the next forget, which would then count it off
    twice: the put deletes it."""
    dock = small_dock(url, "quota-cut", prompts=4, n=2)
    dock.set_quota(1 << 30)
    dock.put_experience({"prompts": [torch.zeros(8200)] * 4}, [0, 1, 2, 3])
    if not dock.client.hlen(dock.keys.tail("prompts")):
        pytest.skip("rows are cut on jemalloc servers only")
    assert stored(dock) == recount(dock, 1 << 30)
    dock.put_experience(rows_of(2), [0, 1])
    assert stored(dock) == recount(dock, 1 << 30)
    dock.clear()
    assert stored(dock) == recount(dock, 1 << 30) == 0


def test_puts_from_many_threads_never_pass_the_quota_together(client):
    dock = small_dock(client, "quota-d", prompts=32, n=2)
    size = one_row_bytes(dock)
    dock.set_quota(20 * size)
    refused, errors = [], []

    def writer(first: int) -> None:
        for r in range(first, 64, 8):
            try:
                dock.put_experience(rows_of(1), [r])
            except QuotaExceededError:
                refused.append(r)
            except Exception as exc:  # noqa: BLE001 - every other failure is a finding
                errors.append(exc)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert len(refused) == 64 - 20 and dock.status()["columns"]["prompts"]["ready"] == 20
    assert stored(dock) == 20 * size == recount(dock, 20 * size)


def test_bad_quotas_are_refused(client):
    dock = small_dock(client, "quota-e")
    for bad in (-1, 1.5, "10", True):
        with pytest.raises(InvalidExperienceError, match="quota"):
            dock.set_quota(bad)


def test_status_the_cli_and_the_exporter_show_the_quota(client):
    from broker.ops.watch import format_table

    dock = small_dock(client, "quota-f")
    assert "quota" not in dock.status()
    dock.set_quota(1000)
    dock.put_experience(rows_of(1), [0])
    quota = dock.status()["quota"]
    assert quota == {"bytes": 1000, "stored_bytes": stored(dock)} and quota["stored_bytes"] > 0
    assert f"quota: {quota['stored_bytes']:,} of 1,000 bytes stored" in format_table(dock.status())


def test_a_sliced_put_past_the_quota_writes_no_slice(client, monkeypatch):
    """A put written in slices (data/slices.py) is checked against the quota whole, by its first slice: past
    it, no slice lands, whatever the order the slices would have landed in (the two lanes race on a real
    server). Rows rewritten in later slices count with what they hold, so a rewrite that fits is let through."""
    from broker.data import slices as slices_module

    dock = small_dock(client, "quota-sliced", prompts=8, n=2)
    size = one_row_bytes(dock)
    monkeypatch.setattr(slices_module, "SLICE_BYTES", 2 * size)  # one group of 2 rows per slice
    assert dock.set_quota(12 * size) == 0
    with pytest.raises(QuotaExceededError, match=r"quota-sliced.*16 rows.*past its quota.*nothing was written"):
        dock.put_experience(rows_of(16), list(range(16)))  # 8 slices; the first 6 would fit
    assert dock.status()["columns"]["prompts"]["ready"] == 0
    assert stored(dock) == 0 == recount(dock, 12 * size)
    dock.put_experience(rows_of(10), list(range(10)))
    dock.put_experience(rows_of(12, torch.ones(64)), list(range(12)))  # 10 rewritten at their size: 12 in all
    assert stored(dock) == 12 * size == recount(dock, 12 * size)
    assert dock.status()["columns"]["prompts"]["ready"] == 12
