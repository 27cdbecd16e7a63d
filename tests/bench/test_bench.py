"""``broker bench`` on a tiny batch: every mode runs on a real redis-server and every system's checksums agree."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import redis
import torch

from broker.bench.docks import BenchDock
from broker.bench.inprocess import InProcessDock
from broker.bench.large_workload import LargeWorkload, as_bytes, checksum, make_batch
from broker.bench.pipeline import run_pipeline
from broker.bench.redis_floor import RedisFloorDock
from broker.bench.resp import RespConnection, command_parts
from broker.bench.sampling import ages_latency
from broker.bench.workload import Rows, Workload
from broker.cli import main

pytestmark = pytest.mark.real

TINY = ["--prompts", "8", "--n", "4", "--groups-per-call", "2"]
WORKLOAD = Workload(prompts=8, n=4, groups_per_call=2)


def _json_line(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_every_mode_and_every_system_agree_and_no_key_is_left(real_url, capsys):
    client = redis.Redis.from_url(real_url)
    client.flushdb()
    args = ["bench", "--url", real_url, *TINY, "--repeat", "1", "--warmup", "0", "--per-stage", "1",
            "--sampling-sizes", "64,256", "--sampling-calls", "10"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "checksums all equal" in out and "equal to the sequential run" in out
    report = _json_line(out)
    systems = report["pipeline"]["systems"]
    assert set(systems) == {"broker", "broker-random", "adapter", "adapter-ray", "ray", "redis-floor", "inprocess"}
    assert report["pipeline"]["checksums_equal"]
    assert len({s["checksum"] for s in systems.values()}) == 1
    assert systems["broker"]["ratio_to_broker"] == 1.0
    floor = systems["redis-floor"]["server_per_pass"]
    assert floor["scripts"] == 0 < floor["commands"]
    assert set(systems["broker"]["stages"]) == {"load", *WORKLOAD.consumers}
    concurrent = report["concurrent"]["systems"]
    assert set(concurrent) == {"broker", "adapter", "adapter-ray", "ray"}  # every system processes can share
    assert {c["checksum"] for c in concurrent.values()} == {systems["broker"]["checksum"]}
    assert set(report["sampling"]["sizes"]) == {"64", "256"}
    ages = report["sampling"]["ages"]
    assert set(ages["sizes"]) == {"256"}  # 64 rows are too few groups to spread over every age
    aged = ages["sizes"]["256"]
    assert all(count > 0 for count in aged["groups_by_age"].values()) and len(aged["groups_by_age"]) == 5
    plain = report["sampling"]["sizes"]["256"]["fifo"]
    for kind in ("trainer", "rollout"):
        assert aged[kind]["calls"] > 0 and aged[kind]["p99_ms"] >= aged[kind]["p50_ms"] > 0
        assert aged[kind]["server_us_per_get"] > 0
        assert aged[f"{kind}_over_plain"]["p99"] == aged[kind]["p99_ms"] / plain["p99_ms"]
    assert "with ages in play" in out
    assert report["targets"]["sampling_p99_ages_ms"]["rows"] == 256
    assert report["balance"]["balanced_max"] <= report["balance"]["naive_max"]
    assert report["memory"]["payload_bytes"] == WORKLOAD.payload_bytes()
    assert report["memory"]["systems"]["broker"]["per_payload_byte"] > 1.0
    assert set(report["targets"]) == {"broker_over_floor", "ray_over_broker", "sampling_p99_ms", "sampling_growth",
                                      "sampling_p99_ages_ms", "memory_per_payload_byte", "adapter_over_broker",
                                      "adapter_over_native", "ray_over_adapter_ray",
                                      "dp_balance_max_over_mean",
                                      "concurrent_adapter_over_broker", "concurrent_ray_over_adapter_ray"}
    assert client.dbsize() == 0  # a user's server gets back exactly what it had


def test_exporter_mode_scrapes_in_one_round_trip_and_cleans_up(real_url, capsys):
    client = redis.Redis.from_url(real_url)
    client.flushdb()
    assert main(["bench", "--url", real_url, "--exporter", "--exporter-docks", "20", "--exporter-scrapes", "3"]) == 0
    out = capsys.readouterr().out
    assert "exporter scrape of 20 docks" in out
    report = _json_line(out)
    assert "pipeline" not in report  # naming --exporter runs it alone
    for label in ("with_memory", "counts_only"):
        assert report["exporter"][label]["round_trips"] == 1.0
        assert report["exporter"][label]["server_ms"] > 0
    assert client.dbsize() == 0


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_without_url_it_starts_a_private_server_and_says_so(capsys):
    assert main(["bench", *TINY, "--pipeline", "--systems", "broker,inprocess", "--repeat", "1", "--warmup", "0",
                 "--json"]) == 0
    captured = capsys.readouterr()
    assert "started a private Redis" in captured.err
    report = _json_line(captured.out)
    assert report["redis"]["private"] and report["pipeline"]["checksums_equal"]
    assert len(captured.out.strip().splitlines()) == 1  # --json: nothing but the JSON line
    # The server's own work per pass, beside the times: the broker's commands and scripts, none in-process.
    work = {name: s["server_per_pass"] for name, s in report["pipeline"]["systems"].items()}
    assert work["broker"]["commands"] > work["broker"]["scripts"] > 0 and work["broker"]["cpu_seconds"] > 0
    assert work["inprocess"]["commands"] == work["inprocess"]["scripts"] == 0


def test_a_corrupted_stage_output_changes_the_checksum():
    good = run_pipeline("inprocess", InProcessDock(WORKLOAD), WORKLOAD).checksums
    ref = WORKLOAD.stage("ref_log_prob")

    def off_by_one_ulp(batch: Rows, rows: list[int]) -> Rows:
        out = ref.fn(batch, rows)
        first = out["ref_log_prob"][0]
        out["ref_log_prob"][0] = torch.nextafter(first, torch.full_like(first, 1.0))
        return out

    stages = [dataclasses.replace(ref, fn=off_by_one_ulp) if s.name == ref.name else s for s in WORKLOAD.stages]
    bad = run_pipeline("inprocess", InProcessDock(WORKLOAD), WORKLOAD, stages=stages).checksums
    assert bad.total() != good.total()
    changed = {s for s, h in bad.by_stage().items() if h != good.by_stage()[s]}
    assert changed == {"ref_log_prob", "actor_train"}  # the bad output, and the trainer that read it


class _FlipOneByte:
    """A dock whose reads hand back one damaged cell: the checksum must notice bytes damaged in transit."""

    def __init__(self, inner: BenchDock, column: str):
        self.inner, self.column, self.done = inner, column, False

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def get(self, consumer: str, columns: tuple[str, ...], count: int) -> tuple[Rows, list[int]]:
        batch, rows = self.inner.get(consumer, columns, count)
        if self.column in columns and not self.done:
            damaged = batch[self.column][-1].clone()
            damaged.view(torch.uint8)[-1] ^= 1
            batch[self.column][-1] = damaged
            self.done = True
        return batch, rows


def test_bytes_damaged_in_transit_change_the_checksum(real_url):
    floor = RedisFloorDock(real_url, "bench-test-flip", WORKLOAD)
    try:
        good = run_pipeline("redis-floor", floor, WORKLOAD).checksums
        floor.reset()
        bad = run_pipeline("redis-floor", _FlipOneByte(floor, "responses"), WORKLOAD).checksums
    finally:
        floor.close()
    assert bad.total() != good.total()
    assert bad.by_stage()["ref_log_prob"] != good.by_stage()["ref_log_prob"]


def test_sampling_with_ages_walks_the_emptied_oldest_ages_and_cleans_up(real_url):
    client = redis.Redis.from_url(real_url)
    client.flushdb()
    assert ages_latency(real_url, "bench-test-ages-small", 160, calls=5) is None  # 19 groups: too few per age
    aged = ages_latency(real_url, "bench-test-ages", 512, calls=5)
    assert aged is not None
    # 63 groups in 5 cohorts and the spare one: every age holds groups, the two oldest taken by the trainer.
    assert aged["groups_by_age"] == {"0": 13, "1": 12, "2": 13, "3": 13, "4": 13}
    assert aged["trainer"]["calls"] == 5 and aged["rollout"]["calls"] == 5
    assert client.dbsize() == 0


LARGE_TINY = ["--large", "--batch", "16", "--fields", "3", "--seq-len", "64", "--repeat", "1", "--warmup", "0"]


@pytest.mark.slow
def test_large_mode_moves_every_kind_of_column_intact_and_cleans_up(real_url, capsys):
    client = redis.Redis.from_url(real_url)
    client.flushdb()
    # 3 fields: the complex variant has one regular, one ragged and one string column.
    assert main(["bench", "--url", real_url, *LARGE_TINY, "--complex", "--large-sizes", "8,16",
                 "--large-systems", "broker,redis-floor,redis-floor-2conn"]) == 0
    out = capsys.readouterr().out
    report = _json_line(out)
    assert "pipeline" not in report and "workload" not in report  # naming --large runs it alone
    large = report["large"]
    assert large["checks_equal"] and large["server"]["allocator"] and large["server"]["version"]
    assert [(r["variant"], r["batch"]) for r in large["runs"]] == [("plain", 8), ("plain", 16), ("complex", 8),
                                                                    ("complex", 16)]
    for run in large["runs"]:
        assert set(run["systems"]) == {"broker", "redis-floor", "redis-floor-2conn"}
        for s in run["systems"].values():
            assert s["checks_equal"] and s["put_seconds"] > 0 and s["get_seconds"] > 0 and s["first_put_seconds"] > 0
            assert "memory_per_payload_byte" in s  # at a few KB per column, server noise can outweigh it
        b, f, f2 = (run["systems"][s] for s in ("broker", "redis-floor", "redis-floor-2conn"))
        assert run["ratios"]["broker_put_over_floor"] == b["put_seconds"] / f["put_seconds"]
        assert run["ratios"]["broker_put_over_floor_2conn"] == b["put_seconds"] / f2["put_seconds"]
    assert set(report["targets"]) == {"large_put_over_floor", "large_complex_put_over_floor",
                                      "large_put_over_floor_2conn", "large_memory_per_payload_byte"}
    assert report["targets"]["large_put_over_floor"]["rows"] == 16  # judged at --batch
    assert "large batches" in out and "complex: 16 rows x 3 columns x 64" in out and "floor, 2 conns" in out
    assert client.dbsize() == 0


def test_large_mode_skips_transferqueue_where_it_does_not_import(real_url, capsys, tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'No module named transfer_queue' >&2\nexit 1\n")
    python.chmod(0o755)
    assert main(["bench", "--url", real_url, *LARGE_TINY, "--large-systems", "redis-floor,transferqueue",
                 "--tq-python", str(python)]) == 0
    captured = capsys.readouterr()
    assert "cannot import transfer_queue (No module named transfer_queue): skipping" in captured.err
    report = _json_line(captured.out)
    assert report["large"]["systems"] == ["redis-floor"]
    assert set(report["large"]["runs"][0]["systems"]) == {"redis-floor"}


def test_large_checksums_agree_across_shapes_and_catch_one_flipped_byte():
    w = LargeWorkload(batch=6, fields=3, seq_len=16, complex=True)
    batch = make_batch(w)
    good = checksum(batch, w.names())
    regular, ragged, string = w.names()
    as_rows = {regular: list(batch[regular]), ragged: torch.nested.as_nested_tensor(batch[ragged],
                                                                                    layout=torch.jagged),
               string: batch[string]}
    assert checksum(as_rows, w.names()) == good  # stacked or rows, jagged or a list: the same bytes
    damaged = batch[regular].clone()
    damaged.view(torch.uint8)[3, 5] ^= 1
    assert checksum({**batch, regular: damaged}, w.names())[regular] != good[regular]
    assert w.ragged_lengths() == [1, 4, 7, 10, 13, 16]  # perftest's progression from 1 to seq_len


def test_the_raw_floor_frames_commands_around_views_of_the_payload(real_url):
    conn = RespConnection(real_url)
    try:
        payload = torch.arange(2048, dtype=torch.float32)  # 8 KB: sent as a view, not copied into the framing
        parts = command_parts([b"SET", b"bench:{raw}:x", as_bytes(payload)])
        assert any(isinstance(p, memoryview) for p in parts)
        assert conn.call([b"SET", b"bench:{raw}:x", as_bytes(payload)]) == b"OK"
        dest = torch.empty(2048, dtype=torch.float32)
        conn.send(command_parts([b"MGET", b"bench:{raw}:x", b"bench:{raw}:missing"]))
        got = conn.reply(lambda i, size: as_bytes(dest) if i == 0 else None)
        assert got[1] is None and torch.equal(dest, payload)  # received straight into the destination
        assert conn.call([b"DEL", b"bench:{raw}:x"]) == 1
    finally:
        conn.close()


PERFTEST_TINY = ["--tq-perftest", "--batch", "16", "--fields", "3", "--seq-len", "64", "--repeat", "1",
                 "--warmup", "0"]


def test_tq_perftest_edits_only_the_package_name():
    from broker.bench.tq_perftest import renamed

    script = "import ray\nimport transfer_queue as tq\nfrom transfer_queue.metadata import BatchMeta\nx = 1\n"
    assert renamed(script) == ("import ray\nimport broker.transfer_queue as tq\n"
                               "from broker.transfer_queue.metadata import BatchMeta\nx = 1\n")


def test_tq_perftest_runs_the_native_api_in_perftest_by_its_import_alone():
    from broker.bench.tq_perftest import on_native_api

    script = "import ray\nimport transfer_queue as tq\nx = tq.kv_batch_put\n"
    assert on_native_api(script) == "import ray\nimport broker.bench.tq_native as tq\nx = tq.kv_batch_put\n"
    with pytest.raises(ValueError, match="no longer says"):
        on_native_api("import ray\n")


def test_tq_perftest_is_skipped_saying_why_without_the_wheel(real_url, capsys, tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'No module named transfer_queue' >&2\nexit 1\n")
    python.chmod(0o755)
    assert main(["bench", "--url", real_url, *PERFTEST_TINY, "--tq-python", str(python)]) == 0
    captured = capsys.readouterr()
    assert "cannot import transfer_queue (No module named transfer_queue): skipping --tq-perftest" in captured.err
    report = _json_line(captured.out)
    assert "tq_perftest" not in report and not report["targets"]


@pytest.mark.once  # minutes: run once by .ci/run, apart from the README's test command
@pytest.mark.slow
def test_tq_perftest_runs_the_wheels_benchmark_as_it_is_and_through_the_drop_in(real_url, capsys):
    pytest.importorskip("transfer_queue")
    pytest.importorskip("ray")
    client = redis.Redis.from_url(real_url)
    client.flushdb()
    assert main(["bench", "--url", real_url, *PERFTEST_TINY]) == 0
    out = capsys.readouterr().out
    report = _json_line(out)
    perftest = report["tq_perftest"]
    assert perftest["edits"] == ["import transfer_queue as tq -> import broker.transfer_queue as tq"]
    assert perftest["perftest"].endswith("scripts/performance_test/perftest.py")
    (run,) = perftest["runs"]
    assert run["variant"] == "plain" and run["batch"] == 16
    assert set(run["systems"]) == {"transferqueue", "drop-in", "broker"}
    for s in run["systems"].values():
        assert s["put_seconds"] > 0 and s["get_seconds"] > 0
    dropin = run["systems"]["drop-in"]
    # Read from the drop-in's embedded server, found through the run's Ray: the one the drop-in started.
    assert dropin["server"]["version"] and dropin["server"]["allocator"]
    assert dropin["memory_per_payload_byte"] > 0 and "reading_errors" not in dropin
    # The actors' CPU, read from this run's Ray processes: perftest's two TQClientActors in both runs,
    # TransferQueue's storage units in its own.
    tq_roles = run["systems"]["transferqueue"]["actor_cpu_seconds"]
    assert "TQClientActor put" in dropin["actor_cpu_seconds"] and "TQClientActor get" in tq_roles
    assert any(role.startswith("SimpleStorageUnit") for role in tq_roles)
    assert 0 <= dropin["caller_cpu_put_seconds"] <= dropin["actor_cpu_put_seconds"]
    assert "caller's CPU s (medians" in out and "every Ray actor's CPU s" in out
    # The native API ran in perftest too (broker/bench/tq_native.py), read on the benchmark's own server.
    native = run["systems"]["broker"]
    assert "TQClientActor put" in native["actor_cpu_seconds"] and native["memory_per_payload_byte"] > 0
    assert native["server"]["version"] and "reading_errors" not in native
    d, t, b = dropin, run["systems"]["transferqueue"], run["systems"]["broker"]
    assert run["ratios"]["dropin_get_speed_over_tq"] == t["get_seconds"] / d["get_seconds"]
    assert run["ratios"]["dropin_put_speed_over_native"] == b["put_seconds"] / d["put_seconds"]
    assert set(report["targets"]) == {"tq_perftest_get_over_tq", "tq_perftest_put_over_native",
                                      "tq_perftest_memory_per_payload_byte"}
    assert "TransferQueue's perftest" in out and "drop-in" in out
    # The native system's dock is gone but for the replies its calls keep for resends, which expire by themselves
    # (lua/include/once.lua); the drop-in's data was on its own server.
    left = client.keys("*")
    assert all(b":reply:" in k and 0 < client.pttl(k) <= 60_000 for k in left), left
