"""Pipeline soak: prompts, rollout, filter and trainer on one dock, with workers that sleep past their
lease or are SIGKILLed; then an exact accounting of what the trainer learnt from.

What it guards: a worker that is slow, not dead, writes its result after its lease ran out. Before writes
were fenced that result landed on whatever the rows held by then: the same prompt, redone by another worker
(a response overwritten after its reward was computed), or the next prompt, which the driver had put into
the rows the trainer cleared. The trainer then learnt from a (prompt, response, reward) that do not belong
together: 219 such rows in 30 s with 10 % of rollout batches sleeping 1.5 x their lease, 0 without the
sleeps. Now such a write raises FencedError and writes nothing (broker/delivery.py).

The dock has columns ``prompts``, ``responses``, ``rewards`` and consumers ``rollout``, ``filter``,
``train``; a group is one prompt's n rows. The benchmark process is the driver and the trainer:

* driver: claims free groups (``reserve_groups``) and puts a new prompt into each, ids 1, 2, 3, ...,
  with a plain list of rows (a producer's put, not fenced);
* rollout workers: take a group with a lease; each row's response names the prompt and row it answers,
  the worker and the attempt; with probability ``slow`` they sleep ``slow_factor`` x the lease first;
  the put names the delivery (fenced), which acks the rows in the same step;
* filter workers: take prompts and responses with a lease (sleeping past it at random too); reward =
  ``reward_of(prompt, response)``; a prompt whose id is a multiple of ``drop_every`` is dropped with
  ``drop_groups(..., delivery=rows)``, any other gets its rewards put, fenced (and acked);
* trainer: takes whole groups of all three columns with a lease, checks every row's pairing, acks, and
  only then counts the group trained and clears it for the driver to refill.

With ``kill``, a random rollout or filter worker is SIGKILLed every ``kill_every`` seconds on average and
replaced. With ``unfenced`` (the control run) workers write with plain lists, ``list(rows)``, drop
without ``delivery`` and ack after the put, as before the fence: the mispairs this run counts are what the
fence prevents.

When the time is up the driver stops and the pipeline drains; then the logs (one per process, fixed-size
records that survive SIGKILL, see soak.py) and the dock must show: every prompt put trained exactly once,
or dropped by the filter's rule, or still in the dock (a failed drain); none lost; no prompt the filter
rejects trained; the dock's ``discarded`` count equal to the prompts dropped; no mispaired row. ``failed``
names the checks that did not hold.

Mispairs of a reward with a response that a redo wrote again are also counted apart
(``reward_after_a_rewrite``). This soak found them under the fence while the put and its ack were two
calls: a put landing on a lease past its deadline (nobody had taken it back yet) left the rows leased, so
another worker could be handed them before the ack and replace the response the filter had judged. A put
naming a leased delivery now acks its rows in the same step (tests/delivery/test_write_fence.py).
"""

from __future__ import annotations

import random
import struct
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from broker.api.delivery import HandedRows
from broker.api.dock import TransferDock
from broker.bench.broker_dock import delete_dock
from broker.bench.docks import dock_target
from broker.bench.sampling import percentiles
from broker.bench.soak import Flag, Record, RecordLog, Workers, read_logs, remove_folder
from broker.errors import FencedError

ROLLOUT, FILTER, TRAIN = "rollout", "filter", "train"
COLUMNS = ("prompts", "responses", "rewards")

# Record kinds; a record is (kind, prompt id, group or row, latency s, time s), see soak.RecordLog.
PUT = 1  #: driver: prompt a put into group b
#: rollout: took / put landed / put refused / its ack released fewer rows than it was handed (the group was
#: trained and cleared, or dropped, before the ack, or the lease had run out and the rows went to another worker)
R_GOT, R_WROTE, R_FENCED, R_ACK_SHORT = 10, 11, 12, 13
F_GOT, F_REWARDED, F_DROPPED, F_FENCED, F_DROP_FENCED, F_ACK_SHORT = 20, 21, 22, 23, 24, 25  #: filter, the same
T_GOT, TRAINED, T_ACK_SHORT = 30, 31, 32  #: trainer: took / acked, so trained / its ack came too late
MISPAIRED_PROMPT = 33  #: a trained row (a = the row's prompt, b = row) whose response answers another prompt or row
MISPAIRED_REWARD = 34  #: a trained row whose reward was computed for another (prompt, response)
SLOW = 0x80  #: or'd into a worker's write outcome: the write came after sleeping past the lease
_WRITES = (R_WROTE, F_REWARDED, F_DROPPED)
_REFUSED = (R_FENCED, F_FENCED, F_DROP_FENCED)
_LATENCIES = {R_GOT: "rollout_get", R_WROTE: "rollout_put", F_GOT: "filter_get", F_REWARDED: "filter_put",
              F_DROPPED: "filter_drop", T_GOT: "train_get"}


@dataclass(frozen=True)
class PipelineSoakConfig:
    """What to run; see the module docstring."""

    per_stage: int = 2  #: rollout processes, and as many filter processes
    seconds: float = 30.0
    lease_seconds: float = 0.5
    slow: float = 0.1  #: chance that a rollout or filter batch sleeps past its lease
    slow_factor: float = 1.5  #: ... for this many times the lease
    kill: bool = False
    kill_every: float = 1.0
    unfenced: bool = False
    groups: int = 16
    n: int = 4
    drop_every: int = 7
    seed: int = 0


def reward_of(prompt: int, response: Sequence[int]) -> int:
    """The filter's reward: a function of the prompt and the whole response (its worker and attempt too),
    so a reward computed for another response of the same prompt does not check either."""
    return zlib.crc32(struct.pack(f"<{1 + len(response)}q", prompt, *response))


def rejected(prompt: int, drop_every: int) -> bool:
    """Whether the filter drops the prompt's group (a stand-in for DAPO's "all n rewards equal")."""
    return prompt % drop_every == 0


def _worker(role: str, worker: int, url: str, name: str, params: dict[str, Any], done: Flag, log_path: str) -> None:
    """A rollout or filter process: take a group, maybe sleep past the lease, write (fenced), ack."""
    torch.set_num_threads(1)
    cfg = PipelineSoakConfig(**params)
    dock = TransferDock.attach(dock_target(url), name)
    log = RecordLog(Path(log_path))
    rng = random.Random(cfg.seed * 1_000_003 + worker)
    columns = ["prompts"] if role == ROLLOUT else ["prompts", "responses"]
    got_kind = R_GOT if role == ROLLOUT else F_GOT
    attempt = 0
    while not done.is_set():
        t0 = time.perf_counter()
        batch, rows = dock.get_experience(role, columns, cfg.n, timeout=0.2, lease=cfg.lease_seconds)
        if batch is None or rows is None:
            continue
        prompts = [int(t[0]) for t in batch["prompts"]]
        prompt, group = prompts[0], rows[0] // cfg.n
        log(got_kind, prompt, group, time.perf_counter() - t0)
        attempt += 1
        slow = SLOW if rng.random() < cfg.slow else 0
        if slow and done.wait(cfg.slow_factor * cfg.lease_seconds):
            break  # the run is over: every prompt was trained already, this write would be refused
        # The control run names plain rows, as every worker did before writes were fenced.
        target = list(rows) if cfg.unfenced else rows
        t0 = time.perf_counter()
        try:
            if role == ROLLOUT:
                responses = [torch.tensor([p, r, worker, attempt]) for p, r in zip(prompts, rows)]
                dock.put_experience({"responses": responses}, target)
                wrote = R_WROTE
            elif rejected(prompt, cfg.drop_every):
                fence = None if cfg.unfenced or not isinstance(rows, HandedRows) else rows
                dock.drop_groups(FILTER, [group], delivery=fence)
                wrote = F_DROPPED
            else:
                rewards = [torch.tensor([reward_of(p, t.tolist())]) for p, t in zip(prompts, batch["responses"])]
                dock.put_experience({"rewards": rewards}, target)
                wrote = F_REWARDED
        except FencedError:
            refused = R_FENCED if role == ROLLOUT else F_DROP_FENCED if rejected(prompt, cfg.drop_every) else F_FENCED
            log(refused | slow, prompt, group)
            continue  # the rows are someone else's now: nothing to ack
        log(wrote | slow, prompt, group, time.perf_counter() - t0)
        if wrote == F_DROPPED or not cfg.unfenced:
            continue  # a drop forgets the rows, leases included; a fenced put acked its rows
        if dock.ack(role, rows) < len(rows):
            # Downstream was quicker (trained and cleared, or dropped), or the lease ran out and the rows
            # went to another worker, who writes them again (``rewritten`` counts those).
            log((R_ACK_SHORT if role == ROLLOUT else F_ACK_SHORT) | slow, prompt, group)


def _refill(dock: TransferDock, cfg: PipelineSoakConfig, log: RecordLog, prompt: int) -> int:
    """Put a new prompt into every free group (the driver); returns the next prompt id."""
    while groups := dock.reserve_groups(1, "prompts"):
        g = groups[0]
        dock.put_experience({"prompts": [torch.tensor([prompt])] * cfg.n}, list(range(g * cfg.n, (g + 1) * cfg.n)))
        log(PUT, prompt, g)
        prompt += 1
    return prompt


def _train(dock: TransferDock, cfg: PipelineSoakConfig, log: RecordLog) -> None:
    """One step of the trainer: take a group, check its pairing, ack; only an ack in time trains it."""
    t0 = time.perf_counter()
    batch, rows = dock.get_experience(TRAIN, list(COLUMNS), cfg.n, timeout=0.05, lease=cfg.lease_seconds)
    if batch is None or rows is None:
        return
    prompts = [int(t[0]) for t in batch["prompts"]]
    group = rows[0] // cfg.n
    log(T_GOT, prompts[0], group, time.perf_counter() - t0)
    wrong: list[tuple[int, int, int]] = []
    for prompt, row, response, reward in zip(prompts, rows, batch["responses"], batch["rewards"]):
        answered = response.tolist()
        if answered[:2] != [prompt, row] or prompt != prompts[0]:
            wrong.append((MISPAIRED_PROMPT, prompt, row))
        elif int(reward[0]) != reward_of(prompt, answered):
            wrong.append((MISPAIRED_REWARD, prompt, row))
    if dock.ack(TRAIN, rows) < len(rows):
        log(T_ACK_SHORT, prompts[0], group)  # given back to be trained again: this delivery does not count
        return
    for kind, prompt, row in wrong:
        log(kind, prompt, row)
    log(TRAINED, prompts[0], group)
    dock.clear(list(rows))  # free for the driver's next prompt


def _drained(dock: TransferDock) -> bool:
    """No prompt left in the dock, and no lease out."""
    status = dock.status()
    return status["columns"]["prompts"]["ready"] == 0 and all(c["leased"] == 0 for c in status["consumers"].values())


def run_pipeline_soak(url: str, name: str, cfg: PipelineSoakConfig) -> dict[str, Any]:
    """Run the pipeline soak; its figures and accounting, ``ok`` when every check passed."""
    from broker.bench.concurrent import context

    if not 0 <= cfg.slow <= 1:
        raise ValueError(f"slow is a probability, got {cfg.slow}")
    dock = TransferDock(dock_target(url), name, prompts_num=cfg.groups, n_samples_per_prompt=cfg.n,
                        columns=list(COLUMNS), consumers=[ROLLOUT, FILTER, TRAIN])
    folder = Path(tempfile.mkdtemp(prefix="broker-pipeline-soak-"))
    ctx = context()
    done = Flag(ctx)
    params = asdict(cfg)
    roles = [ROLLOUT] * cfg.per_stage + [FILTER] * cfg.per_stage
    workers = Workers(ctx, folder, [f"{role}{slot:02d}" for slot, role in enumerate(roles)], _worker,
                      lambda slot, incarnation: (roles[slot], slot * 10_000 + incarnation, url, name, params, done),
                      kill_every=cfg.kill_every if cfg.kill else None, seed=cfg.seed)
    log = RecordLog(folder / "main.log")
    try:
        dock.clear()
        prompt = _refill(dock, cfg, log, 1)
        workers.start()
        start = time.monotonic()
        while time.monotonic() < start + cfg.seconds:
            _train(dock, cfg, log)
            prompt = _refill(dock, cfg, log, prompt)
            workers.tick()
        load_end = time.monotonic()
        # Drain: no new prompts; the workers and the trainer go on until nothing is left (slow workers
        # included: their leases run out and the rows are redone), killing stops.
        deadline = load_end + 4 * cfg.slow_factor * cfg.lease_seconds + 30
        drained = False
        while not drained and time.monotonic() < deadline:
            for _ in range(5):
                _train(dock, cfg, log)
            drained = _drained(dock)
        drain_seconds = time.monotonic() - load_end
        done.set()
        workers.join(10)
        final = dock.status()
        held = dock.read_rows(["prompts"], range(dock.capacity))["prompts"]
        in_dock = {int(t[0]) for t in held if t is not None}
    finally:
        done.set()
        workers.kill_all()
        log.close()
        delete_dock(dock)
    records = read_logs(folder, "*.log")
    remove_folder(folder)
    result = account(records, final["discarded"].get(FILTER, 0), in_dock, cfg.drop_every)
    result.update(mode="pipeline", config=asdict(cfg), kills=workers.kills, crashed=workers.crashed,
                  drained=drained, drain_seconds=drain_seconds, load_seconds=load_end - start,
                  redelivered_rows={c: final["consumers"][c]["redelivered"] for c in (ROLLOUT, FILTER, TRAIN)},
                  **_rates(records, start, load_end, cfg.n))
    result["failed"] += [name for name, good in (("drained", drained), ("no_crash", not workers.crashed)) if not good]
    result["ok"] = not result["failed"]
    return result


def account(records: Sequence[Record], discarded: int, in_dock: Collection[int], drop_every: int) -> dict[str, Any]:
    """The checks and counts from every process's records, the dock's ``discarded`` count for the filter
    and the prompts still in the dock at the end."""
    kinds = Counter(r[0] for r in records)
    put = [r[1] for r in records if r[0] == PUT]
    trained = Counter(r[1] for r in records if r[0] == TRAINED)
    put_once, left = set(put), set(in_dock)
    twice = sorted(p for p, c in trained.items() if c > 1)
    unknown = sorted(trained.keys() - put_once)
    trained_rejected = sorted(p for p in trained if rejected(p, drop_every))
    # The filter's rule is deterministic: a rejected prompt no longer in the dock and never trained was
    # dropped. Whether the worker that dropped it lived to log it does not matter (a SIGKILL may land in
    # between); the dock's own count must agree.
    dropped = {p for p in put_once - left - trained.keys() if rejected(p, drop_every)}
    lost = sorted(put_once - trained.keys() - dropped - left)
    mispaired_prompt, mispaired_reward = kinds[MISPAIRED_PROMPT], kinds[MISPAIRED_REWARD]
    drops_logged = kinds[F_DROPPED] + kinds[F_DROPPED | SLOW]
    slow_landed = sum(kinds[k | SLOW] for k in _WRITES)
    slow_refused = sum(kinds[k | SLOW] for k in _REFUSED)
    # A prompt whose responses (rewards) landed from two deliveries: redone after a write that landed, whose
    # worker then lost the rows before its ack. The second write replaces what the filter may have judged.
    responses = Counter(r[1] for r in records if r[0] & ~SLOW == R_WROTE)
    rewards = Counter(r[1] for r in records if r[0] & ~SLOW == F_REWARDED)
    rewritten = {p for p, c in responses.items() if c > 1}
    after_rewrite = sum(1 for r in records if r[0] == MISPAIRED_REWARD and r[1] in rewritten)
    checks = {
        "put_once": len(put) == len(put_once),  # the driver's own bookkeeping
        "trained_once": not twice,
        "trained_known": not unknown,
        "rejected_untrained": not trained_rejected,
        "nothing_lost": not lost,
        "paired": mispaired_prompt == mispaired_reward == 0,
        "discarded_matches": discarded == len(dropped),
        "drops_counted": drops_logged <= discarded,
    }
    failed = [name for name, passed in checks.items() if not passed]
    return {
        "ok": not failed, "failed": failed,
        "prompts_put": len(put), "trained": len(trained), "dropped": len(dropped), "in_dock": len(left),
        "lost": len(lost), "trained_twice": len(twice), "unknown": len(unknown),
        "trained_rejected": len(trained_rejected),
        "mispaired_rows": mispaired_prompt + mispaired_reward,
        "mispaired": {"response_of_another_prompt": mispaired_prompt, "reward_of_another_response": mispaired_reward,
                      "reward_after_a_rewrite": after_rewrite},
        "discarded": discarded, "drops_logged": drops_logged,
        "slow_batches": slow_landed + slow_refused,
        "late_writes": {"refused": slow_refused, "landed": slow_landed},
        "fenced": {"rollout_puts": kinds[R_FENCED] + kinds[R_FENCED | SLOW],
                   "filter_puts": kinds[F_FENCED] + kinds[F_FENCED | SLOW],
                   "filter_drops": kinds[F_DROP_FENCED] + kinds[F_DROP_FENCED | SLOW]},
        "short_acks": {"rollout": kinds[R_ACK_SHORT] + kinds[R_ACK_SHORT | SLOW],
                       "filter": kinds[F_ACK_SHORT] + kinds[F_ACK_SHORT | SLOW], "train": kinds[T_ACK_SHORT]},
        "rewritten": {"responses": len(rewritten), "rewards": sum(1 for c in rewards.values() if c > 1)},
        "examples": {"lost": lost[:5], "trained_twice": twice[:5], "unknown": unknown[:5],
                     "trained_rejected": trained_rejected[:5]},
    }


def _rates(records: Sequence[Record], start: float, load_end: float, n: int) -> dict[str, Any]:
    """Throughput and latencies of the load phase."""
    in_load = [r for r in records if start <= r[4] <= load_end]
    seconds = max(load_end - start, 1e-9)
    trained = sum(1 for r in in_load if r[0] == TRAINED)
    latency = {name: [r[3] for r in in_load if r[0] & ~SLOW == kind] for kind, name in _LATENCIES.items()}
    return {"prompts_trained_per_second": trained / seconds, "rows_trained_per_second": trained * n / seconds,
            "latency": {name: {"calls": len(v), **percentiles(v)} for name, v in latency.items() if v}}
