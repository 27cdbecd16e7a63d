"""What the benchmark asks of every system measured, and the in-process status the floors keep."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import redis

from broker.adapters.mindspeed.padding import padding_dict_to_tensor_dict, remove_padding_tensor_dict_to_dict
from broker.bench.workload import Rows, Workload


def dock_target(url: str) -> str | redis.Redis:
    """What to open a dock (or the floor's client) with: the URL itself, except for unix sockets.

    ``connection.connect`` passes ``socket_keepalive`` to every URL and redis-py's unix-socket
    connections reject it (TypeError); a client made here is accepted by the public API instead.
    """
    return redis.Redis.from_url(url) if url.startswith("unix://") else url


class BenchDock(Protocol):
    """One system holding one global batch; the stage driver calls only these."""

    def put(self, data: Rows, rows: list[int]) -> None:
        """Write rows of some columns (a list of 1-D tensors per column) and mark them ready."""

    def get(self, consumer: str, columns: tuple[str, ...], count: int) -> tuple[Rows, list[int]]:
        """Sample ``count`` rows (whole groups) ready in ``columns`` and not yet given to ``consumer``."""

    def reset(self) -> None:
        """Forget every row, ready for the next global batch."""

    def close(self) -> None:
        """Release everything the system holds (keys, actors, connections)."""


class SampleError(RuntimeError):
    """A sampling call found too few rows: the driver asked for more than the pipeline has produced."""


class MindSpeedCalls:
    """A dock with MindSpeed-RL's call shape, reached through ``call``: every MindSpeed-style system.

    Pads a batch before each put and unpads it after each get, as MindSpeed's workers do
    (``collect_transfer_dock_data`` and ``dispatch_transfer_dock_data``), so each system pays the
    same for its batch format.
    """

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def put(self, data: Rows, rows: list[int]) -> None:
        self.call("put_experience", data_dict=padding_dict_to_tensor_dict(data), indexes=rows)

    def try_get(self, consumer: str, columns: Sequence[str], count: int) -> tuple[Rows, list[int]] | None:
        """The rows, or None if too few are ready (MindSpeed's ``(None, None)``)."""
        batch, rows = self.call("get_experience", consumer, list(columns), count)
        return None if rows is None else (remove_padding_tensor_dict_to_dict(batch), rows)

    def get(self, consumer: str, columns: tuple[str, ...], count: int) -> tuple[Rows, list[int]]:
        got = self.try_get(consumer, columns, count)
        if got is None:
            raise SampleError(f"{consumer}: fewer than {count} rows ready in {columns}")
        return got

    def all_consumed(self, consumer: str) -> bool:
        return bool(self.call("all_consumed", consumer))

    def reset(self) -> None:
        self.call("clear")


class ActorCalls(MindSpeedCalls):
    """A MindSpeed-style dock inside a Ray actor: every call ``ray.get(actor.method.remote(...))``."""

    def __init__(self, ray: Any, actor: Any, started_ray: bool = False):
        self._ray, self.actor, self.started_ray = ray, actor, started_ray

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._ray.get(getattr(self.actor, method).remote(*args, **kwargs))

    def stop(self) -> None:
        """Kill the actor, and stop Ray if the benchmark started it for this system."""
        self._ray.kill(self.actor)
        if self.started_ray:
            self._ray.shutdown()


class LocalStatus:
    """Ready and consumed status in the benchmark process, for the floors: numpy flags, FIFO groups.

    The floors must not do less work than a dock would, only less than a shared one: they still check
    readiness per column and hand out whole groups, lowest first.
    """

    def __init__(self, workload: Workload, columns: tuple[str, ...], consumers: tuple[str, ...]):
        self.n = workload.n
        self.ready = {c: np.zeros(workload.capacity, dtype=bool) for c in columns}
        self.taken = {c: np.zeros(workload.prompts, dtype=bool) for c in consumers}

    def mark_ready(self, columns: list[str], rows: list[int]) -> None:
        for c in columns:
            self.ready[c][rows] = True

    def sample(self, consumer: str, columns: tuple[str, ...], count: int) -> list[int]:
        groups_ready = np.logical_and.reduce([self.ready[c].reshape(-1, self.n).all(1) for c in columns])
        free = np.flatnonzero(groups_ready & ~self.taken[consumer])[: count // self.n]
        if len(free) * self.n < count:
            raise SampleError(f"{consumer}: {len(free) * self.n} rows ready in {columns}, asked for {count}")
        self.taken[consumer][free] = True
        rows: list[int] = (free[:, None] * self.n + np.arange(self.n)).reshape(-1).tolist()
        return rows

    def reset(self) -> None:
        for flags in (*self.ready.values(), *self.taken.values()):
            flags[:] = False
