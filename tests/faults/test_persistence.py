"""Redis killed with SIGKILL mid-run and restarted: acknowledged puts and consumed marks survive.

The configuration under test is the one docs/reliability.md recommends: ``appendonly yes`` with
``appendfsync always`` (every write reaches the disk before Redis replies).
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import redis
import torch

from broker import StoreFullError, TransferDock
from broker.ops.local_redis import RedisServer

pytestmark = pytest.mark.real

PERSISTENT = ("--appendonly", "yes", "--appendfsync", "always")


def value(row: int) -> torch.Tensor:
    return torch.full((3 + row % 4,), row, dtype=torch.int32)


def test_kill_9_and_restart_keeps_acknowledged_puts_and_consumed_marks(tmp_path):
    server = RedisServer(*PERSISTENT, folder=tmp_path).start()
    try:
        dock = TransferDock(server.url, "durable", prompts_num=128, n_samples_per_prompt=4,
                            columns=["prompts"], consumers=["train"])
        acknowledged: list[int] = []
        received: list[int] = []

        def crash_and_restart() -> None:
            time.sleep(random.uniform(0.3, 0.6))
            server.stop(kill=True)
            time.sleep(0.5)
            server.start()

        crash = threading.Thread(target=crash_and_restart)
        crash.start()
        # The loop rides through the crash: the client retries for a few seconds, and every call is safe
        # to resend.
        for group in range(128):
            rows = list(range(4 * group, 4 * group + 4))
            dock.put_experience({"prompts": [value(r) for r in rows]}, indexes=rows)
            acknowledged += rows
            _, got = dock.get_experience("train", ["prompts"], 4)
            received += got or []
            time.sleep(0.005)
        crash.join()
        assert server.proc is not None  # it did come back

        status = TransferDock.attach(server.url, "durable").status()
        assert status["columns"]["prompts"]["ready"] == len(acknowledged) == 512
        assert status["consumers"]["train"]["consumed"] == len(received)
        assert sorted(received) == list(range(512)), "rows lost or handed out twice across the crash"
        client = server.client()
        for row in random.sample(acknowledged, 32):
            assert client.getbit("td:{durable}:ready:prompts", row) == 1
        batch, _ = dock.get_experience("train", ["prompts"], indexes=acknowledged[:64])
        assert all(torch.equal(t, value(r)) for t, r in zip(batch["prompts"], acknowledged[:64]))
    finally:
        server.close()


def test_state_survives_a_kill_between_calls(tmp_path):
    """The plain case, without racing: write, consume, SIGKILL, restart, read the same state."""
    server = RedisServer(*PERSISTENT, folder=tmp_path).start()
    try:
        dock = TransferDock(server.url, "d", prompts_num=4, n_samples_per_prompt=2, columns=["a"], consumers=["c"])
        dock.put_experience({"a": [value(r) for r in range(6)]}, indexes=list(range(6)))
        dock.get_experience("c", ["a"], 2)
        dock.get_experience("c", ["a"], 2, lease=300)
        before = dock.status()
        server.stop(kill=True)
        server.start()
        assert TransferDock.attach(server.url, "d").status() == before
    finally:
        server.close()


def test_without_persistence_the_same_kill_loses_the_dock(tmp_path):
    """The control: the test above can fail, because a server without AOF forgets everything."""
    server = RedisServer(folder=tmp_path).start()
    try:
        dock = TransferDock(server.url, "d", prompts_num=1, n_samples_per_prompt=2, columns=["a"], consumers=["c"])
        dock.put_experience({"a": [value(0), value(1)]}, indexes=[0, 1])
        server.stop(kill=True)
        server.start()
        assert server.client().dbsize() == 0
    finally:
        server.close()


def test_maxmemory_at_a_later_slice_of_a_put_is_a_store_full_error_naming_what_landed(monkeypatch):
    """Before: RedisCommandError "Transaction discarded because of previous errors" (the EXECABORT of the
    slice's MULTI, not the OOM that caused it), where an unsliced put and a refused first slice give
    StoreFullError; then "nothing of this call was applied", though earlier slices had landed."""
    from broker.data import slices

    monkeypatch.setattr(slices, "SLICE_BYTES", 64 * 1024)
    with RedisServer("--maxmemory-policy", "noeviction") as server:
        dock = TransferDock(server.url, "full", prompts_num=64, n_samples_per_prompt=1, columns=["a"],
                            consumers=["c"])
        # Room for about half of the put's 4 MB past what the server holds once the dock is open (which
        # differs between servers and client releases: the function library's text, buffers).
        admin = server.client()
        admin.config_set("maxmemory", int(admin.info("memory")["used_memory"]) + 2 * 1024 * 1024)
        landed = r"out of memory \(maxmemory reached\); rows \[0, .* of this put landed, whole"
        with pytest.raises(StoreFullError, match=landed) as info:
            dock.put_experience({"a": torch.zeros(64, 16_000)}, indexes=list(range(64)))
        assert "nothing of this call was applied" not in str(info.value)
        ready = dock.status()["columns"]["a"]["ready"]
        assert 0 < ready < 64 and server.client().hlen("td:{full}:data:a") == ready  # whole slices, no stray bytes


def test_maxmemory_during_a_put_is_a_clear_error_and_marks_nothing():
    with RedisServer("--maxmemory", "4mb", "--maxmemory-policy", "noeviction") as server:
        dock = TransferDock(server.url, "full", prompts_num=256, n_samples_per_prompt=1, columns=["a", "b"],
                            consumers=["c"])
        written = 0
        with pytest.raises(StoreFullError, match="out of memory.*nothing of this call was applied") as info:
            for row in range(256):
                dock.put_experience({"b": [torch.ones(1)], "a": [torch.zeros(40_000)]}, indexes=[row])
                written += 1
        assert "dock 'full'" in str(info.value)
        status = dock.status()
        # Every put that returned is complete in both columns; the refused one left nothing behind.
        assert status["columns"]["a"]["ready"] == status["columns"]["b"]["ready"] == written > 0
        client = server.client()
        assert client.hlen("td:{full}:data:b") == client.hlen("td:{full}:data:a") == written
        # Reads still work on a full server, and freeing memory lets puts through again.
        assert dock.get_experience("c", ["a", "b"], 1)[1] == [0]
        dock.clear()
        dock.put_experience({"a": [torch.zeros(10)], "b": [torch.ones(1)]}, indexes=[0])
        assert redis.Redis(port=server.port).bitcount("td:{full}:ready:a") == 1
