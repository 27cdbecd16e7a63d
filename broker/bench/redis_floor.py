"""The Redis floor: the same bytes through one pipelined HSET or HMGET per column and call.

No header, no Lua, no MULTI: raw tensor bytes, dtype and shape known to the reader in advance, and
status kept in the benchmark process. What any Redis data plane costs on this server and client;
the broker can only approach it.
"""

from __future__ import annotations

import warnings

import torch

from broker.bench.docks import LocalStatus, dock_target
from broker.bench.workload import COLUMNS, DTYPES, Rows, Workload
from broker.ops.clients import connect, disconnect


class RedisFloorDock:
    """Raw bytes in one hash per column (field = row), read back as views on the received bytes."""

    def __init__(self, url: str, name: str, workload: Workload):
        # The broker's own client settings, so both pay the same client costs.
        target = dock_target(url)
        self.client, _ = connect(target)
        self._shared_url = target if isinstance(target, str) else None
        self.keys = {c: f"bench:{{{name}}}:floor:{c}" for c in COLUMNS}
        self.status = LocalStatus(workload, COLUMNS, workload.consumers)

    def put(self, data: Rows, rows: list[int]) -> None:
        fields = [str(r) for r in rows]
        pipe = self.client.pipeline(transaction=False)
        for col, values in data.items():
            pipe.hset(self.keys[col], mapping={f: memoryview(v.numpy()).cast("B") for f, v in zip(fields, values)})  # type: ignore[arg-type]
        pipe.execute()
        self.status.mark_ready(list(data), rows)

    def get(self, consumer: str, columns: tuple[str, ...], count: int) -> tuple[Rows, list[int]]:
        rows = self.status.sample(consumer, columns, count)
        fields = [str(r) for r in rows]
        pipe = self.client.pipeline(transaction=False)
        for col in columns:
            pipe.hmget(self.keys[col], fields)
        replies = pipe.execute()
        # The floor views the received bytes without a copy, the least any data plane must do (the
        # broker copies each column once, into a writable buffer). Torch warns about views on read-only
        # buffers; this is the benchmark's own process, so the warning is silenced here, for this read.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
            return {col: [_view(v, DTYPES[col]) for v in values] for col, values in zip(columns, replies)}, rows

    def reset(self) -> None:
        self.client.delete(*self.keys.values())
        self.status.reset()

    def close(self) -> None:
        try:
            self.client.delete(*self.keys.values())
        finally:
            # A URL's client is shared with the docks of that URL (closing a cluster client would break
            # theirs): hand it back. One made for a unix socket is the floor's own.
            if self._shared_url is not None:
                disconnect(self._shared_url)
            else:
                self.client.close()


def _view(value: bytes, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(value, dtype=dtype) if value else torch.empty(0, dtype=dtype)
