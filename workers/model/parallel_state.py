"""torch.distributed inside one role's worker group: its world, TP groups and DP groups, and the
collectives the trainer needs on top of the model's own (gradient averaging and a TP-aware clip).

Rank layout of a ``dp x tp`` group (Megatron's): global rank ``r`` is TP rank ``r % tp`` of DP replica
``r // tp``, so the ranks of one TP group are contiguous and land next to each other in the
placement group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from .tensor_parallel import shard_dim


@dataclass(frozen=True)
class Layout:
    """One role's worker group: ``dp`` data-parallel replicas of ``tp`` tensor-parallel ranks each."""

    dp: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp

    def __str__(self) -> str:
        return f"{self.dp}x{self.tp}"

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``"2x2"`` -> Layout(dp=2, tp=2)."""
        try:
            dp, tp = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"layout must look like DPxTP, e.g. 2x1, got {text!r}") from None
        if dp < 1 or tp < 1:
            raise ValueError(f"layout {text!r}: DP and TP must be >= 1")
        return cls(dp, tp)


#: Gloo runs everywhere; the workers keep every tensor on the CPU (see the note in ``ParallelState``).
BACKEND = "gloo"


class ParallelState:
    """This process's place in its role's group, and the process groups it belongs to.

    Only gloo on CPU is wired up: the Ray bundles ask for no GPUs and the model and batches stay on
    the CPU. NCCL would need GPU bundles and device moves in dispatch, generate and training.
    """

    def __init__(self, layout: Layout, rank: int, master_addr: str | None = None, master_port: int | None = None,
                 timeout_seconds: float = 1800.0) -> None:
        if not 0 <= rank < layout.world:
            raise ValueError(f"rank {rank} is outside the {layout} group")
        self.layout = layout
        self.rank = rank
        self.dp_rank, self.tp_rank = divmod(rank, layout.tp)
        self.tp_group: dist.ProcessGroup | None = None
        self.dp_group: dist.ProcessGroup | None = None
        if layout.world == 1:
            return  # a lone rank needs no process group at all
        if master_addr is None or master_port is None:
            raise ValueError("a group of more than one rank needs its rank 0's address and port")
        dist.init_process_group(
            BACKEND, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=layout.world,
            timeout=timedelta(seconds=timeout_seconds),
        )
        # new_group is collective over the whole world: every rank creates every group, in one order.
        for d in range(layout.dp):
            group = dist.new_group([d * layout.tp + t for t in range(layout.tp)])
            if d == self.dp_rank and layout.tp > 1:
                self.tp_group = group
        for t in range(layout.tp):
            group = dist.new_group([d * layout.tp + t for d in range(layout.dp)])
            if t == self.tp_rank and layout.dp > 1:
                self.dp_group = group

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def tp_src(self) -> int:
        """Global rank of this TP group's rank 0: the one that talks to the broker."""
        return self.dp_rank * self.layout.tp

    @property
    def is_tp_src(self) -> bool:
        return self.tp_rank == 0

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def average_gradients(model: nn.Module, dp_group: dist.ProcessGroup | None) -> None:
    """Mean of every gradient over the DP replicas, so they take identical optimizer steps."""
    if dp_group is None:
        return
    size = dist.get_world_size(dp_group)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    # One flat all-reduce instead of one per tensor: the model has ~30 small tensors.
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=dp_group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset: offset + g.numel()].view_as(g))
        offset += g.numel()


def clip_grad_norm_tp(model: nn.Module, max_norm: float, tp_group: dist.ProcessGroup | None) -> float:
    """``clip_grad_norm_`` for a TP model: the norm of the *full* gradient, the same on every TP rank.

    Plain ``clip_grad_norm_`` on a shard sees only that shard's norm, so each rank would scale by a
    different factor and the replicated weights would drift apart. Shards are summed over the group;
    replicated tensors (the same on every rank) count once.
    """
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    grads = []
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        sq = p.grad.detach().double().pow(2).sum()
        if shard_dim(name) is None:
            replicated += sq
        else:
            sharded += sq
    sums = torch.stack([sharded, replicated])
    size = 1
    if tp_group is not None:
        size = dist.get_world_size(tp_group)
        dist.all_reduce(sums, group=tp_group)  # identical result on every rank, so one scale factor
    total = math.sqrt(float(sums[0] + sums[1] / size))
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return total
