"""Connections cut at the worst moments: after Redis ran a command, before the reply arrived."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import redis
import torch
from redis.cluster import RedisCluster

from broker import TransferDock
from tests.helpers import fill, lose_next_reply, lose_next_transaction_reply

pytestmark = pytest.mark.real


@contextlib.contextmanager
def cut_connections_as_the_pool_hands_them_out(url: str, times: int) -> Iterator[list[int]]:
    """Have the server close a connection just before the pool checks it, ``times`` times in a row.

    The pool's check sees a closed connection, reconnects and checks again: the second cut lands on
    the fresh connection, which redis-py does not retry by itself.
    """
    admin = redis.Redis.from_url(url)
    original = redis.connection.AbstractConnection.can_read
    cuts: list[int] = []
    cutting = threading.Lock()

    def can_read(self, timeout: float = 0) -> bool:
        # The lock keeps the admin's own connection checks out of the cutting.
        if len(cuts) < times and self._sock is not None and cutting.acquire(blocking=False):
            try:
                host, port = self._sock.getsockname()[:2]
                cuts.append(admin.client_kill_filter(addr=f"{host}:{port}"))
                time.sleep(0.05)  # let the close reach this socket
            finally:
                cutting.release()
        return original(self, timeout)

    redis.connection.AbstractConnection.can_read = can_read
    try:
        yield cuts
    finally:
        redis.connection.AbstractConnection.can_read = original
        admin.close()


@pytest.fixture
def dock(real_url) -> TransferDock:
    redis.Redis.from_url(real_url).flushdb()
    return TransferDock(real_url, "blip", prompts_num=4, n_samples_per_prompt=2,
                        columns=["prompts", "responses"], consumers=["actor_train"])


@pytest.fixture
def dock_anywhere(dock_url) -> TransferDock:
    """The dock on the real server, or on the cluster (whose client retries a lost reply on its own path)."""
    return TransferDock(dock_url, "blip", prompts_num=4, n_samples_per_prompt=2,
                        columns=["prompts", "responses"], consumers=["actor_train"])


def test_lost_sampling_reply_returns_the_same_rows_on_retry(dock_anywhere):
    dock = dock_anywhere
    fill(dock)
    with lose_next_reply("EVALSHA") as cuts:
        batch, rows = dock.get_experience("actor_train", ["prompts"], 4)
    assert cuts == [1]
    # Without the request id the retry would sample rows 4-7 and rows 0-3 would be lost for good.
    assert rows == [0, 1, 2, 3]
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 4
    assert dock.get_experience("actor_train", ["prompts"], 4)[1] == [4, 5, 6, 7]


def test_lost_put_reply_is_retried_harmlessly(dock):
    with lose_next_transaction_reply() as cuts:
        dock.put_experience({"prompts": [torch.tensor([i]) for i in range(4)]}, indexes=[0, 1, 2, 3])
    assert cuts == [1]
    assert dock.status()["columns"]["prompts"] == {"ready": 4, "groups_ready": 2}
    batch, _ = dock.get_experience("actor_train", ["prompts"], indexes=[0, 3])
    assert [t.item() for t in batch["prompts"]] == [0, 3]


def test_lost_ack_and_status_replies_are_retried(dock):
    fill(dock)
    _, rows = dock.get_experience("actor_train", ["prompts"], 2, lease=30)
    with lose_next_reply("EVALSHA"):
        dock.ack("actor_train", rows)
    with lose_next_transaction_reply():
        status = dock.status()
    assert status["consumers"]["actor_train"] == {"consumed": 2, "leased": 0, "redelivered": 0}


def test_connection_cut_while_the_pool_hands_it_out_is_retried(dock, real_url):
    fill(dock)
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 0  # leaves a pooled, idle connection
    with cut_connections_as_the_pool_hands_them_out(real_url, times=2) as cuts:
        batch, rows = dock.get_experience("actor_train", ["prompts"], 4)
    assert cuts == [1, 1]
    assert rows == [0, 1, 2, 3]
    assert [t.tolist() for t in batch["prompts"]] == [t.tolist() for t in dock.get_experience(
        "actor_train", ["prompts"], indexes=rows)[0]["prompts"]]


def test_exactly_once_while_connections_are_killed_at_random(dock_url):
    """Readers race a killer that cuts every client connection every few milliseconds (on a cluster, on
    every primary: the dock's control slot and its data shards)."""
    dock = TransferDock(dock_url, "storm", prompts_num=64, n_samples_per_prompt=4, columns=["prompts"],
                        consumers=["actor_train"])
    fill(dock)
    if isinstance(dock.client, RedisCluster):
        admins = [redis.Redis(host=n.host, port=n.port) for n in dock.client.get_primaries()]
    else:
        admins = [redis.Redis.from_url(dock_url)]
    stop = threading.Event()
    kills = []

    def killer() -> None:
        while not stop.is_set():
            for admin in admins:
                kills.append(admin.client_kill_filter(_type="normal", skipme=True))
            time.sleep(0.003)

    got: list[list[int]] = []
    errors: list[Exception] = []

    def reader() -> None:
        try:
            while not dock.all_consumed("actor_train"):
                _, rows = dock.get_experience("actor_train", ["prompts"], 4)
                if rows:
                    got.append(rows)
        except Exception as exc:  # a reader that gives up is a failure, reported below
            errors.append(exc)

    threads = [threading.Thread(target=killer)] + [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join(120)
    stop.set()
    threads[0].join()
    assert not errors, errors
    assert sum(kills) > 0
    flat = sorted(r for rows in got for r in rows)
    assert flat == list(range(256)), "rows lost or handed out twice while connections were cut"
