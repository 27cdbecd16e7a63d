"""How a dock treats generation: partial rollout (MindSpeed's ``max_age``) and a staleness bound.

Stored in the dock's schema (meta field ``rollout``, JSON), so every process opening the dock agrees
on it and every script checks it like the rest of the schema.

Partial rollout (``max_age > 1``): prompts are put with ``is_prompt=True`` and get placeholder
responses; the rollout consumer is handed unfinished rows, oldest group first, possibly fewer than it
asked for; responses are put with a per-row ``rollout_completed`` flag; every other consumer sees a
group only once all its n rows are finished, and takes at most ``gbs_train`` groups per iteration;
``clear(consumer=...)`` ends an iteration: it forgets the rows that consumer trained on and ages every
group kept.

Staleness (``max_staleness=k``): puts may carry the policy version that produced the rows; a group
whose oldest row is older than ``current version - k`` is never handed to a consumer other than the
rollout consumer. ``stale_policy`` says what happens to it instead: ``"drop"`` forgets the group and
counts it, ``"regenerate"`` keeps its ``prompt_columns`` and offers it to the rollout consumer again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from broker.errors import SchemaError

#: What ``stale_policy`` may be.
STALE_POLICIES = ("drop", "regenerate")

#: Placeholder responses of a prompt put with ``is_prompt=True``, as MindSpeed writes them:
#: ``[-1]`` in a response column, ``[0]`` in a response column that is a length column.
PLACEHOLDER_RESPONSE = -1
PLACEHOLDER_LENGTH = 0


@dataclass(frozen=True)
class Rollout:
    """A dock's generation settings. The default (``Rollout()``) turns nothing on."""

    #: The consumer that generates (MindSpeed's ``actor_rollout``).
    consumer: str = "actor_rollout"
    #: Columns the rollout writes (``responses``, ``response_length``): placeholders for a prompt,
    #: not ready again while a row is out for generation.
    response_columns: tuple[str, ...] = ()
    #: Iterations a response may take; above 1 turns partial rollout on (MindSpeed's ``max_age``).
    max_age: int = 1
    #: Groups trained per iteration (MindSpeed's ``GBS_train``); needed by partial rollout.
    gbs_train: int = 0
    #: Versions a trained row may lag the current one; None: no bound.
    max_staleness: int | None = None
    stale_policy: str = "drop"
    #: Columns a regenerated group keeps (its prompt); the rest are forgotten.
    prompt_columns: tuple[str, ...] = field(default=())

    @property
    def partial(self) -> bool:
        return self.max_age > 1

    @property
    def bounded(self) -> bool:
        return self.max_staleness is not None

    @property
    def age_buckets(self) -> int:
        """Age bitmaps kept per level: ages 0 .. max_age, the last holding every group that old or older."""
        return self.max_age + 1 if self.partial else 0

    @classmethod
    def build(cls, **given: Any) -> Rollout:
        """From user arguments (sequences of names, numpy ints); ``check`` validates against a schema."""
        for name in ("response_columns", "prompt_columns"):
            if name in given and not isinstance(given[name], str):
                given[name] = tuple(given[name])
        return cls(**given)

    def check(self, columns: Iterable[str], consumers: Iterable[str]) -> None:
        """Raise SchemaError unless these settings make sense for a dock with these names."""
        columns, consumers = tuple(columns), tuple(consumers)
        for name in ("max_age", "gbs_train"):
            value = getattr(self, name)
            if type(value) is not int or value < (1 if name == "max_age" else 0):
                raise SchemaError(f"{name} must be an int >= {1 if name == 'max_age' else 0}, got {value!r}")
        if self.max_staleness is not None and (type(self.max_staleness) is not int
                                               or not 0 <= self.max_staleness < 2**53):
            raise SchemaError(f"max_staleness must be None or an int >= 0 and below 2**53, got {self.max_staleness!r}")
        if self.stale_policy not in STALE_POLICIES:
            raise SchemaError(f"stale_policy must be one of {STALE_POLICIES}, got {self.stale_policy!r}")
        for name in ("response_columns", "prompt_columns"):
            names = getattr(self, name)
            if isinstance(names, str):
                raise SchemaError(f"{name} must be a list of column names, got {names!r}")
            unknown = [c for c in names if c not in columns]
            if unknown:
                raise SchemaError(f"{name} {unknown} are not columns of the dock ({list(columns)})")
        if self.partial or (self.bounded and self.stale_policy == "regenerate"):
            if self.consumer not in consumers:
                raise SchemaError(
                    f"rollout consumer {self.consumer!r} is not a consumer of the dock ({list(consumers)})"
                )
        if self.partial:
            if self.gbs_train < 1:
                raise SchemaError("GBS for update must be provided when enabling partial rollout (gbs_train >= 1)")
            if not self.response_columns:
                raise SchemaError("partial rollout needs response_columns (the columns the rollout writes)")
        if self.bounded and self.stale_policy == "regenerate":
            if not self.prompt_columns:
                raise SchemaError('stale_policy="regenerate" needs prompt_columns (the columns a group keeps)')
            both = sorted(set(self.prompt_columns) & set(self.response_columns))
            if both:
                raise SchemaError(f"columns {both} cannot be both prompt and response columns")

    def to_json(self) -> str:
        if self == Rollout():
            return "{}"
        return json.dumps({
            "consumer": self.consumer, "response_columns": list(self.response_columns), "max_age": self.max_age,
            "gbs_train": self.gbs_train, "max_staleness": self.max_staleness, "stale_policy": self.stale_policy,
            "prompt_columns": list(self.prompt_columns),
        }, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Rollout:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        return cls.build(**raw)
