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
from broker.local_redis import RedisServer
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
