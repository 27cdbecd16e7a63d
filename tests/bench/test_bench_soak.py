"""The soak of ``broker bench``: a short run's accounting, with and without leases and killed clients."""

from __future__ import annotations

import json

import pytest

from broker.bench.soak import GOT, PUT_BEGIN, PUT_DONE, SoakConfig, _account, run_soak
from broker.cli import main

pytestmark = pytest.mark.real

_STATUS = {"consumers": {"soak": {"redelivered": 0}}, "columns": {"payload": {"groups_ready": 2}}}


def test_soak_without_leases_hands_every_item_out_exactly_once(real_url):
    result = run_soak(real_url, "bench-test-soak", SoakConfig(clients=6, seconds=2.0, groups_per_client=2))
    assert result["ok"], result
    assert result["items_put"] > result["config"]["clients"] * 2  # clients recycled groups: items beyond the fill
    assert result["lost"] == result["repeats"] == result["unknown"] == result["corrupt"] == 0
    assert result["drained"] and result["kills"] == 0
    assert {"get", "put", "clear"} <= set(result["latency"]) and result["ops_per_second"] > 0


def test_soak_with_leases_loses_nothing_while_clients_are_killed(real_url):
    # A lease long enough that live clients rarely outlast it on a loaded machine; one that does acks
    # late, and its ack releases nothing (the lease token is no longer on the rows).
    cfg = SoakConfig(clients=6, seconds=3.0, groups_per_client=2, leases=True, kill=True, lease_seconds=2.0,
                     kill_every=0.3)
    result = run_soak(real_url, "bench-test-soak-kill", cfg)
    assert result["ok"], result
    # Some 10 kills are due in 3 s; on a loaded machine a replaced client takes long to start, and 2 were seen.
    assert result["kills"] >= 1 and result["lost"] == 0 and result["unknown"] == 0
    assert result["repeats"] <= result["redelivered_rows"]
    assert "ack" in result["latency"]


def test_the_accounting_catches_lost_and_repeated_items():
    cfg = SoakConfig(clients=1, groups_per_client=2)
    put = [(PUT_BEGIN, g, 0, 0.0, 1.0) for g in range(2)] + [(PUT_DONE, g, 0, 0.0, 1.0) for g in range(2)]

    def account(got: list, config: SoakConfig = cfg, driver: list = put) -> dict:
        return _account(got, driver, config, 0.0, 2.0, _STATUS)

    exact = account([(GOT, 0, 0, 0.001, 1.0), (GOT, 1, 0, 0.001, 1.0)])
    assert exact["ok"]
    lost = account([(GOT, 0, 0, 0.001, 1.0)])
    assert not lost["ok"] and lost["lost"] == 1
    twice = account([(GOT, 0, 0, 0.001, 1.0)] * 2 + [(GOT, 1, 0, 0.001, 1.0)])
    assert not twice["ok"] and twice["repeats"] == 1
    unknown = account([(GOT, 0, 0, 0.0, 1.0), (GOT, 1, 0, 0.0, 1.0), (GOT, 1, 5, 0.0, 1.0)])
    assert not unknown["ok"] and unknown["unknown"] == 1
    # Churn: generation 0 of group 0 was cleared unread (fine); the last generation of each group must be read.
    churn = SoakConfig(clients=1, groups_per_client=2, churn=True)
    regen = put + [(PUT_BEGIN, 0, 1, 0.0, 1.5), (PUT_DONE, 0, 1, 0.0, 1.5)]
    cleared = account([(GOT, 0, 1, 0.0, 1.6), (GOT, 1, 0, 0.0, 1.6)], churn, regen)
    assert cleared["ok"] and cleared["cleared_unread"] == 1 and cleared["lost"] == 0
    final_lost = account([(GOT, 0, 0, 0.0, 1.2), (GOT, 1, 0, 0.0, 1.6)], churn, regen)
    assert not final_lost["ok"] and final_lost["lost"] == 1


def test_soak_with_a_driver_clearing_while_clients_read_repeats_and_mixes_nothing(real_url):
    result = run_soak(real_url, "bench-test-soak-churn", SoakConfig(clients=4, seconds=2.0, churn=True))
    assert result["ok"], result
    assert result["repeats"] == result["corrupt"] == result["unknown"] == result["lost"] == 0
    assert result["churn"]["whole_clears"] > 10 and result["churn"]["partial_clears"] > 10
    assert result["cleared_unread"] > 0 and result["items_consumed"] > 100  # the race really ran


def test_kill_without_leases_is_refused(real_url):
    with pytest.raises(ValueError, match="needs leases"):
        run_soak(real_url, "bench-test-soak-refused", SoakConfig(kill=True))


def test_the_soak_from_the_command_line(real_url, capsys):
    assert main(["bench", "--url", real_url, "--soak", "--clients", "4", "--seconds", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["soak"]["ok"] and report["soak"]["config"]["clients"] == 4


@pytest.mark.slow
def test_the_tenants_soak_runs_a_tenant_beside_a_hostile_one_and_cleans_up(capsys):
    """``broker bench --tenants`` on its private Redis 7: the normal tenant's accounting holds in both phases,
    every scrape is answered, the hostile tenant's scripts are refused and its oversized put meets its quota;
    the users and keys it made are gone after."""
    from broker.ops.local_redis import RedisServer

    with RedisServer() as server:
        assert main(["bench", "--tenants", "--clients", "2", "--seconds", "1.5", "--rounds", "1",
                     "--url", server.url]) == 0
        report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tenants"]
        assert report["ok"] and report["scrapes"]["total"] > 0 and not report["scrapes"]["failed"]
        for phase in ("alone", "beside_hostile"):
            assert report[phase]["lost"] == report[phase]["corrupt"] == 0 and report[phase]["calls_per_second"] > 0
        attempts = report["hostile_attempts"]
        assert attempts.get("eval while true: NoPermissionError") and attempts.get("function load: NoPermissionError")
        assert attempts.get("put past its quota: QuotaExceededError")
        assert set(report["slowdown"]) >= {"calls_per_second", "p99 get"}
        client = server.client()
        assert client.dbsize() == 0 or all(b":reply:" in k for k in client.keys("*"))
        users = [u.decode() if isinstance(u, bytes) else u for u in client.acl_users()]
        assert [u for u in users if u.startswith("bench-")] == []


def test_the_tenants_soak_refuses_redis_62(redis62_url, capsys):
    assert main(["bench", "--tenants", "--clients", "1", "--seconds", "0.5", "--rounds", "1",
                 "--url", redis62_url]) == 2
    assert "6.2 is for trusted tenants only" in capsys.readouterr().err


def test_the_tenants_soak_refuses_a_cluster(cluster_url, capsys):
    assert main(["bench", "--tenants", "--clients", "1", "--seconds", "0.5", "--rounds", "1",
                 "--url", cluster_url]) == 2
    assert "runs on one server" in capsys.readouterr().err
