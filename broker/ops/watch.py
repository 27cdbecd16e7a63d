"""``broker status --watch``: the status table redrawn in place, with rows per second filling and draining.

On a terminal each frame is drawn over the last (cursor home, clear to the end: plain ANSI, which
every terminal and tmux take, so no dependency); the frame is cut to the terminal's height, as a
frame that scrolled would be drawn over the wrong lines. Piped into a file or another program, each
frame is printed after the last with a time stamp and no escape codes, or, with ``--json``, as one
JSON line per reading. Ctrl-C ends it, with the last frame left on the screen and the cursor shown.

A reading that fails (Redis restarting, a network cut) is shown in the frame and the view goes on:
an operator watching a restart wants to see the docks come back, not a traceback.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, TextIO

from broker.control.status import Survey
from broker.errors import BrokerError

_HOME_AND_CLEAR = "\x1b[H\x1b[J"
_HIDE_CURSOR, _SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"


@dataclass
class Rates:
    """Rows per second since the previous reading: per (dock, column) ready, per (dock, consumer) consumed.

    A clear between two readings shows as a negative rate: the rows went away.
    """

    ready: dict[tuple[str, str], float] = field(default_factory=dict)
    consumed: dict[tuple[str, str], float] = field(default_factory=dict)


def counts(docks: list[tuple[str, Any]]) -> dict[str, dict[tuple[str, str], int]]:
    """The counts that rates are computed from, keyed like :class:`Rates`."""
    ready, consumed = {}, {}
    for name, status in docks:
        if isinstance(status, dict):
            ready.update({(name, c): s["ready"] for c, s in status["columns"].items()})
            consumed.update({(name, c): s["consumed"] for c, s in status["consumers"].items()})
    return {"ready": ready, "consumed": consumed}


def rates(before: dict[str, dict[tuple[str, str], int]], after: dict[str, dict[tuple[str, str], int]],
          seconds: float) -> Rates:
    """Rates between two ``counts``; a dock or column that appeared in between has none yet."""
    def per_second(kind: str) -> dict[tuple[str, str], float]:
        old, new = before[kind], after[kind]
        return {k: (v - old[k]) / seconds for k, v in new.items() if k in old} if seconds > 0 else {}

    return Rates(per_second("ready"), per_second("consumed"))


def format_table(status: dict[str, Any], rates: Rates | None = None) -> str:
    """A dock's status as a small table; with ``rates``, a rows-per-second column beside each count."""
    cap, n, groups, name = status["capacity"], status["n_samples_per_prompt"], status["prompts_num"], status["name"]
    lines = [f"dock {name}: {cap} rows = {groups} prompts x {n} samples"]
    width = max(len(c) for c in [*status["columns"], *status["consumers"], "consumer"]) + 2

    def rate(table: dict[tuple[str, str], float], key: str) -> str:
        if rates is None:
            return ""
        value = table.get((name, key))
        return f"{'-' if value is None else f'{value:+.1f}':>10}"

    per_second = f"{'rows/s':>10}" if rates else ""
    lines.append(f"  {'column':<{width}}{'ready rows':>14}{'ready groups':>16}{per_second}")
    for col, s in status["columns"].items():
        ready = rate(rates.ready, col) if rates else ""
        lines.append(f"  {col:<{width}}{s['ready']:>8}/{cap:<5}{s['groups_ready']:>10}/{groups:<5}{ready}")
    header = f"{'consumed rows':>14}{'leased':>10}{'redelivered':>13}{'dead':>7}"
    lines.append(f"  {'consumer':<{width}}{header}{per_second}")
    for consumer, s in status["consumers"].items():
        drained = rate(rates.consumed, consumer) if rates else ""
        lines.append(
            f"  {consumer:<{width}}{s['consumed']:>8}/{cap:<5}{s['leased']:>10}{s['redelivered']:>13}{s['dead']:>7}"
            f"{drained}"
        )
    lines += _generation_lines(status)
    return "\n".join(line.rstrip() for line in lines)


def _generation_lines(status: dict[str, Any]) -> list[str]:
    """Partial rollout and staleness, when the dock has them: unfinished rows, groups by age (the last
    age counts every group that old or older), the version, stale and discarded groups."""
    lines = []
    rollout = status.get("rollout")
    if rollout:
        ages = list(rollout["groups_by_age"].items())
        by_age = " ".join(f"{a}{'+' if i == len(ages) - 1 else ''}:{g}" for i, (a, g) in enumerate(ages))
        waiting = sum(rollout.get("groups_waiting", {}).values())
        lines.append(f"  rollout: {rollout['unfinished_rows']} unfinished rows, {rollout['finished_groups']} "
                     f"finished groups; groups by age {by_age}; {waiting} prompts waiting since a clear")
    if "stale_groups" in status or status.get("version") or status.get("discarded"):
        parts = [f"version {status.get('version', 0)}"]
        if "stale_groups" in status:
            parts.append(f"{status['stale_groups']} stale groups")
        discarded = status.get("discarded") or {}
        if discarded:
            parts.append("discarded groups: " + ", ".join(f"{k} {v}" for k, v in sorted(discarded.items())))
        lines.append("  " + "; ".join(parts))
    quota = status.get("quota")
    if quota:
        share = f" ({100 * quota['stored_bytes'] / quota['bytes']:.0f} %)" if quota["bytes"] else ""
        lines.append(f"  quota: {quota['stored_bytes']:,} of {quota['bytes']:,} bytes stored{share}")
    return lines


def format_reading(docks: list[tuple[str, Any]], rates: Rates | None = None) -> str:
    """Every dock's table, a broken dock as one error line; ``""`` when there are none."""
    tables = [
        f"dock {name}: ERROR {type(s).__name__}: {s}" if isinstance(s, BrokerError) else format_table(s, rates)
        for name, s in docks
    ]
    return "\n\n".join(tables)


def as_json(docks: list[tuple[str, Any]]) -> list[dict[str, Any]]:
    """Every dock's status as ``broker status --json`` prints it, a broken dock as ``{name, error}``."""
    return [
        {"name": name, "error": f"{type(s).__name__}: {s}"} if isinstance(s, BrokerError) else s for name, s in docks
    ]


def watch(
    survey: Survey,
    seconds: float,
    out: TextIO,
    *,
    where: str,
    as_lines: bool = False,
    guard: Callable[[], AbstractContextManager[Any]] = nullcontext,
    readings: int | None = None,
) -> int:
    """Read and draw every ``seconds`` until Ctrl-C (or ``readings`` readings); returns the exit code, 0.

    ``guard`` is a context manager factory that turns Redis errors into broker errors (the CLI passes
    ``redis_errors``); ``as_lines`` prints JSON lines. ``out.isatty()`` picks redrawing or appending.
    """
    tty = out.isatty() and not as_lines
    before: dict[str, dict[tuple[str, str], int]] | None = None
    before_at = 0.0
    done = 0
    if tty:
        out.write(_HIDE_CURSOR)
    try:
        while readings is None or done < readings:
            started = time.monotonic()
            try:
                with guard():
                    reading = survey.read()
                now = time.monotonic()
                after = counts(reading.docks)
                change = rates(before, after, now - before_at) if before is not None else Rates()
                before, before_at = after, now
                if as_lines:
                    frame = json.dumps({"time": time.time(), "docks": as_json(reading.docks)})
                else:
                    frame = format_reading(reading.docks, change) or f"no docks at {where}"
            except BrokerError as exc:
                before = None  # rates across an outage would mean nothing
                frame = json.dumps({"time": time.time(), "error": str(exc)}) if as_lines else f"ERROR {exc}"
            _draw(out, frame, where, seconds, tty=tty, as_lines=as_lines)
            done += 1
            if readings is None or done < readings:
                time.sleep(max(0.0, seconds - (time.monotonic() - started)))
    except KeyboardInterrupt:
        pass
    finally:
        if tty:
            out.write(_SHOW_CURSOR + "\n")
        out.flush()
    return 0


def _draw(out: TextIO, frame: str, where: str, seconds: float, *, tty: bool, as_lines: bool) -> None:
    if as_lines:
        out.write(frame + "\n")
    else:
        header = f"{where}  every {seconds:g}s  {time.strftime('%Y-%m-%d %H:%M:%S')}"
        header += "  (Ctrl-C ends)" if tty else ""
        lines = [header, "", *frame.splitlines()]
        if tty:
            height = shutil.get_terminal_size().lines - 1
            if len(lines) > height:
                cut = len(lines) - height + 1
                lines = lines[: height - 1] + [f"... {cut} more lines: a taller terminal, or broker status NAME"]
            out.write(_HOME_AND_CLEAR + "\n".join(lines))
        else:
            out.write("\n".join(lines) + "\n\n")
    out.flush()

