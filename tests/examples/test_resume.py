"""A run killed whole (driver, workers and its Redis, SIGKILL) resumes with ``--resume DIR``: no prompt skipped,
none trained twice.

The ledger is the trainer's, in each iteration's metrics: the rows it trained and a sum over them of a CRC
of (row, prompt). A resumed run's ledger, iteration by iteration, must equal an uninterrupted run's with
the same seed: the iteration running at the kill is redone from its start with the same prompts, by the
trainer as it was when that iteration began. The checkpoint's own failure modes (none, damaged, of
another format, half written) are checked without Ray below.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from workers.runtime import checkpoint as checkpoints

ITERATIONS = 8
RUN = ["--prompts", "4", "--n", "4", "--tp", "1", "--no-progress", "--cpus", "2", "--seed", "3"]


def demo(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "workers.demo", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kwargs)


def ledgers(folder: Path) -> list[tuple[int, dict, float, float]]:
    """Per iteration: its number, the trainer's ledger, and the reward and loss rounded (this 1 x 1 run is
    deterministic: a resumed trainer that did not take up its model and optimizer would differ there)."""
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["iteration"], r["ledger"], round(r["reward"], 6), round(r["pg_loss"], 6)) for r in records]


def done_iterations(folder: Path) -> int:
    try:
        return json.loads((folder / checkpoints.CURRENT / checkpoints.STATE).read_text())["iteration"]
    except (FileNotFoundError, ValueError):
        return 0


def processes_using(path: Path) -> list[int]:
    """Pids whose command line names ``path`` (the run's redis-server: its --dir)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(path).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


#: The runs killed: a synchronous one (its dock is empty at every checkpoint), and a partial-rollout one
#: without leases (checkpoints depend on neither), whose checkpoints hold the dock's groups, their partial
#: responses and ages. Asynchronous rollout (--max-staleness) resumes through the same dock snapshot.
CASES = {"synchronous": [], "partial-no-leases": ["--max-age", "2", "--lease-seconds", "0"]}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, request) -> list[tuple[int, dict, float, float]]:
    folder = tmp_path_factory.mktemp("uninterrupted")
    run = demo("--iterations", str(ITERATIONS), "--out", str(folder), *RUN, *CASES[request.param])
    output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output
    return ledgers(folder)


@pytest.mark.slow
@pytest.mark.real
@pytest.mark.parametrize("uninterrupted", list(CASES), indirect=True)
def test_a_run_killed_whole_resumes_without_skipping_or_repeating_a_prompt(uninterrupted, tmp_path, request):
    """Once per case, at a random point of each."""
    case = request.node.callspec.params["uninterrupted"]
    seed = int(os.environ.get("BROKER_KILL_SEED", random.randrange(1 << 30))) + list(CASES).index(case)
    pick = random.Random(seed)
    # An iteration of this run takes some 0.2-0.5 s: the kill lands in the iteration after checkpoint `after`,
    # or in that checkpoint's write.
    after, delay = pick.randrange(1, ITERATIONS // 2 + 1), pick.uniform(0.0, 0.3)
    folder = tmp_path / "run"
    run = demo("--iterations", str(ITERATIONS), "--out", str(folder), *RUN, *CASES[case], start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while done_iterations(folder) < after and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(delay)
        print(f"{case}, seed {seed}: SIGKILL of Redis, the driver and its workers {delay:.2f} s after checkpoint "
              f"{after}")
        for pid in processes_using(folder / "redis"):  # the server first: it crashes, it is not shut down
            os.kill(pid, signal.SIGKILL)
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(30)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    if done_iterations(folder) == ITERATIONS:
        pytest.skip(f"seed {seed}: the run had finished before the kill")  # nothing to resume
    resumed = demo("--resume", str(folder), "--cpus", "2")
    output, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, output
    assert "resumed:" in output, output
    assert ledgers(folder) == uninterrupted, f"seed {seed}\n{output}"


# -- the checkpoint's own failures, without Ray ------------------------------------------------------------


def sample(iteration: int = 2) -> checkpoints.Checkpoint:
    return checkpoints.Checkpoint(iteration=iteration, records=[{"iteration": 1}], dock="d", fingerprint="f",
                                  restarts=0, trainers={"actor_train": [{"model": {"w": torch.ones(2)}}]},
                                  prompt_generator=torch.Generator().manual_seed(1).get_state())


def test_a_checkpoint_reads_back_as_written_and_replaces_the_last_one(tmp_path):
    checkpoints.save(tmp_path, sample(1))
    checkpoints.save(tmp_path, sample(2))
    got = checkpoints.load(tmp_path)
    assert got.iteration == 2 and torch.equal(got.trainers["actor_train"][0]["model"]["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoints.CURRENT]


def test_a_crash_between_the_renames_leaves_the_last_checkpoint(tmp_path):
    checkpoints.save(tmp_path, sample(1))
    (tmp_path / checkpoints.CURRENT).rename(tmp_path / checkpoints.OLD)  # as the save leaves it between them
    (tmp_path / checkpoints.NEW).mkdir()  # a half-written new one, without its state.json
    assert checkpoints.load(tmp_path).iteration == 1
    checkpoints.save(tmp_path, sample(2))  # the next save clears the remains
    assert checkpoints.load(tmp_path).iteration == 2


def test_no_damaged_or_foreign_checkpoint_is_resumed_from(tmp_path):
    with pytest.raises(checkpoints.CheckpointError, match="no checkpoint to resume from"):
        checkpoints.load(tmp_path)
    checkpoints.save(tmp_path, sample())
    state = tmp_path / checkpoints.CURRENT / checkpoints.STATE
    state.write_text(json.dumps({**json.loads(state.read_text()), "format": 99}))
    with pytest.raises(checkpoints.CheckpointError, match="format 99"):
        checkpoints.load(tmp_path)
    checkpoints.save(tmp_path, sample())
    (tmp_path / checkpoints.CURRENT / checkpoints.TRAINERS).write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoints.CheckpointError, match="unreadable checkpoint"):
        checkpoints.load(tmp_path)


@pytest.mark.real
def test_a_checkpoint_holds_the_docks_keys_and_puts_them_back(url, tmp_path):
    """What a partial-rollout run's checkpoint holds of its dock: the keys as they were when it was saved,
    back in place whatever the dock held since; a checkpoint without them is refused for such a run."""
    from broker import TransferDock
    from tests.delivery.test_partial_rollout import COLUMNS, CONSUMERS, ROLLOUT_COLUMNS, partial, prompts, respond
    from tests.helpers import raw_state, restored_from

    def make(prompts_num, n, columns, consumers, name=None, **kwargs):
        return TransferDock(url, name or f"resume-{os.getpid()}", prompts_num=prompts_num, n_samples_per_prompt=n,
                            columns=columns, consumers=consumers, **kwargs)

    dock = partial(make)
    try:
        prompts(dock, [0, 1])
        _, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 4, get_n_samples=False)
        respond(dock, rows, [1, 1, 0, 0])
        dock.clear(consumer="actor_train")
        saved = raw_state(dock)
        checkpoints.save(tmp_path, sample(), dock=dock)
        _, rows = dock.get_experience("actor_rollout", ROLLOUT_COLUMNS, 4, get_n_samples=False)
        respond(dock, rows, [1] * len(rows))  # the iteration the kill interrupted
        dock.get_experience("actor_train", list(COLUMNS), 2)
        assert raw_state(dock) != saved
        checkpoints.restore_dock(checkpoints.load(tmp_path), dock)
        assert raw_state(dock) == restored_from(saved, dock) and tuple(dock.consumers) == CONSUMERS
        checkpoints.save(tmp_path, sample())  # a synchronous run's: no rows
        with pytest.raises(checkpoints.CheckpointError, match="holds no rows"):
            checkpoints.restore_dock(checkpoints.load(tmp_path), dock)
    finally:
        dock.delete()


def test_resume_takes_the_runs_options_and_refuses_other_ones(tmp_path):
    from workers.demo import RUN_FILE, resumed_args
    from workers.options import build_demo_parser

    parser = build_demo_parser()
    started = parser.parse_args(["--prompts", "4", "--n", "4", "--iterations", "3"])
    (tmp_path / RUN_FILE).write_text(json.dumps({"options": vars(started)}))
    alone = resumed_args(parser.parse_args(["--resume", str(tmp_path)]))
    assert (alone.prompts, alone.n, alone.iterations, alone.out) == (4, 4, 3, str(tmp_path))
    again = resumed_args(parser.parse_args(["--prompts", "4", "--n", "4", "--iterations", "9", "--resume",
                                            str(tmp_path)]))
    assert (again.prompts, again.iterations) == (4, 9)  # typed again, with more iterations
    with pytest.raises(ValueError, match="started with --n 4, not 8"):
        resumed_args(parser.parse_args(["--n", "8", "--resume", str(tmp_path)]))
    with pytest.raises(ValueError, match="no run.json there"):
        resumed_args(argparse.Namespace(**{**vars(alone), "resume": str(tmp_path / "elsewhere")}))
