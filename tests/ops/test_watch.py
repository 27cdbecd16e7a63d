"""``broker status --watch``: under a pseudo-terminal, piped, as JSON lines, and through an outage."""

from __future__ import annotations

import io
import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time

import pytest
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from broker.connection import redis_errors
from broker.control.status import Survey
from broker.ops.local_redis import free_port
from broker.ops.watch import counts, rates, watch
from tests.helpers import interruptible, small_dock

pytestmark = pytest.mark.real


def test_rates_are_rows_per_second_between_readings():
    def reading(ready: int, consumed: int):
        status = {"columns": {"prompts": {"ready": ready}}, "consumers": {"actor": {"consumed": consumed}}}
        return [("grpo", status)]

    got = rates(counts(reading(2, 0)), counts(reading(8, 4)), 2.0)
    assert got.ready == {("grpo", "prompts"): 3.0} and got.consumed == {("grpo", "actor"): 2.0}
    cleared = rates(counts(reading(8, 4)), counts(reading(0, 0)), 4.0)
    assert cleared.ready == {("grpo", "prompts"): -2.0}  # a clear drains
    appeared = rates(counts([]), counts(reading(8, 4)), 1.0)
    assert appeared.ready == {} and appeared.consumed == {}  # no rate before a dock's first reading


class Frames(io.StringIO):
    """Output that wakes a waiter at every frame."""

    def __init__(self) -> None:
        super().__init__()
        self.frames = threading.Semaphore(0)

    def write(self, text: str) -> int:
        if text.endswith("\n\n"):
            self.frames.release()
        return super().write(text)


def test_piped_output_appends_frames_without_escapes(url):
    dock = small_dock(url, "grpo")
    out = Frames()
    client = redis.Redis.from_url(url)

    def fill_after_first_frame() -> None:
        out.frames.acquire(timeout=30)
        dock.put_experience({"prompts": torch.ones(4, 1)}, indexes=[0, 1, 2, 3])

    filler = threading.Thread(target=fill_after_first_frame)
    filler.start()
    assert watch(Survey(client), 0.5, out, where=url, readings=2) == 0
    filler.join()
    text = out.getvalue()
    assert "\x1b" not in text
    first, second = text.split(f"{url}  every 0.5s")[1:]  # each frame starts with its header
    row = next(line for line in first.splitlines() if line.strip().startswith("prompts"))
    assert row.split() == ["prompts", "0/8", "0/4", "-"]
    row = next(line for line in second.splitlines() if line.strip().startswith("prompts"))
    ready, groups, rate = row.split()[1:]
    assert (ready, groups) == ("4/8", "2/4") and float(rate) > 0


def test_json_lines_one_per_reading(url):
    small_dock(url, "grpo").put_experience({"prompts": torch.ones(2, 1)}, indexes=[0, 1])
    out = io.StringIO()
    watch(Survey(redis.Redis.from_url(url)), 0.05, out, where=url, as_lines=True, readings=3)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 3
    assert all(line["docks"][0]["columns"]["prompts"]["ready"] == 2 for line in lines)


def test_an_outage_is_shown_and_the_view_goes_on():
    # No retries: redis-py's own 10 (3 s a reading) would try the client's patience, not the view.
    client = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    out = io.StringIO()
    where = "redis://127.0.0.1:closed"
    assert watch(Survey(client), 0.05, out, where=where, readings=2, guard=lambda: redis_errors(where)) == 0
    assert out.getvalue().count("ERROR Redis at") == 2


def json_watch(url: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "broker", "status", "--url", url, "--watch", "0.2", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=interruptible)


def test_a_dock_made_while_it_watches_shows_at_its_next_frame(url):
    """The watch rescanned for new docks every 60 s: a dock made meanwhile was missing for a minute."""
    small_dock(url, "first")
    proc = json_watch(url)
    try:
        assert [d["name"] for d in json.loads(proc.stdout.readline())["docks"]] == ["first"]
        small_dock(url, "second")
        proc.stdout.readline()  # a frame possibly read before the dock was made
        names = [d["name"] for d in json.loads(proc.stdout.readline())["docks"]]
        assert names == ["first", "second"]
    finally:
        proc.kill()
        proc.wait()


def test_json_lines_say_so_during_an_outage_and_go_on_after_it():
    """Killed or hung, the server left the JSON stream silent for the reading's reconnect attempts (its
    --timeout, 30 s): no line said Redis was gone."""
    from broker.ops.local_redis import RedisServer

    port = free_port()
    server = RedisServer(port=port).start()
    small_dock(server.url, "grpo")
    proc = json_watch(server.url)
    lines: list[tuple[float, dict]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), json.loads(line))
                                                          for line in proc.stdout), daemon=True)
    reader.start()
    try:
        while not lines:
            time.sleep(0.05)
        for outage in ("hung", "killed"):
            if outage == "hung":
                os.kill(server.proc.pid, signal.SIGSTOP)
            else:
                server.stop(kill=True)
            began = time.monotonic()
            time.sleep(6)
            # A reading gives up within two frames, or 1 s: several lines saying so, not silence.
            errors = [line for at, line in lines if at > began and "Redis at" in line.get("error", "")]
            assert len(errors) >= 2, (outage, lines[-3:])
            # A reading changes nothing: it must not say it may have been applied, as a put's timeout does.
            assert not [e for e in errors if "may or may not" in e["error"]], errors[-1]
            if outage == "hung":
                os.kill(server.proc.pid, signal.SIGCONT)
        server = RedisServer(port=port).start()  # back, empty: the view goes on
        began = time.monotonic()
        time.sleep(3)
        assert any(at > began and line.get("docks") == [] for at, line in lines), lines[-3:]
    finally:
        proc.kill()
        proc.wait()
        server.stop(kill=True)


def test_under_a_terminal_it_redraws_in_place_and_ends_cleanly_on_ctrl_c(url):
    dock = small_dock(url, "grpo")
    parent, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "broker", "status", "grpo", "--url", url, "--watch", "0.2"],
        stdin=child, stdout=child, stderr=child, close_fds=True, env={**os.environ, "COLUMNS": "100", "LINES": "40"},
        preexec_fn=interruptible,
    )
    os.close(child)
    seen = b""

    def read_until(predicate, seconds: float = 60) -> None:
        nonlocal seen
        deadline = time.monotonic() + seconds
        while not predicate(seen) and time.monotonic() < deadline:
            ready, _, _ = select.select([parent], [], [], 0.5)
            if ready:
                try:
                    seen += os.read(parent, 65536)
                except OSError:  # the child closed the terminal
                    return

    try:
        read_until(lambda s: s.count(b"\x1b[H\x1b[J") >= 2)
        dock.put_experience({"prompts": torch.ones(4, 1)}, indexes=[0, 1, 2, 3])
        read_until(lambda s: b"4/8" in s)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        read_until(lambda s: s.endswith(b"\x1b[?25h\r\n"), 5)
    finally:
        proc.kill()
        proc.wait()
        os.close(parent)
    assert seen.startswith(b"\x1b[?25l")  # cursor hidden while redrawing
    assert seen.count(b"\x1b[H\x1b[J") >= 3  # frames drawn over each other, not appended
    assert b"4/8" in seen and b"Ctrl-C ends" in seen
    assert b"Traceback" not in seen and b"KeyboardInterrupt" not in seen
    assert seen.endswith(b"\x1b[?25h\r\n")  # cursor shown again


def test_watch_needs_a_positive_number_of_seconds(url, capsys):
    from broker.cli import main

    for bad in ("0", "-1", "soon", "inf"):
        with pytest.raises(SystemExit):
            main(["status", "--url", url, "--watch", bad])
        assert "seconds" in capsys.readouterr().err
