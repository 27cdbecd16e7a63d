"""docker/docker-compose.cluster.yml: the demo on a Redis Cluster of 3 primaries and 3 replicas.

No Docker engine runs here, so the file is checked for what it promises: every Redis node is a cluster
node with AOF, the one-shot init service forms the cluster over all of them with one replica per
primary, the workers point at one node, and the demo command parses with the real CLI.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from broker.cli import build_parser

yaml = pytest.importorskip("yaml")

COMPOSE = yaml.safe_load((Path(__file__).resolve().parents[2] / "docker" / "docker-compose.cluster.yml").read_text())
SERVICES = COMPOSE["services"]
NODES = sorted(name for name in SERVICES if name.startswith("redis-"))


def test_six_cluster_nodes_with_persistence():
    assert len(NODES) == 6
    for name in NODES:
        command = SERVICES[name]["command"]
        assert command[command.index("--cluster-enabled") + 1] == "yes"
        assert command[command.index("--appendonly") + 1] == "yes"


def test_the_init_service_forms_one_cluster_of_every_node_with_a_replica_each():
    command = SERVICES["cluster-init"]["command"]
    assert "--cluster create" in command and "--cluster-replicas 1" in command
    assert all(f"getent hosts {name} " in command for name in NODES)
    assert set(SERVICES["cluster-init"]["depends_on"]) == set(NODES)
    assert SERVICES["ray-head"]["depends_on"]["cluster-init"]["condition"] == "service_completed_successfully"


def test_the_workers_point_at_a_cluster_node_and_the_demo_parses(monkeypatch):
    for name in ("ray-head", "ray-worker"):
        host = SERVICES[name]["environment"]["REDIS_URL"].split("//")[1].split(":")[0]
        assert host in NODES
    head = SERVICES["ray-head"]["command"]
    demo = head[head.index("broker demo"):].rstrip("\"")
    monkeypatch.setenv("REDIS_URL", SERVICES["ray-head"]["environment"]["REDIS_URL"])
    args = build_parser().parse_args(shlex.split(demo)[1:])
    assert args.redis_url == SERVICES["ray-head"]["environment"]["REDIS_URL"]
