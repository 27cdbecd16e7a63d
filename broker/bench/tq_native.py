"""The calls TransferQueue's perftest makes, on the broker's native API: ``broker bench --tq-perftest``'s baseline.

perftest run with ``import broker.bench.tq_native as tq`` in place of ``import transfer_queue as tq`` times
the dock's own ``put_experience`` / ``read_rows(..., stack=True)`` / ``clear`` in the same Ray actors, on
the same TensorDicts, timed the same way as the drop-in (``broker.transfer_queue``). The difference between
the two is then what the adapter adds: keys, partitions, tags and the field schema beside the rows, and the
TensorDict it builds of a get. The TensorDict of a put becomes columns here as in the adapter
(``tensors.put_columns``: a regular tensor as it is, a nested one as its rows, strings as their list).

Rows are the keys' positions in the put (``test_key_i`` is row i); ``kv_list`` names them ``row:I``, which
``kv_batch_get`` and ``kv_clear`` read back. The server is ``$BROKER_BENCH_URL`` (the benchmark's own).
Only what perftest calls is here; it is not a second adapter.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from broker.api.dock import TransferDock
from broker.errors import DockNotFoundError
from broker.transfer_queue.tensors import put_columns

#: The variable naming the server (set by ``tq_perftest.py`` for the run).
URL_ENV = "BROKER_BENCH_URL"
DOCK = "perftest_native"

_dock: TransferDock | None = None
_made = False


def init(conf: Any = None) -> None:
    """Nothing to start: the dock is opened by the first put or get of this process."""


def _open(columns: list[str], rows: int) -> TransferDock:
    """The writer's dock: made afresh by its first put (a dock left by an earlier run may have other columns)."""
    global _dock, _made
    if _dock is None or sorted(_dock.columns) != sorted(columns) or _dock.capacity < rows:
        url = os.environ[URL_ENV]
        try:
            TransferDock.attach(url, DOCK).delete()
        except DockNotFoundError:
            pass
        _dock, _made = TransferDock(url, DOCK, rows, 1, columns, ["reader"]), True
    return _dock


def kv_batch_put(keys: list[str], partition_id: str, fields: Any) -> None:
    columns, _ = put_columns(fields, len(keys))
    _open(list(columns), len(keys)).put_experience(columns, list(range(len(keys))))


def kv_list(partition_id: str | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    ready = _attached().ready_rows()  # per column, a bool per row
    rows = torch.stack(list(ready.values())).all(0).nonzero().flatten().tolist() if ready else []
    return {partition_id or "": {f"row:{i}": {} for i in rows}}


def kv_batch_get(keys: list[str], partition_id: str) -> dict[str, Any]:
    dock = _attached()
    return dock.read_rows(dock.columns, _rows(keys), stack=True)


def kv_clear(keys: list[str], partition_id: str) -> None:
    _attached().clear(_rows(keys) if keys and keys[0].startswith("row:") else None)


def _rows(keys: list[str]) -> list[int]:
    """The rows ``kv_list`` named ``row:I``."""
    return [int(k.split(":")[1]) for k in keys]


def close() -> None:
    """The writer (the process that made the dock) deletes it: the benchmark's server is left as it was."""
    global _dock, _made
    if _dock is not None:
        if _made:
            _dock.delete()
        _dock.close()
    _dock, _made = None, False


def _attached() -> TransferDock:
    global _dock
    if _dock is None:
        _dock = TransferDock.attach(os.environ[URL_ENV], DOCK)
    return _dock
