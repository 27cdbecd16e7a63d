"""What one ``get_experience`` call asks for, as one object.

``TransferDock.get_experience`` keeps its documented signature (thirteen arguments, most of them optional);
it builds a ``GetRequest`` from them once and hands that down (``Handouts.get``), so the arguments are
written out only where a caller reads them, and a new one is a field here rather than a parameter added
along the whole path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["GetRequest"]


@dataclass(frozen=True)
class GetRequest:
    """The arguments of one ``get_experience`` call, as the caller gave them: not checked yet (``Handouts.get``
    checks each, and says which was wrong). Field for field the documented parameters: see
    ``TransferDock.get_experience`` for what each means."""

    consumer: str
    experience_columns: Sequence[str] | None = None
    experience_count: int | None = None
    indexes: Sequence[int] | None = None
    get_n_samples: bool = True
    timeout: float | None = None
    policy: str | None = None
    lease: float | None = None
    dp_size: int = 1
    balance: bool | Sequence[str] = False
    dp_padding: bool = False
    max_staleness: int | None = None
    stack: bool = False
    #: Not a parameter of ``get_experience``: a sampled get hands out what qualifies (at least one unit) when
    #: fewer than ``experience_count`` units do. A partitioned dock's get asks each partition so
    #: (``broker/api/partitioned.py``); a partial rollout's rollout consumer samples so anyway.
    fewer: bool = False
    #: Not a parameter either: told, after each sampling script, how many units still qualified there after its
    #: pick (0 when it handed nothing out). A partitioned dock's get uses it to ask a drained partition last.
    on_left: Callable[[int], None] | None = None
