"""``broker.adapters.mindspeed.GRPOTransferDock`` as the benchmark measures it, two ways MindSpeed users run it.

``adapter``: one object in each process, straight to Redis (the recommended way). ``adapter-ray``:
the same class wrapped as one Ray actor that every call goes through, as MindSpeed deploys its own
dock, so existing ``ray.get(td.m.remote(...))`` code runs unchanged. Both pad before a put and unpad
after a get, as MindSpeed's workers do (and as the ``ray`` baseline does): see ``MindSpeedCalls``.
"""

from __future__ import annotations

from typing import Any

from broker.adapters.mindspeed import GRPOTransferDock
from broker.api.dock import TransferDock
from broker.bench.broker_dock import delete_dock
from broker.bench.docks import ActorCalls, MindSpeedCalls, dock_target
from broker.bench.workload import COLUMNS, Workload


def adapter_arguments(workload: Workload) -> dict[str, Any]:
    """The adapter's dock for the workload: MindSpeed's columns and consumers plus the workload's."""
    return {"prompts_num": workload.prompts, "n_samples_per_prompt": workload.n,
            "addition_columns": list(COLUMNS), "addition_consumers": list(workload.consumers)}


class AdapterDock(MindSpeedCalls):
    """A per-process ``GRPOTransferDock``: MindSpeed's calls, no actor hop."""

    def __init__(self, url: str, name: str, workload: Workload):
        self.td = GRPOTransferDock(**adapter_arguments(workload), url=dock_target(url), name=name)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.td, method)(*args, **kwargs)

    def close(self) -> None:
        delete_dock(self.td.dock)


class AdapterRayDock(ActorCalls):
    """The adapter inside one Ray actor, every call ``ray.get(actor.m.remote(...))``."""

    def __init__(self, url: str, name: str, workload: Workload):
        import ray

        from broker.bench.ray_dock import ACTOR_OPTIONS, start_ray

        self.url, self.name = url, name
        started = start_ray()
        actor = ray.remote(GRPOTransferDock).options(**ACTOR_OPTIONS)
        super().__init__(ray, actor.remote(**adapter_arguments(workload), url=url, name=name), started)

    def close(self) -> None:
        self.stop()
        delete_dock(TransferDock.attach(dock_target(self.url), self.name))
