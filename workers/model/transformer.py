"""A small causal transformer language model, tensor-parallel the Megatron way (``tensor_parallel.py``).

Token and position embeddings, the layer norms and the LM head are **replicated**: every rank
holds the full tensor, sees the same input and computes the same gradient, so no extra collective
is needed to keep them in sync; attention and the MLP are split over the TP ranks.

With ``tp_group=None`` the model is a plain single-process model and torch.distributed is never
touched. Weights are created full-size from a seed (:func:`init_state_dict`) and each rank keeps its
slice (``tensor_parallel.shard_state_dict``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .tensor_parallel import (
    ROW_PARALLEL,
    ColumnParallelLinear,
    RowParallelLinear,
    all_gather_state_dict,
    module_of,
    shard_state_dict,
    split_evenly,
    tp_rank_of,
    tp_size_of,
)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the model; the defaults train in seconds on a CPU."""

    vocab_size: int = 16
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 256
    max_seq_len: int = 32

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")


class Attention(nn.Module):
    """Causal multi-head self-attention; each TP rank owns ``n_heads // tp_size`` whole heads."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.local_heads = split_evenly(cfg.n_heads, tp_size_of(group), "n_heads")
        # Separate q/k/v (not one fused matrix) so a contiguous slice of each is a set of whole heads.
        self.q_proj = ColumnParallelLinear(cfg.d_model, cfg.d_model, group)
        self.k_proj = ColumnParallelLinear(cfg.d_model, cfg.d_model, group)
        self.v_proj = ColumnParallelLinear(cfg.d_model, cfg.d_model, group)
        self.o_proj = RowParallelLinear(cfg.d_model, cfg.d_model, group)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape

        def heads(y: Tensor) -> Tensor:
            return y.view(b, t, self.local_heads, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)), is_causal=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.local_heads * self.head_dim))


class MLP(nn.Module):
    """GELU MLP with the hidden layer split over the TP ranks."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.d_model, cfg.d_ff, group)
        self.fc2 = RowParallelLinear(cfg.d_ff, cfg.d_model, group)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block; the layer norms are replicated."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg, group)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg, group)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


#: What a model's last layer computes: next-token logits (the policy), or one scalar per position
#: (a critic's value head, as verl and DeepSpeed-Chat put on the same network family).
HEADS = ("lm", "value")


class TransformerLM(nn.Module):
    """Causal LM: ``forward(tokens[B, L]) -> logits[B, L, vocab]``; with ``head="value"`` a critic:
    ``forward(tokens[B, L]) -> values[B, L]``, a replicated linear head on the same trunk.

    Parameters are allocated uninitialised (so building a model never draws from the global RNG);
    fill them with :meth:`load_full_state_dict` or use :func:`build_model`.
    """

    def __init__(self, cfg: ModelConfig, tp_group: dist.ProcessGroup | None = None, head: str = "lm") -> None:
        super().__init__()
        if head not in HEADS:
            raise ValueError(f"head must be one of {HEADS}, got {head!r}")
        self.cfg = cfg
        self.head = head
        self.tp_group = tp_group
        self.tp_size = tp_size_of(tp_group)
        self.tp_rank = tp_rank_of(tp_group)
        self.tok_emb = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        self.pos_emb = nn.Parameter(torch.empty(cfg.max_seq_len, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg, tp_group) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        if head == "lm":
            self.lm_head = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        else:
            # Replicated like the LM head: every TP rank holds the whole (tiny) head.
            self.v_head = nn.Parameter(torch.empty(1, cfg.d_model))

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len {self.cfg.max_seq_len}")
        x = F.embedding(tokens, self.tok_emb) + self.pos_emb[:t]
        for block in self.blocks:
            x = block(x)
        if self.head == "value":
            return F.linear(self.ln_f(x), self.v_head).squeeze(-1)
        return F.linear(self.ln_f(x), self.lm_head)

    @torch.no_grad()
    def load_full_state_dict(self, full: Mapping[str, Tensor]) -> None:
        """Load a TP=1 state dict, keeping this rank's slice of every TP-split tensor."""
        self.load_state_dict(shard_state_dict(full, self.tp_rank, self.tp_size))

    def full_state_dict(self) -> dict[str, Tensor]:
        """The TP=1 state dict, gathered over the TP group (a collective: every rank must call it)."""
        local = {k: v.detach() for k, v in self.state_dict().items()}
        return all_gather_state_dict(local, self.tp_group)


# --------------------------------------------------------------------------------------------------
# Weights: deterministic init


def init_state_dict(cfg: ModelConfig, seed: int, head: str = "lm") -> dict[str, Tensor]:
    """Full (TP=1) weights drawn from ``seed`` alone: GPT-2 style, normal(0, 0.02), zero biases,
    residual output projections scaled by ``1/sqrt(2 n_layers)`` so the residual stream starts small.

    A critic (``head="value"``) draws exactly the policy's weights, then its value head: it starts from
    the policy's trunk, as verl's critic starts from the actor's model."""
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, Tensor] = {}
    # Always in the policy's order: the LM head is drawn among the trunk's tensors (state_dict lists a
    # module's own parameters before its submodules'), and a critic must not shift the trunk's draws.
    for name, p in TransformerLM(cfg).state_dict().items():
        leaf = name.rsplit(".", 1)[-1]
        if module_of(name).startswith("ln"):  # ln1, ln2, ln_f
            out[name] = torch.ones_like(p) if leaf == "weight" else torch.zeros_like(p)
        elif leaf == "bias":
            out[name] = torch.zeros_like(p)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layers) if module_of(name) in ROW_PARALLEL else 0.02
            out[name] = torch.randn(p.shape, generator=gen) * std
    if head == "value":
        del out["lm_head"]
        out["v_head"] = torch.randn(1, cfg.d_model, generator=gen) * 0.02
    elif head != "lm":
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    return out


def build_model(
    cfg: ModelConfig, seed: int = 0, tp_group: dist.ProcessGroup | None = None, head: str = "lm"
) -> TransformerLM:
    """A model initialised from ``seed``; under TP every rank builds the same full weights and keeps
    its shard, so the result equals sharding the TP=1 model built from the same seed."""
    model = TransformerLM(cfg, tp_group, head)
    model.load_full_state_dict(init_state_dict(cfg, seed, head))
    return model


# --------------------------------------------------------------------------------------------------
# Log-probs and sampling


def token_log_probs(logits: Tensor, tokens: Tensor) -> Tensor:
    """Log-prob of each next token: ``logits = model(tokens)`` of shape [B, L, V], ``tokens`` [B, L];
    returns [B, L-1] with ``out[:, t] = log p(tokens[:, t+1] | tokens[:, :t+1])``."""
    logp = logits[:, :-1].float().log_softmax(-1)
    return logp.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)


def response_log_probs(model: nn.Module, prompts: Tensor, responses: Tensor) -> Tensor:
    """Log-probs [B, T] of ``responses`` [B, T] given ``prompts`` [B, P] (one forward pass)."""
    seq = torch.cat([prompts, responses], dim=1)
    return token_log_probs(model(seq), seq)[:, prompts.shape[1] - 1 :]


def response_values(critic: nn.Module, prompts: Tensor, responses: Tensor) -> Tensor:
    """A critic's values [B, T] of the states before each response token: ``out[:, t]`` is read at the
    position whose next token is response token t, aligned with :func:`response_log_probs` (and
    with DeepSpeed-Chat's ``values[:, start:]`` after ``critic(seq)[:, :-1]``)."""
    seq = torch.cat([prompts, responses], dim=1)
    return critic(seq)[:, prompts.shape[1] - 1 : -1]


@torch.no_grad()
def generate(
    model: TransformerLM,
    prompts: Tensor | Sequence[Tensor],
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
) -> Tensor:
    """Sample ``max_new_tokens`` tokens after each prompt; returns them as [B, max_new_tokens].

    Prompts must all have the same length (no padding, hence no attention mask). Once a row has
    produced ``eos_id`` its later tokens are ``pad_id`` (default ``eos_id``). ``temperature == 0``
    is greedy. The whole prefix is recomputed every step (no KV cache): sequences here are tiny.

    Under TP every rank samples with its own ``generator`` - pass one seeded identically on every
    rank so the generators stay in lockstep - and then the tokens of TP rank 0 are broadcast, so all
    ranks hold bit-identical tokens even if their logits differ in the last bit.
    """
    seq = prompts if isinstance(prompts, Tensor) else _stack_same_length(prompts)
    batch = seq.shape[0]
    pad = eos_id if pad_id is None else pad_id
    done = torch.zeros(batch, dtype=torch.bool)
    out = torch.full((batch, max_new_tokens), pad if pad is not None else 0, dtype=torch.long)
    for step in range(max_new_tokens):
        logits = model(seq)[:, -1].float()
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        if model.tp_group is not None:
            dist.broadcast(nxt, src=dist.get_global_rank(model.tp_group, 0), group=model.tp_group)
        if pad is not None:
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        out[:, step] = nxt
        seq = torch.cat([seq, nxt.unsqueeze(1)], dim=1)
        if eos_id is not None:
            done |= nxt == eos_id
            if bool(done.all()):  # identical on every rank: the tokens were broadcast
                break
    return out


def _stack_same_length(prompts: Sequence[Tensor]) -> Tensor:
    if len({p.shape[0] for p in prompts}) != 1:
        raise ValueError("generate() needs prompts of one length (no padding support)")
    return torch.stack(list(prompts))
