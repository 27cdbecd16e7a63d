"""``broker.mindspeed.GRPOTransferDock`` as the benchmark measures it, two ways MindSpeed users run it.

``adapter``: one object in each process, straight to Redis (the recommended way). ``adapter-ray``:
the same class wrapped as one Ray actor that every call goes through, as MindSpeed deploys its own
dock, so existing ``ray.get(td.m.remote(...))`` code runs unchanged. Both pad before a put and unpad
after a get, as MindSpeed's workers do (and as the ``ray`` baseline does).
"""

from __future__ import annotations

from typing import Any

from ..dock import TransferDock
from ..experience import padding_dict_to_tensor_dict, remove_padding_tensor_dict_to_dict
from ..mindspeed import GRPOTransferDock
from .broker_dock import delete_dock
from .docks import SampleError, dock_target
from .workload import COLUMNS, Rows, Workload


def open_adapter(url: str, name: str, workload: Workload) -> GRPOTransferDock:
    """The adapter's dock for the workload: MindSpeed's columns and consumers plus the workload's."""
    return GRPOTransferDock(workload.prompts, workload.n, addition_columns=list(COLUMNS),
                            addition_consumers=list(workload.consumers), url=dock_target(url), name=name)


class AdapterDock:
    """A per-process ``GRPOTransferDock``: MindSpeed's calls, no actor hop."""

    def __init__(self, url: str, name: str, workload: Workload):
        self.td: Any = open_adapter(url, name, workload)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.td, method)(*args, **kwargs)

    def put(self, data: Rows, rows: list[int]) -> None:
        self.call("put_experience", data_dict=padding_dict_to_tensor_dict(data), indexes=rows)

    def get(self, consumer: str, columns: tuple[str, ...], count: int) -> tuple[Rows, list[int]]:
        batch, rows = self.call("get_experience", consumer, list(columns), count)
        if rows is None:
            raise SampleError(f"{consumer}: fewer than {count} rows ready in {columns}")
        return remove_padding_tensor_dict_to_dict(batch), rows

    def reset(self) -> None:
        self.call("clear")

    def close(self) -> None:
        delete_dock(self.td.dock)


class AdapterRayDock(AdapterDock):
    """The adapter inside one Ray actor, every call ``ray.get(actor.m.remote(...))``."""

    def __init__(self, url: str, name: str, workload: Workload):
        import ray

        self.url, self.name = url, name
        from .ray_dock import ACTOR_OPTIONS, start_ray

        self._ray = ray
        self.started_ray = start_ray()
        actor = ray.remote(GRPOTransferDock).options(**ACTOR_OPTIONS)
        self.td = actor.remote(workload.prompts, workload.n, addition_columns=list(COLUMNS),
                               addition_consumers=list(workload.consumers), url=url, name=name)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._ray.get(getattr(self.td, method).remote(*args, **kwargs))

    def close(self) -> None:
        self._ray.kill(self.td)
        if self.started_ray:
            self._ray.shutdown()
        delete_dock(TransferDock.attach(dock_target(self.url), self.name))
