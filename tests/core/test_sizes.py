"""Rows larger than the server takes in one value are refused before anything is sent.

Redis answers an oversized value only by closing the connection while the client is still sending,
and the client's retries then sent the payload 8 times over several seconds before failing with
"Connection reset by peer". Each server here runs with a limit of 1 MB.
"""

from __future__ import annotations

import pytest
import redis
import torch

from broker import ExperienceTooLargeError, InvalidExperienceError, TransferDock
from broker.ops.local_redis import RedisServer
from tests.helpers import redis62_binary, redis_server_binary

pytestmark = pytest.mark.real

LIMITS = {
    "proto-max-bulk-len": ["--proto-max-bulk-len", "1mb"],
    "client-query-buffer-limit": ["--client-query-buffer-limit", "1mb"],
}


def _binaries() -> list:
    return [pytest.param(redis_server_binary, id="redis"), pytest.param(redis62_binary, id="redis62")]


@pytest.mark.parametrize("find_binary", _binaries())
@pytest.mark.parametrize("setting", sorted(LIMITS))
@pytest.mark.parametrize("size", [1_500_000, 30_000_000], ids=["1.5MB", "30MB"])
def test_a_row_over_the_server_limit_is_refused_before_sending(find_binary, setting, size):
    binary = find_binary()
    if binary is None:
        pytest.skip("no such server")
    with RedisServer(*LIMITS[setting], binary=binary) as server:
        dock = TransferDock(server.url, "big", prompts_num=2, n_samples_per_prompt=1, columns=["a", "b"],
                            consumers=["c"])
        admin = server.client()
        admin.config_resetstat()
        connections = admin.info("stats")["total_connections_received"]
        with pytest.raises(ExperienceTooLargeError) as info:
            dock.put_experience({"a": [torch.ones(2), torch.ones(size // 4)], "b": [torch.ones(1)] * 2}, [0, 1])
        message = str(info.value)
        assert isinstance(info.value, InvalidExperienceError)
        assert f"column 'a', row 1: {size + 32:,} bytes" in message and setting in message
        assert "1,048,57" in message  # the limit, as the server reports it
        # Nothing was sent: no write, no reconnect.
        assert "cmdstat_hset" not in admin.info("commandstats")
        assert admin.info("stats")["total_connections_received"] == connections
        assert dock.status()["columns"]["a"]["ready"] == 0
        dock.put_experience({"a": [torch.ones(2), torch.ones(200_000)], "b": [torch.ones(1)] * 2}, [0, 1])
        assert dock.get_experience("c", ["a", "b"], 2)[1] == [0, 1]


def test_a_user_without_config_rights_falls_back_to_redis_defaults():
    with RedisServer() as server:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "w", "on", ">pw", "~*", "&*", "+@all", "-config")
        url = f"redis://w:pw@127.0.0.1:{server.port}/0"
        dock = TransferDock(url, "x", prompts_num=1, n_samples_per_prompt=1, columns=["a"], consumers=["c"])
        dock.put_experience({"a": [torch.ones(3)]}, [0])
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis.from_url(url).config_get("proto-max-bulk-len")
        assert dock.get_experience("c", ["a"], 1)[1] == [0]


@pytest.mark.parametrize("shards", [None, 2], ids=["one-slot", "sharded"])
def test_a_row_over_a_limit_this_user_cannot_read_is_sent_once_and_refused(shards):
    """A worker confined by ACL (no CONFIG) cannot read the server's limits, so its put is sent: the server
    (client-query-buffer-limit 1 MB) closes the connection mid-send and still answers a new one. The put
    raises ExperienceTooLargeError after that one send, and nothing is ready: the MULTI was never executed
    (one slot), or claim.lua ran and the bytes were refused before mark.lua (sharded). It used to be sent
    9 times and raise BrokerConnectionError ("Connection reset by peer") after 6-7 s."""
    with RedisServer(*LIMITS["client-query-buffer-limit"]) as server:
        admin = server.client()
        TransferDock(server.url, "big", prompts_num=2, n_samples_per_prompt=2, columns=["p", "a"], consumers=["c"],
                     shards=shards).close()
        admin.execute_command("ACL", "SETUSER", "w", "on", ">pw", "~*", "&*", "+@all", "-config")
        dock = TransferDock.attach(f"redis://w:pw@127.0.0.1:{server.port}/0", "big")
        dock.put_experience({"p": [torch.ones(1)] * 4}, [0, 1, 2, 3])
        _, rows = dock.get_experience("c", ["p"], 2, lease=30)  # a stage's put of its results: fenced
        results = {"a": [torch.ones(2), torch.ones(500_000)]}  # 2,000,032 bytes encoded
        admin.config_resetstat()
        with pytest.raises(ExperienceTooLargeError) as info:
            dock.put_experience(results, rows)
        message = str(info.value)
        print(f"\n{message}")
        assert "row 1: 2,000,032 bytes" in message and "client-query-buffer-limit" in message
        assert "CONFIG GET" in message and "not sent again" in message
        # Sent once: a resend needs a new connection (the server closed the first), and there was one only,
        # the one that found the server up; and, sharded, the one that gave the lease its own deadline back
        # after the put (lua/unhold.lua), a small call.
        assert admin.info("stats")["total_connections_received"] == (2 if shards else 1)
        assert admin.info("stats")["total_net_input_bytes"] < 2 * 2_000_032
        assert dock.status()["columns"]["a"]["ready"] == 0 and dock.read_rows(["a"], rows)["a"] == [None, None]
        # The server's limit raised, the same put lands (its delivery is still current).
        admin.config_set("client-query-buffer-limit", "8mb")
        dock.put_experience(results, rows)
        assert dock.status()["columns"]["a"]["ready"] == 2
        assert dock.read_rows(["a"], [1])["a"][0].numel() == 500_000


@pytest.mark.parametrize("setting", sorted(LIMITS))
def test_a_transfer_queue_tag_over_the_server_limit_is_refused_naming_the_key(setting):
    """A tag dict is one value in Redis (msgpack): one over the server's limit got "Connection reset by peer"
    after the client had sent it again and again; now an ExperienceTooLargeError names the key, before the
    put writes its rows or its data, and the key stays unlisted."""
    pytest.importorskip("tensordict")
    from tensordict import TensorDict

    import broker.transfer_queue as tq

    with RedisServer(*LIMITS[setting]) as server:
        tq.init({"broker": {"url": server.url, "namespace": "tags"}})
        try:
            fields = TensorDict({"v": torch.ones(2, 3)}, batch_size=2)
            with pytest.raises(ExperienceTooLargeError, match=rf"'b': tags of 1,500,0\d\d bytes .* {setting}"):
                tq.kv_batch_put(["a", "b"], "p", fields, [{"t": 1}, {"t": "x" * 1_500_000}])
            assert tq.kv_list("p") == {}
            tq.kv_batch_put(["a", "b"], "p", fields, [{"t": 1}, {"t": "x" * 900_000}])
            # merged over what the key had, the tags pass the limit: refused before the write, the old ones kept
            with pytest.raises(ExperienceTooLargeError, match=r"tags of 1,800,0\d\d bytes"):
                tq.kv_batch_put(["b"], "p", tags=[{"u": "y" * 900_000}])
            assert len(tq.kv_list("p")["p"]["b"]["t"]) == 900_000 and "u" not in tq.kv_list("p")["p"]["b"]
        finally:
            tq.close()
