"""The broker command against a Redis Cluster, through a URL naming a node that does not own the docks' slots:
``broker status`` (every dock of every primary, one dock, JSON, the live view), ``broker clear`` (and
``--delete``, data shards included), the exporter and ``broker acl``; what a plain client pointed at such a
node gets; and a dock opened from a cluster URL going through pickle."""

from __future__ import annotations

import json
import pickle
import threading
import urllib.request

import pytest
import redis
import torch
from prometheus_client.parser import text_string_to_metric_families
from redis.cluster import RedisCluster

import broker.ops.watch
from broker import ClusterError, RedisCommandError, TransferDock
from broker.cli import main
from broker.connection import connect, disconnect
from broker.control.keys import DockKeys
from broker.ops.exporter import serve
from tests.helpers import cli_output, empty_cluster, server_keys, small_dock

pytestmark = pytest.mark.real


@pytest.fixture
def cluster(cluster_url):
    """A client of the session's cluster, emptied."""
    with RedisCluster.from_url(cluster_url) as client:
        empty_cluster(client)
        yield client


def primary_of(cluster: RedisCluster, name: str) -> str:
    """host:port of the primary serving dock ``name``'s control slot."""
    return cluster.get_node_from_key(DockKeys(name).meta).name


def url_not_serving(cluster: RedisCluster, name: str) -> str:
    """URL of a primary that does not serve dock ``name``'s control slot."""
    node = next(n for n in cluster.get_primaries() if n.name != primary_of(cluster, name))
    return f"redis://{node.host}:{node.port}/0"


def names_on_every_primary(cluster: RedisCluster) -> list[str]:
    """One dock name per primary, each served by another primary."""
    found: dict[str, str] = {}
    i = 0
    while len(found) < len(cluster.get_primaries()):
        found.setdefault(primary_of(cluster, f"dock{i}"), f"dock{i}")
        i += 1
    return sorted(found.values())


def make(url: str, name: str) -> TransferDock:
    """A dock with three rows written and two of them consumed (as tests/ops/test_cli.py makes them)."""
    dock = small_dock(url, name, prompts=2)
    dock.put_experience({"prompts": [torch.ones(2)] * 3}, indexes=[0, 1, 2])
    dock.get_experience("actor_train", ["prompts"], 2)
    return dock


def test_status_lists_the_docks_of_every_primary(cluster, cluster_url, capsys):
    names = names_on_every_primary(cluster)
    docks = [make(cluster_url, name) for name in names]
    assert len({primary_of(cluster, n) for n in names}) == 3
    url = url_not_serving(cluster, names[0])
    assert main(["status", "--url", url]) == 0
    out = capsys.readouterr().out
    for name in names:
        assert f"dock {name}: 4 rows = 2 prompts x 2 samples" in out
    assert [line.split() for line in out.splitlines() if line.strip().startswith("prompts")] == [
        ["prompts", "3/4", "1/2"]] * 3
    assert main(["status", "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == [dock.status() for dock in docks]


def test_status_of_one_dock_from_a_node_not_serving_it(cluster, cluster_url, capsys):
    dock = make(cluster_url, "grpo")
    url = url_not_serving(cluster, "grpo")
    assert main(["status", "grpo", "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == dock.status()
    assert main(["status", "grpo", "--url", url]) == 0
    assert "dock grpo: 4 rows" in capsys.readouterr().out
    assert main(["status", "nope", "--url", url]) == 2
    assert "no dock named 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("as_json", [False, True])
def test_the_live_view_reads_every_primary(cluster, cluster_url, capsys, monkeypatch, as_json):
    names = names_on_every_primary(cluster)
    for name in names:
        make(cluster_url, name)

    def ctrl_c(seconds: float) -> None:  # the view's wait after its first frame: end it as Ctrl-C does
        raise KeyboardInterrupt

    monkeypatch.setattr(broker.ops.watch.time, "sleep", ctrl_c)
    assert main(["status", "--url", url_not_serving(cluster, names[0]), "--watch", "1", *(["--json"] * as_json)]) == 0
    out = capsys.readouterr().out
    if as_json:
        (line,) = out.splitlines()
        assert [d["name"] for d in json.loads(line)["docks"]] == names
    else:
        assert "ERROR" not in out and all(f"dock {name}: 4 rows" in out for name in names)


def test_clear_and_delete_reach_the_data_shards_on_every_primary(cluster, cluster_url, capsys):
    dock = make(cluster_url, "grpo")
    assert len(dock.schema.shards) == 3  # one data shard per primary: the row bytes are on every node
    shard_keys = server_keys(cluster, "td:{grpo~*}:*")
    assert len({cluster.get_node_from_key(k).name for k in shard_keys}) >= 2
    url = url_not_serving(cluster, "grpo")

    assert main(["clear", "grpo", "--url", url, "--yes"]) == 0
    assert "cleared dock grpo" in capsys.readouterr().out
    status = dock.status()
    assert status["columns"]["prompts"]["ready"] == 0 and status["consumers"]["actor_train"]["consumed"] == 0
    assert server_keys(cluster, "td:{grpo~*}:*") == []  # the bytes went with the rows

    dock.put_experience({"prompts": [torch.ones(2)] * 4}, indexes=[0, 1, 2, 3])
    assert server_keys(cluster, "td:{grpo~*}:*") != []
    assert main(["clear", "grpo", "--url", url, "--yes", "--delete"]) == 0
    assert "deleted dock grpo" in capsys.readouterr().out
    assert [k for k in server_keys(cluster, "td:{grpo}:*") if b":reply:" not in k] == []
    assert server_keys(cluster, "td:{grpo~*}:*") == []
    assert main(["status", "grpo", "--url", url]) == 2


def test_exporter_scrapes_every_primary_and_measures_the_data_shards(cluster, cluster_url):
    names = names_on_every_primary(cluster)
    for name in names:
        make(cluster_url, name)
    big = small_dock(cluster_url, "big", prompts=4)
    big.put_experience({"prompts": torch.ones(8, 16_384, dtype=torch.uint8)}, indexes=list(range(8)))
    url = url_not_serving(cluster, names[0])
    client, _ = connect(url)
    server = serve(client, where=url, port=0, addr="127.0.0.1", memory_keys=10_000)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=30) as reply:
            text = reply.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        disconnect(url)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("broker_up", ())] == 1
    assert samples[("broker_docks", ())] == 4
    for name in names:
        assert samples[("broker_column_ready_rows", (("column", "prompts"), ("dock", name)))] == 3
    assert samples[("broker_column_ready_rows", (("column", "prompts"), ("dock", "big")))] == 8
    # 128 kB of rows, all on the data shards: the dock's memory counts them.
    assert samples[("broker_dock_memory_bytes", (("dock", "big"),))] > 8 * 16_384
    assert samples[("broker_dock_memory_bytes", (("dock", names[0]),))] < 8 * 16_384


def test_acl_prints_cluster_rules_covering_the_data_shards(capsys):
    assert main(["acl", "grpo", "--user", "w", "--password", "pw", "--cluster"]) == 0
    out, err = capsys.readouterr()
    command = out.split()
    assert command[:5] == ["ACL", "SETUSER", "w", "on", ">pw"]
    assert {"~td:{grpo}:*", "~td:{grpo~*}:*", "&td:{grpo}:*", "+info", "+cluster|slots", "+spublish"} <= set(command)
    assert "every node" in err
    plain = cli_output(["acl", "grpo"]).split()
    assert "~td:{grpo~*}:*" in plain and "+spublish" not in plain
    assert "+info" in plain  # opening a dock reads the eviction policy from INFO (CONFIG is not granted)
    assert "+cluster|slots" in cli_output(["acl", "--reader", "--cluster"]).split()


def test_acl_apply_refuses_the_placeholder_password(cluster_url, capsys):
    assert main(["acl", "grpo", "--apply", "--url", cluster_url]) == 2
    assert "--password" in capsys.readouterr().err


@pytest.fixture(params=["cluster_url", "cluster62_url"])
def any_cluster(request):
    """A client of the Redis 7 or the Redis 6.2 cluster, emptied, and its URL; drops the test's ACL users."""
    url = request.getfixturevalue(request.param)
    with RedisCluster.from_url(url) as client:
        empty_cluster(client)
        yield client, url
        for node in client.get_nodes():
            node.redis_connection.execute_command("ACL", "DELUSER", "worker-a", "watcher")


def test_acl_apply_sets_the_user_on_every_node_and_confines_it_to_its_dock(any_cluster, capsys):
    cluster, cluster_url = any_cluster
    url = url_not_serving(cluster, "a")
    assert main(["acl", "a", "--user", "worker-a", "--password", "pw-a", "--apply", "--url", url]) == 0
    assert "on all 3 nodes of the Redis Cluster" in capsys.readouterr().out
    for node in cluster.get_nodes():
        assert node.redis_connection.execute_command("ACL", "GETUSER", "worker-a") is not None
    admin_b = make(cluster_url, "b")
    small_dock(cluster_url, "a")  # the admin makes the dock; the worker attaches

    host, port = url.split("//")[1].split("/")[0].split(":")
    worker_url = f"redis://worker-a:pw-a@{host}:{port}/0"
    with TransferDock.attach(worker_url, "a") as dock:
        assert isinstance(dock.client, RedisCluster) and len(dock.schema.shards) == 3
        later = threading.Timer(0.3, lambda: dock.put_experience({"prompts": torch.ones(8, 2)}, list(range(8))))
        later.start()
        batch, rows = dock.get_experience("actor_train", ["prompts"], 4, timeout=30)  # woken by the put
        later.join()
        assert rows == [0, 1, 2, 3] and torch.equal(torch.stack(batch["prompts"]), torch.ones(4, 2))
        leased = dock.get_experience("actor_train", ["prompts"], 4, lease=30)[1]
        assert dock.ack("actor_train", leased) == 4
        dock.clear([0, 1])
        dock.clear()
        assert dock.status()["columns"]["prompts"]["ready"] == 0
        with pytest.raises(RedisCommandError, match="denied"):
            TransferDock.attach(worker_url, "b")
    assert admin_b.status()["columns"]["prompts"]["ready"] == 3  # dock B untouched

    assert main(["acl", "--reader", "--user", "watcher", "--password", "pw-r", "--apply", "--url", url]) == 0
    capsys.readouterr()
    assert main(["status", "--url", f"redis://watcher:pw-r@{host}:{port}/0", "--json"]) == 0
    assert [d["name"] for d in json.loads(capsys.readouterr().out)] == ["a", "b"]


def test_a_plain_client_on_a_node_not_serving_the_dock_gets_a_cluster_error(cluster, cluster_url):
    small_dock(cluster_url, "grpo")
    url = url_not_serving(cluster, "grpo")
    plain = redis.Redis.from_url(url)
    for opening in (lambda: TransferDock.attach(plain, "grpo"), lambda: small_dock(plain, "grpo")):
        with pytest.raises(ClusterError, match=r"is a Redis Cluster node and redirected the call \(MOVED") as info:
            opening()
        assert f"is served by {primary_of(cluster, 'grpo')}" in str(info.value)
        assert "RedisCluster" in str(info.value)  # it says what to do instead
    plain.close()


def test_a_dock_opened_from_a_cluster_url_pickles_as_its_url_and_name(cluster, cluster_url):
    url = url_not_serving(cluster, "grpo")
    dock = small_dock(url, "grpo", policy="random", seed=3)
    dock.put_experience({"prompts": torch.arange(8).reshape(8, 1)}, indexes=list(range(8)))
    _, args = dock.__reduce__()
    assert args[:2] == (url, "grpo")
    back = pickle.loads(pickle.dumps(dock))
    assert isinstance(back.client, RedisCluster) and back.schema == dock.schema
    assert back.status() == dock.status()
    batch, rows = back.get_experience("actor_train", ["prompts"], 4)
    assert [int(v) for v in batch["prompts"]] == rows
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 4
    back.close()
    dock.close()


def test_acl_apply_on_one_server_sets_the_user_there(url, capsys):
    admin = redis.Redis.from_url(url)
    try:
        assert main(["acl", "a", "--user", "worker-a", "--password", "pw-a", "--apply", "--url", url]) == 0
        assert "set ACL user worker-a at" in capsys.readouterr().out
        small_dock(url, "a", shards=2)  # data shards on one server too: the rules cover their keys
        worker_url = url.replace("redis://", "redis://worker-a:pw-a@", 1)
        with TransferDock.attach(worker_url, "a") as dock:
            dock.put_experience({"prompts": torch.ones(8, 2)}, list(range(8)))
            assert dock.get_experience("actor_train", ["prompts"], 8)[1] == list(range(8))
            dock.clear()
            assert dock.status()["columns"]["prompts"]["ready"] == 0
        with pytest.raises(RedisCommandError, match="denied"):
            small_dock(worker_url, "b")
    finally:
        admin.execute_command("ACL", "DELUSER", "worker-a")
        admin.close()
