"""Sequence parallelism that leaves the logits' bits as they are without it.

Ranks hold contiguous slices of every sequence (:func:`seq_slices`) and keep their own output
slice throughout. Nothing adds across ranks in a new order; every reduction is the one the
non-SP model performs:

* **Per-token ops** (norms, projections, router, experts, combine, lm_head) run on a rank's slice
  alone: they are batch-invariant, so a token's bits do not depend on which other tokens share
  the call.
* **Attention** all-gathers K and V along the sequence (data movement, no arithmetic) and runs the
  rank's queries against them at their absolute positions: the kernel's reduction over keys is a
  fixed tree of key tiles at absolute positions, the same for a query whatever else is in the
  call, so no ring-style merge of per-rank partial softmaxes (whose order would follow the ranks).
* **Row-parallel layers with TP** (:func:`tree_gemm_reduce_scatter`): each rank's subtree roots
  of the tree GEMM (:mod:`kernels.tree_gemm`) for every token go to the rank owning that token's
  slice (an all-to-all in place of the all-gather), which combines them by the same tree:
  Megatron's reduce-scatter, with TP=1's additions.

:func:`sp_hidden` runs an attention + MLP/MoE model of ours (:class:`kernels.models.moe_lm.MoELM`)
this way, for all ranks on one device (simulated) or for this process's rank of a real group
(:func:`process_group_seq_gather`); ``python -m kernels.moe_check`` checks it under torchrun.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import moe, routing
from .tree_gemm import subtree_root, tree_plan, tree_reduce

#: Gathers one tensor per local rank, (B, len_r, ...), into the full sequence (B, n, ...).
SeqGather = Callable[[dict[int, torch.Tensor]], torch.Tensor]
#: ``all_to_all(parts)``: parts[d] goes to rank d; returns what every rank sent here, in rank order.
AllToAll = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def seq_slices(n: int, world: int) -> list[tuple[int, int]]:
    """Balanced contiguous [lo, hi) position ranges of a length-n sequence over ``world`` ranks
    (the first ``n % world`` ranks hold one position more)."""
    if world < 1:
        raise ValueError(f"world must be at least 1, not {world}")
    base, extra = divmod(n, world)
    bounds = [0]
    for r in range(world):
        bounds.append(bounds[-1] + base + (r < extra))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def simulated_seq_gather(parts: dict[int, torch.Tensor]) -> torch.Tensor:
    """All ranks on this device: their slices in rank order."""
    return torch.cat([parts[r] for r in sorted(parts)], dim=1)


def process_group_seq_gather(n: int, group: object | None = None) -> SeqGather:
    """This process's rank of a real group (one local slice): an all-gather of the slices, padded
    to the longest and trimmed back."""
    import torch.distributed as dist

    def gather(parts: dict[int, torch.Tensor]) -> torch.Tensor:
        ((rank, t),) = parts.items()
        world = dist.get_world_size(group)
        sl = seq_slices(n, world)
        width = max(hi - lo for lo, hi in sl)
        pad = torch.zeros(t.shape[0], width, *t.shape[2:], dtype=t.dtype, device=t.device)
        pad[:, : t.shape[1]] = t
        wire = pad.view(torch.uint8)  # the bits, whatever dtypes the backend supports
        out = [torch.empty_like(wire) for _ in range(world)]
        dist.all_gather(out, wire, group=group)
        full = [o.view(t.dtype) for o in out]
        return torch.cat([f[:, : hi - lo] for f, (lo, hi) in zip(full, sl, strict=True)], dim=1)

    return gather


def sp_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    world: int,
    ranks: Sequence[int] | None = None,
    gather: SeqGather = simulated_seq_gather,
) -> dict[int, torch.Tensor]:
    """The final hidden states of ``ranks`` (default all: simulated), each (B, len_r, hidden) for
    its slice of (B, n) ids, with sequence parallelism of degree ``world``. ``model`` is an
    attention model of ours with ``embed``, ``blocks`` (``norm1``, ``mixer``, ``norm2``, ``mlp``)
    and ``norm`` (:class:`~kernels.models.moe_lm.MoELM`). Tokens are tagged (batch row, position)."""
    b, n = input_ids.shape
    dev = input_ids.device
    ranks = list(range(world)) if ranks is None else list(ranks)
    sl = seq_slices(n, world)
    pos = {r: torch.arange(*sl[r], device=dev).repeat(b) for r in ranks}
    rows = {r: torch.arange(b, device=dev).repeat_interleave(sl[r][1] - sl[r][0]) for r in ranks}
    x = {r: model.embed(input_ids[:, sl[r][0] : sl[r][1]].reshape(-1)) for r in ranks}
    for blk in model.blocks:
        att = blk.mixer
        qkv = {r: att.qkv(blk.norm1(x[r]), pos[r]) for r in ranks}
        shaped = {r: lambda t, r=r: t.view(b, sl[r][1] - sl[r][0], *t.shape[1:]) for r in ranks}
        kc = gather({r: shaped[r](qkv[r][1]) for r in ranks})
        vc = gather({r: shaped[r](qkv[r][2]) for r in ranks})
        for r in ranks:
            lo, hi = sl[r]
            cu = torch.arange(b + 1, device=dev, dtype=torch.int32) * (hi - lo)
            pos0 = torch.full((b,), lo, device=dev, dtype=torch.int32)
            kv_len = torch.full((b,), hi, device=dev, dtype=torch.int32)
            o = routing.attention(qkv[r][0], kc, vc, cu, pos0, kv_len, None, att.cfg.head_dim**-0.5)
            h = x[r] + routing.linear(o.reshape(x[r].shape[0], -1), att.o.weight)
            with moe.tokens(rows[r], pos[r]):
                x[r] = h + blk.mlp(blk.norm2(h))
    return {r: model.norm(x[r]).view(b, sl[r][1] - sl[r][0], -1) for r in ranks}


def tree_gemm_reduce_scatter(
    x_local: torch.Tensor,
    w_local: torch.Tensor,
    k: int,
    tp: int,
    rank: int,
    all_to_all: AllToAll,
    leaf: int = 256,
    out_dtype: torch.dtype | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """One rank of a TP group with sequence parallelism: a row-parallel layer's output for this
    rank's slice of the M rows (:func:`seq_slices` over M), from its K columns of every row. The
    rank's subtree roots for every row are split by slice and exchanged (``all_to_all``), and the
    ``tp`` roots of each of its rows are combined by the same tree as without SP, so each row has
    the bits of :func:`kernels.tree_gemm.tree_gemm` (and of TP=1)."""
    root = subtree_root(x_local, w_local, tree_plan(k, leaf, tp), rank, impl)  # (M, N) fp32
    mine = all_to_all([root[lo:hi] for lo, hi in seq_slices(root.shape[0], tp)])
    return tree_reduce(torch.stack(mine)).to(out_dtype or x_local.dtype)


def tree_gemm_sp(
    x: torch.Tensor,
    weight: torch.Tensor,
    tp: int,
    leaf: int = 256,
    out_dtype: torch.dtype | None = None,
    impl: str | None = None,
) -> list[torch.Tensor]:
    """:func:`tree_gemm_reduce_scatter` for all ``tp`` ranks on this device: each rank's output
    slice of ``x (M, K) @ weight.T``."""
    plan = tree_plan(x.shape[1], leaf, tp)
    roots = []
    for r in range(tp):
        lo, hi = plan.k_range(r)
        roots.append(subtree_root(x[:, lo:hi], weight[:, lo:hi], plan, r, impl))
    return [
        tree_reduce(torch.stack([root[lo:hi] for root in roots])).to(out_dtype or x.dtype)
        for lo, hi in seq_slices(x.shape[0], tp)
    ]


def process_group_all_to_all(group: object | None = None) -> AllToAll:
    """An all-to-all of row blocks over a ``torch.distributed`` group: ``parts[d]`` goes to rank d;
    this rank receives every rank's block for it (all of this rank's own block's shape)."""
    import torch.distributed as dist

    def exchange(parts: list[torch.Tensor]) -> list[torch.Tensor]:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        mine = parts[rank].shape[0]
        out = parts[0].new_empty(world * mine, *parts[0].shape[1:])
        send = torch.cat([p.contiguous() for p in parts])
        dist.all_to_all_single(out, send, [mine] * world, [p.shape[0] for p in parts], group=group)
        return list(out.split(mine))

    return exchange
