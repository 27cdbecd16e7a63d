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

from broker import TransferDock
from broker.experience import put_prompts_experience

from . import task
from .cluster import WorkerGroup, cpus_per_rank, wait_all
from .config import COLUMNS, ROLES, SYNCED_ROLES, RunConfig


def create_dock(url: str, name: str, cfg: RunConfig) -> TransferDock:
    """The run's dock: one row per (prompt, sample), every role a consumer. Emptied if it existed."""
    dock = TransferDock(url, name, prompts_num=cfg.prompts, n_samples_per_prompt=cfg.n, columns=COLUMNS,
                        consumers=ROLES)
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

    def put_prompts(self) -> None:
        """This iteration's global batch: fresh prompts, each repeated n times (MindSpeed's layout)."""
        prompts = task.make_prompts(self.cfg.prompts, self._prompt_gen)
        data, indexes = put_prompts_experience({"prompts": prompts}, self.cfg.n)
        self.dock.put_experience({"prompts": data["prompts"], "prompt_length": data["prompt_length"]}, indexes)

    def run_iteration(self, iteration: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Put a global batch, let every role drain it, fetch the new weights; returns (metrics, per-rank results).

        The dock is left as the roles left it (every row consumed by every role); ``clear`` empties it.
        """
        self.put_prompts()
        start = time.time()
        refs = []
        for role, group in self.groups.items():
            refs += group.run_iteration(iteration, self.weights if role in SYNCED_ROLES else None)
        results = wait_all(refs, timeout=self.cfg.stall_seconds + 60)
        seconds = time.time() - start
        # Submitted now, resolved inside the rollout and log-prob actors when the next iteration starts.
        self.weights = self.groups["actor_train"].export_weights()
        return summarize(iteration, start, seconds, results, self.cfg), results

    def clear(self) -> None:
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
        "response_length": tokens / rows,
        "samples_per_s": rows / seconds,
        "tokens_per_s": tokens / seconds,
        **{k: total("actor_train", k) / steps for k in ("kl", "clip_frac", "pg_loss", "ratio", "grad_norm")},
        # Optimizer steps of the model: DP replicas step together, each counted its own.
        "train_steps": int(total("actor_train", "steps")) // cfg.layouts["actor_train"].dp,
        "busy_seconds": busy_seconds,
        "busy": busy,
    }
