"""A worker's own dock calls as Prometheus metrics: how long its puts and gets take, rows and bytes moved.

The exporter (``broker exporter``) shows what is in Redis; this shows what one process sees of it,
latency included, which only the caller can measure. Nothing is recorded until :func:`enable` (or
:func:`start_http_server`) is called, so a worker that does not ask pays one attribute test per call.

    from broker.api import metrics
    metrics.start_http_server(9809)     # /metrics on every interface, this process's calls

or, in a process that already serves Prometheus metrics (vLLM, a trainer), ``metrics.enable()`` to
add them to ``prometheus_client``'s default registry. Metric names are in docs/operations.md.

Every dock in the process records into the same metrics, labelled by dock name and operation:
``put``, ``get`` (sampling and explicit rows alike; the time includes waiting for puts when the call
was given a timeout), ``ack`` and ``clear``. ``outcome`` is ``ok``, ``empty`` (a get that found too few
rows) or ``error`` (the call raised).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = [
    "LATENCY_BUCKETS",
    "enable",
    "start_http_server",
    "disable",
    "enabled",
    "Call",
    "observe",
]

#: Latency buckets, in seconds: a put of a few rows on a local Redis takes well under a millisecond,
#: a get waiting for a slow rollout takes minutes.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

class _Metrics:
    """The metric objects, registered in one registry."""

    def __init__(self, registry: CollectorRegistry):
        labels = ("dock", "op", "outcome")
        self.seconds = Histogram(
            "broker_client_call_seconds", "Duration of this process's dock calls, waiting included",
            labels, buckets=LATENCY_BUCKETS, registry=registry,
        )
        self.rows = Counter(
            "broker_client_rows", "Rows this process's dock calls wrote, handed out, acked or cleared",
            ("dock", "op"), registry=registry,
        )
        self.bytes = Counter(
            "broker_client_bytes", "Encoded bytes this process's puts sent and gets read", ("dock", "op"),
            registry=registry,
        )
        self.registry = registry


_metrics: _Metrics | None = None
_lock = threading.Lock()


def enable(registry: CollectorRegistry | None = None) -> CollectorRegistry:
    """Start recording this process's dock calls into ``registry`` (default: prometheus_client's).

    Idempotent: a second call returns the registry already in use, whatever it is given.
    """
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = _Metrics(prometheus_client.REGISTRY if registry is None else registry)
        return _metrics.registry


def start_http_server(port: int, addr: str = "0.0.0.0", registry: CollectorRegistry | None = None) -> Any:
    """Record this process's dock calls and serve them on ``http://ADDR:PORT/metrics``.

    Returns the HTTP server (``shutdown()`` stops it). Port 0 picks a free one: ``server.server_port``.
    """
    used = enable(registry)
    server, _thread = prometheus_client.start_http_server(port, addr=addr, registry=used)
    return server


def disable() -> None:
    """Stop recording and take the metrics out of their registry (a later ``enable`` starts from zero)."""
    global _metrics
    with _lock:
        if _metrics is not None:
            for metric in (_metrics.seconds, _metrics.rows, _metrics.bytes):
                _metrics.registry.unregister(metric)
            _metrics = None


def enabled() -> bool:
    """Whether this process records its dock calls."""
    return _metrics is not None


class Call:
    """What one dock call moved, filled in by the dock as it learns it."""

    __slots__ = ("live", "rows", "nbytes", "empty")

    def __init__(self, live: bool) -> None:
        self.live = live  # False: nothing is recorded, so the dock need not count bytes
        self.rows = 0
        self.nbytes = 0
        self.empty = False


@contextmanager
def observe(dock: str, op: str) -> Iterator[Call]:
    """Time one dock call and record it with what the dock put in the yielded :class:`Call`."""
    metrics = _metrics
    call = Call(live=metrics is not None)
    if metrics is None:
        yield call
        return
    started = time.perf_counter()
    outcome = "error"
    try:
        yield call
        outcome = "empty" if call.empty else "ok"
    finally:
        metrics.seconds.labels(dock, op, outcome).observe(time.perf_counter() - started)
        if call.rows:
            metrics.rows.labels(dock, op).inc(call.rows)
        if call.nbytes:
            metrics.bytes.labels(dock, op).inc(call.nbytes)
