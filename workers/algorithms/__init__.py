"""The RL algorithms the demo runs, by name, and what they are built from.

``base.py`` says what an algorithm is to the pipeline; ``roles.py`` holds the roles they share; ``grpo.py``,
``ppo.py`` and ``dapo.py`` each build one :class:`~workers.algorithms.base.Algorithm`, with their formulas
beside them in ``*_math.py`` (pure tensor functions, tested on hand-computed examples); ``batch_sizes.py``
turns the global PPO batch sizes into per-rank ones as verl does.
"""

from __future__ import annotations

from . import dapo, grpo, ppo
from .base import Algorithm

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (grpo.GRPO, ppo.PPO, dapo.DAPO)}


def get_algorithm(name: str) -> Algorithm:
    """The algorithm called ``name``; ValueError naming the known ones otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(ALGORITHMS)}") from None
