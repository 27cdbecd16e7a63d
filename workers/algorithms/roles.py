"""The roles every algorithm shares, and the base classes of the ones an algorithm defines itself.

A role computes on one padded batch and returns what it writes back (one tensor per row). Every rank
of a TP group runs ``compute`` on the same batch; only TP rank 0's output is written. Token columns
arrive padded with EOS and float columns with 0.0, to a width that is a multiple of the TP size, so
widths are cut back with the ``*_length`` columns wherever a row's length matters.

Shared as they are: the rollout, the reference and actor log-probs. Shared as bases: the rule reward
(an algorithm shapes the task's score), and the streamed trainer (an algorithm gives its loss).
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..model import task
from ..model.parallel_state import ParallelState, average_gradients, clip_grad_norm_tp
from ..model.transformer import TransformerLM, build_model, generate, response_log_probs
from .base import RunSettings
from .ppo_math import clipped_policy_loss, policy_metrics

Output = dict[str, list[Tensor]]

#: The key under which a role names the groups it rejects (one int64 tensor of group numbers): the worker
#: drops them from the dock (``TransferDock.drop_groups``) and writes the role's output for the other rows.
DROP = "drop_groups"


def prompts_of(batch: Mapping[str, Tensor]) -> Tensor:
    # The task's prompts share one length; cut the TP padding off again, generate() takes no mask.
    lengths = batch["prompt_length"][:, 0]
    width = int(lengths.max())
    if int(lengths.min()) != width:
        raise ValueError("prompts of different lengths: this task's model runs without an attention mask")
    return batch["prompts"][:, :width]


def per_row(values: Tensor, lengths: Tensor) -> list[Tensor]:
    """Row i cut to ``lengths[i]`` (views: the dock copies each row once, when it encodes it)."""
    return [values[i, :n] for i, n in enumerate(lengths.tolist())]


def length_mask(lengths: Tensor, width: int) -> Tensor:
    """Float mask [B, width]: 1.0 on each row's first ``lengths[i]`` tokens, 0.0 on the padding."""
    return (torch.arange(width) < lengths.reshape(-1, 1)).float()


def scalars(values: Tensor) -> list[Tensor]:
    return [v.reshape(1) for v in values.float()]


def checksum(batch: Mapping[str, Tensor], indexes: list[int]) -> int:
    """CRC32 of the rows' indexes and every padded tensor's bytes: equal on ranks that got the same batch."""
    crc = zlib.crc32(torch.tensor(indexes, dtype=torch.int64).numpy().tobytes())
    for column in sorted(batch):
        crc = zlib.crc32(batch[column].contiguous().numpy().tobytes(), crc)
    return crc


class Role:
    """One role's computation. Subclasses set ``name`` and implement ``compute``."""

    name = ""
    #: The network this role holds (``"lm"`` a policy, ``"value"`` a critic), or None.
    head: str | None = None

    def __init__(self, cfg: RunSettings, state: ParallelState) -> None:
        self.cfg = cfg
        self.state = state
        self.inputs = cfg.inputs(self.name)
        self.outputs = cfg.algorithm.outputs[self.name]
        self._stats: dict[str, float] = {}

    def compute(self, batch: Mapping[str, Tensor], indexes: list[int], iteration: int) -> Output:
        raise NotImplementedError

    def load_weights(self, full: Mapping[str, Tensor]) -> None:
        raise TypeError(f"role {self.name} holds no model")

    def finish_iteration(self, iteration: int) -> bool:
        """Work left once this rank has consumed its last row of the iteration; True if there was some."""
        return False

    def add(self, **values: float) -> None:
        for key, value in values.items():
            self._stats[key] = self._stats.get(key, 0.0) + value

    def take_stats(self) -> dict[str, float]:
        """Sums since the last call (the worker calls it once per iteration)."""
        stats, self._stats = self._stats, {}
        return stats


class ModelRole(Role):
    """A role holding a TP shard of a network (the policy unless ``head`` says otherwise), initialised
    from the run's seed on every rank."""

    head: str | None = "lm"

    def __init__(self, cfg: RunSettings, state: ParallelState) -> None:
        super().__init__(cfg, state)
        self.model: TransformerLM = build_model(cfg.model(), seed=cfg.seed, tp_group=state.tp_group,
                                                head=self.head or "lm")

    def load_weights(self, full: Mapping[str, Tensor]) -> None:
        self.model.load_full_state_dict(full)


class Rollout(ModelRole):
    """Samples one response per row (the dock repeats each prompt n times), cut after its EOS."""

    name = "actor_rollout"

    #: The weights' version (trainer updates they include), set by the worker with the weights.
    version = 0

    @torch.no_grad()
    def compute(self, batch: Mapping[str, Tensor], indexes: list[int], iteration: int) -> Output:
        # Seeded from the rows, not the rank: every TP rank draws the same way, and a rerun samples alike.
        gen = torch.Generator().manual_seed(hash((self.cfg.seed, iteration, indexes[0])) & 0x7FFF_FFFF_FFFF)
        if self.cfg.tracked:
            return self._continue(batch, gen)
        out = generate(self.model, prompts_of(batch), task.MAX_NEW_TOKENS, self.cfg.temperature, gen, eos_id=task.EOS)
        is_eos = out == task.EOS
        # First EOS position + 1, or the full width for a response that never stopped.
        lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, out.shape[1])
        self.add(tokens=float(lengths.sum()), rows=len(indexes))
        return {"responses": per_row(out, lengths), "response_length": [n.reshape(1) for n in lengths]}

    def _continue(self, batch: Mapping[str, Tensor], gen: torch.Generator) -> Output:
        """One pass of at most ``token_budget`` tokens per row, continuing each row's partial response
        (prompt + what earlier passes generated is the input). A row is finished once it produced EOS or
        reached ``MAX_NEW_TOKENS``; the others go back to the dock unfinished, under the
        ``rollout_completed`` key the worker hands to the put."""
        prompts = prompts_of(batch)
        done = batch["response_length"][:, 0].long()  # 0 for a fresh prompt (its placeholder response)
        old = batch["responses"].long()
        rows = len(done)
        responses: list[Tensor] = [torch.empty(0)] * rows
        finished = [0] * rows
        tokens = 0
        # The model takes no mask: rows continue in sub-batches of one prefix length (a few: passes
        # add whole budgets until a row finishes).
        for length in sorted(set(done.tolist())):
            sel = (done == length).nonzero().flatten()
            steps = min(self.cfg.token_budget, task.MAX_NEW_TOKENS - length)
            prefix = torch.cat([prompts[sel], old[sel, :length]], dim=1)
            out = generate(self.model, prefix, steps, self.cfg.temperature, gen, eos_id=task.EOS)
            is_eos = out == task.EOS
            new = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, out.shape[1])
            for k, i in enumerate(sel.tolist()):
                responses[i] = torch.cat([old[i, :length], out[k, : int(new[k])]])
                finished[i] = int(bool(is_eos[k].any()) or length + int(new[k]) >= task.MAX_NEW_TOKENS)
            tokens += int(new.sum())
        ages = batch["age"][:, 0] if "age" in batch else torch.zeros(rows, dtype=torch.int32)
        self.add(tokens=float(tokens), rows=rows, passes=1, finished=float(sum(finished)),
                 **{f"pass_rows_age{int(a)}": float((ages == a).sum()) for a in ages.unique()})
        return {
            "responses": responses,
            "response_length": [torch.tensor([r.numel()]) for r in responses],
            "versions": [torch.tensor([self.version])] * rows,
            "rollout_completed": [torch.tensor([f]) for f in finished],
        }


class LogProb(ModelRole):
    """Log-probs of each response token under this role's weights."""

    @torch.no_grad()
    def compute(self, batch: Mapping[str, Tensor], indexes: list[int], iteration: int) -> Output:
        lp = response_log_probs(self.model, prompts_of(batch), batch["responses"])
        return {self.outputs[0]: per_row(lp, batch["response_length"][:, 0])}


class RefLogProb(LogProb):
    """The frozen reference: the initial weights, never updated."""

    name = "ref_log_prob"


class ActorLogProb(LogProb):
    """The sampling policy's log-probs (``old_log_probs`` of the clipped ratio), updated every iteration."""

    name = "actor_log_prob"


class RuleReward(Role):
    """The task's rule reward, one score per response; an algorithm shapes it in ``shape``."""

    name = "rule_reward"

    def compute(self, batch: Mapping[str, Tensor], indexes: list[int], iteration: int) -> Output:
        prompts = prompts_of(batch)
        lengths = batch["response_length"][:, 0]
        scores = torch.tensor([
            task.reward(p, r[:n]) for p, r, n in zip(prompts, batch["responses"], lengths.tolist())
        ])
        self.add(reward_sum=float(scores.sum()), exact=float((scores == 1.0).sum()), rows=len(indexes),
                 response_tokens=float(lengths.sum()))
        return self.shape(scores, batch)

    def shape(self, scores: Tensor, batch: Mapping[str, Tensor]) -> Output:
        """What the stage writes from the task's scores (the report averages the unshaped ones)."""
        return {"rewards": scalars(scores)}


def in_groups(indexes: list[int], n: int, role: str) -> list[int]:
    """Positions of ``indexes`` ordered so each group's n rows are consecutive, whatever order the get
    returned them in; ValueError unless the batch holds whole groups."""
    order = sorted(range(len(indexes)), key=indexes.__getitem__)
    groups = [indexes[i] // n for i in order]
    if len(groups) % n or any(groups[k] != groups[k - k % n] for k in range(len(groups))):
        raise ValueError(f"{role} needs whole groups of {n} rows, got rows {sorted(indexes)}")
    return order


class Trainer(ModelRole):
    """A model update, streamed: one step on each minibatch as it arrives from the dock, then, once the
    iteration's rows are all in, ``epochs - 1`` more passes over them in shuffled minibatches (PPO's
    ``ppo_epochs``). A minibatch is split into micro-batches whose gradients accumulate (verl's
    ``ppo_micro_batch_size_per_gpu``). Subclasses say which columns a step needs and give the loss.

    Why not all epochs per minibatch as it arrives: two steps in a row on the same 16 prompts learn the
    task far slower (mean reward ~0.5 instead of ~0.95 after 25 iterations, measured with
    ``train_local``'s settings); the first streamed pass keeps training overlapped with rollout, and
    the shuffled passes recover the learning speed of shuffled epochs.
    """

    name = "actor_train"

    def __init__(self, cfg: RunSettings, state: ParallelState) -> None:
        super().__init__(cfg, state)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.learning_rate(), weight_decay=0.0)
        self._held: list[dict[str, Tensor]] = []

    def learning_rate(self) -> float:
        return self.cfg.lr

    def minibatch(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The tensors a step needs, one row per sample (2-D ones padded to one width)."""
        raise NotImplementedError

    def loss(self, mb: Mapping[str, Tensor], mask: Tensor) -> tuple[Tensor, dict[str, float]]:
        """The loss of a micro-batch and its metrics; ``mask`` [B, T] marks the response tokens."""
        raise NotImplementedError

    def log_probs(self, mb: Mapping[str, Tensor]) -> Tensor:
        """The trained policy's log-probs [B, T] of the micro-batch's responses, with grad."""
        return response_log_probs(self.model, mb["prompts"], mb["responses"])

    def compute(self, batch: Mapping[str, Tensor], indexes: list[int], iteration: int) -> Output:
        if "prompts" in batch:  # the ledger: which prompts this step trains (see pipeline.summarize)
            prompts = prompts_of(batch)
            self.add(ledger_rows=float(len(indexes)), ledger_sum=float(sum(
                zlib.crc32(prompts[i].contiguous().numpy().tobytes(), row) for i, row in enumerate(indexes))))
        minibatch = self.minibatch(batch)
        if "versions" in batch:
            # How many updates behind the trained weights (iteration - 1 so far) each row's generator was.
            lag = (iteration - 1) - batch["versions"][:, 0].long()
            self.add(version_lag=float(lag.sum()), trained_rows=float(len(indexes)))
            self._stats["version_lag_max"] = max(self._stats.get("version_lag_max", 0.0), float(lag.max()))
        self._step(minibatch)
        if self.cfg.epochs > 1:
            self._held.append(minibatch)
        return {}

    def finish_iteration(self, iteration: int) -> bool:
        """The remaining epochs over every row this replica got, reshuffled each epoch."""
        if not self._held:
            return False
        held = _concat_padded(self._held)
        size = self._held[0]["lengths"].shape[0]
        self._held = []
        # Same seed on every TP rank of a replica (they must pick the same rows), another per DP replica.
        # Ints only: a str's hash differs between processes (PYTHONHASHSEED), and TP ranks are processes.
        gen = torch.Generator().manual_seed(hash((self.cfg.seed, iteration, self.state.dp_rank)) & 0x7FFF_FFFF_FFFF)
        for _ in range(self.cfg.epochs - 1):
            for idx in torch.randperm(held["lengths"].numel(), generator=gen).split(size):
                self._step({k: v[idx] for k, v in held.items()})
        return True

    def _step(self, mb: Mapping[str, Tensor]) -> None:
        """One optimizer step on a minibatch, its gradient accumulated over micro-batches; each micro-batch's
        loss is weighted by its share of the minibatch's rows (verl's ``loss * rows / mini_batch_size``)."""
        rows = int(mb["lengths"].shape[0])
        micro = self.cfg.micro_batch_rows or rows
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for start in range(0, rows, micro):
            part = {k: v[start:start + micro] for k, v in mb.items()}
            loss, metrics = self.loss(part, length_mask(part["lengths"], part["responses"].shape[1]))
            share = part["lengths"].shape[0] / rows
            (loss * share).backward()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value * share
        average_gradients(self.model, self.state.dp_group)
        grad_norm = clip_grad_norm_tp(self.model, 1.0, self.state.tp_group)
        self.optimizer.step()
        self.add(steps=1, grad_norm=grad_norm, **sums)

    def export_state(self) -> dict[str, Any]:
        """This rank's shard of the model and its optimizer's state, copied: what a rank restarted in the same
        place of the group loads (``load_state``) to redo an iteration from where this one began it."""
        return {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """The model shard and optimizer state ``export_state`` took, on a rank of the same layout."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._held = []

    def export_weights(self) -> dict[str, Tensor] | None:
        """Full weights on TP rank 0 of DP replica 0 (a collective over that TP group), else None."""
        if self.state.dp_rank != 0:
            return None
        full = self.model.full_state_dict()
        return {k: v.clone() for k, v in full.items()} if self.state.is_tp_src else None


class PolicyTrainer(Trainer):
    """The actor update with PPO's clipped surrogate (ratio clipped to ``[1 - clip_eps, 1 + clip_high]``),
    averaged over every token of the micro-batch; advantages one per row, or one per token with
    ``per_token``. No KL term: an algorithm that wants one adds it to the rewards or to the loss."""

    per_token = False

    def minibatch(self, batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return policy_minibatch(batch, per_token=self.per_token)

    def loss(self, mb: Mapping[str, Tensor], mask: Tensor) -> tuple[Tensor, dict[str, float]]:
        width = mask.shape[1]
        lp = self.log_probs(mb)
        old, adv = mb["old_log_probs"][:, :width], mb["advantages"]
        adv = adv[:, :width] if self.per_token else adv
        low, high = self.cfg.clip_eps, self.cfg.clip_high
        loss = clipped_policy_loss(lp, old, adv, mask, low, high, token_level=True)
        return loss, policy_metrics(lp, old, adv, mask, low, high)


def response_minibatch(batch: Mapping[str, Tensor], *extra: str) -> dict[str, Tensor]:
    """What any step on responses reads: prompts, responses and their lengths, with the ``extra`` columns."""
    out = {"prompts": prompts_of(batch), "responses": batch["responses"], "lengths": batch["response_length"][:, 0]}
    out.update({c: batch[c] for c in extra})
    return out


def policy_minibatch(batch: Mapping[str, Tensor], *extra: str, per_token: bool = False) -> dict[str, Tensor]:
    """What a policy step reads: :func:`response_minibatch`'s columns, ``advantages`` (one per row, or one
    per token with ``per_token``) and the sampling policy's ``old_log_probs``, with the ``extra`` columns."""
    advantages = batch["advantages"]  # a one-value column arrives padded to the TP size too
    return {**response_minibatch(batch, "old_log_probs", *extra),
            "advantages": advantages if per_token else advantages[:, 0]}


def _concat_padded(batches: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Stack minibatches whose 2-D columns differ in width: right-pad to the widest (EOS for tokens, 0.0
    for log-probs, as dispatch pads them; the response mask hides the padding either way)."""
    out: dict[str, Tensor] = {}
    for key in batches[0]:
        parts = [b[key] for b in batches]
        if parts[0].dim() == 2 and key != "prompts":
            width = max(p.shape[1] for p in parts)
            fill = task.EOS if key == "responses" else 0.0
            parts = [torch.nn.functional.pad(p, (0, width - p.shape[1]), value=fill) for p in parts]
        out[key] = torch.cat(parts)
    return out


def make_role(name: str, cfg: RunSettings, state: ParallelState) -> Role:
    """Role ``name`` of the run's algorithm."""
    role: Role = cfg.algorithm.role_classes[name](cfg, state)
    return role

