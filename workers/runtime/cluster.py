"""Ray side of the workers: starting or joining Ray, and placing each role's group with a placement group."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from broker import TransferDock

from ..config import RunConfig
from .worker import RoleWorker

RemoteWorker = ray.remote(RoleWorker)


def start_ray(address: str | None, cpus: int | None) -> str:
    """Join the Ray cluster at ``address``, or start a private one with ``cpus`` CPUs; says which."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    quiet: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address:
        ray.init(address=address, **quiet)
        return f"joined the Ray cluster at {address} ({ray.cluster_resources().get('CPU', 0):g} CPUs)"
    cpus = cpus or os.cpu_count() or 1
    # A private cluster gets Ray's default token auth; its notice about that default is noise here.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    # The dashboard and a large object store are of no use here; the weights are ~2 MB per iteration.
    ray.init(num_cpus=cpus, include_dashboard=False, object_store_memory=256 * 1024 * 1024, **quiet)
    return f"started a local Ray with {cpus} CPUs"


def wait_for_cpus(minimum: float, timeout: float = 120.0) -> float:
    """The cluster's CPU count, once at least ``minimum`` have joined (worker containers start late)."""
    deadline = time.monotonic() + timeout
    while True:
        cpus = float(ray.cluster_resources().get("CPU", 0))
        if cpus >= minimum or time.monotonic() > deadline:
            return cpus
        time.sleep(1.0)


class WorkerGroup:
    """The ``dp x tp`` actors of one role, in one placement group, joined in one torch.distributed world.

    One bundle per rank, packed: a TP group's ranks are contiguous, so PACK keeps them on one node
    as long as they fit, where the per-layer all-reduces are cheapest.
    """

    def __init__(self, role: str, cfg: RunConfig, dock: TransferDock, cpus_per_rank: float) -> None:
        self.role = role
        self.layout = cfg.layout(role)
        bundles = [{"CPU": cpus_per_rank} for _ in range(self.layout.world)]
        self.placement = placement_group(bundles, strategy="PACK")
        ray.get(self.placement.ready(), timeout=300)
        self.actors = [
            RemoteWorker.options(
                num_cpus=cpus_per_rank,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=i),
            ).remote(role, cfg, dock, i)
            for i in range(self.layout.world)
        ]

    def setup(self) -> list[ray.ObjectRef]:
        """Start every rank's process-group set-up; they rendezvous at rank 0's address."""
        addr, port = ray.get(self.actors[0].address.remote()) if self.layout.world > 1 else (None, None)
        return [a.setup.remote(addr, port) for a in self.actors]

    def run_iteration(self, iteration: int, weights: ray.ObjectRef | None) -> list[ray.ObjectRef]:
        # An ObjectRef argument is resolved inside each actor: the weights go object store -> actor,
        # never through the driver.
        return [a.run_iteration.remote(iteration, weights) for a in self.actors]

    def export_state(self) -> list[ray.ObjectRef]:
        """Refs to every rank's trainer state, in rank order (what a restarted group loads)."""
        return [a.export_state.remote() for a in self.actors]

    def load_state(self, states: list[dict[str, Any]]) -> list[ray.ObjectRef]:
        """Every rank loads the state its predecessor in the same place exported."""
        return [a.load_state.remote(state) for a, state in zip(self.actors, states)]

    def export_weights(self) -> list[ray.ObjectRef]:
        """Every rank's part of the weights export (it is a TP collective); rank 0's ref holds the weights."""
        return [a.export_weights.remote() for a in self.actors]

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.placement)


def cpus_per_rank(cfg: RunConfig, cluster_cpus: float) -> float:
    """Fractional CPUs per rank so every role's every rank fits at once (they all run concurrently)."""
    ranks = sum(cfg.layout(role).world for role in cfg.roles)
    # Ray counts resources in 1e-4 units; round down so the sum never exceeds the cluster.
    return max(0.0001, int(cluster_cpus / ranks * 1e4) / 1e4)


def wait_all(refs: list[ray.ObjectRef], timeout: float) -> list[Any]:
    """Results of ``refs`` in order; the first failing task's error is raised as soon as it fails."""
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
        if not ready:
            raise TimeoutError(f"{len(pending)} worker tasks made no progress for {timeout:.0f} s")
        for ref in ready:
            results[index[ref]] = ray.get(ref)
    return results
