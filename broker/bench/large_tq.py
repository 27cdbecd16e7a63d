"""TransferQueue 0.1.11 (SimpleStorage) on the large workload, as its perftest runs it, in a child interpreter.

``broker bench --large`` starts ``python large_tq.py`` (the interpreter of ``--tq-python``, by default
its own) and speaks JSON lines with it: this file is the driver of a private Ray with a writer and a
reader actor, each calling ``tq.init`` (the writer's first, so it starts the controller and the
storage units) and then ``kv_batch_put`` / ``kv_list`` + ``kv_batch_get`` / ``kv_clear``, timed here
around ``ray.get`` exactly as perftest times them. Replies are printed on lines starting with
``@@bench`` (Ray and TransferQueue log to the same streams). Only stdlib, torch, tensordict, ray,
omegaconf and transfer_queue are imported: the interpreter may have no broker installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import sys
import time
from typing import Any

# Run as a script, this file's folder is sys.path[0], and its siblings would shadow the standard library
# (concurrent.py): it goes before anything else is imported.
_HERE = os.path.dirname(os.path.abspath(__file__))
if sys.path and os.path.abspath(sys.path[0] or ".") == _HERE:
    sys.path.pop(0)

try:
    from broker.bench.large_workload import STRING, LargeWorkload, checksum, make_batch
except ImportError:  # an interpreter without the broker: load the sibling module by its path
    _spec = importlib.util.spec_from_file_location("bench_large_workload", os.path.join(_HERE, "large_workload.py"))
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["bench_large_workload"] = _module
    _spec.loader.exec_module(_module)
    STRING, LargeWorkload, checksum, make_batch = (  # type: ignore[misc]
        _module.STRING, _module.LargeWorkload, _module.checksum, _module.make_batch)

TAG = "@@bench "
PARTITION = "bench_large"


class TQClient:
    """One side of perftest's ``TQClientActor``: the batch as a TensorDict, and the four calls."""

    def __init__(self, workload: dict[str, Any], conf: dict[str, Any]):
        import torch
        from tensordict import NonTensorStack, TensorDict

        self.w = LargeWorkload(**workload)
        self.conf = conf
        self.keys = [f"test_key_{i}" for i in range(self.w.batch)]
        self.data: Any = None
        self.last: Any = None
        self._torch, self._tensordict, self._nontensor = torch, TensorDict, NonTensorStack

    def initialize(self, writer: bool) -> None:
        import transfer_queue as tq
        from omegaconf import OmegaConf

        tq.init(OmegaConf.create(self.conf))
        if writer:
            batch = make_batch(self.w)
            td = self._tensordict(batch_size=(self.w.batch,))
            for name, kind in self.w.columns():
                value = batch[name]
                if kind == STRING:
                    td.set(name, self._nontensor.from_list(value))
                elif isinstance(value, list):  # ragged: a jagged nested tensor, as perftest builds it
                    td.set(name, self._torch.nested.as_nested_tensor(value, layout=self._torch.jagged))
                else:
                    td.set(name, value)
            self.data = td

    def expected(self) -> dict[str, int]:
        return checksum(self._plain(self.data), self.w.names())

    def put(self) -> None:
        import transfer_queue as tq

        tq.kv_batch_put(keys=self.keys, partition_id=PARTITION, fields=self.data)

    def list_keys(self) -> list[str]:
        import transfer_queue as tq

        return list(tq.kv_list(partition_id=PARTITION).get(PARTITION, {}).keys())

    def get(self, keys: list[str]) -> None:
        import transfer_queue as tq

        self.last = None
        self.last = tq.kv_batch_get(keys=keys, partition_id=PARTITION)

    def got(self, keys: list[str]) -> dict[str, int]:
        """Checksums of the last get, its rows put back in the writer's key order."""
        order = [keys.index(k) for k in self.keys]
        plain = self._plain(self.last)
        reordered = {n: [v[i] for i in order] if isinstance(v, list) else v[order] for n, v in plain.items()}
        return checksum(reordered, self.w.names())

    def _plain(self, td: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, kind in self.w.columns():
            value = td.get(name)
            if kind == STRING:
                out[name] = list(value.tolist() if hasattr(value, "tolist") else value)
            elif getattr(value, "is_nested", False):
                out[name] = list(value.unbind())
            else:
                out[name] = value
        return out

    def clear(self, keys: list[str]) -> None:
        import transfer_queue as tq

        tq.kv_clear(keys=keys, partition_id=PARTITION)

    def close(self) -> None:
        import transfer_queue as tq

        tq.close()


def _reply(**fields: Any) -> None:
    print(TAG + json.dumps(fields), flush=True)


def main() -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray: Any = importlib.import_module("ray")  # untyped where it matters here (actor handles)

    if "bench_large_workload" in sys.modules:  # Ray's workers cannot import it by name: send it along
        ray.cloudpickle.register_pickle_by_value(sys.modules["bench_large_workload"])
    start = json.loads(sys.stdin.readline())
    conf = {"backend": {"storage_backend": "SimpleStorage", "SimpleStorage": {"total_storage_size": None}}}
    # TransferQueue's controller and each of its two storage units claim a whole CPU: a 2-core machine
    # could not place them. Claims are bookkeeping only (every process shares the machine's cores), so
    # Ray is told of at least 4.
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR, _node_ip_address="127.0.0.1")
    # perftest's placement: a sliver of a CPU each, on this node.
    actor = ray.remote(TQClient).options(num_cpus=0.001)
    writer = actor.remote(start["workload"], conf)
    reader = actor.remote(start["workload"], conf)
    ray.get(writer.initialize.remote(True))  # first: it starts the controller and the storage units
    ray.get(reader.initialize.remote(False))
    _reply(ok=True, version=_version())
    keys: list[str] = []
    for line in sys.stdin:
        op = json.loads(line)["op"]
        began = time.perf_counter()
        if op == "put":
            ray.get(writer.put.remote())
            _reply(seconds=time.perf_counter() - began)
        elif op == "get":
            keys = ray.get(reader.list_keys.remote())  # untimed, as in perftest
            began = time.perf_counter()
            ray.get(reader.get.remote(keys))
            _reply(seconds=time.perf_counter() - began)
        elif op == "check":
            _reply(expected=ray.get(writer.expected.remote()), got=ray.get(reader.got.remote(keys)))
        elif op == "clear":
            if keys:
                ray.get(writer.clear.remote(keys))
            keys = []
            _reply(ok=True)
        elif op == "close":
            ray.get([writer.close.remote(), reader.close.remote()])
            ray.shutdown()
            _reply(ok=True)
            return 0
    ray.shutdown()
    return 0


def _version() -> str:
    from importlib.metadata import version

    return version("transferqueue")


if __name__ == "__main__":
    sys.exit(main())
