"""The broker command against a real redis-server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import redis
import torch

from broker import TransferDock
from broker.cli import main
from tests.helpers import small_dock

pytestmark = pytest.mark.real


def make(url: str, name: str) -> TransferDock:
    """A dock with three prompts written and two of them consumed: something for status to show."""
    dock = small_dock(url, name, prompts=2)
    dock.put_experience({"prompts": [torch.ones(2)] * 3}, indexes=[0, 1, 2])
    dock.get_experience("actor_train", ["prompts"], 2)
    return dock


def test_status_table_of_every_dock(url, capsys):
    make(url, "grpo")
    make(url, "ppo")
    assert main(["status", "--url", url]) == 0
    out = capsys.readouterr().out
    assert "dock grpo: 4 rows = 2 prompts x 2 samples" in out and "dock ppo:" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("prompts"))
    assert line.split() == ["prompts", "3/4", "1/2"]
    line = next(x for x in out.splitlines() if x.strip().startswith("actor_train"))
    assert line.split() == ["actor_train", "2/4", "0", "0", "0"]


def test_status_json_of_one_dock(url, capsys):
    dock = make(url, "grpo")
    assert main(["status", "grpo", "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == dock.status()


def test_status_of_a_missing_dock_and_of_an_empty_server(url, capsys):
    assert main(["status", "nope", "--url", url]) == 2
    assert "no dock named 'nope'" in capsys.readouterr().err
    assert main(["status", "--url", url]) == 0
    assert "no docks at" in capsys.readouterr().out


def test_status_reports_a_broken_dock_and_lists_the_others(url, capsys):
    make(url, "good")
    redis.Redis.from_url(url).hset("td:{bad}:meta", "format_version", "oops")
    assert main(["status", "--url", url, "--json"]) == 1
    reports = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in reports] == ["bad", "good"]
    assert "DecodeError" in reports[0]["error"] and "td:{bad}:meta" in reports[0]["error"]


def test_status_reports_a_tenants_garbage_meta_and_a_stray_key_and_lists_the_others(url, capsys):
    make(url, "good")
    make(url, "deep")
    admin = redis.Redis.from_url(url)
    admin.hset("td:{deep}:meta", "columns", "[" * 100_000)  # nested past Python's recursion limit
    admin.hset("td:{a b}:meta", "format_version", "1")  # a name no dock may have
    assert main(["status", "--url", url, "--json"]) == 1
    reports = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert sorted(reports) == ["a b", "deep", "good"] and "error" not in reports["good"]
    assert "DecodeError" in reports["deep"]["error"] and "td:{deep}:meta" in reports["deep"]["error"]
    assert "td:{a b}:meta" in reports["a b"]["error"]
    assert main(["status", "--url", url]) == 1
    out = capsys.readouterr()
    assert "dock good:" in out.out and "deep" in out.out + out.err and "a b" in out.out + out.err


def test_clear_needs_yes(url, capsys):
    dock = make(url, "grpo")
    assert main(["clear", "grpo", "--url", url]) == 2
    assert "--yes" in capsys.readouterr().err
    assert dock.status()["columns"]["prompts"]["ready"] == 3
    assert main(["clear", "grpo", "--url", url, "--yes"]) == 0
    assert dock.status()["columns"]["prompts"]["ready"] == 0
    assert dock.status()["consumers"]["actor_train"]["consumed"] == 0


def test_clear_delete_removes_the_dock_so_it_can_be_made_with_another_size(url, capsys):
    make(url, "resized")
    assert main(["clear", "resized", "--url", url, "--yes", "--delete"]) == 0
    assert "deleted dock resized" in capsys.readouterr().out
    left = redis.Redis.from_url(url).keys("td:{resized}:*")
    assert [k for k in left if b":reply:" not in k] == []  # sampling replies expire by themselves


def test_unreachable_server_is_a_clear_error(capsys, no_retry_pauses):
    assert main(["status", "--url", "redis://127.0.0.1:1/0"]) == 1
    assert "127.0.0.1:1" in capsys.readouterr().err


def test_console_script_reads_redis_url_from_the_environment(url):
    make(url, "grpo")
    env = {**os.environ, "REDIS_URL": url}
    out = subprocess.run([sys.executable, "-m", "broker", "status", "grpo"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "dock grpo:" in out.stdout


def test_a_reader_that_goes_away_ends_the_command_quietly(url):
    """``broker status | head``: the pipe's reader is gone before the table is written. A Unix tool ends quietly
    (a shell reports 141, SIGPIPE's); the command printed a BrokenPipeError traceback instead."""
    make(url, "grpo")
    read, write = os.pipe()
    os.close(read)  # head has read its lines and left
    try:
        out = subprocess.run([sys.executable, "-m", "broker", "status", "--url", url], stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert out.returncode == 141 and out.stderr == ""


#: What an operator's command must not load: the dock's data plane with torch, Ray and the workers, the benchmarks.
HEAVY = ("torch", "ray", "workers", "broker.bench", "broker.api.dock")


def _imported(*argv: str) -> set[str]:
    """The modules ``python -m broker.cli ARGV`` imported (python -X importtime lists each on stderr)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "broker.cli", *argv], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("argv", [["status"], ["exporter"], ["acl", "x"], ["clear"], ["dead"], ["functions"], []],
                         ids=["status", "exporter", "acl", "clear", "dead", "functions", "broker"])
def test_an_operators_command_loads_no_torch_ray_demo_or_benchmark(argv, url):
    """Every command's help, and status and acl run against a server, import none of HEAVY. Before, importing
    any part of the package imported all of it: ``broker status --help`` took 1.9 s here, 1.5 s of it torch
    (9.3 s on a loaded 2-core machine), for a command that never touches a tensor."""
    runs = [[*argv, "--help"]]
    if argv and argv[0] in ("status", "acl"):
        make(url, "light")
        runs.append([*argv, "--url", url] if argv[0] == "status" else ["acl", "light", "--url", url])
    for run in runs:
        heavy = sorted(m for m in _imported(*run) if m.split(".")[0] in HEAVY or m.startswith(HEAVY))
        assert not heavy, f"broker {' '.join(run)} imported {heavy[:8]}"


def test_the_commands_that_need_them_still_load_the_demo_and_the_benchmark():
    assert "broker.bench.options" in _imported("bench", "--help")
    assert "workers.options" in _imported("demo", "--help")
