"""``python -m workers.demo`` (also ``broker demo``): GRPO, PPO or DAPO on digit reversal, Ray worker groups
and a Redis broker.

Starts (or joins) Ray and a Redis, places the algorithm's role groups, runs ``--iterations`` global
batches with a progress bar, and writes ``metrics.jsonl`` and ``ALGO.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import Layout, RunConfig, with_layouts
from .options import TUNABLES, build_demo_parser


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run's settings from parsed options; raises ValueError naming a bad one."""
    tuned = {name: getattr(args, name) for name in TUNABLES if getattr(args, name) is not None}
    base = RunConfig.for_algorithm(
        args.algo, seed=args.seed, guarantee_order=args.guarantee_order, max_age=args.max_age,
        max_staleness=args.max_staleness, partitions=args.partitions, mini_batch_prompts=args.mini_batch_size,
        micro_batch_rows=args.micro_batch_size, **tuned)
    roles = base.roles
    overrides: dict[str, Layout] = {}
    for item in args.layout:
        role, sep, text = item.partition("=")
        if not sep or role not in roles:
            raise ValueError(f"--layout {item!r}: expected ROLE=DPxTP with ROLE one of {', '.join(roles)}")
        overrides[role] = Layout.parse(text)
    if args.iterations < 1:
        raise ValueError("--iterations must be >= 1")
    cfg = with_layouts(base, args.dp, args.tp, overrides)
    cfg.validate()
    return cfg


def iteration_line(cfg: RunConfig, metrics: Mapping[str, Any]) -> str:
    """One iteration's summary on the progress bar: reward and speed, and what the run's settings add."""
    line = (f"reward {metrics['reward']:.3f} | {metrics['samples_per_s']:.0f} samples/s | "
            f"{metrics['tokens_per_s']:.0f} tok/s | {metrics['seconds']:.1f} s")
    if cfg.partial:
        ages = ", ".join(f"{a}:{c}" for a, c in metrics["groups_by_age"].items())
        line += f" | groups by age {ages}"
    if "value_loss" in metrics:
        line += f" | value loss {metrics['value_loss']:.4f}"
    if cfg.algorithm.dynamic_sampling:
        line += f" | filtered groups {metrics['filtered_groups']}"
    if metrics.get("restarts"):
        line += f" | worker groups restarted {metrics['restarts']}"
    if cfg.asynchronous:
        line += (f" | version lag {metrics.get('version_lag', 0.0):.2f} | "
                 f"stale dropped {metrics['stale_dropped']}")
    return line


#: The file in a run's folder holding the options it was started with (what ``--resume DIR`` starts from).
RUN_FILE = "run.json"
#: Options that say where and how a run is run and watched, not what it computes: ``--resume`` takes them as
#: typed (``--iterations`` may grow the run); every other option must be the run's own.
SETTING_OPTIONS = {"iterations", "no_progress", "ray_address", "cpus", "redis_url", "resume", "out"}


def _saved_options(args: argparse.Namespace) -> dict[str, Any]:
    """The demo's own options of ``args`` (not what the ``broker`` command adds), as JSON values."""
    from .options import build_demo_parser

    names = {a.dest for a in build_demo_parser()._actions if a.dest != "help"}
    return {k: v for k, v in vars(args).items() if k in names}


def resumed_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` of ``--resume DIR``: the options DIR's run was started with, and those of ``args`` that
    ``SETTING_OPTIONS`` name where given; ValueError if another option given differs from the run's."""
    from .options import build_demo_parser

    folder = Path(args.resume)
    try:
        saved = json.loads((folder / RUN_FILE).read_text(encoding="utf-8"))["options"]
    except FileNotFoundError:
        raise ValueError(f"--resume {folder}: no {RUN_FILE} there; is it the folder (--out) of a run?") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--resume {folder}: {RUN_FILE} is unreadable ({exc})") from None
    defaults = vars(build_demo_parser().parse_args([]))
    merged = vars(args).copy()
    for key, value in _saved_options(args).items():
        if key not in saved:
            continue
        if key in SETTING_OPTIONS:
            merged[key] = value if value != defaults.get(key) else saved[key]
        elif value != defaults.get(key) and value != saved[key]:
            option = "--" + key.replace("_", "-")
            raise ValueError(f"--resume {folder}: the run was started with {option} {saved[key]!r}, not {value!r}; "
                             f"resume it with the options it has (or --resume {folder} alone)")
        else:
            merged[key] = saved[key]
    merged["out"], merged["resume"] = str(folder), str(folder)
    return argparse.Namespace(**merged)


def resume_command(out: Path) -> str:
    """The command that goes on with the run in ``out``, spelled as this one was started: ``.venv/bin/broker
    demo`` typed as such, else this interpreter running the module."""
    typed = sys.argv[0]
    head = f"{typed} demo" if Path(typed).name == "broker" else f"{sys.executable} -m workers.demo"
    return f"{head} --resume {shlex.quote(str(out))}"


def check_redis_url(url: str) -> str | None:
    """Why the Redis at ``url`` cannot serve the run (it does not answer, refuses the password, ...), or None:
    asked before anything is started or written, so a wrong URL costs a second, not Ray's start-up."""
    from broker.connection import bounded, connect, disconnect, redact
    from broker.errors import BrokerError

    try:
        with bounded(redact(url), 10.0, reads=True):
            client, _ = connect(url)
            try:
                client.ping()
            finally:
                disconnect(url)
    except BrokerError as exc:
        return str(exc)
    return None


def run(args: argparse.Namespace) -> int:
    """The demo; returns the exit status (130 when stopped by Ctrl-C, saying how to go on)."""
    try:
        if args.resume:
            args = resumed_args(args)
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    if args.redis_url:
        why = check_redis_url(args.redis_url)
        if why is not None:
            print(f"demo: {why.rstrip('.')}. Nothing was started.", file=sys.stderr)
            return 1
    progress = Progress(Path(args.out or f"{cfg.algo}-demo"))  # as the user gave it: relative to where they stand
    try:
        return _run(args, cfg, progress)
    except KeyboardInterrupt:
        out, done = progress.out, progress.saved
        what = (f"iterations 1-{done} of {args.iterations} are checkpointed in {out}" if done
                else f"no iteration was checkpointed yet (its options are in {out / RUN_FILE})")
        print(f"\ndemo: stopped by Ctrl-C; {what}. Go on with: {resume_command(out)}", file=sys.stderr)
        return 130


@dataclass
class Progress:
    """Where a run is, for the line a Ctrl-C prints: its folder, and the last iteration checkpointed there."""

    out: Path
    saved: int = 0


def _run(args: argparse.Namespace, cfg: RunConfig, progress: Progress) -> int:
    """The run itself, into ``progress.out``, which learns of every checkpoint."""
    out = progress.out
    # Heavy imports only once the options are known to be good.
    from tqdm import tqdm

    from broker.connection import redact
    from broker.ops.local_redis import redis_for_run

    from .model import task
    from .runtime import checkpoint as checkpoints
    from .runtime.cluster import start_ray, wait_for_cpus
    from .runtime.pipeline import Pipeline, create_dock
    from .runtime.report import MetricsLog, first_last, plot

    picture = out / f"{cfg.algo}.png"
    began = time.monotonic()
    records: list[dict] = []
    resume: checkpoints.Checkpoint | None = None
    if args.resume and checkpoints.latest(out) is None:
        # Stopped before its first checkpoint: nothing to go on from, so the run starts again, with its options.
        print(f"demo: --resume {out}: no iteration was checkpointed; starting the run from iteration 1", flush=True)
    elif args.resume:
        try:
            resume = checkpoints.load(out)
        except checkpoints.CheckpointError as exc:
            print(f"demo: --resume: {exc}", file=sys.stderr)
            return 2
        progress.saved = resume.iteration
        records = resume.records
        if resume.iteration >= args.iterations:
            print(f"demo: --resume {out}: the run already did its {resume.iteration} iterations (give --iterations "
                  "to run more)", file=sys.stderr)
            return 2
    if resume is None:
        out.mkdir(parents=True, exist_ok=True)
        # A new run in the folder of an earlier one: nothing of that one may be resumed as this one's.
        for leftover in (*checkpoints.FOLDERS, "redis"):
            shutil.rmtree(out / leftover, ignore_errors=True)
        (out / RUN_FILE).write_text(json.dumps({"options": _saved_options(args)}, indent=1), encoding="utf-8")
    # A private Redis keeps its data in the run's folder (an append-only file): a resumed run starts it again
    # from there. A checkpoint needs none of it (a synchronous run's dock is empty at every checkpoint, and
    # one that keeps rows across iterations holds them), but the dock's name and schema are checked against it.
    with redis_for_run(args.redis_url, folder=None if args.redis_url else out / "redis") as target:
        print(f"redis: {target.description}", flush=True)
        print(f"ray: {start_ray(args.ray_address, None if args.ray_address else args.cpus)}", flush=True)
        if args.ray_address and not args.redis_url:
            print("redis: the private Redis listens on 127.0.0.1 only; Ray nodes on other machines cannot reach it "
                  "(pass --redis-url)", flush=True)
        name = resume.dock if resume else args.dock or f"{cfg.algo}-demo-{uuid.uuid4().hex[:8]}"
        dock = pipeline = log = None
        try:
            cluster_cpus = wait_for_cpus(args.cpus or 1)
            if args.cpus and cluster_cpus < args.cpus:
                print(f"ray: only {cluster_cpus:g} of the {args.cpus} CPUs asked for joined; going on with those",
                      flush=True)
            dock = create_dock(target.url, name, cfg)
            if resume and dock.fingerprint != resume.fingerprint:
                raise checkpoints.CheckpointError(
                    f"{out}: the checkpoint is of dock {name!r} with schema {resume.fingerprint}, the dock now has "
                    f"{dock.fingerprint}: it belongs to another run, or the run's options changed")
            print(f"dock: {name}, {cfg.dock_groups} prompts x {cfg.n} samples = {cfg.dock_groups * cfg.n} rows "
                  f"(watch: broker status --url {redact(target.url)} {name})", flush=True)
            if cfg.partial:
                print(f"partial rollout: max age {cfg.max_age}, at most {cfg.token_budget} of {task.MAX_NEW_TOKENS} "
                      f"tokens per response per pass; {cfg.prompts} of the dock's {cfg.dock_groups} groups trained "
                      "per iteration", flush=True)
            if cfg.asynchronous:
                print(f"asynchronous rollout: up to {cfg.max_staleness} versions behind the trainer; "
                      f"{cfg.prompts} of the dock's {cfg.dock_groups} groups trained per iteration", flush=True)
            print(f"algorithm: {cfg.algorithm.summary}", flush=True)
            if cfg.algorithm.dynamic_sampling:
                print(f"dynamic sampling: groups whose {cfg.n} rewards are all equal are dropped and replaced, up "
                      f"to {(cfg.max_gen_batches - 1) * cfg.prompts} per iteration", flush=True)
            pipeline = Pipeline(dock, cfg, cluster_cpus)
            layout = ", ".join(f"{role} {cfg.layout(role)}" for role in cfg.roles)
            sizes = "; ".join(f"{t}: mini-batch {s.mini_batch_size} rows per DP rank" + (
                f" in {s.grad_accum_steps} micro-batches of {s.micro_batch_size}" if s.micro_batch_size else "")
                for t in cfg.algorithm.trainers for s in [cfg.rank_batch_sizes(t)])
            print(f"roles (DPxTP): {layout}; {pipeline.cpus_per_rank:g} CPU per rank; model roles "
                  f"{', '.join(cfg.algorithm.model_roles)}; set up in {time.monotonic() - began:.1f} s", flush=True)
            print(f"batches: {cfg.epochs} epoch(s) per iteration; {sizes}", flush=True)
            start_at = 1
            if resume:
                restore_began = time.monotonic()
                pipeline.restore(resume)
                start_at = resume.iteration + 1
                print(f"resumed: {resume.iteration} iterations done, going on from iteration {start_at} "
                      f"(restored in {time.monotonic() - restore_began:.1f} s)", flush=True)
            log = MetricsLog(out / "metrics.jsonl")
            for record in records:  # a resumed run's metrics file again as its checkpoint has them
                log.write(record)
            bar = tqdm(total=args.iterations, initial=start_at - 1, desc=cfg.algo.upper(), unit="iter",
                       disable=args.no_progress, dynamic_ncols=True)
            train_began = time.monotonic()
            saved_seconds = 0.0
            for iteration in range(start_at, args.iterations + 1):
                metrics, _ = pipeline.run_iteration(iteration)
                pipeline.clear()
                log.write(metrics)
                records.append(metrics)
                saving = time.monotonic()
                pipeline.save_checkpoint(out, iteration, records)
                progress.saved = iteration
                saved_seconds += time.monotonic() - saving
                line = iteration_line(cfg, metrics)
                bar.set_postfix_str(line, refresh=False)
                bar.update(1)
                if args.no_progress:
                    print(f"iteration {iteration}: {line}", flush=True)
            bar.close()
            train_seconds = time.monotonic() - train_began
        except BaseException:
            # The error (or the user's Ctrl-C, which reaches Ray's daemons too) is what the user must see, not
            # what winding down the workers it stopped says after it; the checkpoint is what a resume needs.
            _wind_down(log, pipeline, dock, quietly=True)
            raise
        _wind_down(log, pipeline, dock, quietly=False)
    plot(records, picture)
    first, last = first_last([r["reward"] for r in records])
    k = min(3, len(records))
    print(f"mean reward: first {k} iterations {first:.3f}, last {k} iterations {last:.3f}")
    print(f"time: {train_seconds:.1f} s for {args.iterations - start_at + 1} iterations, "
          f"{time.monotonic() - began:.1f} s in all "
          f"(Ray, Redis and worker start-up included), checkpoints {saved_seconds:.2f} s of the training "
          f"(to run more: {resume_command(out)} --iterations N)")
    print(f"wrote {out / 'metrics.jsonl'} and {picture}")
    return 0


def _wind_down(log: Any, pipeline: Any, dock: Any, *, quietly: bool) -> None:
    """Close the metrics log, stop the worker groups and Ray, delete the dock (a resume makes it again). With
    ``quietly`` (the run failed or was stopped), a step that fails does not stop the others, and says nothing."""
    import ray

    for owner, step in ((log, "close"), (pipeline, "shutdown"), (dock, "delete"), (ray, "shutdown")):
        if owner is None:
            continue
        try:
            getattr(owner, step)()
        except Exception:  # noqa: BLE001 - the run's own error, or the Ctrl-C line, says what happened
            if not quietly:
                raise


def main(argv: Sequence[str] | None = None) -> int:
    from broker.errors import BrokerError

    try:
        return run(build_demo_parser().parse_args(argv))
    except BrokerError as exc:  # a checkpoint that cannot be resumed, a Redis that went away: what, not where
        print(f"demo: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
