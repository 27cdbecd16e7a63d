"""A partition's state read in one transaction (``System.snapshot``): what a get checks before it reads, and
what a put's KVBatchMeta reports after it wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from broker.api.delivery import HandedRows
from broker.control.scripts import Handout
from broker.errors import SampleNotFoundError
from broker.transfer_queue.names import dock_name_of


class Snapshot:
    """A partition's state read in one transaction (``System.snapshot``): its fields' schemas, their ready
    bits, and the rows of the keys (with the delivery that fences their read) and the tags (of ``tag_rows``;
    none if not asked) asked for."""

    def __init__(self, partition: str, schema: dict[str, dict[str, Any]], ready: dict[str, np.ndarray],
                 keys: list[str], found: list[int | None] | None, tags: list[dict[str, Any]],
                 fence: Handout | None = None):
        self.partition, self.schema, self.tags = partition, schema, tags
        self._ready, self._keys, self._found = ready, keys, found
        #: The rows of the keys asked for as a delivery of that moment: a read naming it fails once a clear
        #: took any of them (their bytes may be another key's by then). None when no keys were asked for.
        self.delivery = None if fence is None or found is None else HandedRows(
            [r for r in found if r is not None], fence.epoch, fence.runs, fence.generations)

    def found_rows(self) -> list[int | None]:
        """The rows of the keys asked for, in their order, None for a key the partition lacks."""
        return list(self._found or [])

    def rows_of_keys(self) -> list[int]:
        """The rows of the keys asked for; SampleNotFoundError names those the partition lacks (as
        ``System.rows_of_keys``)."""
        found = self._found or []
        missing = [k for k, r in zip(self._keys, found) if r is None]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise SampleNotFoundError(f"partition {self.partition!r} holds no key {missing[:5]!r}{more}")
        return [r for r in found if r is not None]

    def produced_each(self, rows: Sequence[int], fields: Sequence[str]) -> list[np.ndarray]:
        """Per field, per row: whether it is produced (as ``System.produced_each``)."""
        index = np.asarray(rows, dtype=np.int64)
        out = []
        for field in fields:
            bits = self._ready.get(dock_name_of(field), np.zeros(0, dtype=bool))
            has = np.zeros(len(index), dtype=bool)
            inside = index < len(bits)
            has[inside] = bits[index[inside]]
            out.append(has)
        return out

    def common_fields(self, rows: Sequence[int]) -> list[str]:
        """The partition's fields produced for every one of ``rows`` (as ``System.common_fields``)."""
        if not rows:
            return []
        fields = list(self.schema)
        return [f for f, ok in zip(fields, self.produced_each(rows, fields)) if ok.all()]
