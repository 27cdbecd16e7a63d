"""What an RL algorithm is, to the pipeline: its roles in order, the columns each reads and writes, which
roles hold a network and whose weights they follow, and the class that computes each role.

An algorithm is one small module in ``workers/algorithms/`` that builds an :class:`Algorithm` from the
shared pieces (``roles.py``: the rollout, log-probs, rule reward and the streamed trainer; ``workers/model/``;
the worker loop and the pipeline in ``workers/runtime/``). The pipeline, the workers and the report read
everything from it, so a new algorithm is a new file, not a fork of the demo.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..model.transformer import ModelConfig


@dataclass(frozen=True)
class Algorithm:
    """One algorithm's wiring. Every role is also the dock consumer of the same name."""

    name: str
    #: One line for ``--help`` and the demo's banner.
    summary: str
    #: Worker groups in pipeline order (the timeline's lanes follow it).
    roles: tuple[str, ...]
    #: Columns each role reads from the dock.
    inputs: Mapping[str, tuple[str, ...]]
    #: Columns each role writes back (a trainer writes nothing).
    outputs: Mapping[str, tuple[str, ...]]
    #: The class computing each role (a ``roles.Role`` subclass); ``Any``, as roles.py imports this module.
    role_classes: Mapping[str, Any]
    #: Role -> the trainer whose weights it loads at the start of every iteration (the rollout and the
    #: log-prob stage follow the actor, a critic's value stage its trainer; the reference follows nobody).
    follows: Mapping[str, str] = field(default_factory=dict)
    #: Rows a role asks for per get (rounded to whole groups that split each DP rank's share evenly).
    batch_rows: Mapping[str, int] = field(default_factory=dict)
    #: Fewest samples per prompt it works with (group-relative advantages need 2).
    min_n: int = 1
    #: Hand rows out one by one (``get_n_samples=False``) instead of whole groups of n.
    row_sampling: bool = False
    #: DAPO's dynamic sampling: the role that drops groups (its compute returns ``roles.DROP``); the driver
    #: puts new prompts in their place, and the rollout runs until this role has kept a full batch. "": none.
    filter_role: str = ""
    #: RunConfig fields this algorithm sets differently from the defaults (its paper's settings).
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for what, table in (("inputs", self.inputs), ("outputs", self.outputs), ("role_classes", self.role_classes)):
            if set(table) != set(self.roles):
                raise ValueError(f"{self.name}: {what} names roles {sorted(table)}, expected {sorted(self.roles)}")
        for role, trainer in self.follows.items():
            if role not in self.roles or trainer not in self.roles:
                raise ValueError(f"{self.name}: follows {role!r} -> {trainer!r} names an unknown role")
        if self.filter_role and self.filter_role not in self.roles:
            raise ValueError(f"{self.name}: filter_role {self.filter_role!r} is not one of its roles")
        for role, cls in self.role_classes.items():
            if getattr(cls, "name", role) != role:
                raise ValueError(f"{self.name}: role {role!r} is computed by {cls.__name__}, named {cls.name!r}")

    @property
    def columns(self) -> tuple[str, ...]:
        """Every column any role reads or writes, in first-use order."""
        seen: dict[str, None] = {}
        for role in self.roles:
            seen.update(dict.fromkeys(self.inputs[role]))
            seen.update(dict.fromkeys(self.outputs[role]))
        return tuple(seen)

    @property
    def dynamic_sampling(self) -> bool:
        return bool(self.filter_role)

    @property
    def before_filter(self) -> tuple[str, ...]:
        """Roles up to the filter, which see replacement groups arrive a few at a time."""
        return self.roles[: self.roles.index(self.filter_role) + 1] if self.filter_role else ()

    @property
    def model_roles(self) -> tuple[str, ...]:
        """Roles holding a network (they take the ``--dp`` x ``--tp`` layout)."""
        return tuple(r for r in self.roles if getattr(self.role_classes[r], "head", None) is not None)

    @property
    def trainers(self) -> tuple[str, ...]:
        """Roles whose weights others follow, in pipeline order."""
        return tuple(r for r in self.roles if r in set(self.follows.values()))


class RunSettings(Protocol):
    """What the roles read of the run they are part of; ``workers.config.RunConfig`` is one.

    Spelled out here rather than imported because the config is built from the algorithms (their roles,
    columns and defaults): the algorithms must not depend on it in turn. Read-only, as the config is frozen.
    """

    def inputs(self, role: str) -> tuple[str, ...]:
        """The columns ``role`` reads in this run."""

    def model(self) -> ModelConfig:
        """The shape of every network in the run."""

    # The run.
    @property
    def algorithm(self) -> Algorithm: ...

    @property
    def n(self) -> int: ...

    @property
    def prompts(self) -> int: ...

    @property
    def seed(self) -> int: ...

    @property
    def tracked(self) -> bool: ...

    @property
    def token_budget(self) -> int: ...

    @property
    def temperature(self) -> float: ...

    # Any trainer.
    @property
    def lr(self) -> float: ...

    @property
    def epochs(self) -> int: ...

    @property
    def micro_batch_rows(self) -> int | None: ...

    @property
    def clip_eps(self) -> float: ...

    @property
    def clip_high(self) -> float: ...

    @property
    def kl_coef(self) -> float: ...

    # PPO.
    @property
    def critic_lr(self) -> float: ...

    @property
    def gamma(self) -> float: ...

    @property
    def lam(self) -> float: ...

    @property
    def cliprange_value(self) -> float: ...

    @property
    def clip_reward_value(self) -> float: ...

    # DAPO.
    @property
    def overlong_buffer(self) -> int: ...

    @property
    def overlong_factor(self) -> float: ...

    @property
    def max_gen_batches(self) -> int: ...
