"""The synthetic GRPO global batch and its stages, as pure functions with checksums.

Every system measured runs exactly this: the same prompts, the same lengths, the same stage code.
Each stage's output is a pure function of the rows it read (and their indexes), so equal checksums
across systems prove that every byte arrived intact, in the right row.

Columns (int32 tokens, float32 per-token values, one-element scalars):

=================  =======  ============================  ==========================
column             dtype    length per row                written by
=================  =======  ============================  ==========================
prompts            int32    64-512 (one draw per prompt)  load (the driver)
prompt_length      int32    1                             load
responses          int32    64-2048 (one draw per row)    actor_rollout
response_length    int32    1                             actor_rollout
input_ids          int32    prompt + response             actor_rollout
ref_log_prob       float32  response                      ref_log_prob
old_log_prob       float32  response                      actor_log_prob
rm_scores          float32  1                             rule_reward
advantages         float32  response                      compute_advantage
=================  =======  ============================  ==========================
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

Rows = dict[str, list[torch.Tensor]]
StageFn = Callable[[Rows, list[int]], Rows]

COLUMNS = (
    "prompts", "prompt_length", "responses", "response_length", "input_ids",
    "ref_log_prob", "old_log_prob", "rm_scores", "advantages",
)
DTYPES = {c: torch.float32 if c in ("ref_log_prob", "old_log_prob", "rm_scores", "advantages") else torch.int32
          for c in COLUMNS}
LOAD_COLUMNS = ("prompts", "prompt_length")

_MASK = (1 << 64) - 1
_VOCAB = 32_000
# Position weights of the fold below: odd, so every element moves the sum; distinct, so a swap does too.
_WEIGHTS = ((np.arange(1, 1 << 13, dtype=np.int64) * 2_654_435_761) % (1 << 31)) | 1


def fold(t: torch.Tensor) -> int:
    """A position-weighted 64-bit sum of a 1-D int32 or float32 tensor's bits (float bits reinterpreted)."""
    a = t.numpy()
    bits = a.view(np.int32) if a.dtype == np.float32 else a
    n = bits.shape[0]
    weights = _WEIGHTS[:n] if n <= _WEIGHTS.shape[0] else np.resize(_WEIGHTS, n)
    return int(np.dot(bits.astype(np.int64), weights)) & _MASK  # int64 wraps: still deterministic


def mix(*values: int) -> int:
    """Combine 64-bit values order-sensitively (splitmix64 finaliser per step)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = ((h ^ (v & _MASK)) * 0xBF58476D1CE4E5B9) & _MASK
        h ^= h >> 31
    return h


@dataclass(frozen=True)
class Stage:
    """One consumer of the dock: reads ``reads`` in calls of ``count`` rows, writes ``writes``."""

    name: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    count: int
    fn: StageFn = field(compare=False)


@dataclass(frozen=True)
class Workload:
    """One GRPO global batch: ``prompts`` × ``n`` rows, read ``groups_per_call`` groups at a time."""

    prompts: int = 256
    n: int = 8
    seed: int = 0
    groups_per_call: int = 16
    prompt_len: tuple[int, int] = (64, 512)
    response_len: tuple[int, int] = (64, 2048)

    @property
    def capacity(self) -> int:
        return self.prompts * self.n

    @property
    def call_rows(self) -> int:
        return min(self.groups_per_call, self.prompts) * self.n

    @functools.cached_property
    def _draws(self) -> tuple[list[torch.Tensor], np.ndarray]:
        g = np.random.default_rng(self.seed)
        lo, hi = self.prompt_len
        prompts = [torch.from_numpy(g.integers(0, _VOCAB, int(length), dtype=np.int32))
                   for length in g.integers(lo, hi + 1, self.prompts)]
        lo, hi = self.response_len
        return prompts, g.integers(lo, hi + 1, self.capacity).astype(np.int64)

    def prompt_rows(self, rows: Sequence[int]) -> Rows:
        """The load stage's data: each prompt repeated for its n rows, as MindSpeed's put_prompts_experience."""
        prompts, _ = self._draws
        p = [prompts[r // self.n] for r in rows]
        return {"prompts": p, "prompt_length": [torch.tensor([len(x)], dtype=torch.int32) for x in p]}

    def response_length(self, row: int) -> int:
        """How long rollout's answer to ``row`` is: a per-row draw from the seed, like a sampler's."""
        return int(self._draws[1][row])

    @functools.cached_property
    def stages(self) -> tuple[Stage, ...]:
        """The stages in pipeline order."""
        k, everything = self.call_rows, self.capacity
        lengths = ("input_ids", "responses", "prompt_length", "response_length")
        return (
            Stage("actor_rollout", ("prompts",), ("responses", "response_length", "input_ids"), k, self._rollout),
            Stage("ref_log_prob", lengths, ("ref_log_prob",), k, functools.partial(_log_prob, salt=17)),
            Stage("actor_log_prob", lengths, ("old_log_prob",), k, functools.partial(_log_prob, salt=29)),
            Stage("rule_reward", ("prompts", "responses"), ("rm_scores",), k, _reward),
            Stage("compute_advantage", ("rm_scores", "response_length"), ("advantages",), everything,
                  functools.partial(_advantage, n=self.n)),
            Stage("actor_train", ("input_ids", "responses", "prompt_length", "response_length", "old_log_prob",
                                  "ref_log_prob", "advantages"), (), k, _train),
        )

    @property
    def consumers(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def payload_bytes(self) -> int:
        """Bytes of tensor data in a full batch: every column of every row."""
        prompts, resp = self._draws
        p = sum(len(prompts[r // self.n]) for r in range(self.capacity))
        r = int(resp.sum())
        # prompts + input_ids (p + r) + responses + three per-token float columns + three scalars
        return 4 * (p + (p + r) + r + 3 * r + 3 * self.capacity)

    def _rollout(self, batch: Rows, rows: list[int]) -> Rows:
        responses, lengths, input_ids = [], [], []
        for row, prompt in zip(rows, batch["prompts"]):
            length = self.response_length(row)
            start = mix(fold(prompt), row) & 0x7FFFFFFF
            tokens = ((np.arange(length, dtype=np.int64) * 40_503 + start) % _VOCAB).astype(np.int32)
            response = torch.from_numpy(tokens)
            responses.append(response)
            lengths.append(torch.tensor([length], dtype=torch.int32))
            input_ids.append(torch.cat((prompt, response)))
        return {"responses": responses, "response_length": lengths, "input_ids": input_ids}


def _log_prob(batch: Rows, rows: list[int], salt: int) -> Rows:
    out = []
    for ids, resp, plen, rlen in zip(batch["input_ids"], batch["responses"], batch["prompt_length"],
                                     batch["response_length"]):
        p, r = int(plen[0]), int(rlen[0])
        context = fold(ids[:p]) % 10_007
        tokens = resp.numpy()[:r].astype(np.int64)
        value = ((tokens * salt + context) % 10_007).astype(np.float32) * np.float32(-5.0 / 10_007)
        out.append(torch.from_numpy(value))
    return {("ref_log_prob" if salt == 17 else "old_log_prob"): out}


def _reward(batch: Rows, rows: list[int]) -> Rows:
    scores = [torch.tensor([(mix(fold(p), fold(r)) % 1000) / 1000.0], dtype=torch.float32)
              for p, r in zip(batch["prompts"], batch["responses"])]
    return {"rm_scores": scores}


def _advantage(batch: Rows, rows: list[int], n: int) -> Rows:
    order = np.argsort(rows)  # group-normalise in row order, whatever order the dock handed rows in
    scores = torch.cat(batch["rm_scores"])[order].reshape(-1, n)
    norm = ((scores - scores.mean(1, keepdim=True)) / (scores.std(1, keepdim=True) + 1e-6)).reshape(-1)
    out: list[torch.Tensor] = [torch.empty(0)] * len(rows)
    for pos, i in enumerate(order):
        out[i] = torch.full((int(batch["response_length"][i][0]),), float(norm[pos]), dtype=torch.float32)
    return {"advantages": out}


def _train(batch: Rows, rows: list[int]) -> Rows:
    """The trainer writes nothing; its per-row result (a digest of all it read) is what gets checked.

    Integer digests of the float bits, not a float loss: a float reduction may round differently
    depending on how a buffer is aligned, and buffers from Redis are aligned differently from torch's.
    """
    reads = ("input_ids", "responses", "prompt_length", "response_length", "old_log_prob", "ref_log_prob",
             "advantages")
    return {"train": [torch.tensor([mix(*(fold(batch[c][i]) for c in reads)) >> 1], dtype=torch.int64)
                      for i in range(len(rows))]}


class Checksums:
    """Order-independent digests of what each stage produced, per row; equal across systems iff data agree."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[int, int]] = {}

    def add(self, stage: str, out: Rows, rows: list[int]) -> None:
        seen = self.rows.setdefault(stage, {})
        columns = sorted(out)
        for i, row in enumerate(rows):
            seen[row] = mix(row, *(_digest(out[c][i]) for c in columns))

    def merge(self, other: Checksums) -> None:
        for stage, rows in other.rows.items():
            self.rows.setdefault(stage, {}).update(rows)

    def by_stage(self) -> dict[str, str]:
        """Stage -> hex digest over its rows (sum of per-row mixes, so row order does not matter)."""
        return {s: f"{sum(mix(r, v) for r, v in rows.items()) & _MASK:016x}" for s, rows in sorted(self.rows.items())}

    def total(self) -> str:
        stages = self.by_stage()
        return f"{mix(*(int(h, 16) for h in stages.values()), len(stages)):016x}"


def _digest(t: torch.Tensor) -> int:
    if t.dtype == torch.int64:  # the trainer's results
        return int(t[0]) & _MASK
    return fold(t)
