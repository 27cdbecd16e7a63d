"""A worker's own dock calls as Prometheus metrics (broker.api.metrics), on every backend."""

from __future__ import annotations

import urllib.request

import fakeredis
import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from broker import UnknownConsumerError
from broker.api import metrics
from tests.helpers import data_cell, small_dock


@pytest.fixture
def registry():
    registry = CollectorRegistry()
    assert metrics.enable(registry) is registry
    yield registry
    metrics.disable()


def sample(registry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, labels)
    return 0.0 if got is None else got


def test_puts_and_gets_are_timed_and_counted(make_dock, registry):
    dock = make_dock(name="grpo")
    dock.put_experience({"prompts": torch.ones(4, 8), "responses": torch.ones(4, 8)}, indexes=[0, 1, 2, 3])
    def stored_bytes(column: str) -> int:  # the bytes the put wrote, in the dock's slot or on its data shards
        return sum(len(dock.client.hget(*data_cell(dock, column, row))) for row in range(4))

    prompt_bytes = stored_bytes("prompts")
    put_bytes = prompt_bytes + stored_bytes("responses")
    assert sample(registry, "broker_client_rows_total", dock="grpo", op="put") == 4
    assert sample(registry, "broker_client_bytes_total", dock="grpo", op="put") == put_bytes
    assert sample(registry, "broker_client_call_seconds_count", dock="grpo", op="put", outcome="ok") == 1

    batch, rows = dock.get_experience("actor_train", ["prompts"], 2, lease=30)
    assert sample(registry, "broker_client_rows_total", dock="grpo", op="get") == 2
    got_bytes = sample(registry, "broker_client_bytes_total", dock="grpo", op="get")
    assert got_bytes == prompt_bytes / 4 * 2  # 2 of the 4 rows
    dock.get_experience("actor_train", ["prompts"], 8)  # too few rows: empty
    assert sample(registry, "broker_client_call_seconds_count", dock="grpo", op="get", outcome="empty") == 1
    assert sample(registry, "broker_client_call_seconds_count", dock="grpo", op="get", outcome="ok") == 1

    assert dock.ack("actor_train", rows) == 2
    assert sample(registry, "broker_client_rows_total", dock="grpo", op="ack") == 2
    dock.clear([0, 1])
    dock.clear()
    assert sample(registry, "broker_client_rows_total", dock="grpo", op="clear") == 2 + dock.capacity
    assert sample(registry, "broker_client_call_seconds_sum", dock="grpo", op="put", outcome="ok") > 0


def test_a_call_that_raises_is_an_error(make_dock, registry):
    dock = make_dock(name="grpo")
    with pytest.raises(UnknownConsumerError):
        dock.get_experience("nobody", ["prompts"], 2)
    assert sample(registry, "broker_client_call_seconds_count", dock="grpo", op="get", outcome="error") == 1
    assert sample(registry, "broker_client_rows_total", dock="grpo", op="get") == 0


def test_nothing_is_recorded_until_enabled(make_dock):
    assert not metrics.enabled()
    dock = make_dock(name="grpo")
    dock.put_experience({"prompts": torch.ones(2, 1)}, indexes=[0, 1])
    registry = metrics.enable(CollectorRegistry())
    try:
        assert sample(registry, "broker_client_rows_total", dock="grpo", op="put") == 0
        dock.put_experience({"prompts": torch.ones(2, 1)}, indexes=[2, 3])
        assert sample(registry, "broker_client_rows_total", dock="grpo", op="put") == 2
    finally:
        metrics.disable()
    dock.put_experience({"prompts": torch.ones(2, 1)}, indexes=[4, 5])
    assert registry.get_sample_value("broker_client_rows_total", {"dock": "grpo", "op": "put"}) is None


def test_served_over_http():
    # On one backend: the other tests check what each records; here the registry is served as it is, and
    # each backend waited out the HTTP server's shutdown poll (0.5 s) only.
    server = metrics.start_http_server(0, addr="127.0.0.1", registry=CollectorRegistry())
    try:
        small_dock(fakeredis.FakeRedis(server=fakeredis.FakeServer()), "grpo").put_experience(
            {"prompts": torch.ones(2, 1)}, indexes=[0, 1])
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=30) as reply:
            text = reply.read().decode()
        names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
        assert {"broker_client_call_seconds_bucket", "broker_client_rows_total", "broker_client_bytes_total"} <= names
    finally:
        server.shutdown()
        server.server_close()
        metrics.disable()
