"""The driver: one global batch per iteration, through the dock, drained by all of the algorithm's roles at once.

Per iteration the driver puts the prompts (each repeated n times), tells every rank of every role
to run, and waits. The roles do not wait for the driver between stages: each pulls ready rows from
the dock as soon as an earlier stage has written them, so rollout, log-probs, reward, advantage and
training overlap. When every role has consumed every row, each trainer's new weights go to the roles
that follow it (the actor's to the rollout and log-prob ranks, the critic's to its value ranks) for
the next iteration, and the driver clears the dock. Under DAPO's dynamic sampling the driver also puts
new prompts into the groups the advantage stage drops, while the iteration runs.

Weights travel through Ray's object store, not the broker: they are one ~2 MB blob per iteration
read by every model rank at once, not per-row experience with ready/consumed status; Ray keeps one
shared-memory copy per node that actors read without a copy of their own and ships it between nodes
itself, while in the dock they would need a column no consumer drains and would be wiped by clear().
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import ray
import torch

from broker import Rollout, TransferDock
from broker.api.batches import put_prompts_experience

from ..config import RunConfig
from ..model import task
from . import checkpoint as checkpoints
from .checkpoint import Checkpoint, CheckpointError
from .cluster import WorkerGroup, cpus_per_rank, wait_all

log = logging.getLogger(__name__)


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
                        consumers=cfg.roles, length_columns=["prompt_length", "response_length"],
                        rollout=dock_rollout(cfg), partitions=cfg.partitions)
    dock.clear()  # a dock left by a crashed run with the same name and schema
    return dock


class Pipeline:
    """All worker groups of one run, and the loop that feeds them a global batch per iteration."""

    def __init__(self, dock: TransferDock, cfg: RunConfig, cluster_cpus: float) -> None:
        cfg.validate()
        self.dock = dock
        self.cfg = cfg
        self.cpus_per_rank = cpus_per_rank(cfg, cluster_cpus)
        self.groups: dict[str, WorkerGroup] = {}
        try:
            for role in cfg.roles:
                self.groups[role] = WorkerGroup(role, cfg, dock, self.cpus_per_rank)
            # All groups rendezvous at once: their set-ups are independent.
            setups = {role: g.setup() for role, g in self.groups.items()}
            done = iter(wait_all([ref for refs in setups.values() for ref in refs], timeout=300))
            #: Role -> each rank's set-up answer (its pid and host), kept current across restarts.
            self.hosts: dict[str, list[dict[str, Any]]] = {role: [next(done) for _ in refs]
                                                           for role, refs in setups.items()}
        except BaseException:
            self.shutdown()
            raise
        #: Worker groups restarted in this run (see ``_restart``).
        self.restarts = 0
        #: Trainer -> each rank's state (model and optimizer) when the current iteration began, held by the
        #: driver: what a trainer group restarted during it starts again from (see ``_restart``), and what a
        #: checkpoint holds; None before the first iteration.
        self._begun: dict[str, list[dict[str, Any]]] | None = None
        self.weights: dict[str, list[ray.ObjectRef]] = {}
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
            self._put_prompts(list(range(cfg.prompts)))
            return cfg.prompts
        put = 0
        while (groups := self.dock.reserve_groups(cfg.prompts, "prompts")) is not None:
            self._put_prompts(groups, is_prompt=True)
            put += cfg.prompts
        return put

    def _put_prompts(self, groups: list[int], is_prompt: bool = False) -> None:
        """Fresh prompts into ``groups``, each repeated n times (MindSpeed's layout)."""
        n = self.cfg.n
        prompts = task.make_prompts(len(groups), self._prompt_gen)
        rows = [g * n + j for g in groups for j in range(n)]
        data, indexes = put_prompts_experience({"prompts": prompts}, n, indexes=rows)
        kwargs = {"is_prompt": True} if is_prompt else {}
        self.dock.put_experience({"prompts": data["prompts"], "prompt_length": data["prompt_length"]}, indexes,
                                 **kwargs)

    def refill(self) -> int:
        """Dynamic sampling: new prompts into every group the advantage stage dropped; returns how many.

        A dropped group is free (no prompt written, not claimed) as soon as its drop returns, and nothing
        else holds its rows (see ``algorithms/dapo.py``); ``reserve_groups`` claims it so two drivers, or a
        driver polling twice, never fill one group twice.
        """
        put = 0
        while (groups := self.dock.reserve_groups(1, "prompts")) is not None:
            self._put_prompts(groups)
            put += 1
        return put

    def _wait(self, refs: dict[str, list[ray.ObjectRef]], iteration: int) -> tuple[list[dict[str, Any]], int]:
        """Every rank's result, in role order; a group whose worker died restarted on the way (``_restart``),
        and under dynamic sampling, dropped groups refilled meanwhile (returns how many)."""
        timeout = self.cfg.stall_seconds + 60
        dynamic = self.cfg.algorithm.dynamic_sampling
        refilled = 0
        owner = {ref: role for role, role_refs in refs.items() for ref in role_refs}
        pending = list(owner)
        deadline = time.monotonic() + timeout
        while pending:
            # Every rank's task is a loop on the dock: done, it is done for good, so polling ray.wait is safe.
            ready, pending = ray.wait(pending, num_returns=1, timeout=0.05 if dynamic else timeout)
            for ref in ready:
                try:
                    ray.get(ref)  # a failed rank raises now, not after the others stall
                except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                    role = owner[ref]
                    gone = set(refs[role])
                    pending = [r for r in pending if r not in gone]
                    refs[role] = self._restart(role, iteration, exc)
                    owner.update({r: role for r in refs[role]})
                    pending += refs[role]
            added = self.refill() if dynamic else 0
            refilled += added
            if ready or added:
                deadline = time.monotonic() + timeout
            elif time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} worker tasks made no progress for {timeout:.0f} s")
        return ray.get([ref for role_refs in refs.values() for ref in role_refs]), refilled

    def _restart(self, role: str, iteration: int, error: BaseException) -> list[ray.ObjectRef]:
        """Replace ``role``'s whole group after one of its workers died (or failed), and start the iteration
        again on it; returns the new ranks' tasks.

        The whole group, not the one rank: its ranks share torch.distributed groups, which cannot take in a
        new process, and a rank blocked in a collective with the dead one never returns. So the driver kills
        every rank and places a new group (Ray's own actor restarts would bring back one process into
        collectives that no longer exist). Then:

        - its rows go back to the role at once (``reclaim(all_leases=True)``): every holder is dead, and a
          rank that was not is fenced, its late result refused;
        - a trainer starts the iteration again from the state its group had when the iteration began
          (model and optimizer, exported then), and every row is offered to it again (``reset_consumer``):
          the updates of the dead group are gone with it, so each row is trained once in what remains;
        - a role that follows a trainer gets the weights the iteration began with; the others their seed's.
        """
        cfg = self.cfg
        if not cfg.lease_seconds or self.restarts >= cfg.max_restarts:
            raise error
        self.restarts += 1
        log.warning("%s: a worker failed in iteration %d (%s); restarting the group (%d of at most %d restarts)",
                    role, iteration, str(error).splitlines()[0][:200], self.restarts, cfg.max_restarts)
        self.groups[role].shutdown()
        group = self.groups[role] = WorkerGroup(role, cfg, self.dock, self.cpus_per_rank)
        self.hosts[role] = wait_all(group.setup(), timeout=300)
        if self._begun and self._begun.get(role):
            wait_all(group.load_state(self._begun[role]), timeout=300)
            self.dock.reset_consumer(role)
        self.dock.reclaim(role, all_leases=True)
        return group.run_iteration(iteration, self._weights_of(cfg.algorithm.follows.get(role, "")))

    def run_iteration(self, iteration: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Put a global batch, let every role drain it, fetch the new weights; returns (metrics, per-rank results).

        The dock is left as the roles left it (every row consumed by every role); ``clear`` empties it.
        """
        prompts_put = self.put_prompts()
        start = time.time()
        if self._begun is None:  # the trainers' state before their first step (later: after each iteration)
            states, failed = self._trainer_states()
            if failed:
                raise next(iter(failed.values()))  # nothing trained yet: nothing to restart from
            self._begun = states
        follows = self.cfg.algorithm.follows
        refs = {role: group.run_iteration(iteration, self._weights_of(follows.get(role, "")))
                for role, group in self.groups.items()}
        results, refilled = self._wait(refs, iteration)
        # The trainers' new weights (for the roles that follow them) and state (for a restart in the next
        # iteration), both checked: a trainer that died after its last step, before these, lost the
        # iteration's updates with it, and trains the iteration again.
        while True:
            weights = {t: self.groups[t].export_weights() for t in self.cfg.algorithm.trainers}
            states, failed = self._trainer_states(weights)
            if not failed:
                break
            for role, error in failed.items():
                refs[role] = self._restart(role, iteration, error)
            results, more = self._wait(refs, iteration)
            refilled += more
        seconds = time.time() - start
        # Resolved inside the following actors when the next iteration starts.
        self.weights = weights
        self._begun = states
        metrics = summarize(iteration, start, seconds, results, self.cfg)
        if self.cfg.algorithm.dynamic_sampling:
            metrics["prompts_put"] = prompts_put + refilled
            filter_role = self.cfg.algorithm.filter_role
            metrics["dropped_by_dock"] = int(self.dock.status()["discarded"].get(filter_role, 0))
        if self.cfg.tracked:
            metrics.update(self._dock_metrics(prompts_put))
        metrics["restarts"] = self.restarts
        return metrics, results

    def _weights_of(self, trainer: str) -> ray.ObjectRef | None:
        """The latest weights of ``trainer`` (its first rank's export), or None before its first iteration."""
        refs = self.weights.get(trainer)
        return refs[0] if refs else None

    def _trainer_states(
        self, weights: dict[str, list[ray.ObjectRef]] | None = None,
    ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, BaseException]]:
        """Every trainer rank's state (what a restart and a checkpoint start from), fetched, with the exports of
        ``weights`` waited for; and the error of each trainer whose group could not give them."""
        refs = {t: self.groups[t].export_state() for t in self.cfg.algorithm.trainers}
        states: dict[str, list[dict[str, Any]]] = {}
        failed: dict[str, BaseException] = {}
        for trainer, ranks in refs.items():
            try:
                states[trainer] = wait_all([*ranks, *(weights or {}).get(trainer, [])], timeout=300)[:len(ranks)]
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
                failed[trainer] = exc
        return states, failed

    def checkpoint(self, iteration: int, records: list[dict[str, Any]]) -> Checkpoint:
        """What a run resumes from after ``iteration``, but the dock's rows (see ``save_checkpoint``)."""
        assert self._begun is not None, "run_iteration first"
        return Checkpoint(iteration=iteration, records=list(records), dock=self.dock.name,
                          fingerprint=self.dock.fingerprint, restarts=self.restarts, trainers=self._begun,
                          prompt_generator=self._prompt_gen.get_state())

    def save_checkpoint(self, folder: Path, iteration: int, records: list[dict[str, Any]]) -> None:
        """Write what a run resumes from after ``iteration`` into ``folder`` (``workers/runtime/checkpoint.py``):
        call it after ``run_iteration`` and ``clear``, with every iteration's metrics so far. The dock's keys
        go with it when its rows outlive an iteration; no worker runs then, so they are the rows the next
        iteration starts from."""
        checkpoints.save(folder, self.checkpoint(iteration, records), dock=self.dock if self.cfg.tracked else None)

    def restore(self, checkpoint: Checkpoint) -> None:
        """Take up a run where ``checkpoint`` left it: the trainers' models and optimizers, the weights the
        roles that follow them get, the prompts still to come, and the dock's rows when they outlive an
        iteration; the next iteration is checkpoint's + 1."""
        missing = set(self.cfg.algorithm.trainers) - set(checkpoint.trainers)
        ranks = {t: len(self.groups[t].actors) for t in checkpoint.trainers if t in self.groups}
        if missing or any(len(checkpoint.trainers[t]) != n for t, n in ranks.items()):
            raise CheckpointError(
                f"the checkpoint holds trainers {sorted((t, len(s)) for t, s in checkpoint.trainers.items())} "
                f"(name, ranks); this run has {sorted(ranks.items())}: resume with the layout the run had")
        self._begun = checkpoint.trainers
        wait_all([ref for t, states in self._begun.items() for ref in self.groups[t].load_state(states)], timeout=300)
        self.weights = {t: self.groups[t].export_weights() for t in self.cfg.algorithm.trainers}
        wait_all([ref for refs in self.weights.values() for ref in refs], timeout=300)
        self._prompt_gen.set_state(checkpoint.prompt_generator)
        self.restarts = checkpoint.restarts
        if self.cfg.tracked:
            # Whatever the dock held when the run died (groups of the iteration lost, trained or not) goes:
            # the rows, ages, version and admission count come back as the next iteration must find them.
            checkpoints.restore_dock(checkpoint, self.dock)
            self._dropped = int(self.dock.status()["discarded"].get("stale", 0))

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

    def per_step(role: str, keys: tuple[str, ...]) -> dict[str, float]:
        steps = max(total(role, "steps"), 1.0)
        return {k: total(role, k) / steps for k in keys}

    rows = cfg.capacity
    trained = total("actor_train", "trained_rows")
    tokens = total("actor_rollout", "tokens")
    # Rows the reward stage scored: more than the batch when dynamic sampling replaced dropped groups.
    scored = max(total("rule_reward", "rows"), 1.0)
    busy = sorted(
        ([r["role"], r["dp_rank"], b0, b1] for r in leaders for b0, b1 in r["busy"]), key=lambda b: b[2]
    )
    busy_seconds = {role: 0.0 for role in cfg.roles}
    for role, _, b0, b1 in busy:
        busy_seconds[role] += b1 - b0
    out: dict[str, Any] = {
        "iteration": iteration,
        "algo": cfg.algo,
        "start": start,
        "seconds": seconds,
        "rows": rows,
        "reward": total("rule_reward", "reward_sum") / scored,
        "exact": total("rule_reward", "exact") / scored,
        "response_length": total("rule_reward", "response_tokens") / scored,
        "samples_per_s": rows / seconds,
        "tokens_per_s": tokens / seconds,
        **per_step("actor_train", ("kl", "clip_frac", "pg_loss", "ratio", "grad_norm")),
        # Optimizer steps of the model: DP replicas step together, each counted its own.
        "train_steps": int(total("actor_train", "steps")) // cfg.layout("actor_train").dp,
        # What the trainer took in this iteration: rows, and a sum over them of a CRC of (row, prompt), the
        # same for a run that was killed and resumed as for one that was not (tests/examples/test_resume.py).
        "ledger": {"rows": int(total("actor_train", "ledger_rows")),
                   "prompts": int(total("actor_train", "ledger_sum"))},
        "busy_seconds": busy_seconds,
        **({"version_lag": total("actor_train", "version_lag") / trained,
            "version_lag_max": max((r["stats"].get("version_lag_max", 0.0) for r in leaders
                                    if r["role"] == "actor_train"), default=0.0)} if trained else {}),
        "busy": busy,
    }
    if "critic_train" in cfg.roles:
        out.update(per_step("critic_train", ("value_loss", "value_mean", "return_mean")))
        out["critic_steps"] = int(total("critic_train", "steps")) // cfg.layout("critic_train").dp
        out["kl"] = total("rule_reward", "kl_sum") / max(total("rule_reward", "kl_tokens"), 1.0)
    if cfg.algorithm.dynamic_sampling:
        out["filtered_groups"] = int(total(cfg.algorithm.filter_role, "filtered_groups"))
        out["judged_groups"] = int(total(cfg.algorithm.filter_role, "judged_groups"))
        out["overlong_rows"] = int(total("rule_reward", "overlong_rows"))
    return out
