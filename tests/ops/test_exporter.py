"""The Prometheus exporter, scraped over real HTTP from a real redis-server."""

from __future__ import annotations

import functools
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import redis
import torch
from prometheus_client.parser import text_string_to_metric_families
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker.cli import main
from broker.control.status import Survey
from broker.ops.exporter import serve
from broker.ops.local_redis import RedisServer, free_port
from tests.helpers import cli_output, interruptible, small_dock

pytestmark = pytest.mark.real


def scrape(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of one scrape, keyed by (sample name, sorted labels)."""
    port = server.server_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


# A second consumer, so that the per-consumer series have more than one value.
make = functools.partial(small_dock, consumers=("actor_train", "reference"))


@pytest.fixture
def exporter(url):
    servers = []

    def start(names=(), **kwargs):
        client = redis.Redis.from_url(url)
        server = serve(client, names, where=url, port=0, addr="127.0.0.1", **kwargs)
        servers.append((server, client))
        return server

    yield start
    for server, client in servers:
        server.shutdown()
        server.server_close()
        client.close()


def test_scrape_reports_what_status_says(url, exporter):
    dock = make(url, "grpo")
    dock.put_experience({"prompts": torch.ones(6, 3)}, indexes=list(range(6)))
    dock.put_experience({"responses": torch.ones(2, 3)}, indexes=[0, 1])
    dock.get_experience("actor_train", ["prompts"], 4)
    dock.get_experience("reference", ["prompts"], 2, lease=30)
    status = dock.status()

    samples = scrape(exporter())
    assert value(samples, "broker_up") == 1
    assert value(samples, "broker_docks") == 1
    assert value(samples, "broker_dock_up", dock="grpo") == 1
    assert value(samples, "broker_dock_capacity_rows", dock="grpo") == 8
    assert value(samples, "broker_dock_capacity_groups", dock="grpo") == 4
    for col, s in status["columns"].items():
        assert value(samples, "broker_column_ready_rows", dock="grpo", column=col) == s["ready"]
        assert value(samples, "broker_column_ready_groups", dock="grpo", column=col) == s["groups_ready"]
    for consumer, s in status["consumers"].items():
        assert value(samples, "broker_consumer_consumed_rows", dock="grpo", consumer=consumer) == s["consumed"]
        assert value(samples, "broker_consumer_leased_rows", dock="grpo", consumer=consumer) == s["leased"]
        assert value(samples, "broker_consumer_redelivered_rows_total", dock="grpo", consumer=consumer) == 0
        assert value(samples, "broker_consumer_dead_letter_rows", dock="grpo", consumer=consumer) == s["dead"]
    assert value(samples, "broker_column_ready_rows", dock="grpo", column="prompts") == 6
    assert value(samples, "broker_consumer_leased_rows", dock="grpo", consumer="reference") == 2
    assert value(samples, "broker_scrape_duration_seconds") > 0


def test_a_partitioned_dock_is_one_dock_its_partitions_summed(url, exporter):
    dock = make(url, "grpo", partitions=2)
    dock.put_experience({"prompts": torch.ones(6, 3)}, indexes=list(range(6)))
    dock.get_experience("reference", ["prompts"], 4, lease=30)
    server = exporter(memory_keys=64)
    samples = scrape(server)
    assert value(samples, "broker_docks") == 1
    assert value(samples, "broker_dock_capacity_rows", dock="grpo") == 8
    assert value(samples, "broker_column_ready_rows", dock="grpo", column="prompts") == 6
    assert value(samples, "broker_consumer_leased_rows", dock="grpo", consumer="reference") == 4
    measured = [value(scrape(server), "broker_dock_memory_bytes", dock="grpo") for _ in range(4)]
    assert measured[-1] > 6 * 3 * 4  # every partition's keys measured by then, summed
    named = scrape(exporter(["grpo"]))  # the name alone finds its partitions
    assert value(named, "broker_dock_up", dock="grpo") == 1
    assert value(named, "broker_dock_capacity_rows", dock="grpo") == 8


def test_partial_rollout_and_staleness_series(url, exporter):
    from broker import Rollout

    rollout = Rollout(consumer="actor_train", response_columns=("responses",), max_age=2, gbs_train=1,
                      max_staleness=0)
    dock = small_dock(url, "pr", consumers=("actor_train", "reference"), rollout=rollout)
    dock.put_experience({"prompts": torch.ones(6, 1)}, list(range(6)), is_prompt=True)
    dock.put_experience({"responses": torch.ones(2, 1)}, [0, 1], rollout_completed=[1, 1], version=0)
    dock.drop_groups("reference", [1])
    dock.set_version(1)
    samples = scrape(exporter())
    assert value(samples, "broker_dock_version", dock="pr") == 1
    assert value(samples, "broker_dock_discarded_groups_total", dock="pr", reason="reference") == 1
    assert value(samples, "broker_dock_unfinished_rows", dock="pr") == 2
    assert value(samples, "broker_dock_finished_groups", dock="pr") == 1
    assert value(samples, "broker_dock_groups_by_age", dock="pr", age="0") == 1
    assert value(samples, "broker_dock_stale_groups", dock="pr") == 1


def test_counts_follow_the_dock_between_scrapes(url, exporter):
    dock = make(url, "grpo")
    server = exporter()
    assert value(scrape(server), "broker_column_ready_rows", dock="grpo", column="prompts") == 0
    dock.put_experience({"prompts": torch.ones(8, 1)}, indexes=list(range(8)))
    assert value(scrape(server), "broker_column_ready_rows", dock="grpo", column="prompts") == 8
    dock.get_experience("actor_train", ["prompts"], 2, lease=0.05)
    time.sleep(0.1)
    dock.all_consumed("actor_train")  # gives the expired lease back
    samples = scrape(server)
    assert value(samples, "broker_consumer_redelivered_rows_total", dock="grpo", consumer="actor_train") == 2
    dock.clear()
    assert value(scrape(server), "broker_column_ready_rows", dock="grpo", column="prompts") == 0


def test_docks_created_and_deleted_while_it_runs(url, exporter):
    make(url, "a")
    server = exporter(rescan_seconds=0.2)
    assert value(scrape(server), "broker_docks") == 1
    b = make(url, "b")
    time.sleep(0.3)
    samples = scrape(server)
    assert value(samples, "broker_docks") == 2 and value(samples, "broker_dock_up", dock="b") == 1
    b.delete()
    samples = scrape(server)  # gone at once, without waiting for the next scan
    assert value(samples, "broker_dock_up", dock="b") is None and value(samples, "broker_docks") == 1


def test_a_dock_recreated_with_another_schema_shows_its_new_counts_at_once(url, exporter):
    make(url, "grpo").delete()
    make(url, "grpo", prompts=4)
    server = exporter()
    assert value(scrape(server), "broker_dock_capacity_rows", dock="grpo") == 8
    redis.Redis.from_url(url).flushdb()
    make(url, "grpo", prompts=16)
    assert value(scrape(server), "broker_dock_capacity_rows", dock="grpo") == 32


def test_a_dock_holding_garbage_is_an_error_counter_not_a_crash(url, exporter):
    make(url, "good").put_experience({"prompts": torch.ones(2, 1)}, indexes=[0, 1])
    make(url, "bitmap")
    admin = redis.Redis.from_url(url)
    admin.hset("td:{meta}:meta", "format_version", "oops")  # a meta no broker wrote
    admin.set("td:{bitmap}:ready:prompts", b"\xff" * 64)  # more bits than the dock has rows
    server = exporter()
    for scrapes in (1, 2):
        samples = scrape(server)
        assert value(samples, "broker_up") == 1
        assert value(samples, "broker_dock_up", dock="good") == 1
        assert value(samples, "broker_column_ready_rows", dock="good", column="prompts") == 2
        for name in ("meta", "bitmap"):
            assert value(samples, "broker_dock_up", dock=name) == 0
        assert value(samples, "broker_dock_errors_total", dock="meta", error="DecodeError") == scrapes
        assert value(samples, "broker_dock_errors_total", dock="bitmap", error="DecodeError") == scrapes
        assert value(samples, "broker_column_ready_rows", dock="bitmap", column="prompts") is None


def test_one_tenants_garbage_meta_or_stray_key_is_that_dock_down_and_the_rest_as_usual(url, exporter):
    """A tenant may write anything into its own dock's keys: a meta nested past Python's recursion limit, or a
    meta key under a name no dock may have, shows as that dock down, not as Redis down for every dock."""
    make(url, "good").put_experience({"prompts": torch.ones(2, 1)}, indexes=[0, 1])
    make(url, "deep")
    admin = redis.Redis.from_url(url)
    admin.hset("td:{deep}:meta", "columns", "[" * 100_000)
    admin.hset("td:{a b}:meta", "format_version", "1")
    server = exporter()
    samples = scrape(server)
    assert value(samples, "broker_up") == 1
    assert value(samples, "broker_dock_up", dock="good") == 1
    assert value(samples, "broker_column_ready_rows", dock="good", column="prompts") == 2
    assert value(samples, "broker_dock_up", dock="deep") == 0
    assert value(samples, "broker_dock_up", dock="a b") == 0
    assert value(samples, "broker_dock_errors_total", dock="deep", error="DecodeError") == 1


def test_named_docks_only_and_a_missing_one(url, exporter):
    make(url, "a")
    make(url, "b")
    samples = scrape(exporter(["b", "nope"]))
    assert value(samples, "broker_dock_up", dock="a") is None
    assert value(samples, "broker_dock_up", dock="b") == 1
    assert value(samples, "broker_dock_up", dock="nope") == 0
    assert value(samples, "broker_dock_errors_total", dock="nope", error="DockNotFoundError") == 1


def test_memory_is_sampled_a_bounded_share_per_scrape(url, exporter):
    dock = make(url, "grpo")
    dock.put_experience({"prompts": torch.ones(8, 256)}, indexes=list(range(8)))
    keys = dock.keys.every_key(dock.columns, dock.consumers)
    server = exporter(memory_keys=4)
    admin = redis.Redis.from_url(url)
    admin.config_resetstat()
    scrapes = -(-len(keys) // 4)
    for _ in range(scrapes - 1):
        assert value(scrape(server), "broker_dock_memory_bytes", dock="grpo") is None  # not every key measured yet
    measured = value(scrape(server), "broker_dock_memory_bytes", dock="grpo")
    calls = admin.info("commandstats")["cmdstat_memory|usage"]["calls"]
    assert calls == scrapes * 4  # 4 keys a scrape, never more
    expected = sum(admin.memory_usage(k, samples=5) or 0 for k in keys)
    assert measured == expected
    assert measured > 8 * 256 * 4  # the data hash's bytes are in it


def test_scrape_is_one_round_trip_whatever_the_number_of_docks(url, exporter):
    """Every dock's counts and the memory samples travel in one pipeline: one write to the socket."""
    sent = []

    class Counting(redis.Connection):
        def send_packed_command(self, command, check_health=True):
            sent.append(1)
            return super().send_packed_command(command, check_health)

    def round_trips(docks: int) -> int:
        admin = redis.Redis.from_url(url)
        admin.flushdb()
        for i in range(docks):
            make(url, f"d{i}").close()
        client = redis.Redis.from_url(url, connection_class=Counting)
        server = serve(client, where=url, port=0, addr="127.0.0.1")
        try:
            scrape(server)  # the first scrape also scans and reads the schemas
            sent.clear()
            samples = scrape(server)
            assert value(samples, "broker_docks") == docks
            return len(sent)
        finally:
            server.shutdown()
            server.server_close()

    assert round_trips(3) == round_trips(60) == 1


def test_unreachable_redis_is_broker_up_0_not_an_http_error():
    server = RedisServer().start()
    dock = make(server.url, "grpo")
    dock.close()
    # No retries: redis-py's own 10 would only delay the failed scrape by 3 s; the exporter's answer is the point.
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    http = serve(client, where=server.url, port=0, addr="127.0.0.1")
    try:
        assert value(scrape(http), "broker_up") == 1
        server.stop()
        samples = scrape(http)
        assert value(samples, "broker_up") == 0
        assert value(samples, "broker_scrape_failures_total") == 1
        assert value(samples, "broker_dock_up", dock="grpo") is None
        server.start()  # the same port, an empty server
        samples = scrape(http)
        assert value(samples, "broker_up") == 1 and value(samples, "broker_docks") == 0
    finally:
        http.shutdown()
        http.server_close()
        server.close()


def test_the_reader_acl_user_gets_every_metric_and_can_write_nothing():
    with RedisServer() as server:
        make(server.url, "grpo").put_experience({"prompts": torch.ones(2, 1)}, indexes=[0, 1])
        admin = server.client()
        admin.execute_command(*shlex.split(cli_output(["acl", "--reader", "--user", "watcher", "--password", "pw"])))
        client = redis.Redis.from_url(f"redis://watcher:pw@127.0.0.1:{server.port}/0")
        http = serve(client, where=server.url, port=0, addr="127.0.0.1", memory_keys=1000)
        try:
            samples = scrape(http)
            assert value(samples, "broker_column_ready_rows", dock="grpo", column="prompts") == 2
            assert value(samples, "broker_dock_memory_bytes", dock="grpo") > 0
        finally:
            http.shutdown()
            http.server_close()
        for command in (("DEL", "td:{grpo}:meta"), ("HSET", "td:{grpo}:meta", "a", "b"), ("FLUSHDB",)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
        with pytest.raises(redis.exceptions.ResponseError, match="(?i)no permission|NOPERM|ACL"):
            client.eval("return redis.call('DEL', KEYS[1])", 1, "td:{grpo}:meta")
        assert admin.exists("td:{grpo}:meta")
        # Counts, not payloads: the rows' bytes, the shared metrics and a script reading them are refused.
        make(server.url, "grpo").update_metrics("loss", 0.5)
        for command in (("HGETALL", "td:{grpo}:data:prompts"), ("HMGET", "td:{grpo}:data:prompts", "0"),
                        ("HGETALL", "td:{grpo}:metrics"), ("HGETALL", "td:{grpo}:tail:prompts")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
        # Nor Lua of its own: SCRIPT LOAD then EVALSHA of `while true do end` stalled the whole server.
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.script_load("while true do end")
        assert client.hlen("td:{grpo}:data:prompts") == 2  # what status counts: allowed


def test_on_redis_62_the_reader_gets_its_rules_from_apply_and_every_count(redis62_url):
    """Redis 6.2 has no ACL selectors (it refuses Redis 7's reader rules): ``--apply`` gives it rules it takes,
    with every dock key, and status reads every count, partial rollout's included."""
    from broker import Rollout

    dock = small_dock(redis62_url, "pr6", columns=("prompts", "responses"), consumers=("actor_rollout", "actor_train"),
                      rollout=Rollout(response_columns=("responses",), max_age=2, gbs_train=1))
    dock.put_experience({"prompts": torch.ones(2, 1)}, indexes=[0, 1], is_prompt=True)
    try:
        assert main(["acl", "--reader", "--user", "watcher62", "--password", "pw", "--apply", "--url",
                     redis62_url]) == 0
        client = redis.Redis.from_url(redis62_url.replace("redis://", "redis://watcher62:pw@"))
        ((name, got),) = Survey(client, ["pr6"]).read().docks
        assert got == dock.status()
    finally:
        dock.delete()


def test_a_user_without_memory_usage_still_gets_the_counts():
    with RedisServer() as server:
        make(server.url, "grpo").put_experience({"prompts": torch.ones(2, 1)}, indexes=[0, 1])
        admin = server.client()
        rules = shlex.split(cli_output(["acl", "--reader", "--user", "watcher", "--password", "pw"]))
        admin.execute_command(*(r for r in rules if "memory" not in r))
        client = redis.Redis.from_url(f"redis://watcher:pw@127.0.0.1:{server.port}/0")
        http = serve(client, where=server.url, port=0, addr="127.0.0.1")
        try:
            for _ in range(2):
                samples = scrape(http)
                assert value(samples, "broker_up") == 1
                assert value(samples, "broker_column_ready_rows", dock="grpo", column="prompts") == 2
                assert value(samples, "broker_dock_memory_bytes", dock="grpo") is None
        finally:
            http.shutdown()
            http.server_close()


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_broker_exporter_command_serves_and_stops_cleanly(url, stop):
    make(url, "grpo").put_experience({"prompts": torch.ones(3, 1)}, indexes=[0, 1, 2])
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "broker", "exporter", "--url", url, "--port", str(port), "--addr", "127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=interruptible,
    )
    try:
        line = proc.stdout.readline()
        assert re.search(rf"http://127.0.0.1:{port}/metrics", line), line + proc.stderr.read()

        class Server:
            server_port = port

        assert value(scrape(Server), "broker_column_ready_rows", dock="grpo", column="prompts") == 3
        proc.send_signal(stop)
        assert proc.wait(30) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()


def test_a_docks_quota_and_what_it_holds_are_scraped(url, exporter):
    dock = make(url, "quota")
    plain = make(url, "plain")
    dock.set_quota(10_000)
    dock.put_experience({"prompts": torch.ones(2, 3)}, indexes=[0, 1])
    samples = scrape(exporter())
    assert value(samples, "broker_dock_quota_bytes", dock="quota") == 10_000
    assert value(samples, "broker_dock_stored_bytes", dock="quota") == dock.status()["quota"]["stored_bytes"] > 0
    assert value(samples, "broker_dock_quota_bytes", dock=plain.name) is None
