"""What ``BatchMeta`` and ``KVBatchMeta`` share (metadata.py, kv_metadata.py): the merge of batch-level
``extra_info`` at a concat (the broker's deliveries kept, one per lease), chunk bounds, row positions and
repeated values, checked as TransferQueue checks them.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from broker.errors import InvalidExperienceError
from broker.transfer_queue.errors import MetaIndexTypeError

#: The metadata module's logger: the warnings TransferQueue's metadata logs come from there.
logger = logging.getLogger("broker.transfer_queue.metadata")


def values_equal(a: Any, b: Any) -> bool:
    """Whether two extra_info values agree: tensors and arrays by content, anything else by ``==``."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return bool(np.array_equal(a, b))
    try:
        return bool(a == b)
    except Exception:  # an == that raises or gives something without a truth value: not equal
        return False


#: Where a leased ``get_meta`` keeps its delivery (the broker's, beyond TransferQueue): one delivery, or after
#: ``concat`` of batches from several takes, the tuple of theirs (client.py's ``deliveries_of`` reads either).
DELIVERY = "broker_delivery"


def merged_extra_info(infos: Sequence[dict[str, Any] | None], what: str) -> dict[str, Any]:
    """The union of batch-level infos; a key whose values differ between chunks cannot be merged, but for the
    broker's deliveries: each batch's lease stays its own, so the concatenation keeps them all."""
    keys = [set(info or ()) for info in infos]
    if any(k != keys[0] for k in keys[1:]):
        logger.warning(f"{what}.concat: extra_info key sets differ across chunks, performing union of keys.")
    merged: dict[str, Any] = {}
    for key in dict.fromkeys(k for info in infos for k in info or ()):  # first seen first
        values = [info[key] for info in infos if info and key in info]
        if key == DELIVERY:
            merged[key] = deliveries(values)
            continue
        for i, v in enumerate(values[1:], start=1):
            if not values_equal(values[0], v):
                raise InvalidExperienceError(
                    f"{what}.concat: extra_info key '{key}' has conflicting values across chunks and cannot be "
                    f"merged. chunk[0]={values[0]!r}, chunk[{i}]={v!r}"
                )
        merged[key] = values[0]
    return merged


def deliveries(values: Sequence[Any]) -> Any:
    """The deliveries of concatenated batches, each once, in order: one stays one (not a tuple of one)."""
    flat: list[Any] = []
    for value in values:
        for delivery in value if isinstance(value, tuple) else (value,):
            if not any(d is delivery or (type(d) is type(delivery) and d == delivery
                                         and getattr(d, "token", None) == getattr(delivery, "token", None))
                       for d in flat):
                flat.append(delivery)
    return flat[0] if len(flat) == 1 else tuple(flat)


def chunk_bounds(size: int, chunks: int, what: str) -> list[tuple[int, int]]:
    """``chunks`` consecutive ranges covering ``range(size)``, the first ``size % chunks`` one longer."""
    try:
        chunks = operator.index(chunks)
    except TypeError:
        raise MetaIndexTypeError(f"{what}.chunk: chunks must be an int, got {chunks!r}") from None
    if chunks < 1:
        raise InvalidExperienceError(f"{what}.chunk: chunks must be at least 1, got {chunks}")
    if size < chunks:
        logger.warning(f"Chunk size {chunks} > number of samples in {what} {size}, this will return some "
                       f"empty {what} chunks.")
    base, extra = divmod(size, chunks)
    bounds, start = [], 0
    for i in range(chunks):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def positions(indices: Iterable[Any], what: str) -> list[int]:
    """Row positions as ints (numpy ints too); anything else is refused by name."""
    try:
        return [operator.index(i) for i in indices]
    except TypeError:
        raise MetaIndexTypeError(f"{what} takes a list of int positions, got {indices!r}") from None


def repeated(values: Iterable[Any]) -> list[Any]:
    """The values that occur more than once, each once, in first-seen order."""
    seen: set[Any] = set()
    repeated: dict[Any, None] = {}
    for v in values:
        if v in seen:
            repeated[v] = None
        seen.add(v)
    return list(repeated)
