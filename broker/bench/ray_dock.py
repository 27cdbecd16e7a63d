"""The single-actor dock as MindSpeed-RL deploys it: one Ray actor, every call ``ray.get(dock.m.remote(...))``.

Workers pad a batch before a put and unpad after a get (``collect_transfer_dock_data`` and
``dispatch_transfer_dock_data``), so the benchmark does too. MindSpeed fires puts without waiting;
here they are awaited, so each put's cost lands in the stage that made it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from broker.bench.docks import ActorCalls
from broker.bench.mindspeed import MindSpeedGRPOTransferDock
from broker.bench.workload import COLUMNS, Workload

#: MindSpeed declares ``@ray.remote(max_concurrency=100, num_cpus=10)``; CPUs are only a scheduling
#: claim, and 10 would not fit on a 2-core machine, so the actor claims none.
ACTOR_OPTIONS = {"max_concurrency": 100, "num_cpus": 0}


def start_ray() -> bool:
    """Start a private local Ray unless one is running; True if this call started it."""
    import ray

    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # address="local": a cluster of our own, even when another one runs on this machine (ray.init()
    # would join it, and the baseline's actor would share its CPUs with someone else's job).
    # On the loopback address: the concurrent mode's stage processes join it there.
    ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR, object_store_memory=1 << 30, _node_ip_address="127.0.0.1")
    return True


@contextlib.contextmanager
def ray_for_modes(needed: bool) -> Iterator[None]:
    """One private Ray for every mode and system of a run that needs it (``needed``), stopped at the end.

    Each Ray system starts Ray itself when none runs, and stops it when done: run one after another,
    the pipeline mode's and the concurrent mode's two Ray systems started and stopped it three times,
    seconds each on a small machine, for nothing the figures show (start-up is never timed)."""
    if not needed:
        yield
        return
    import ray

    started = start_ray()
    try:
        yield
    finally:
        if started:
            ray.shutdown()


class RayDock(ActorCalls):
    """Client side of the actor, with the padding a MindSpeed worker does around each call."""

    def __init__(self, workload: Workload, seed: int = 0):
        import ray

        started = start_ray()
        actor = ray.remote(MindSpeedGRPOTransferDock).options(**ACTOR_OPTIONS)
        super().__init__(ray, actor.remote(workload.prompts, workload.n, list(COLUMNS), list(workload.consumers), seed),
                         started)
        self.call("all_consumed", workload.consumers[0])  # up yet?

    def close(self) -> None:
        self.stop()
