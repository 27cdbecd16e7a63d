"""``broker bench`` on Redis Cluster: ``--url`` naming a cluster node, and ``--cluster`` beside one server."""

from __future__ import annotations

import json

import pytest
import redis
from redis.cluster import RedisCluster

from broker.bench import cluster as bench_cluster
from broker.bench.pipeline import run_pipeline
from broker.bench.servers import admin, primaries
from broker.bench.workload import Workload
from broker.cli import main
from broker.ops import local_redis
from tests.helpers import redis_server_binary, required

pytestmark = pytest.mark.real

TINY = ["--prompts", "8", "--n", "4", "--groups-per-call", "2"]


def _json_line(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture
def redis_server_on_path():
    required(redis_server_binary(), "redis-server", "the Redis Cluster benchmark")


def _bench_keys(url: str) -> list[bytes]:
    client = RedisCluster.from_url(url)
    try:
        return list(client.scan_iter(match="*bench-*", count=1000))
    finally:
        client.close()


def test_a_cluster_url_runs_the_modes_with_the_single_servers_checksum_and_leaves_no_key(cluster_url, url, capsys):
    args = [*TINY, "--pipeline", "--memory", "--sampling", "--systems", "broker,redis-floor,inprocess",
            "--repeat", "1", "--warmup", "0", "--sampling-sizes", "64", "--sampling-calls", "5", "--json"]
    assert main(["bench", "--url", url, *args]) == 0
    single = _json_line(capsys.readouterr().out)
    assert main(["bench", "--url", cluster_url, *args]) == 0
    clustered = _json_line(capsys.readouterr().out)
    assert clustered["redis"]["cluster_primaries"] == 3 and "cluster_primaries" not in single["redis"]
    assert clustered["pipeline"]["checksums_equal"]
    assert clustered["pipeline"]["systems"]["broker"]["checksum"] == single["pipeline"]["systems"]["broker"]["checksum"]
    # Memory is summed over the primaries: the sharded dock's bytes are on all three, yet all are counted.
    broker = clustered["memory"]["systems"]["broker"]
    assert broker["keys_per_payload_byte"] > 1.0 and broker["per_payload_byte"] > 0.9
    assert clustered["sampling"]["sizes"]["64"]["fifo"]["server_script_us"] > 0  # EVALSHA, on whichever primary
    assert _bench_keys(cluster_url) == []


def test_the_exporter_mode_on_a_cluster_cleans_up(cluster_url, capsys):
    assert main(["bench", "--url", cluster_url, "--exporter", "--exporter-docks", "4", "--exporter-scrapes", "2",
                 "--json"]) == 0
    report = _json_line(capsys.readouterr().out)
    assert report["exporter"]["counts_only"]["server_ms"] > 0
    assert _bench_keys(cluster_url) == []


def test_cluster_mode_compares_one_server_and_a_cluster_and_stops_them(redis_server_on_path, capsys):
    before = set(local_redis._running)
    assert main(["bench", "--cluster", *TINY, "--repeat", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert set(local_redis._running) == before  # every server the run started is stopped
    assert "one redis-server vs a 3-primary Redis Cluster (3 data shards)" in out
    assert "checksums equal, and equal to the in-process reference" in out
    report = _json_line(out)
    c = report["cluster"]
    assert c["checksums_equal"] and c["single"]["checksum"] == c["cluster"]["checksum"] == c["reference_checksum"]
    assert c["ratio"] == c["cluster"]["seconds"] / c["single"]["seconds"] > 0
    assert report["targets"]["cluster_over_single"]["value"] == c["ratio"]
    assert c["moved_bytes"] == c["written_bytes"] + c["read_bytes"] > report["workload"]["payload_bytes"]
    nodes = c["cluster"]["nodes"]
    assert len(nodes) == 3 and sum(n["control"] for n in nodes.values()) == 1
    assert sum(n["payload_bytes"] for n in nodes.values()) == c["moved_bytes"]  # one pass: every byte on a primary
    for n in nodes.values():
        assert n["payload_bytes"] > 0 and n["data_seconds"] > 0 and n["cpu_seconds_per_gb"] > 0
        assert n["command_seconds_per_gb"] == pytest.approx(n["command_seconds"] / (n["payload_bytes"] / 1e9))
        assert (n["script_seconds"] > 0) == n["control"]  # the scripts run on the control slot's primary only
    p = c["projection"]
    assert nodes[p["control_node"]]["control"]
    for measure in ("command", "process"):
        m = p[measure]
        busiest = max(n[f"{'command' if measure == 'command' else 'cpu'}_seconds_per_gb"] for n in nodes.values())
        assert m["seconds_per_gb"] == busiest
        assert m["linear_gb_per_second"]["6"] == pytest.approx(6 / busiest)
        limit = m["control_ceiling_gb_per_second"]
        assert limit is None or all(v < limit for v in m["control_gb_per_second"].values())
    # At the measured S, the P = 1 "measured" figure is the control model's.
    assert p["measured_gb_per_second"] == pytest.approx(p["command"]["control_gb_per_second"]["3"])
    assert "spread_gb_per_second" not in p
    single = c["single"]["nodes"]
    assert len(single) == 1 and next(iter(single.values()))["payload_bytes"] == c["moved_bytes"]


def test_cluster_mode_with_partitions_spreads_the_scripts_over_the_primaries(redis_server_on_path, capsys):
    before = set(local_redis._running)
    assert main(["bench", "--cluster", *TINY, "--repeat", "1", "--warmup", "0", "--partitions", "3"]) == 0
    out = capsys.readouterr().out
    assert set(local_redis._running) == before
    assert "(a dock of 3 partitions, each of 3 data shards)" in out and "(target <= 1.3)" in out
    c = _json_line(out)["cluster"]
    assert c["partitions"] == 3 and c["checksums_equal"] and c["cluster"]["checksum"] == c["reference_checksum"]
    nodes = c["cluster"]["nodes"]
    # One partition's control slot on each primary, so each runs scripts; every byte on some primary.
    assert sorted(p for n in nodes.values() for p in n["controls"]) == [0, 1, 2]
    assert all(len(n["controls"]) == 1 and n["script_seconds"] > 0 and n["data_seconds"] > 0 for n in nodes.values())
    assert sum(n["payload_bytes"] for n in nodes.values()) == c["moved_bytes"]
    for n in nodes.values():
        gb = n["payload_bytes"] / 1e9
        assert n["script_seconds_per_gb"] == pytest.approx(n["script_seconds"] / gb)
        assert n["command_seconds_per_gb"] == pytest.approx(n["script_seconds_per_gb"] + n["data_seconds_per_gb"])
    p = c["projection"]
    scripts = [n["script_seconds"] for n in nodes.values()]
    assert p["script_over_mean"] == pytest.approx(max(scripts) / (sum(scripts) / 3))
    assert "control_gb_per_second" not in p["command"]  # no one control primary to bound it
    busiest = max(n["command_seconds_per_gb"] for n in nodes.values())
    assert p["command"]["linear_gb_per_second"]["24"] == pytest.approx(24 / busiest)
    gb = c["moved_bytes"] / 1e9  # one pass
    assert p["script_seconds_per_gb"] == pytest.approx(sum(scripts) / gb)
    assert p["measured_gb_per_second"] == pytest.approx(1 / (max(scripts) / gb + p["data_seconds_per_gb"] / 3))
    assert p["spread_gb_per_second"]["24"] == pytest.approx(
        24 / (p["script_over_mean"] * p["script_seconds_per_gb"] + p["data_seconds_per_gb"]))


@pytest.mark.parametrize("partitions", [1, 3])
def test_a_primarys_share_is_the_rows_whose_bytes_it_holds(cluster_url, cluster_admin, partitions):
    # The bench's attribution (group -> partition -> shard -> primary), checked against where the dock put the
    # bytes: after a pass, each primary's data fields over all of them is its share of the rows.
    workload = Workload(prompts=16, n=4, groups_per_call=2)
    one_each = bench_cluster.Moved(0, 0, [1] * workload.capacity, "")
    with admin(cluster_url) as client:
        target = bench_cluster._Target("cluster", cluster_url, f"bench-share-{partitions}", workload, client,
                                       one_each, partitions=partitions)
        try:
            run_pipeline("cluster", target.dock, workload)
            fields = {where: sum(node.hlen(key) for key in node.scan_iter(match="td:{*}:data:*", count=1000))
                      for where, node in primaries(client)}
        finally:
            target.dock.close()
    total = sum(fields.values())
    assert total > 0 and sum(target.share.values()) == workload.capacity
    assert {w: f / total for w, f in fields.items()} == pytest.approx(
        {w: s / workload.capacity for w, s in target.share.items()})
    assert len([s for s in target.share.values() if s]) == 3  # spread over every primary


def test_cluster_mode_times_wait_replicas_on_a_cluster_with_replicas(redis_server_on_path, capsys):
    before = set(local_redis._running)
    assert main(["bench", "--cluster", *TINY, "--repeat", "1", "--warmup", "0", "--wait-replicas", "1"]) == 0
    out = capsys.readouterr().out
    assert set(local_redis._running) == before  # the replicas are stopped too
    c = _json_line(out)["cluster"]
    assert c["wait_replicas"] == 1 and c["checksums_equal"]
    assert c["durable"]["checksum"] == c["reference_checksum"]
    assert c["durable_ratio"] == c["durable"]["seconds"] / c["cluster"]["seconds"] > 0
    assert "wait_replicas=1 / cluster" in out


def test_cluster_mode_stops_every_server_when_the_run_fails(redis_server_on_path, monkeypatch):
    before = set(local_redis._running)

    def broken(*args, **kwargs):
        raise RuntimeError("a pass failed")

    monkeypatch.setattr(bench_cluster, "run_pipeline", broken)
    monkeypatch.setattr(bench_cluster, "moved_bytes", lambda w: bench_cluster.Moved(1, 1, [0] * w.capacity, "x"))
    with pytest.raises(RuntimeError, match="a pass failed"):
        main(["bench", "--cluster", *TINY, "--repeat", "1", "--warmup", "0"])
    assert set(local_redis._running) == before


def test_cluster_mode_takes_no_url(capsys):
    assert main(["bench", "--cluster", "--url", "redis://127.0.0.1:1/0"]) == 2
    assert "takes no --url" in capsys.readouterr().err


def test_partitions_belong_to_the_cluster_mode(capsys):
    assert main(["bench", "--pipeline", "--partitions", "3"]) == 2
    assert main(["bench", "--cluster", *TINY, "--partitions", "9"]) == 2  # more partitions than groups
    assert "--partitions belongs to --cluster" in capsys.readouterr().err


def test_a_plain_client_of_a_cluster_node_is_not_what_admin_reads_use(cluster_url):
    # What went wrong before: a plain client of one node saw a third of the keys and one primary's stats.
    from broker.bench.servers import admin, key_count, primaries

    node = redis.Redis.from_url(cluster_url)
    cluster = RedisCluster.from_url(cluster_url)
    try:
        keys = [f"bench-admin-{i}" for i in range(30)]
        for key in keys:
            cluster.set(key, 1)
        with admin(cluster_url) as client:
            assert len(primaries(client)) == 3
            assert key_count(client) - node.dbsize() > 0
            assert key_count(client) >= 30
        cluster.delete(*keys)
    finally:
        node.close()
        cluster.close()
