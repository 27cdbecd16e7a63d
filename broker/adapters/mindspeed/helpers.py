"""What the adapter's classes share beside the dock: MindSpeed's batch format, row indexes, errors and
partial-rollout settings, converted to and from the native dock's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from broker.adapters.mindspeed.defaults import RESPONSE_COLUMNS, ROLLOUT_CONSUMER
from broker.adapters.mindspeed.padding import ORIGINAL_LENGTH_KEY, padding_dict_to_tensor_dict
from broker.api.checks import is_int
from broker.control.rollout import Rollout
from broker.errors import BrokerError, InvalidExperienceError, RowIndexError

try:  # imported once, here: it takes about a second, which a first get_experience should not pay
    from tensordict import TensorDict
except ImportError:  # the "mindspeed" extra is not installed: batches are plain dicts
    TensorDict = None  # type: ignore[misc, assignment]


def bad(message: str) -> InvalidExperienceError:
    """MindSpeed's error for bad input: a ValueError (the broker's InvalidExperienceError)."""
    return InvalidExperienceError(message)


def check_seconds(name: str, value: Any) -> float:
    """A timeout as MindSpeed takes it: a finite number of seconds > 0 (not a string, not NaN, not -1), as a
    float; else MindSpeed's ValueError, before anything is made."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not np.isfinite(value) or value <= 0:
        raise bad(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


def check_names(name: str, value: Any) -> list[str]:
    """A list of column or consumer names: a string is refused (``"xyz"`` would be the names x, y and z)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise bad(f"{name} must be a list of names, got {value!r}")
    return list(value)


def pickled_url(what: str, url: Any) -> None:
    """Refuse to pickle an object made from a client object, not a URL: a connection cannot cross processes
    (pickle would fail on its lock, with a TypeError naming neither)."""
    if not isinstance(url, str):
        raise BrokerError(f"a {what} made from a {type(url).__name__} cannot be pickled (a connection cannot cross "
                          "processes): make it from a URL to hand it to Ray workers or subprocesses")


def as_dict(data: Any) -> dict[str, Any]:
    """A data dict from what MindSpeed's workers hand over: a dict or a TensorDict."""
    if isinstance(data, Mapping):
        return dict(data)
    if hasattr(data, "to_dict") and hasattr(data, "keys"):  # a TensorDict, without importing tensordict
        return {k: data[k] for k in data.keys()}
    raise bad(f"data_dict must be a dict or a TensorDict of columns, got {type(data).__name__}")


def narrowed(data: Mapping[str, Any]) -> dict[str, Any]:
    """int64 rows become int32, as MindSpeed's ``trans_input_to_experience`` stores them: a padded column
    (a matrix, given before it is cut into rows) in one conversion, a list of rows row by row. The row
    lengths of a padded batch (``original_length``) stay as they are."""
    def narrow(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.dtype != torch.int64:
            return v
        try:  # numpy's conversion runs on this thread: torch's may be split over threads (see batches.py)
            return torch.from_numpy(v.numpy().astype(np.int32))
        except (RuntimeError, TypeError):  # not a CPU tensor numpy can view
            return v.to(torch.int32)

    return {column: value if column == ORIGINAL_LENGTH_KEY
            else [narrow(v) for v in value] if isinstance(value, (list, tuple)) else narrow(value)
            for column, value in data.items()}


def mindspeed_batch(batch: Mapping[str, list[Any]]) -> Any:
    """MindSpeed's return format: padded tensors plus ``original_length``, as a TensorDict if possible."""
    padded = padding_dict_to_tensor_dict(batch)
    if TensorDict is None:
        return padded
    tensors = {k: v for k, v in padded.items() if isinstance(v, torch.Tensor)}
    if len(tensors) != len(padded):
        return padded  # label columns: a plain dict, as MindSpeed's queue builds around them
    return TensorDict.from_dict(tensors)


def int_rows(indexes: Any) -> list[int]:
    """Row indexes as ints; anything else raises (int() would turn 0.5 into row 0 silently)."""
    if isinstance(indexes, (torch.Tensor, np.ndarray)):
        indexes = indexes.tolist()
    if isinstance(indexes, (str, bytes)) or not isinstance(indexes, Sequence):
        raise RowIndexError(f"indexes must be a list of row numbers, got {type(indexes).__name__}")
    wrong = [i for i in indexes if not is_int(i)]
    if wrong:
        raise RowIndexError(f"indexes must be ints, got {wrong[:5]!r}")
    return [int(i) for i in indexes]


def partial_rollout(max_age: int, gbs_train: int) -> Rollout | None:
    """MindSpeed's partial rollout (``max_age > 1``) as the native dock's settings."""
    if max_age == 1:
        return None
    return Rollout(consumer=ROLLOUT_CONSUMER, response_columns=RESPONSE_COLUMNS, max_age=max_age,
                   gbs_train=gbs_train)

