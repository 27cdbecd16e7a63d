"""Options of ``broker bench``; argparse only, so building the ``broker`` parser stays cheap."""

from __future__ import annotations

import argparse
import os

#: Timed passes per system when --repeat is not given: the pipeline mode's, and --cluster's (two systems only,
#: so more passes fit in the same time and steady its ratio on a busy machine).
REPEAT, CLUSTER_REPEAT = 3, 5

SYSTEMS = ("broker", "broker-random", "adapter", "adapter-ray", "ray", "redis-floor", "inprocess")
MODES = ("pipeline", "concurrent", "sampling", "memory", "balance")


def _systems(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if s not in SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
    return names


def _program(text: str) -> str:
    """A program to run: a path made absolute (the benchmark runs it from folders of its own; a venv's python
    stays the symlink it is, or its venv would be lost), a bare name left to PATH."""
    return os.path.abspath(text) if os.sep in text else text


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated row counts, got {text!r}") from None
    if not sizes or any(s < 16 or s % 8 for s in sizes):
        raise argparse.ArgumentTypeError("every size must be a multiple of 8 rows (whole groups), at least 16")
    return sizes


LARGE_SYSTEMS = ("broker", "redis-floor", "redis-floor-2conn", "transferqueue")


def _large_systems(text: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in text.split(",") if s.strip())
    unknown = [s for s in names if s not in LARGE_SYSTEMS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown systems {unknown}; choose from {', '.join(LARGE_SYSTEMS)}")
    return names


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated row counts, got {text!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError("every batch size must be at least 1 row")
    return sizes


def add_bench_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the benchmark's options to ``parser`` (the ``bench`` subcommand) and return it."""
    p = parser
    p.add_argument("--url", default=None,
                   help="Redis to measure (default: start a private redis-server on a free port for the run; "
                        "$REDIS_URL is not read, so a benchmark never lands on a shared server by accident)")
    p.add_argument("--unix", action="store_true", help="the private redis-server listens on a unix socket")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    g = p.add_argument_group("workload")
    g.add_argument("--prompts", type=int, default=256, help="prompts in the global batch (default: %(default)s)")
    g.add_argument("--n", type=int, default=8, help="responses per prompt (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed of prompts and lengths (default: %(default)s)")
    g.add_argument("--groups-per-call", type=int, default=16,
                   help="groups each stage reads per call (default: %(default)s, i.e. 128 rows at n=8)")
    g = p.add_argument_group("modes (default: all five; naming any runs only those named)")
    for mode in MODES:
        more = " (with --soak: the pipeline soak, see below)" if mode == "pipeline" else ""
        g.add_argument(f"--{mode}", action="store_true", help=f"run the {mode} mode{more}")
    g.add_argument("--systems", type=_systems, default=SYSTEMS,
                   help=f"systems of the pipeline mode, comma-separated (default: {','.join(SYSTEMS)})")
    g.add_argument("--repeat", type=int, default=None,
                   help="timed passes per system; the best counts (default: 3, and 5 with --cluster)")
    g.add_argument("--warmup", type=int, default=1, help="untimed passes per system first (default: 1)")
    g.add_argument("--per-stage", type=int, default=2,
                   help="processes per stage in concurrent mode, and rollout and filter processes each in the "
                        "pipeline soak (default: 2)")
    g.add_argument("--sampling-sizes", type=_sizes, default=(4096, 16384, 65536),
                   help="dock sizes in rows for sampling latency (default: 4096,16384,65536)")
    g.add_argument("--sampling-calls", type=int, default=300, help="calls per size and policy (default: 300)")
    g.add_argument("--exporter", action="store_true",
                   help="cost of one Prometheus exporter scrape against many docks (only when named)")
    g.add_argument("--fencing", action="store_true",
                   help="cost of the write fence: the rollout's puts unfenced, fenced, and leased, alternated "
                        "(only when named; uses --repeat, --warmup and the workload)")
    g.add_argument("--exporter-docks", type=int, default=1000, help="docks the exporter scrapes (default: 1000)")
    g.add_argument("--exporter-scrapes", type=int, default=30, help="timed scrapes (default: %(default)s)")
    g = p.add_argument_group("large batches (--large and --tq-perftest, only when named): TransferQueue's perftest "
                             "workload; uses --repeat, --warmup and --seed")
    g.add_argument("--large", action="store_true",
                   help="a writer process puts one batch, a reader process gets all of it, timed from the driver, "
                        "for each of --large-systems; passes alternated")
    g.add_argument("--batch", type=int, default=1024, help="rows of the batch (default: %(default)s)")
    g.add_argument("--fields", type=int, default=10, help="columns (default: %(default)s)")
    g.add_argument("--seq-len", type=int, default=8192, help="float32 values per row (default: %(default)s)")
    g.add_argument("--complex", action="store_true",
                   help="also the complex variant: a third of the columns ragged, a third strings (perftest's "
                        "--use_complex_case)")
    g.add_argument("--large-sizes", type=_batch_sizes, default=None, metavar="ROWS,...",
                   help="sweep these batch sizes instead of --batch (e.g. 64,256,1024,4096)")
    g.add_argument("--large-systems", type=_large_systems, default=LARGE_SYSTEMS,
                   help=f"systems, comma-separated (default: {','.join(LARGE_SYSTEMS)}; transferqueue only where it "
                        "imports)")
    g.add_argument("--tq-perftest", action="store_true",
                   help="TransferQueue's own benchmark (perftest.py from the transferqueue wheel) on --batch x "
                        "--fields x --seq-len (and its --use_complex_case with --complex): as it is, and through "
                        "broker.transfer_queue with only the package name changed, beside the broker's native "
                        "put and get; skipped, saying why, without the wheel")
    g.add_argument("--tq-python", default=None, metavar="PATH", type=_program,
                   help="interpreter to run TransferQueue 0.1.11 in (default: this one, if it imports "
                        "transfer_queue)")
    g = p.add_argument_group("cluster comparison (runs instead of the modes above, on servers of its own)")
    g.add_argument("--cluster", action="store_true",
                   help="the pipeline through the broker, one client, on a private redis-server and on a private "
                        "Redis Cluster in one run: time ratio, checksums, server seconds per GB per primary, and "
                        "the throughput that projects for more primaries (uses --repeat, --warmup and the workload)")
    g.add_argument("--primaries", type=int, default=3, help="primaries of the cluster (default: %(default)s)")
    g.add_argument("--partitions", type=int, default=1, metavar="P",
                   help="make the cluster's dock with partitions=P (its scripts spread over the primaries holding "
                        "the partitions' slots; the one server's dock keeps one) and project throughput with P = S "
                        "(default: %(default)s)")
    g.add_argument("--wait-replicas", type=int, default=0, metavar="K",
                   help="give each primary K replicas and time a third dock on the cluster, opened with "
                        "wait_replicas=K: what the durability option costs (default: %(default)s, off)")
    g = p.add_argument_group("soak (runs instead of the modes above)")
    g.add_argument("--soak", action="store_true", help="run the soak")
    g.add_argument("--clients", type=int, default=16, help="client processes (default: %(default)s)")
    g.add_argument("--seconds", type=float, default=30.0, help="load time (default: %(default)s)")
    g.add_argument("--leases", action="store_true", help="take rows with leases and ack them (at-least-once)")
    g.add_argument("--kill", action="store_true", help="SIGKILL a random client now and then (implies --leases)")
    g.add_argument("--churn", action="store_true",
                   help="clients only read; a driver clears and refills the dock as fast as it can")
    g.add_argument("--lease-seconds", type=float, default=None,
                   help="lease length (default: 5.0, and 0.5 with --pipeline)")
    g.add_argument("--kill-every", type=float, default=1.0, help="mean seconds between kills (default: %(default)s)")
    g = p.add_argument_group("tenants soak (--tenants; uses --clients, --seconds, --seed)")
    g.add_argument("--tenants", action="store_true",
                   help="instead of the modes: the soak of one tenant alone and beside a hostile one on the same "
                        "server, as ACL users of broker acl (Redis 7; makes the users, and deletes them after)")
    g.add_argument("--rounds", type=int, default=2, help="alternated rounds of each (default: %(default)s)")
    g.add_argument("--hostile-pause", type=float, default=0.05,
                   help="seconds between two misbehaviours of the hostile tenant (default: %(default)s)")
    g = p.add_argument_group("pipeline soak (--soak --pipeline; uses --seconds, --per-stage, --lease-seconds, --kill, "
                             "--kill-every, --seed)")
    g.add_argument("--slow", type=float, default=None,
                   help="chance that a rollout or filter batch sleeps 1.5 x its lease before writing (default: 0.1)")
    g.add_argument("--unfenced", action="store_true",
                   help="the control run: workers write and drop naming plain lists of rows, as before writes "
                        "were fenced (it fails, counting the mispaired rows)")
    return p
