"""What a run through the broker is made of: its algorithm, the layouts of its worker groups, and its settings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from .algorithms import get_algorithm
from .algorithms.base import Algorithm
from .algorithms.batch_sizes import RankBatchSizes, normalize_ppo_batch_sizes
from .model import task
from .model.parallel_state import Layout
from .model.transformer import ModelConfig
from .train_local import TrainConfig, model_config

__all__ = ["Layout", "RunConfig", "demo_model_config", "with_layouts"]


@dataclass(frozen=True)
class RunConfig:
    """Everything the workers need to know about a run; pickled to every actor."""

    #: The algorithm (``workers.algorithms``): its roles, columns and losses.
    algo: str = "grpo"
    prompts: int = 64
    n: int = 8
    seed: int = 0
    # The GRPO hyper-parameters tuned on the broker-free loop, so the two cannot drift apart.
    lr: float = TrainConfig.lr
    #: The clip range below 1 (and above, unless ``clip_high`` is set: DAPO's clip-higher).
    clip_eps: float = TrainConfig.clip_eps
    clip_high: float = TrainConfig.clip_eps
    #: GRPO: the KL loss coefficient; PPO: the KL penalty folded into the rewards (DeepSpeed-Chat's kl_ctl).
    kl_coef: float = TrainConfig.kl_coef
    temperature: float = TrainConfig.temperature
    #: Passes over each iteration's batch (PPO's ppo_epochs), by actor and critic alike.
    epochs: int = TrainConfig.epochs
    #: Global mini-batch in prompts (verl's ppo_mini_batch_size): one optimizer step per mini-batch;
    #: None: the algorithm's ``batch_rows`` for the trainer.
    mini_batch_prompts: int | None = None
    #: Rows per forward/backward on one DP rank (verl's ppo_micro_batch_size_per_gpu); None: the whole mini-batch.
    micro_batch_rows: int | None = None
    # PPO (DeepSpeed-Chat's defaults, but for the critic's learning rate, tuned here).
    critic_lr: float = 1e-3
    gamma: float = 1.0
    lam: float = 0.95
    cliprange_value: float = 0.2
    clip_reward_value: float = 5.0
    # DAPO.
    #: L_cache of the soft overlong punishment; L_max is the task's limit of new tokens.
    overlong_buffer: int = 1
    #: Scale of that punishment (verl's overlong_buffer.penalty_factor).
    overlong_factor: float = 1.0
    #: verl's max_num_gen_batches: prompts put per iteration at most this many times the batch.
    max_gen_batches: int = 3
    guarantee_order: bool = False
    #: Longest a get waits for rows before the worker re-checks all_consumed; pub/sub wakes it earlier.
    poll_seconds: float = 2.0
    #: A role that gets no rows for this long while rows are still owed raises instead of hanging.
    stall_seconds: float = 300.0
    #: Rows a worker takes are leased for this long and acked once its result is written (the write fenced
    #: by the lease): rows of a worker that died go back to its role, at once when the driver restarts the
    #: role's group, else when the lease runs out. 0: rows are taken for good (a dead worker's are lost).
    lease_seconds: float = 120.0
    #: Worker groups the driver restarts in one run after a worker died, before it gives up and raises.
    max_restarts: int = 3
    #: Record what every rank received (indexes and checksums), for tests.
    trace: bool = False
    #: Role -> layout; a role not named runs as 1x1 (``with_layouts`` fills them in).
    layouts: dict[str, Layout] = field(default_factory=dict)
    #: Role -> rows per get, over the algorithm's ``batch_rows``.
    batch_rows: dict[str, int] = field(default_factory=dict)
    #: Partial rollout (MindSpeed's ``partial_rollout_max_split``): a response is generated in up to
    #: ``max_age`` passes of ``token_budget`` tokens each, an unfinished one kept for a later pass; 1: off.
    max_age: int = 1
    #: Off-policy rollout: the rollout runs ahead of the trainer with weights up to this many versions
    #: old, and the dock drops groups older than that; None: synchronous (every batch generated with
    #: the weights it is trained against).
    max_staleness: int | None = None
    #: Partitions of the run's dock (``TransferDock(..., partitions=P)``): its control plane over P slots, on a
    #: Redis Cluster over P primaries; 1: one dock in one slot.
    partitions: int = 1

    @classmethod
    def for_algorithm(cls, algo: str, **settings: Any) -> RunConfig:
        """A config with the algorithm's own defaults (its paper's settings), then ``settings``."""
        return cls(algo=algo, **{**get_algorithm(algo).defaults, **settings})

    @property
    def algorithm(self) -> Algorithm:
        return get_algorithm(self.algo)

    @property
    def roles(self) -> tuple[str, ...]:
        return self.algorithm.roles

    def layout(self, role: str) -> Layout:
        return self.layouts.get(role, Layout())

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
        columns = self.algorithm.columns
        return columns + ("versions",) if self.tracked else columns

    def inputs(self, role: str) -> tuple[str, ...]:
        """Columns ``role`` reads: the rollout also reads the partial responses (and their ages) when
        it continues them; the trainer also reads the versions when they are recorded."""
        inputs = self.algorithm.inputs[role]
        if role == "actor_rollout" and self.tracked:
            return inputs + ("responses", "response_length", "age")
        if role == "actor_train" and self.tracked:
            return inputs + ("versions",)
        return inputs

    def model(self) -> ModelConfig:
        return demo_model_config()

    def rows_per_get(self, role: str) -> int:
        """Rows per get: whole groups, as many as fit in ``batch_rows[role]``, dividing each DP rank's share.

        Dividing evenly matters twice: a sampling get of more rows than remain would never be served,
        and data-parallel trainers step in lockstep, so each must get the same number of batches.
        """
        dp = self.layout(role).dp
        share = self.prompts // dp
        want = max(1, self.wanted_rows(role) // self.n)
        groups = max(g for g in range(1, share + 1) if share % g == 0 and g <= want)
        return groups * self.n

    def wanted_rows(self, role: str) -> int:
        """Rows ``role`` would like per get: a trainer's per-rank mini-batch when ``mini_batch_prompts`` is
        given (normalised as verl does), else ``batch_rows``."""
        if role in self.algorithm.trainers and self.mini_batch_prompts is not None:
            return self.rank_batch_sizes(role).mini_batch_size
        return self.batch_rows.get(role) or self.algorithm.batch_rows[role]

    def rank_batch_sizes(self, role: str) -> RankBatchSizes:
        """A trainer's mini- and micro-batch per DP rank, from the global mini-batch in prompts
        (``mini_batch_prompts``, or what one get of ``rows_per_get`` rows on each DP rank adds up to). The
        TP ranks of a replica see the same rows, as an SP group does in verl. ValueError naming the numbers."""
        layout = self.layout(role)
        if self.mini_batch_prompts is not None:
            mini = self.mini_batch_prompts
        else:
            mini = self.rows_per_get(role) * layout.dp // self.n
        return normalize_ppo_batch_sizes(mini, self.n, layout.world, sp_size=layout.tp,
                                         ppo_micro_batch_size_per_gpu=self.micro_batch_rows)

    def validate(self) -> None:
        algorithm = self.algorithm
        if self.n < algorithm.min_n:
            raise ValueError(f"{algorithm.name} needs --n >= {algorithm.min_n} samples per prompt to compare")
        if self.prompts < 1:
            raise ValueError("--prompts must be >= 1")
        if self.max_age < 1:
            raise ValueError("--max-age must be >= 1")
        if not self.lease_seconds >= 0 or self.lease_seconds == float("inf"):
            raise ValueError(f"--lease-seconds must be a finite number >= 0, got {self.lease_seconds}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("--max-staleness must be >= 0")
        if self.partial and self.asynchronous:
            raise ValueError("--max-age and --max-staleness cannot be combined in the demo yet")
        if self.kl_coef < 0 or self.clip_eps <= 0 or self.clip_high <= 0:
            raise ValueError("--kl-coef must be >= 0, and the clip ranges > 0")
        if self.kl_coef and "ref_log_prob" not in algorithm.roles:
            raise ValueError(f"{algorithm.name} has no reference model and no KL term: --kl-coef must be 0")
        if self.guarantee_order and algorithm.dynamic_sampling:
            raise ValueError(f"--guarantee-order takes fixed rows; {algorithm.name}'s dropped groups come back as new "
                             "prompts in rows already taken")
        if self.tracked and algorithm.name != "grpo":
            raise ValueError(f"--max-age and --max-staleness run with --algo grpo; {algorithm.name} runs synchronously")
        if self.epochs < 1:
            raise ValueError("--ppo-epochs must be >= 1")
        if self.max_gen_batches < 1:
            raise ValueError("--max-gen-batches must be >= 1")
        if not 0 < self.overlong_buffer <= task.MAX_NEW_TOKENS:
            raise ValueError(f"--overlong-buffer must be in 1..{task.MAX_NEW_TOKENS}, the task's limit of new tokens")
        if self.micro_batch_rows is not None and self.micro_batch_rows < 1:
            raise ValueError("--micro-batch-size must be >= 1")
        if self.partitions < 1 or self.partitions > self.prompts:
            raise ValueError(f"--partitions must be in 1..--prompts ({self.prompts}), got {self.partitions}")
        if self.tracked and self.guarantee_order:
            raise ValueError("--guarantee-order takes fixed rows; --max-age and --max-staleness hand rows out "
                             "oldest first")
        heads = self.model().n_heads
        for role in self.layouts:
            if role not in algorithm.roles:
                raise ValueError(f"{algorithm.name} has no role {role!r}; its roles are {', '.join(algorithm.roles)}")
        for role in algorithm.roles:
            layout = self.layout(role)
            if self.prompts % layout.dp:
                raise ValueError(f"{role}: --prompts {self.prompts} must split evenly over its {layout.dp} DP ranks")
            if role in algorithm.model_roles and heads % layout.tp:
                raise ValueError(f"{role}: TP {layout.tp} must divide the model's {heads} attention heads")
        if self.mini_batch_prompts is not None and self.mini_batch_prompts < 1:
            raise ValueError("--mini-batch-size must be >= 1")
        for role in algorithm.trainers:
            sizes = self.rank_batch_sizes(role)
            share = self.capacity // self.layout(role).dp
            step = 1 if algorithm.row_sampling else self.n
            if share % sizes.mini_batch_size or sizes.mini_batch_size % step:
                raise ValueError(
                    f"{role}: normalized mini-batch of {sizes.mini_batch_size} rows per DP rank (--mini-batch-size "
                    f"{self.mini_batch_prompts} prompts x n {self.n} // DP {self.layout(role).dp}) must be whole "
                    f"groups of {step} that split the rank's {share} rows per iteration evenly")


def demo_model_config() -> ModelConfig:
    """train_local's model, with room for responses padded to a multiple of any valid TP size."""
    base = model_config()
    # TP divides n_heads, so padding a response to a multiple of TP adds fewer than n_heads tokens.
    width = math.ceil(task.MAX_NEW_TOKENS / base.n_heads) * base.n_heads
    return replace(base, max_seq_len=task.PROMPT_LEN + width)


def with_layouts(cfg: RunConfig, dp: int, tp: int, overrides: dict[str, Layout] | None = None) -> RunConfig:
    """``cfg`` with ``dp x tp`` for the model roles, 1x1 for the light roles, then ``overrides``."""
    model_roles = cfg.algorithm.model_roles
    layouts = {role: Layout(dp, tp) if role in model_roles else Layout() for role in cfg.roles}
    layouts.update(overrides or {})
    return replace(cfg, layouts=layouts)
