"""MindSpeed-RL's ``Metric``, the type ``get_metrics()`` returns."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Metric:
    """MindSpeed-RL's ``Metric``: a dict of named values; ``get_metrics()`` returns one as a snapshot.

    Passed to the constructors, its values are written to the shared metrics of the dock once.
    """

    def __init__(self) -> None:
        self.metric: dict[str, Any] = {}

    def update(self, key: str = "", value: Any = None, cumulate: bool = False) -> None:
        pairs = value if isinstance(value, Mapping) else {key: value}
        for k, v in pairs.items():
            if cumulate:
                more = list(v) if isinstance(v, (list, tuple)) else [v]
                stored = self.metric.get(k)
                self.metric[k] = stored + more if isinstance(stored, list) else more
            else:
                self.metric[k] = v

    def reset(self) -> None:
        self.metric = {}

    def compute_mean(self, key: str, value: Any = None) -> float:
        values = self._numbers(key if value is None else value)
        return sum(values) / len(values)

    def compute_max(self, key: str, value: Any = None) -> float:
        return max(self._numbers(key if value is None else value))

    def compute_min(self, key: str, value: Any = None) -> float:
        return min(self._numbers(key if value is None else value))

    def _numbers(self, value: Any) -> list[float]:
        value = self.metric[value] if isinstance(value, str) else value
        return list(value) if isinstance(value, (list, tuple)) else [value]

    def __repr__(self) -> str:
        return f"Metric({self.metric!r})"

