"""The broker as the benchmark measures it: the public TransferDock API and nothing else."""

from __future__ import annotations

import redis

from broker.api.dock import TransferDock
from broker.api.partitioned import PartitionedDock
from broker.bench.docks import SampleError, dock_target
from broker.bench.workload import COLUMNS, Rows, Workload


class BrokerDock:
    """A TransferDock holding the global batch; calls are exactly what a worker would make."""

    def __init__(self, url: str, name: str, workload: Workload, *, wait_replicas: int = 0, policy: str = "fifo",
                 partitions: int = 1):
        """``policy="random"``: sampling as the MindSpeed adapter asks for it (MindSpeed samples at random),
        the native call the adapter's cost is measured against. ``partitions`` > 1: a partitioned dock."""
        self.dock: TransferDock | PartitionedDock = TransferDock(
            dock_target(url), name, prompts_num=workload.prompts, n_samples_per_prompt=workload.n,
            columns=list(COLUMNS), consumers=list(workload.consumers), wait_replicas=wait_replicas, policy=policy,
            partitions=partitions)
        self.dock.clear()  # a dock left by an interrupted run of the same name

    def put(self, data: Rows, rows: list[int]) -> None:
        self.dock.put_experience(data, indexes=rows)

    def get(self, consumer: str, columns: tuple[str, ...], count: int) -> tuple[Rows, list[int]]:
        batch, rows = self.dock.get_experience(consumer, list(columns), count)
        if batch is None or rows is None:
            raise SampleError(f"{consumer}: fewer than {count} rows ready in {columns}")
        return batch, rows

    def reset(self) -> None:
        self.dock.clear()

    def close(self) -> None:
        delete_dock(self.dock)


def delete_dock(dock: TransferDock | PartitionedDock) -> None:
    """Delete a dock and the replies its sampling calls keep for retries, then close it.

    ``delete()`` leaves those reply keys to expire (a minute); on a user's server the benchmark
    takes them away at once (on a cluster they are in the dock's slot, so on one primary; a partitioned
    dock's in each partition's), where its user may SCAN (a worker confined by ``broker acl`` may not: its
    replies expire).
    """
    client = dock.client
    parts = dock.partitions if isinstance(dock, PartitionedDock) else (dock,)
    try:
        dock.delete()
        try:
            replies = [key for part in parts for key in client.scan_iter(match=part.keys.reply_pattern, count=1000)]
        except redis.exceptions.NoPermissionError:
            replies = []
        for first in range(0, len(replies), 1000):
            client.delete(*replies[first : first + 1000])
    finally:
        dock.close()  # a URL's client is shared by every dock of it: the last dock's close closes it
        if isinstance(client, redis.Redis):
            # A client the bench made itself (dock_target, for unix sockets) is not the dock's to close. For a
            # plain client closing only drops its pooled connections, so a shared one is not harmed; a
            # RedisCluster's close would drop its map of the nodes under the other docks sharing it.
            client.close()
