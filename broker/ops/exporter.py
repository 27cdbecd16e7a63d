"""``broker exporter``: every dock on one Redis server as Prometheus metrics, served on ``/metrics``.

Each scrape is one round trip to Redis in the steady state: the status of every dock (one call of
the status script per dock, as ``broker status``) and this scrape's share of memory samples, in one
pipeline. The docks' schemas are kept between scrapes; the server is scanned for new docks at most
every ``rescan_seconds`` (see :class:`~broker.control.status.Survey`).

Memory is sampled, not summed over every key: ``MEMORY USAGE`` costs the server a walk of the key's
sampled elements, so each scrape measures at most ``memory_keys`` keys, taking the docks' keys in
turn, and a dock's ``broker_dock_memory_bytes`` is the sum of the latest measure of each of its keys,
reported once every key of it has been measured (after ``ceil(keys / memory_keys)`` scrapes; about
20 keys per dock, so 1,000 docks take 80 scrapes at the default 256). ``MEMORY USAGE ... SAMPLES 5``
estimates a hash from 5 of its fields, which is close for a column's rows of one shape. A user
without the MEMORY command (an ACL-confined exporter) gets no memory metric, and a warning once.

A dock whose keys hold what no broker writes, or whose meta vanished under a named dock, is counted
in ``broker_dock_errors_total`` and reported as ``broker_dock_up 0``; the scrape itself goes on. A
Redis server that cannot be reached gives ``broker_up 0`` and the last scrape's duration, not an
HTTP error, so the alert says "Redis down", not "exporter down".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import prometheus_client
import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry
from redis.client import Pipeline

from broker.connection import Client, bounded
from broker.control.keys import DockKeys, partition_of_name
from broker.control.status import DockRef, Survey
from broker.errors import BrokerError

log = logging.getLogger(__name__)

#: HTTP port of ``broker exporter`` (the scrape config of docs/operations.md uses it).
DEFAULT_PORT = 9808

#: The longest a scrape waits for Redis (Prometheus's default scrape_timeout).
SCRAPE_SECONDS = 10.0

#: Keys whose memory one scrape measures at most.
MEMORY_KEYS_PER_SCRAPE = 256

#: Elements ``MEMORY USAGE`` looks at in a hash (Redis's own default).
MEMORY_SAMPLES = 5

#: End of the name under which a sharded dock's data hash of the current epoch is measured.
EPOCH_FIELD = "<epoch>"


class MemorySampler:
    """Measures a bounded share of the docks' keys per scrape and remembers every key's latest size.

    A sharded dock's bytes are in its data shards' hashes of the current epoch (``td:{NAME~S}:data:COLUMN:
    EPOCH``), whose names change with every whole clear: they are kept under a name ending in
    ``EPOCH_FIELD``, measured under the epoch read just before (one more round trip, in a scrape that
    measures some of them), and a hash's latest measure stands for it until it is measured again.
    """

    def __init__(self, keys_per_scrape: int = MEMORY_KEYS_PER_SCRAPE, client: Client | None = None):
        self.keys_per_scrape = keys_per_scrape
        self.enabled = keys_per_scrape > 0
        self._client = client  # reads the epochs of sharded docks; None: their data hashes are not measured
        self._sizes: dict[str, int] = {}  # key -> bytes at its latest measure
        self._turn = 0  # where in the list of every dock's keys the next scrape starts
        self._queued: list[str] = []
        self._keys: dict[DockRef, list[str]] = {}  # each known dock's keys, built once: scrapes come often
        self._epoch_keys: dict[str, str] = {}  # a data shard hash's name with EPOCH_FIELD -> its dock's epoch key

    def queue(self, pipe: Pipeline, refs: Sequence[DockRef]) -> None:
        """Queue this scrape's ``MEMORY USAGE`` commands for some of ``refs``'s keys on ``pipe``."""
        self._queued = []
        if not self.enabled:
            return
        self._keys = {ref: self._keys.get(ref) or self._keys_of(ref) for ref in refs}
        every = [key for keys in self._keys.values() for key in keys]
        if not every:
            return
        live = set(every)
        for gone in [k for k in self._sizes if k not in live]:  # deleted docks, or a schema that lost a column
            del self._sizes[gone]
        self._epoch_keys = {k: epoch for k, epoch in self._epoch_keys.items() if k in live}
        start = self._turn % len(every)
        self._queued = (every[start:] + every[:start])[: self.keys_per_scrape]
        self._turn = start + len(self._queued)
        epochs = self._epochs([self._epoch_keys[k] for k in self._queued if k in self._epoch_keys])
        for key in self._queued:
            if key in self._epoch_keys:
                key = key.removesuffix(EPOCH_FIELD) + str(epochs[self._epoch_keys[key]])
            pipe.execute_command("MEMORY", "USAGE", key, "SAMPLES", MEMORY_SAMPLES)

    def _keys_of(self, ref: DockRef) -> list[str]:
        """The dock's keys to measure: those of its slot, and its data shards' hashes (see the class)."""
        keys = ref.keys.every_key(ref.schema.columns, ref.schema.consumers)
        if self._client is None:
            return keys
        for tag in ref.schema.shards:
            for column in ref.schema.columns:
                key = DockKeys.shard_data(tag, column, 0).removesuffix("0") + EPOCH_FIELD
                self._epoch_keys[key] = ref.keys.epoch
                keys.append(key)
        return keys

    def _epochs(self, keys: list[str]) -> dict[str, int]:
        """The current epoch of each dock whose epoch key is in ``keys``, in one round trip."""
        wanted = sorted(set(keys))
        if not wanted or self._client is None:
            return {}
        pipe = self._client.pipeline(transaction=False)
        for key in wanted:
            pipe.get(key)
        out = {}
        for key, raw in zip(wanted, pipe.execute(raise_on_error=False)):
            if isinstance(raw, Exception):
                raise raw
            try:
                out[key] = int(raw or 0)
            except ValueError:  # garbage: the status script reports the dock; its data hashes read as absent
                out[key] = -1
        return out

    def record(self, replies: Sequence[Any]) -> None:
        """Take the replies of what ``queue`` queued: bytes, or None for a key that does not exist."""
        for key, reply in zip(self._queued, replies):
            if isinstance(reply, Exception):
                raise reply
            self._sizes[key] = int(reply or 0)

    def dock_bytes(self, ref: DockRef) -> int | None:
        """The dock's bytes by the latest measure of each key; None until every key was measured once."""
        total = 0
        for key in self._keys.get(ref) or self._keys_of(ref):
            size = self._sizes.get(key)
            if size is None:
                return None
            total += size
        return total


class DockCollector:
    """A Prometheus collector reading every dock (or the named ones) on one server at each scrape.

    Scrapes may come on several HTTP threads at once; they are read one at a time.
    """

    def __init__(
        self,
        client: Client,
        names: Sequence[str] = (),
        *,
        where: str,
        memory_keys: int = MEMORY_KEYS_PER_SCRAPE,
        rescan_seconds: float = 60.0,
    ):
        self._survey = Survey(client, names, rescan_seconds=rescan_seconds)
        self._where = where
        self._memory = MemorySampler(memory_keys, client)
        self._lock = threading.Lock()
        self._errors: dict[tuple[str, str], int] = {}  # (dock, error class) -> scrapes that found it
        self._failed_scrapes = 0

    def describe(self) -> list[Metric]:
        # Registering a collector calls describe (or collect) to check names; an empty list keeps
        # registering from reaching Redis.
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            yield from self._collect()

    def _collect(self) -> Iterator[Metric]:
        started = time.perf_counter()
        try:
            docks = self._read()
        except BrokerError as exc:
            log.warning("scrape of %s failed: %s", self._where, exc)
            self._failed_scrapes += 1
            docks = None
        up = GaugeMetricFamily("broker_up", "1 if the last scrape read the Redis server, else 0")
        up.add_metric([], 0 if docks is None else 1)
        yield up
        yield CounterMetricFamily(
            "broker_scrape_failures", "Scrapes that could not read the Redis server", value=self._failed_scrapes
        )
        if docks is not None:
            yield from self._families(docks)
        duration = GaugeMetricFamily("broker_scrape_duration_seconds", "Time this scrape took, Redis included")
        duration.add_metric([], time.perf_counter() - started)
        yield duration

    def _read(self) -> list[tuple[str, dict[str, Any] | BrokerError]]:
        def also(pipe: Pipeline) -> None:
            self._memory.queue(pipe, list(self._survey.refs.values()))

        # Bounded by Prometheus's default scrape timeout: a scrape that cannot finish by then is lost anyway.
        with bounded(self._where, SCRAPE_SECONDS, reads=True):
            reading = self._survey.read(also=also if self._memory.enabled else None)
            if self._memory.enabled:
                try:
                    self._memory.record(reading.extra)
                except redis.ResponseError as exc:  # an ACL without MEMORY: the counts are still good
                    log.warning("memory metrics off: Redis at %s refused MEMORY USAGE (%s)", self._where, exc)
                    self._memory.enabled = False
        return reading.docks

    def _dock_bytes(self, name: str) -> int | None:
        """The sampled memory of dock ``name``'s keys; of a partitioned dock, its partitions' summed."""
        refs = self._survey.refs
        parts: list[DockRef | None] = [ref for part, ref in refs.items() if partition_of_name(part) == name]
        sizes = [self._memory.dock_bytes(ref) for ref in parts or [refs.get(name)] if ref is not None]
        return None if not sizes or None in sizes else sum(s for s in sizes if s is not None)

    def _families(self, docks: list[tuple[str, dict[str, Any] | BrokerError]]) -> Iterator[Metric]:
        def gauge(name: str, doc: str, labels: Sequence[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        count = gauge("broker_docks", "Docks found on the server (named ones: those asked for)", [])
        count.add_metric([], len(docks))
        dock_up = gauge("broker_dock_up", "1 if the dock's keys read as a dock, 0 if they hold garbage", ["dock"])
        capacity = gauge("broker_dock_capacity_rows", "Rows in the dock: prompts x samples per prompt", ["dock"])
        groups = gauge("broker_dock_capacity_groups", "Groups (prompts) in the dock", ["dock"])
        ready = gauge("broker_column_ready_rows", "Rows written in the column", ["dock", "column"])
        ready_groups = gauge("broker_column_ready_groups", "Groups whose every row is written", ["dock", "column"])
        consumed = gauge("broker_consumer_consumed_rows", "Rows handed to the consumer", ["dock", "consumer"])
        leased = gauge("broker_consumer_leased_rows", "Rows out on a lease, not yet acked", ["dock", "consumer"])
        redelivered = CounterMetricFamily(
            "broker_consumer_redelivered_rows",
            "Rows given back to the consumer after a lease expired (resets on a whole clear)",
            labels=["dock", "consumer"],
        )
        dead = gauge("broker_consumer_dead_letter_rows",
                     "Rows no longer handed to the consumer: their bytes failed to read dead_letter_after times",
                     ["dock", "consumer"])
        memory = gauge("broker_dock_memory_bytes", "Redis memory of the dock's keys, sampled (docs/operations.md)",
                       ["dock"])
        version = gauge("broker_dock_version", "The dock's current policy version (set_version)", ["dock"])
        discarded = CounterMetricFamily(
            "broker_dock_discarded_groups",
            "Groups dropped by a consumer, dropped as stale, or regenerated (resets on a whole clear)",
            labels=["dock", "reason"],
        )
        unfinished = gauge("broker_dock_unfinished_rows", "Partial rollout: rows whose response is not finished",
                           ["dock"])
        finished = gauge("broker_dock_finished_groups", "Partial rollout: groups whose n responses are finished",
                         ["dock"])
        by_age = gauge("broker_dock_groups_by_age", "Partial rollout: groups of each age (the last: that old or older)",
                       ["dock", "age"])
        stale = gauge("broker_dock_stale_groups", "Groups older than the staleness bound, not yet discarded", ["dock"])
        quota = gauge("broker_dock_quota_bytes", "The dock's byte quota (set_quota); absent without one", ["dock"])
        stored = gauge("broker_dock_stored_bytes", "Bytes of the dock's rows counted against its quota", ["dock"])
        for name, status in docks:
            if isinstance(status, BrokerError):
                found = (name, type(status).__name__)
                self._errors[found] = self._errors.get(found, 0) + 1
                dock_up.add_metric([name], 0)
                continue
            dock_up.add_metric([name], 1)
            capacity.add_metric([name], status["capacity"])
            groups.add_metric([name], status["prompts_num"])
            for col, s in status["columns"].items():
                ready.add_metric([name, col], s["ready"])
                ready_groups.add_metric([name, col], s["groups_ready"])
            for consumer, s in status["consumers"].items():
                consumed.add_metric([name, consumer], s["consumed"])
                leased.add_metric([name, consumer], s["leased"])
                redelivered.add_metric([name, consumer], s["redelivered"])
                dead.add_metric([name, consumer], s["dead"])
            version.add_metric([name], status["version"])
            for reason, times in status["discarded"].items():
                discarded.add_metric([name, reason], times)
            if "rollout" in status:
                unfinished.add_metric([name], status["rollout"]["unfinished_rows"])
                finished.add_metric([name], status["rollout"]["finished_groups"])
                for age, count_of_age in status["rollout"]["groups_by_age"].items():
                    by_age.add_metric([name, str(age)], count_of_age)
            if "stale_groups" in status:
                stale.add_metric([name], status["stale_groups"])
            if "quota" in status:
                quota.add_metric([name], status["quota"]["bytes"])
                stored.add_metric([name], status["quota"]["stored_bytes"])
            size = self._dock_bytes(name) if self._memory.enabled else None
            if size is not None:
                memory.add_metric([name], size)
        errors = CounterMetricFamily(
            "broker_dock_errors",
            "Scrapes that found the dock's keys holding what no broker writes, by error",
            labels=["dock", "error"],
        )
        for (name, kind), times in sorted(self._errors.items()):
            errors.add_metric([name, kind], times)
        yield from (count, dock_up, capacity, groups, ready, ready_groups, consumed, leased, redelivered, dead,
                    memory, version, discarded, unfinished, finished, by_age, stale, quota, stored, errors)


def serve(
    client: Client,
    names: Sequence[str] = (),
    *,
    where: str,
    port: int = DEFAULT_PORT,
    addr: str = "0.0.0.0",
    memory_keys: int = MEMORY_KEYS_PER_SCRAPE,
    rescan_seconds: float = 60.0,
) -> Any:
    """Serve the docks' metrics on ``http://ADDR:PORT/metrics`` from a thread; returns the HTTP server.

    ``server.shutdown()`` stops it; port 0 picks a free port (``server.server_port``). The registry
    holds only the dock collector: the exporter's own process metrics would be noise beside it.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        DockCollector(client, names, where=where, memory_keys=memory_keys, rescan_seconds=rescan_seconds)
    )
    server, _thread = prometheus_client.start_http_server(port, addr=addr, registry=registry)
    return server
