"""The ``broker`` command: look at and clear docks on a Redis server, or run the GRPO demo.

    broker status [--url URL] [NAME] [--json]
    broker clear NAME --yes [--url URL]
    broker demo [--redis-url URL] [--iterations N] [--prompts N] [--n N] [--dp N] [--tp N] ...
    broker bench [--url URL] [--prompts N] [--n N] [--systems ...] [--json] ...   (see broker/bench/__init__.py)
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import redis

from .acl import worker_rules
from .connection import connect, default_url, disconnect, redact, redis_errors
from .dock import TransferDock
from .errors import BrokerError, DockNotFoundError
from .keys import META_PATTERN, dock_name_from_meta_key
from .status import DockRef, read_metas, read_statuses


def dock_names(client: redis.Redis, where: str) -> list[str]:
    """Names of every dock on the server, sorted."""
    with redis_errors(where):
        found = {dock_name_from_meta_key(k) for k in client.scan_iter(match=META_PATTERN, count=1000)}
    return sorted(n for n in found if n)


def format_status(status: dict[str, Any]) -> str:
    """A dock's status as a small table."""
    cap, n = status["capacity"], status["n_samples_per_prompt"]
    groups = status["prompts_num"]
    lines = [f"dock {status['name']}: {cap} rows = {groups} prompts x {n} samples"]
    width = max(len(c) for c in [*status["columns"], *status["consumers"], "consumer"]) + 2
    lines.append(f"  {'column':<{width}}{'ready rows':>14}{'ready groups':>16}")
    for col, s in status["columns"].items():
        lines.append(f"  {col:<{width}}{s['ready']:>8}/{cap:<5}{s['groups_ready']:>10}/{groups:<5}")
    lines.append(f"  {'consumer':<{width}}{'consumed rows':>14}{'leased':>10}{'redelivered':>13}")
    for consumer, s in status["consumers"].items():
        lines.append(f"  {consumer:<{width}}{s['consumed']:>8}/{cap:<5}{s['leased']:>10}{s['redelivered']:>13}")
    return "\n".join(line.rstrip() for line in lines)


def _status(args: argparse.Namespace) -> int:
    client, _ = connect(args.url)
    try:
        return _report(client, args)
    finally:
        disconnect(args.url)


def _report(client: redis.Redis, args: argparse.Namespace) -> int:
    where = redact(args.url)
    names = [args.name] if args.name else dock_names(client, where)
    # Two round trips for any number of docks: every meta, then every dock's counts.
    with redis_errors(where):
        refs = read_metas(client, names)
        found = [r for r in refs if isinstance(r, DockRef)]
        statuses = iter(read_statuses(client, found))
    reports: list[dict[str, Any]] = []
    failed = False
    for name, ref in zip(names, refs):
        result = next(statuses) if isinstance(ref, DockRef) else ref
        if isinstance(result, DockNotFoundError) and args.name:
            print(f"broker: {result} at {where}", file=sys.stderr)
            return 2
        if isinstance(result, BrokerError):  # a broken dock is reported and the others still listed
            failed = True
            reports.append({"name": name, "error": f"{type(result).__name__}: {result}"})
        else:
            reports.append(result)
    if args.json:
        print(json.dumps(reports[0] if args.name else reports))
    elif not reports:
        print(f"no docks at {where}")
    else:
        tables = [f"dock {r['name']}: ERROR {r['error']}" if "error" in r else format_status(r) for r in reports]
        print("\n\n".join(tables))
    return 1 if failed else 0


def _clear(args: argparse.Namespace) -> int:
    if not args.yes:
        print(f"broker: clearing dock {args.name!r} deletes all its rows; add --yes to do it", file=sys.stderr)
        return 2
    with TransferDock.attach(args.url, args.name) as dock:
        dock.clear()
    print(f"cleared dock {args.name} at {redact(args.url)}")
    return 0


def _acl(args: argparse.Namespace) -> int:
    rules = " ".join(worker_rules(args.name))
    print(f"ACL SETUSER {args.user} on >{args.password} {rules}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    # Imported here: the demo pulls in Ray, matplotlib and the model, which status and clear never need.
    from workers.grpo import run

    return run(args)


def _bench(args: argparse.Namespace) -> int:
    # Imported here: the benchmark pulls in Ray and multiprocessing machinery that status and clear never need.
    from .bench.run import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="broker", description="Redis-backed experience broker (TransferDock).")
    url = argparse.ArgumentParser(add_help=False)
    url.add_argument("--url", default=default_url(), help="Redis URL (default: $REDIS_URL or %(default)s)")
    commands = parser.add_subparsers(dest="command", required=True)

    status = commands.add_parser("status", parents=[url], help="capacity, ready and consumed counts of docks")
    status.add_argument("name", nargs="?", help="one dock (default: every dock on the server)")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.set_defaults(run=_status)

    clear = commands.add_parser("clear", parents=[url], help="delete every row and status bit of a dock")
    clear.add_argument("name")
    clear.add_argument("--yes", action="store_true", help="confirm")
    clear.set_defaults(run=_clear)

    acl = commands.add_parser("acl", help="print the ACL SETUSER command confining a worker user to one dock")
    acl.add_argument("name", help="the dock")
    acl.add_argument("--user", default="worker", help="ACL user name (default: %(default)s)")
    acl.add_argument("--password", default="CHANGE-ME", help="its password (default: a placeholder)")
    acl.set_defaults(run=_acl)

    # workers.options is argparse only, so building the parser stays cheap; the demo itself loads lazily.
    from workers.options import add_demo_arguments

    demo = commands.add_parser(
        "demo", help="run GRPO on a toy task with Ray worker groups exchanging data through the broker",
        description="GRPO on a digit-reversal task: Ray worker groups (DP x TP) pass every sample through a "
                    "TransferDock in Redis. Writes metrics.jsonl and grpo.png into --out.",
    )
    add_demo_arguments(demo)
    demo.set_defaults(run=_demo)

    # bench.options is argparse only, like workers.options; the benchmark itself loads in _bench.
    from .bench.options import add_bench_arguments

    bench = commands.add_parser(
        "bench", help="measure the broker against a single-actor Ray dock, the Redis floor and an in-process dict",
        description="Benchmark of a synthetic GRPO global batch through the broker and three reference systems, "
                    "with concurrent, sampling-latency, memory and soak modes. Prints a table and one JSON line.",
    )
    add_bench_arguments(bench)
    bench.set_defaults(run=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokerError as exc:
        print(f"broker: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
