"""Row-parallel linear layers whose output bits do not depend on the TP degree.

In a tensor-parallel model the row-parallel layers (attention ``o_proj``, MLP ``down_proj``) split
the reduction dimension K across ranks and sum the partial products with an NCCL all-reduce, whose
summation order depends on the number of ranks (and on NCCL's algorithm choice). The same weights
then give different logits at TP=1 (the trainer) and TP=8 (the rollout engine).
:class:`RowParallelLinear` computes its shard with the tree GEMM instead (:mod:`isoaudit.kernels.tree_gemm`):
each rank reduces its own subtree, the subtree roots are all-gathered, and every rank combines them
with the same pairwise tree, so every addition is the one TP=1 performs.

``mode="native"`` is the usual Megatron-style layer (shard matmul, then all-reduce), kept as the
baseline that shows the mismatch and the time the invariant layer costs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Literal, NoReturn

import torch
from torch import nn

from .tree_gemm import MAX_TP, tree_gemm_distributed, tree_plan

AllGather = Callable[[torch.Tensor], torch.Tensor]
AllReduce = Callable[[torch.Tensor], torch.Tensor]
Mode = Literal["tree", "native"]

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def join_torchrun_group() -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes: NCCL with one GPU per rank (LOCAL_RANK), else
    gloo on the CPU. Returns (rank, world size, this rank's device)."""
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on these machines
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def leave_group() -> None:
    """Tear the default group down once every rank is done (gloo aborts a rank whose peers have
    already left while it still talks to them)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End a torchrun rank after :func:`leave_group` without running interpreter teardown: gloo's
    threads can still be joinable when C++ static destructors run, and the rank then aborts
    ("terminate called without an active exception") after its work and verdicts are done, which
    torchrun reports as a failure (seen once in 4-rank CPU runs on a 2-core CI machine)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def single_rank_all_gather(t: torch.Tensor) -> torch.Tensor:
    """The all-gather of a group of one (TP=1 needs no process group)."""
    return t.unsqueeze(0)


def process_group_all_gather(group: ProcessGroup | None = None) -> AllGather:
    """An all-gather over a ``torch.distributed`` group: every rank's tensor, stacked in rank order."""
    import torch.distributed as dist

    # torch >= 2.13 names it all_gather_single; older releases all_gather_into_tensor.
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def gather(t: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size(group)
        out = torch.empty((world, *t.shape), dtype=t.dtype, device=t.device)
        # Gathered along dim 0 (gloo insists on that shape); viewed back as one slab per rank.
        gather_into(out.view(world * t.shape[0], *t.shape[1:]), t.contiguous(), group=group)
        return out

    return gather


def process_group_all_reduce(group: ProcessGroup | None = None) -> AllReduce:
    """A sum all-reduce over a ``torch.distributed`` group (the native row-parallel reduction)."""
    import torch.distributed as dist

    def reduce(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=group)
        return t

    return reduce


class RowParallelLinear(nn.Module):
    """One rank's shard of ``y = x W^T + b`` split along K, for an input replicated on every rank.

    The rank keeps only the K columns the tree plan gives it (``tree_plan(K, leaf, tp, max_tp).k_range``:
    balanced, contiguous). ``forward`` takes the full input, as the replicated layers before it
    produce it, and returns the full output on every rank.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        rank: int,
        tp: int,
        all_gather: AllGather = single_rank_all_gather,
        all_reduce: AllReduce | None = None,
        leaf: int = 256,
        mode: Mode = "tree",
        max_tp: int = MAX_TP,
    ) -> None:
        super().__init__()
        if not 0 <= rank < tp:
            raise ValueError(f"rank must be in [0, {tp}), not {rank}")
        if mode not in ("tree", "native"):
            raise ValueError(f"mode must be 'tree' or 'native', not {mode!r}")
        if mode == "native" and tp > 1 and all_reduce is None:
            raise ValueError("mode='native' with tp > 1 needs an all_reduce")
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.rank, self.tp, self.leaf, self.mode, self.max_tp = rank, tp, leaf, mode, max_tp
        self.lo, self.hi = tree_plan(self.in_features, leaf, tp, max_tp).k_range(rank)
        self.weight = nn.Parameter(weight.detach()[:, self.lo : self.hi].contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._all_gather, self._all_reduce = all_gather, all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x_local = x.reshape(-1, self.in_features)[:, self.lo : self.hi]
        if self.mode == "tree":
            y = tree_gemm_distributed(
                x_local,
                self.weight,
                self.in_features,
                self.leaf,
                self.tp,
                self.rank,
                self._all_gather,
                out_dtype=x.dtype,
                max_tp=self.max_tp,
            )
        else:
            y = x_local @ self.weight.T
            if self.tp > 1:
                assert self._all_reduce is not None  # the constructor requires one for native TP > 1
                y = self._all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"k_range=[{self.lo}, {self.hi}), rank={self.rank}, tp={self.tp}, mode={self.mode}"
        )


def shard_row_parallel(
    model: nn.Module,
    rank: int,
    tp: int,
    all_gather: AllGather = single_rank_all_gather,
    all_reduce: AllReduce | None = None,
    names: Iterable[str] = ("o_proj", "down_proj"),
    leaf: int = 256,
    mode: Mode = "tree",
    max_tp: int = MAX_TP,
) -> int:
    """Replace, in place, every ``nn.Linear`` whose attribute name is in ``names`` by this rank's
    :class:`RowParallelLinear` shard. Returns how many layers were sharded. ``(leaf, max_tp)`` is
    the tree plan, which every rank and the rollout side must share (``leaf=0, max_tp=2``: the
    wide plan of a job whose TP is at most 2, about a plain GEMM's cost on Hopper)."""
    wanted = set(names)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if name in wanted and isinstance(child, nn.Linear)
    ]
    for parent, name, child in targets:
        shard = RowParallelLinear(
            child.weight, child.bias, rank, tp, all_gather, all_reduce, leaf, mode, max_tp
        )
        setattr(parent, name, shard)
    return len(targets)
