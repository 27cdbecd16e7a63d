"""Megatron-style tensor parallelism (TP): the split linear layers, their collectives, and the TP=1 <-> shard
conversion of a state dict.

Under TP (``tp_size`` ranks of one ``tp_group``):

* q/k/v projections and the first MLP layer are column-parallel: each rank holds a slice of the
  output features, i.e. ``n_heads // tp_size`` whole attention heads and ``d_ff // tp_size`` hidden
  units. Their input goes through :func:`copy_to_tp_region` (identity forward, all-reduce backward).
* The attention output projection and the second MLP layer are row-parallel: each rank holds the
  matching slice of input features and the partial outputs are summed by
  :func:`reduce_from_tp_region` (all-reduce forward, identity backward); their bias is replicated and
  added once, after the sum.
* Everything else (embeddings, layer norms, heads) is replicated.

Without a group (``None``) every function here is the single-process identity and torch.distributed is
never touched. :func:`shard_state_dict` keeps a rank's slice of full (TP=1) weights;
:func:`gather_state_dict` / :func:`all_gather_state_dict` undo it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

#: Module names whose weight and bias are split along dim 0 (output features).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "fc1")
#: Module names whose weight is split along dim 1 (input features); their bias stays replicated.
ROW_PARALLEL = ("o_proj", "fc2")


# --------------------------------------------------------------------------------------------------
# Collectives with the right autograd


def tp_size_of(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def tp_rank_of(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce backward, since every rank's slice contributed to d(input)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (sum of partial outputs); identity backward, the sum's gradient is shared."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        x = x.contiguous().clone()  # never reduce in place into a tensor autograd may still need
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def copy_to_tp_region(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Enter a column-parallel block (no-op without a group)."""
    return x if group is None else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Leave a row-parallel block (no-op without a group)."""
    return x if group is None else _ReduceFromTP.apply(x, group)


# --------------------------------------------------------------------------------------------------
# Layers


def split_evenly(n: int, tp_size: int, what: str) -> int:
    if n % tp_size:
        raise ValueError(f"{what} {n} is not divisible by the tensor-parallel size {tp_size}")
    return n // tp_size


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's rows (output features) split over the TP ranks; output stays split."""

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.group = group
        local_out = split_evenly(out_features, tp_size_of(group), "out_features")
        self.weight = nn.Parameter(torch.empty(local_out, in_features))
        self.bias = nn.Parameter(torch.empty(local_out))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(copy_to_tp_region(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's columns (input features) split; takes split input, returns full output."""

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None) -> None:
        super().__init__()
        self.group = group
        local_in = split_evenly(in_features, tp_size_of(group), "in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local_in))
        self.bias = nn.Parameter(torch.empty(out_features))

    def forward(self, x: Tensor) -> Tensor:
        # The bias is added after the sum, otherwise it would be counted tp_size times.
        return reduce_from_tp_region(F.linear(x, self.weight), self.group) + self.bias


# --------------------------------------------------------------------------------------------------
# Sharding and gathering a state dict


def module_of(key: str) -> str:
    parts = key.split(".")
    return parts[-2] if len(parts) >= 2 else ""


def shard_dim(key: str) -> int | None:
    """The dimension along which the tensor ``key`` is split under TP, or None if replicated."""
    module, leaf = module_of(key), key.rsplit(".", 1)[-1]
    if module in COLUMN_PARALLEL:
        return 0
    if module in ROW_PARALLEL and leaf == "weight":
        return 1
    return None


def shard_state_dict(full: Mapping[str, Tensor], tp_rank: int, tp_size: int) -> dict[str, Tensor]:
    """Rank ``tp_rank``'s slice of a full (TP=1) state dict; replicated tensors are shared, not copied."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is out of range for tp_size {tp_size}")
    out: dict[str, Tensor] = {}
    for key, value in full.items():
        dim = shard_dim(key)
        if dim is None or tp_size == 1:
            out[key] = value
            continue
        if value.shape[dim] % tp_size:
            raise ValueError(f"{key} of shape {tuple(value.shape)} cannot be split {tp_size} ways on dim {dim}")
        out[key] = value.chunk(tp_size, dim=dim)[tp_rank].contiguous()
    return out


def gather_state_dict(shards: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Inverse of :func:`shard_state_dict`: ``shards[r]`` is rank r's state dict."""
    if not shards:
        raise ValueError("no shards to gather")
    out: dict[str, Tensor] = {}
    for key, first in shards[0].items():
        dim = shard_dim(key)
        out[key] = first if dim is None or len(shards) == 1 else torch.cat([s[key] for s in shards], dim=dim)
    return out


def all_gather_state_dict(local: Mapping[str, Tensor], tp_group: dist.ProcessGroup | None) -> dict[str, Tensor]:
    """Collective form of :func:`gather_state_dict` over ``tp_group``; also works for gradients keyed
    like the parameters. Without a group it returns ``local`` as a dict."""
    if tp_group is None:
        return dict(local)
    size = dist.get_world_size(tp_group)
    out: dict[str, Tensor] = {}
    for key, value in local.items():
        dim = shard_dim(key)
        if dim is None:
            out[key] = value
            continue
        parts = [torch.empty_like(value) for _ in range(size)]
        dist.all_gather(parts, value.contiguous(), group=tp_group)
        out[key] = torch.cat(parts, dim=dim)
    return out
