"""What a GRPO run through the broker is made of: its roles, their columns, layouts and settings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from . import task
from .model import ModelConfig
from .train_local import TrainConfig, model_config

#: The worker groups, in pipeline order. Each is also the dock consumer of the same name.
ROLES = ("actor_rollout", "ref_log_prob", "actor_log_prob", "rule_reward", "compute_advantage", "actor_train")
#: Roles that hold a copy of the policy (the others run plain Python on their batch).
MODEL_ROLES = ("actor_rollout", "ref_log_prob", "actor_log_prob", "actor_train")
#: Roles whose weights follow the trainer each iteration (the reference stays at the initial weights).
SYNCED_ROLES = ("actor_rollout", "actor_log_prob")

#: Columns each role reads from the dock.
INPUTS: dict[str, tuple[str, ...]] = {
    "actor_rollout": ("prompts", "prompt_length"),
    "ref_log_prob": ("prompts", "prompt_length", "responses", "response_length"),
    "actor_log_prob": ("prompts", "prompt_length", "responses", "response_length"),
    "rule_reward": ("prompts", "prompt_length", "responses", "response_length"),
    "compute_advantage": ("rewards",),
    "actor_train": (
        "prompts", "prompt_length", "responses", "response_length", "advantages", "old_log_probs", "ref_log_probs",
    ),
}
#: Columns each role writes back (the trainer only consumes).
OUTPUTS: dict[str, tuple[str, ...]] = {
    "actor_rollout": ("responses", "response_length"),
    "ref_log_prob": ("ref_log_probs",),
    "actor_log_prob": ("old_log_probs",),
    "rule_reward": ("rewards",),
    "compute_advantage": ("advantages",),
    "actor_train": (),
}
COLUMNS = ("prompts", "prompt_length", "responses", "response_length", "rewards", "advantages",
           "old_log_probs", "ref_log_probs")

#: Rows a role asks for per get; rounded down to whole groups that divide the dock evenly.
BATCH_ROWS = {
    "actor_rollout": 64,
    "ref_log_prob": 128,
    "actor_log_prob": 128,
    "rule_reward": 128,
    "compute_advantage": 64,
    "actor_train": 128,  # one minibatch: train_local's value, which learns the task in ~25 iterations
}


@dataclass(frozen=True)
class Layout:
    """One role's worker group: ``dp`` data-parallel replicas of ``tp`` tensor-parallel ranks each."""

    dp: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp

    def __str__(self) -> str:
        return f"{self.dp}x{self.tp}"

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``"2x2"`` -> Layout(dp=2, tp=2)."""
        try:
            dp, tp = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"layout must look like DPxTP, e.g. 2x1, got {text!r}") from None
        if dp < 1 or tp < 1:
            raise ValueError(f"layout {text!r}: DP and TP must be >= 1")
        return cls(dp, tp)


@dataclass(frozen=True)
class RunConfig:
    """Everything the workers need to know about a run; pickled to every actor."""

    prompts: int = 64
    n: int = 8
    seed: int = 0
    # The GRPO hyper-parameters tuned on the broker-free loop, so the two cannot drift apart.
    lr: float = TrainConfig.lr
    clip_eps: float = TrainConfig.clip_eps
    kl_coef: float = TrainConfig.kl_coef
    temperature: float = TrainConfig.temperature
    epochs: int = TrainConfig.epochs
    guarantee_order: bool = False
    #: Longest a get waits for rows before the worker re-checks all_consumed; pub/sub wakes it earlier.
    poll_seconds: float = 2.0
    #: A role that gets no rows for this long while rows are still owed raises instead of hanging.
    stall_seconds: float = 300.0
    #: Record what every rank received (indexes and checksums), for tests.
    trace: bool = False
    layouts: dict[str, Layout] = field(default_factory=lambda: {role: Layout() for role in ROLES})
    batch_rows: dict[str, int] = field(default_factory=lambda: dict(BATCH_ROWS))
    #: Partial rollout (MindSpeed's ``partial_rollout_max_split``): a response is generated in up to
    #: ``max_age`` passes of ``token_budget`` tokens each, an unfinished one kept for a later pass; 1: off.
    max_age: int = 1
    #: Off-policy rollout: the rollout runs ahead of the trainer with weights up to this many versions
    #: old, and the dock drops groups older than that; None: synchronous (every batch generated with
    #: the weights it is trained against).
    max_staleness: int | None = None

    @property
    def capacity(self) -> int:
        """Rows trained per iteration (the global batch): prompts x n."""
        return self.prompts * self.n

    @property
    def partial(self) -> bool:
        return self.max_age > 1

    @property
    def asynchronous(self) -> bool:
        return self.max_staleness is not None

    @property
    def tracked(self) -> bool:
        """Whether the dock keeps groups across iterations (ages, versions), i.e. either option is on."""
        return self.partial or self.asynchronous

    @property
    def dock_groups(self) -> int:
        """Groups the dock holds: one global batch when synchronous; twice that under partial rollout
        (MindSpeed's td_max_len = 2 x GBS: this iteration's prompts and the ones left unfinished); the
        batch being trained plus ``max_staleness`` batches generated ahead when asynchronous."""
        if self.partial:
            return 2 * self.prompts
        if self.asynchronous:
            return (self.max_staleness + 1) * self.prompts
        return self.prompts

    @property
    def token_budget(self) -> int:
        """Tokens one rollout pass may add to a response: ceil(max_new_tokens / max_age)."""
        return math.ceil(task.MAX_NEW_TOKENS / self.max_age)

    @property
    def columns(self) -> tuple[str, ...]:
        # "versions": the weights version that generated each row, for the trainer's version lag.
        return COLUMNS + ("versions",) if self.tracked else COLUMNS

    def inputs(self, role: str) -> tuple[str, ...]:
        """Columns ``role`` reads: the rollout also reads the partial responses (and their ages) when
        it continues them; the trainer also reads the versions when they are recorded."""
        if role == "actor_rollout" and self.tracked:
            return INPUTS[role] + ("responses", "response_length", "age")
        if role == "actor_train" and self.tracked:
            return INPUTS[role] + ("versions",)
        return INPUTS[role]

    def model(self) -> ModelConfig:
        return demo_model_config()

    def rows_per_get(self, role: str) -> int:
        """Rows per get: whole groups, as many as fit in ``batch_rows[role]``, dividing each DP rank's share.

        Dividing evenly matters twice: a sampling get of more rows than remain would never be served,
        and data-parallel trainers step in lockstep, so each must get the same number of batches.
        """
        dp = self.layouts[role].dp
        share = self.prompts // dp
        want = max(1, self.batch_rows[role] // self.n)
        groups = max(g for g in range(1, share + 1) if share % g == 0 and g <= want)
        return groups * self.n

    def validate(self) -> None:
        if self.n < 2:
            raise ValueError("GRPO needs --n >= 2 samples per prompt to compare")
        if self.prompts < 1:
            raise ValueError("--prompts must be >= 1")
        if self.max_age < 1:
            raise ValueError("--max-age must be >= 1")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("--max-staleness must be >= 0")
        if self.partial and self.asynchronous:
            raise ValueError("--max-age and --max-staleness cannot be combined in the demo yet")
        if self.tracked and self.guarantee_order:
            raise ValueError("--guarantee-order takes fixed rows; --max-age and --max-staleness hand rows out "
                             "oldest first")
        heads = self.model().n_heads
        for role, layout in self.layouts.items():
            if role not in ROLES:
                raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
            if self.prompts % layout.dp:
                raise ValueError(f"{role}: --prompts {self.prompts} must split evenly over its {layout.dp} DP ranks")
            if role in MODEL_ROLES and heads % layout.tp:
                raise ValueError(f"{role}: TP {layout.tp} must divide the model's {heads} attention heads")


def demo_model_config() -> ModelConfig:
    """train_local's model, with room for responses padded to a multiple of any valid TP size."""
    base = model_config()
    # TP divides n_heads, so padding a response to a multiple of TP adds fewer than n_heads tokens.
    width = math.ceil(task.MAX_NEW_TOKENS / base.n_heads) * base.n_heads
    return replace(base, max_seq_len=task.PROMPT_LEN + width)


def with_layouts(cfg: RunConfig, dp: int, tp: int, overrides: dict[str, Layout] | None = None) -> RunConfig:
    """``cfg`` with ``dp x tp`` for the model roles, 1x1 for the light roles, then ``overrides``."""
    layouts = {role: Layout(dp, tp) if role in MODEL_ROLES else Layout() for role in ROLES}
    layouts.update(overrides or {})
    return replace(cfg, layouts=layouts)
