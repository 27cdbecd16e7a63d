"""The GRPO driver: one global batch per iteration, through the dock, drained by all roles at once.

Per iteration the driver puts the prompts (each repeated n times), tells every rank of every role
to run, and waits. The roles do not wait for the driver between stages: each pulls ready rows from
the dock as soon as an earlier stage has written them, so rollout, log-probs, reward, advantage and
training overlap. When every role has consumed every row, the trainer's new weights go to the
rollout and actor log-prob ranks for the next iteration, and the driver clears the dock.

Weights travel through Ray's object store, not the broker: they are one ~2 MB blob per iteration
read by every model rank at once, not per-row experience with ready/consumed status; Ray keeps one
shared-memory copy per node that actors read without a copy of their own and ships it between nodes
itself, while in the dock they would need a column no consumer drains and would be wiped by clear().
"""

from __future__ import annotations

import time
from typing import Any

import ray
import torch

from broker import Rollout, TransferDock
from broker.experience import put_prompts_experience

from . import task
from .cluster import WorkerGroup, cpus_per_rank, wait_all
from .config import ROLES, SYNCED_ROLES, RunConfig


def dock_rollout(cfg: RunConfig) -> Rollout | None:
    """The dock's generation settings: none when synchronous.

    Under ``--max-staleness`` alone every response is finished in one pass, yet the dock still keeps
    ages (``max_age = max_staleness + 2``): they make every consumer take the oldest finished groups
    first, so the trainer gets the batches in the order they were generated, and an iteration is
    ``--prompts`` groups (the dock's GBS_train) however many the dock holds.
    """
    if not cfg.tracked:
        return None
    max_age = cfg.max_age if cfg.partial else (cfg.max_staleness or 0) + 2
    return Rollout(consumer="actor_rollout", response_columns=("responses", "response_length"), max_age=max_age,
                   gbs_train=cfg.prompts, max_staleness=cfg.max_staleness, stale_policy="drop",
                   prompt_columns=("prompts", "prompt_length"))


def create_dock(url: str, name: str, cfg: RunConfig) -> TransferDock:
    """The run's dock: one row per (prompt, sample), every role a consumer. Emptied if it existed."""
    dock = TransferDock(url, name, prompts_num=cfg.dock_groups, n_samples_per_prompt=cfg.n, columns=cfg.columns,
                        consumers=ROLES, length_columns=["prompt_length", "response_length"],
                        rollout=dock_rollout(cfg))
    dock.clear()  # a dock left by a crashed run with the same name and schema
    return dock


class Pipeline:
    """All six worker groups of one run, and the loop that feeds them a global batch per iteration."""

    def __init__(self, dock: TransferDock, cfg: RunConfig, cluster_cpus: float) -> None:
        cfg.validate()
        self.dock = dock
        self.cfg = cfg
        self.cpus_per_rank = cpus_per_rank(cfg, cluster_cpus)
        self.groups: dict[str, WorkerGroup] = {}
        try:
            for role in ROLES:
                self.groups[role] = WorkerGroup(role, cfg, dock, self.cpus_per_rank)
            # All groups rendezvous at once: their set-ups are independent.
            self.hosts = wait_all([ref for g in self.groups.values() for ref in g.setup()], timeout=300)
        except BaseException:
            self.shutdown()
            raise
        self.weights: ray.ObjectRef | None = None  # None: every rank still has the seed's initial weights
        self._prompt_gen = torch.Generator().manual_seed(cfg.seed + 1)
        self._dropped = 0  # stale groups the dock had dropped by the end of the last iteration

    def put_prompts(self) -> int:
        """This iteration's global batch: fresh prompts, each repeated n times (MindSpeed's layout).

        When the dock keeps groups across iterations, a batch of ``--prompts`` groups goes into every
        run of free groups there is (the first iteration fills the dock; later ones refill the groups the
        trainer freed). Returns the prompts put.
        """
        cfg = self.cfg
        if not cfg.tracked:
            prompts = task.make_prompts(cfg.prompts, self._prompt_gen)
            data, indexes = put_prompts_experience({"prompts": prompts}, cfg.n)
            self.dock.put_experience({"prompts": data["prompts"], "prompt_length": data["prompt_length"]}, indexes)
            return cfg.prompts
        put = 0
        while (groups := self.dock.reserve_groups(cfg.prompts, "prompts")) is not None:
            prompts = task.make_prompts(cfg.prompts, self._prompt_gen)
            rows = [g * cfg.n + j for g in groups for j in range(cfg.n)]
            data, indexes = put_prompts_experience({"prompts": prompts}, cfg.n, indexes=rows)
            self.dock.put_experience({"prompts": data["prompts"], "prompt_length": data["prompt_length"]}, indexes,
                                     is_prompt=True)
            put += cfg.prompts
        return put

    def run_iteration(self, iteration: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Put a global batch, let every role drain it, fetch the new weights; returns (metrics, per-rank results).

        The dock is left as the roles left it (every row consumed by every role); ``clear`` empties it.
        """
        prompts_put = self.put_prompts()
        start = time.time()
        refs = []
        for role, group in self.groups.items():
            refs += group.run_iteration(iteration, self.weights if role in SYNCED_ROLES else None)
        results = wait_all(refs, timeout=self.cfg.stall_seconds + 60)
        seconds = time.time() - start
        # Submitted now, resolved inside the rollout and log-prob actors when the next iteration starts.
        self.weights = self.groups["actor_train"].export_weights()
        metrics = summarize(iteration, start, seconds, results, self.cfg)
        if self.cfg.tracked:
            metrics.update(self._dock_metrics(prompts_put))
        return metrics, results

    def _dock_metrics(self, prompts_put: int) -> dict[str, Any]:
        """What the dock holds at the end of an iteration, before ``clear`` forgets the trained groups."""
        status = self.dock.status()
        dropped = int(status["discarded"].get("stale", 0))
        out = {
            "max_age": self.cfg.max_age,
            "max_staleness": self.cfg.max_staleness,
            "prompts_put": prompts_put,
            # Groups held by age (iterations kept), the trained ones included.
            "groups_by_age": {str(a): int(c) for a, c in status["rollout"]["groups_by_age"].items()},
            "unfinished_rows": int(status["rollout"]["unfinished_rows"]),
            "version": int(status["version"]),
            "stale_dropped": dropped - self._dropped,
        }
        self._dropped = dropped
        return out

    def clear(self) -> None:
        """End the iteration: forget the trained groups and age the rest, or empty the whole dock."""
        if self.cfg.tracked:
            self.dock.clear(consumer="actor_train")
        else:
            self.dock.clear()

    def shutdown(self) -> None:
        for group in self.groups.values():
            try:
                group.shutdown()
            except Exception:  # noqa: BLE001 - best effort: Ray may already be going down
                pass
        self.groups = {}


def summarize(iteration: int, start: float, seconds: float, results: list[dict[str, Any]],
              cfg: RunConfig) -> dict[str, Any]:
    """One iteration's metrics from every rank's result (TP rank 0 speaks for its group)."""
    leaders = [r for r in results if r["tp_rank"] == 0]

    def total(role: str, key: str) -> float:
        return sum(r["stats"].get(key, 0.0) for r in leaders if r["role"] == role)

    rows = cfg.capacity
    trained = total("actor_train", "trained_rows")
    steps = max(total("actor_train", "steps"), 1.0)
    tokens = total("actor_rollout", "tokens")
    busy = sorted(
        ([r["role"], r["dp_rank"], b0, b1] for r in leaders for b0, b1 in r["busy"]), key=lambda b: b[2]
    )
    busy_seconds = {role: 0.0 for role in ROLES}
    for role, _, b0, b1 in busy:
        busy_seconds[role] += b1 - b0
    return {
        "iteration": iteration,
        "start": start,
        "seconds": seconds,
        "rows": rows,
        "reward": total("rule_reward", "reward_sum") / rows,
        "exact": total("rule_reward", "exact") / rows,
        "response_length": total("rule_reward", "response_tokens") / rows,
        "samples_per_s": rows / seconds,
        "tokens_per_s": tokens / seconds,
        **{k: total("actor_train", k) / steps for k in ("kl", "clip_frac", "pg_loss", "ratio", "grad_norm")},
        # Optimizer steps of the model: DP replicas step together, each counted its own.
        "train_steps": int(total("actor_train", "steps")) // cfg.layouts["actor_train"].dp,
        "busy_seconds": busy_seconds,
        **({"version_lag": total("actor_train", "version_lag") / trained,
            "version_lag_max": max((r["stats"].get("version_lag_max", 0.0) for r in leaders
                                    if r["role"] == "actor_train"), default=0.0)} if trained else {}),
        "busy": busy,
    }
