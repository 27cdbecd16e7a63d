"""The in-process floor: a plain dict of lists, no copies, no IPC. What the workload itself costs."""

from __future__ import annotations

import torch

from broker.bench.docks import LocalStatus
from broker.bench.workload import COLUMNS, Rows, Workload


class InProcessDock:
    """Stores the caller's tensors by reference and hands the same objects back."""

    def __init__(self, workload: Workload):
        self.capacity = workload.capacity
        self.data: dict[str, list[torch.Tensor | None]] = {}
        self.status = LocalStatus(workload, COLUMNS, workload.consumers)
        self.reset()

    def put(self, data: Rows, rows: list[int]) -> None:
        for col, values in data.items():
            store = self.data[col]
            for row, value in zip(rows, values):
                store[row] = value
        self.status.mark_ready(list(data), rows)

    def get(self, consumer: str, columns: tuple[str, ...], count: int) -> tuple[Rows, list[int]]:
        rows = self.status.sample(consumer, columns, count)
        return {c: [self.data[c][r] for r in rows] for c in columns}, rows  # type: ignore[misc]

    def reset(self) -> None:
        self.data = {c: [None] * self.capacity for c in COLUMNS}
        self.status.reset()

    def close(self) -> None:
        self.data = {}
