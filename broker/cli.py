"""The ``broker`` command: look at and clear docks on a Redis server, or run the GRPO demo.

    broker status [--url URL] [NAME] [--json] [--watch [SECONDS]] [--timeout SECONDS]
    broker clear NAME --yes [--url URL]
    broker dead NAME [--consumer C] [--drop --yes] [--url URL]
    broker acl NAME | --reader [--user U] [--password P] [--cluster] [--db N] [--apply --url URL]
    broker functions [--url URL]
    broker exporter [--url URL] [--port 9808] [NAME...]
    broker demo [--redis-url URL] [--iterations N] [--prompts N] [--n N] [--dp N] [--tp N] ...
    broker bench [--url URL] [--prompts N] [--n N] [--systems ...] [--json] ...   (see broker/bench/__init__.py)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from redis.cluster import RedisCluster
from redis.connection import parse_url

from broker.connection import DEFAULT_CALL_TIMEOUT, bounded, connect, default_url, disconnect, redact, redis_errors
from broker.control.scripts.functions import library_names, load_library
from broker.control.status import Survey
from broker.errors import BrokerError, DockNotFoundError
from broker.ops.acl import SHARDED_PUBSUB_COMMANDS, reader_rules, worker_rules
from broker.ops.exporter import DEFAULT_PORT, MEMORY_KEYS_PER_SCRAPE, serve
from broker.ops.watch import as_json, format_reading, watch


def _status(args: argparse.Namespace) -> int:
    where = redact(args.url)
    with bounded(where, args.timeout, reads=True):  # opening asks the server whether it is a cluster
        client, _ = connect(args.url)
    names = [args.name] if args.name else ()
    try:
        if args.watch is not None:
            # Every frame rescans for new docks (as often as scans stay cheap), and a reading gives up
            # within two frames (at most --timeout): during an outage the view says so every frame or two
            # instead of hanging in the client's reconnect attempts.
            reading = min(args.timeout, max(2 * args.watch, 1.0))
            return watch(Survey(client, names, rescan_seconds=None), args.watch, sys.stdout, where=where,
                         as_lines=args.json, guard=lambda: bounded(where, reading, reads=True))
        return _report(Survey(client, names), args, where)
    finally:
        disconnect(args.url)


def _report(survey: Survey, args: argparse.Namespace, where: str) -> int:
    with bounded(where, args.timeout, reads=True):  # a scan, the metas, the counts: 3 round trips, any number of docks
        docks = survey.read().docks
    if args.name and isinstance(docks[0][1], DockNotFoundError):
        print(f"broker: {docks[0][1]} at {where}", file=sys.stderr)
        return 2
    if args.json:
        reports = as_json(docks)
        print(json.dumps(reports[0] if args.name else reports))
    else:
        print(format_reading(docks) or f"no docks at {where}")
    # A broken dock is reported, the others still listed, and the exit code says something is wrong.
    return 1 if any(isinstance(s, BrokerError) for _, s in docks) else 0


def _exporter(args: argparse.Namespace) -> int:
    client, _ = connect(args.url)
    where = redact(args.url)
    try:
        server = serve(client, args.names, where=where, port=args.port, addr=args.addr,
                       memory_keys=args.memory_keys, rescan_seconds=args.rescan_seconds)
        host, port = server.server_address[:2]
        docks = ", ".join(args.names) if args.names else "every dock"
        print(f"serving metrics of {docks} at {where} on http://{host}:{port}/metrics (Ctrl-C ends)", flush=True)
        stop = threading.Event()  # the HTTP server runs in its own thread; this one waits for a signal
        signal.signal(signal.SIGTERM, lambda *_: stop.set())  # docker stop, kill: end as cleanly as Ctrl-C
        try:
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
        server.shutdown()
        return 0
    finally:
        disconnect(args.url)


def _clear(args: argparse.Namespace) -> int:
    if not args.yes:
        print(f"broker: clearing dock {args.name!r} deletes all its rows; add --yes to do it", file=sys.stderr)
        return 2
    from broker.api.dock import TransferDock  # the dock (and torch) only for the commands that use one

    with TransferDock.attach(args.url, args.name) as dock:
        if args.delete:
            dock.delete()
        else:
            dock.clear()
    print(f"{'deleted' if args.delete else 'cleared'} dock {args.name} at {redact(args.url)}")
    return 0


def _dead(args: argparse.Namespace) -> int:
    if args.drop and not args.yes:
        print(f"broker: dropping the dead letters of dock {args.name!r} deletes their rows; add --yes to do it",
              file=sys.stderr)
        return 2
    from broker.api.dock import TransferDock

    with TransferDock.attach(args.url, args.name) as dock:
        letters = dock.dead_letters(args.consumer)
        for consumer, rows in letters.items():
            for row, why in rows.items():
                print(f"{consumer}\t{row}\t{why}")
        if args.drop:
            dropped = dock.drop_dead_letters(args.consumer)
            print(f"dropped {len(dropped)} rows of dock {args.name} at {redact(args.url)}")
        elif not any(letters.values()):
            print(f"no dead letters in dock {args.name} at {redact(args.url)}")
    return 0


#: ``broker acl``'s password when none is given: fine to print, refused by ``--apply``.
PLACEHOLDER_PASSWORD = "CHANGE-ME"


def _acl(args: argparse.Namespace) -> int:
    if args.reader == bool(args.name):
        print("broker: acl takes a dock NAME (a worker's rules) or --reader (the exporter's), not both",
              file=sys.stderr)
        return 2
    try:
        rules = _acl_rules(args, cluster=args.cluster)
    except ValueError as exc:
        print(f"broker: acl: {exc}", file=sys.stderr)
        return 2
    if args.apply:
        return _apply_acl(args)
    # A reader's selectors are one argument each: quoted, as redis-cli takes them ("(~KEYS +COMMANDS)").
    quoted = [f'"{rule}"' if " " in rule else rule for rule in rules]
    print(f"ACL SETUSER {args.user} on >{args.password} {' '.join(quoted)}")
    if args.cluster:
        # On stderr: stdout stays one command, to paste or pipe into redis-cli.
        print("broker: run it on every node of the cluster, primaries and replicas (on Redis 6.2 nodes without "
              f"{' '.join('+' + c for c in SHARDED_PUBSUB_COMMANDS)}), or let broker acl ... --apply --url URL "
              "do it", file=sys.stderr)
    print("broker: these are Redis 7's rules, which run the broker's function library: load it once with broker "
          "functions --url URL (Redis 6.2 has neither functions nor ACL selectors: let broker acl ... --apply "
          "--url URL give a 6.2 server its own rules)", file=sys.stderr)
    return 0


def _acl_rules(args: argparse.Namespace, *, cluster: bool, redis7: bool = True) -> list[str]:
    """The rules ``args`` ask for, for a node of Redis 7 or later (``redis7``: sharded pub/sub, selectors)."""
    db = args.db if args.db is not None else int(parse_url(args.url).get("db", 0) or 0) if args.url else 0
    if args.reader:
        return reader_rules(db=db, cluster=cluster, selectors=redis7)
    return worker_rules(args.name, db=db, cluster=cluster, redis7=redis7)


def _apply_acl(args: argparse.Namespace) -> int:
    """ACL SETUSER on the server at ``--url``; on a Redis Cluster on every node, each with its version's rules."""
    if args.password == PLACEHOLDER_PASSWORD:
        print("broker: acl --apply creates a real user: give it a --password", file=sys.stderr)
        return 2
    client, _ = connect(args.url)
    where = redact(args.url)
    done: list[str] = []
    redis7 = True  # every node: then the library is loaded for the users' FCALLs
    try:
        if isinstance(client, RedisCluster):
            nodes = [(node.name, node.redis_connection) for node in client.get_nodes()]
        else:
            nodes = [("the server", client)]
        for name, node in nodes:
            try:
                with redis_errors(f"{where} (node {name})" if isinstance(client, RedisCluster) else where):
                    if node is None:
                        raise BrokerError(f"Redis Cluster at {where}: no connection to node {name}")
                    major = _major(node)
                    rules = _acl_rules(args, cluster=isinstance(client, RedisCluster), redis7=major >= 7)
                    redis7 = redis7 and major >= 7
                    node.execute_command("ACL", "SETUSER", args.user, "on", f">{args.password}", *rules)
            except BrokerError as exc:
                before = ", ".join(done) or "no node"
                raise BrokerError(f"{exc} (user {args.user!r} was set on {before} before)") from exc
            done.append(name)
        loaded = _load_functions(client, where) if redis7 else None
    finally:
        disconnect(args.url)
    if isinstance(client, RedisCluster):
        print(f"set ACL user {args.user} on all {len(done)} nodes of the Redis Cluster at {where}: {', '.join(done)}")
    else:
        print(f"set ACL user {args.user} at {where}")
    if loaded:
        print(loaded)
    return 0


def _load_functions(client: Any, where: str) -> str:
    """Load the broker's function libraries (every primary of a cluster): the core's, and the TransferQueue
    slice's, which confined workers of a TransferQueue system call; what to print."""
    import broker.transfer_queue.scripts  # noqa: F401 (registers the slice's scripts; loads no torch)

    with redis_errors(where):
        load_library(client)
    return f"loaded the broker's function libraries {', '.join(library_names())} at {where}"


def _functions(args: argparse.Namespace) -> int:
    client, _ = connect(args.url)
    where = redact(args.url)
    try:
        with redis_errors(where):
            major = max(_major(node) for node in _nodes(client))
        if major < 7:
            print(f"broker: Redis at {where} has no functions (Redis 6.2): the broker runs its scripts with EVALSHA "
                  "there", file=sys.stderr)
            return 2
        print(_load_functions(client, where))
    finally:
        disconnect(args.url)
    return 0


def _major(node: Any) -> int:
    """The major version of a Redis server: 7 has functions and ACL selectors, 6.2 has neither."""
    return int(str(node.info("server")["redis_version"]).split(".")[0])


def _nodes(client: Any) -> list[Any]:
    if isinstance(client, RedisCluster):
        return [node.redis_connection for node in client.get_nodes() if node.server_type == "primary"]
    return [client]


def _demo(args: argparse.Namespace) -> int:
    # Imported here: the demo pulls in Ray, matplotlib and the model, which status and clear never need.
    from workers.demo import run

    return run(args)


def _bench(args: argparse.Namespace) -> int:
    # Imported here: the benchmark pulls in Ray and multiprocessing machinery that status and clear never need.
    from broker.bench.run import run

    return run(args)


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The CLI's parser. ``command``: the command about to run, where known (``main``): the demo's and the
    benchmark's options, whose modules belong to those packages, are added only for their own command, so
    that ``broker status`` or ``exporter`` loads neither (nor torch or Ray, which the dock and the workers
    load: the commands that use them import them when they run). None: every command's options."""
    parser = argparse.ArgumentParser(prog="broker", description="Redis-backed experience broker (TransferDock).")
    url = argparse.ArgumentParser(add_help=False)
    url.add_argument("--url", default=default_url(), help="Redis URL (default: $REDIS_URL or %(default)s)")
    commands = parser.add_subparsers(dest="command", required=True)

    status = commands.add_parser("status", parents=[url], help="capacity, ready and consumed counts of docks")
    status.add_argument("name", nargs="?", help="one dock (default: every dock on the server)")
    status.add_argument(
        "--json", action="store_true", help="print JSON instead of a table (with --watch: one line per reading)"
    )
    status.add_argument(
        "--watch", nargs="?", type=_positive_seconds, const=2.0, metavar="SECONDS",
        help="redraw every SECONDS (default 2) with rows per second filling and draining, until Ctrl-C",
    )
    status.add_argument("--timeout", type=_positive_seconds, default=DEFAULT_CALL_TIMEOUT, metavar="SECONDS",
                        help="give up on a server that does not answer within SECONDS (default: %(default)g; with "
                             "--watch, a reading gives up within two frames or 1 s, if sooner)")
    status.set_defaults(run=_status)

    clear = commands.add_parser("clear", parents=[url], help="delete every row and status bit of a dock")
    clear.add_argument("name")
    clear.add_argument("--yes", action="store_true", help="confirm")
    clear.add_argument("--delete", action="store_true",
                       help="delete the dock itself too (its schema), so it can be made again with another size")
    clear.set_defaults(run=_clear)

    dead = commands.add_parser("dead", parents=[url],
                               help="list a dock's dead letters (rows whose bytes kept failing to read), or drop them")
    dead.add_argument("name")
    dead.add_argument("--consumer", help="only this consumer's (default: every consumer's)")
    dead.add_argument("--drop", action="store_true", help="forget those rows (their bytes and marks), as clear does")
    dead.add_argument("--yes", action="store_true", help="confirm --drop")
    dead.set_defaults(run=_dead)

    exporter = commands.add_parser(
        "exporter", parents=[url], help="serve the docks' counts and memory as Prometheus metrics on /metrics",
        description="A Prometheus exporter: each scrape reads every dock (or the named ones) in one round trip. "
                    "Metric names are listed in docs/operations.md.",
    )
    exporter.add_argument("names", nargs="*", metavar="NAME", help="docks to export (default: every dock)")
    exporter.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port (default: %(default)s)")
    exporter.add_argument("--addr", default="0.0.0.0", help="address to listen on (default: %(default)s)")
    exporter.add_argument("--memory-keys", type=int, default=MEMORY_KEYS_PER_SCRAPE, metavar="N",
                          help="keys whose MEMORY USAGE one scrape measures at most; 0 turns memory off "
                               "(default: %(default)s)")
    exporter.add_argument("--rescan-seconds", type=_positive_seconds, default=60.0, metavar="SECONDS",
                          help="how often the server is scanned for new docks (default: %(default)s)")
    exporter.set_defaults(run=_exporter)

    acl = commands.add_parser(
        "acl", parents=[url],
        help="print (or --apply) the ACL SETUSER command confining a worker user to one dock, or a read-only user",
    )
    acl.add_argument("name", nargs="?", help="the dock a worker may use")
    acl.add_argument("--reader", action="store_true",
                     help="rules for broker exporter and broker status instead: every dock, reads only")
    acl.add_argument("--user", default="worker", help="ACL user name (default: %(default)s)")
    acl.add_argument("--password", default=PLACEHOLDER_PASSWORD, help="its password (default: a placeholder)")
    acl.add_argument("--cluster", action="store_true",
                     help="rules for the nodes of a Redis Cluster, on each of which the user must be created")
    acl.add_argument("--db", type=int, default=None, metavar="N",
                     help="the database the user may select, the one its URL names (default: that of --url, else 0); "
                          "no other")
    acl.add_argument("--apply", action="store_true",
                     help="create the user on the server at --url instead of printing the command; on a Redis "
                          "Cluster on every node (primaries and replicas), each with the rules its version takes")
    acl.set_defaults(run=_acl)

    functions = commands.add_parser(
        "functions", parents=[url],
        help="load the broker's Lua function library on the server at --url (every primary of a cluster): what "
             "workers confined by broker acl run on Redis 7",
    )
    functions.set_defaults(run=_functions)

    demo = commands.add_parser(
        "demo", help="run GRPO, PPO or DAPO on a toy task with Ray worker groups exchanging data through the broker",
        description="GRPO, PPO (with a critic) or DAPO on a digit-reversal task: Ray worker groups (DP x TP) pass "
                    "every sample through a TransferDock in Redis. Writes metrics.jsonl and ALGO.png into --out.",
    )
    if command in (None, "demo"):
        from workers.options import add_demo_arguments  # argparse only; the demo itself loads in _demo

        add_demo_arguments(demo)
    demo.set_defaults(run=_demo)

    bench = commands.add_parser(
        "bench", help="measure the broker against a single-actor Ray dock, the Redis floor and an in-process dict",
        description="Benchmark of a synthetic GRPO global batch through the broker and three reference systems, "
                    "with concurrent, sampling-latency, memory and soak modes. Prints a table and one JSON line.",
    )
    if command in (None, "bench"):
        from broker.bench.options import add_bench_arguments  # argparse only; the benchmark loads in _bench

        add_bench_arguments(bench)
    bench.set_defaults(run=_bench)
    return parser


#: The exit status of a command whose reader went away (``broker status | head``): a shell's for SIGPIPE.
EXIT_PIPE_CLOSED = 128 + signal.SIGPIPE


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    chosen = next((a for a in argv if not a.startswith("-")), "")  # the command: the first word (no option before)
    args = build_parser(chosen).parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except BrokerError as exc:
        print(f"broker: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader of stdout is gone: end quietly, as a Unix tool does. stdout goes to /dev/null first, or
        # the interpreter's own flush at exit would fail on the closed pipe again, with a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_PIPE_CLOSED


if __name__ == "__main__":
    sys.exit(main())
