"""The algorithms the demo runs, by name: each module builds one :class:`workers.algorithm.Algorithm`."""

from __future__ import annotations

from ..algorithm import Algorithm
from . import dapo, grpo, ppo

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (grpo.GRPO, ppo.PPO, dapo.DAPO)}


def get_algorithm(name: str) -> Algorithm:
    """The algorithm called ``name``; ValueError naming the known ones otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; known: {', '.join(ALGORITHMS)}") from None
