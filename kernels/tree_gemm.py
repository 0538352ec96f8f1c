"""TP-invariant tree GEMM: the K reduction has one fixed shape however K is sharded.

The tree, exactly:
  * K is cut into ``n = ceil(K / leaf)`` leaves of ``leaf`` columns (the last may be short).
  * Leaf ``i`` is ``x[:, i*leaf:(i+1)*leaf] @ w[:, i*leaf:(i+1)*leaf].T`` accumulated in fp32 from
    zero, in ascending k, in BLOCK_K steps (BLOCK_K divides ``leaf``).
  * The leaves fill ``P = next_pow2(max(n, tp))`` slots; slots ``>= n`` hold exact zeros.
  * Level by level, slot pairs ``(2j, 2j+1)`` are added in fp32 (left + right) until one remains;
    that root is rounded once to the output dtype.
  * With tensor parallelism ``tp`` (a power of two), rank ``r`` owns slots ``[r*P/tp, (r+1)*P/tp)``,
    i.e. one complete subtree, and the K columns of its leaves. It reduces its subtree locally;
    the ``tp`` roots are all-gathered (never all-reduced: NCCL's summation order is not ours) and
    combined by the same pairwise rule. Every add is the same add as at tp=1, so the bits are too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._triton import HAVE_TRITON, dot_precision, jit, resolve, tl, triton


@dataclass(frozen=True)
class TreePlan:
    """Where each rank's leaves sit in K and in the tree."""

    k: int
    leaf: int
    tp: int
    n_leaves: int
    slots: int

    @property
    def slots_per_rank(self) -> int:
        return self.slots // self.tp

    def k_range(self, rank: int) -> tuple[int, int]:
        """The K columns rank ``rank`` owns (possibly empty: its subtree is then all zeros)."""
        lo = min(rank * self.slots_per_rank * self.leaf, self.k)
        hi = min((rank + 1) * self.slots_per_rank * self.leaf, self.k)
        return lo, hi


def tree_plan(k: int, leaf: int = 256, tp: int = 1) -> TreePlan:
    """The tree for a reduction of length ``k`` with leaves of ``leaf`` columns over ``tp`` ranks."""
    if tp < 1 or tp & (tp - 1):
        raise ValueError("tp must be a power of two")
    n = -(-k // leaf)
    slots = 1
    while slots < max(n, tp):
        slots *= 2
    return TreePlan(k=k, leaf=leaf, tp=tp, n_leaves=n, slots=slots)


if HAVE_TRITON:

    @jit(do_not_specialize=["M"])
    def _leaf_kernel(
        a_ptr,
        b_ptr,
        c_ptr,
        M,
        N,
        K,
        LEAF,
        stride_am,
        stride_ak,
        stride_bn,
        stride_bk,
        stride_cl,
        stride_cm,
        stride_cn,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        leaf = tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        k_lo = leaf * LEAF
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, LEAF, BLOCK_K):
            ks = k_lo + kk + offs_k
            k_ok = ks < K
            a = tl.load(
                a_ptr + offs_m[:, None] * stride_am + ks[None, :] * stride_ak,
                mask=(offs_m[:, None] < M) & k_ok[None, :],
                other=0.0,
            )
            b = tl.load(
                b_ptr + ks[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                mask=k_ok[:, None] & (offs_n[None, :] < N),
                other=0.0,
            )
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        tl.store(
            c_ptr + leaf * stride_cl + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
            acc,
            mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
        )


def _block_k(dtype: torch.dtype) -> int:
    return 32 if dtype == torch.float32 else 64


def leaf_partials(x: torch.Tensor, weight: torch.Tensor, leaf: int, impl: str | None = None) -> torch.Tensor:
    """fp32 partial products of each ``leaf``-column slab of K: shape (n_leaves, M, N)."""
    m, k = x.shape
    n = weight.shape[0]
    n_leaves = -(-k // leaf)
    if resolve(impl, x) == "torch":
        xf, wf = x.float(), weight.float()
        bk = _block_k(weight.dtype)
        parts = []
        for i in range(n_leaves):
            acc = torch.zeros(m, n, dtype=torch.float32, device=x.device)
            for k0 in range(i * leaf, min((i + 1) * leaf, k), bk):
                acc = acc + xf[:, k0 : k0 + bk] @ wf[:, k0 : k0 + bk].T
            parts.append(acc)
        return torch.stack(parts) if parts else torch.zeros(0, m, n, device=x.device)
    bk = _block_k(weight.dtype)
    assert leaf % bk == 0, "BLOCK_K must divide the leaf width"
    out = torch.empty(n_leaves, m, n, dtype=torch.float32, device=x.device)
    if n_leaves and m:
        bm, bn = 64, 64
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), n_leaves)
        _leaf_kernel[grid](
            x,
            weight,
            out,
            m,
            n,
            k,
            leaf,
            x.stride(0),
            x.stride(1),
            weight.stride(0),
            weight.stride(1),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            PRECISION=dot_precision(weight.dtype),
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            num_warps=4,
            num_stages=3,
        )
    return out


def tree_reduce(slots: torch.Tensor) -> torch.Tensor:
    """Pairwise (left + right) reduction of a power-of-two stack of fp32 slots to one."""
    s = slots
    while s.shape[0] > 1:
        s = s[0::2] + s[1::2]
    return s[0]


def subtree_root(
    x_local: torch.Tensor, w_local: torch.Tensor, plan: TreePlan, rank: int, impl: str | None = None
) -> torch.Tensor:
    """What one rank computes: the fp32 root of its subtree, from its own K columns only."""
    lo, hi = plan.k_range(rank)
    assert x_local.shape[1] == hi - lo and w_local.shape[1] == hi - lo, "shard does not match the plan"
    m, n = x_local.shape[0], w_local.shape[0]
    parts = leaf_partials(x_local, w_local, plan.leaf, impl)
    pad = plan.slots_per_rank - parts.shape[0]
    if pad:
        parts = torch.cat([parts, torch.zeros(pad, m, n, dtype=torch.float32, device=x_local.device)])
    return tree_reduce(parts)


def tree_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    leaf: int = 256,
    tp: int = 1,
    out_dtype: torch.dtype | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """``x @ weight.T`` reduced over the fixed tree, the ``tp`` ranks simulated on this device."""
    plan = tree_plan(x.shape[-1], leaf, tp)
    x2 = x.reshape(-1, x.shape[-1])
    roots = []
    for r in range(tp):
        lo, hi = plan.k_range(r)
        roots.append(subtree_root(x2[:, lo:hi], weight[:, lo:hi], plan, r, impl))
    out = tree_reduce(torch.stack(roots))
    return out.to(out_dtype or x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def tree_gemm_distributed(
    x_local: torch.Tensor,
    w_local: torch.Tensor,
    k: int,
    leaf: int,
    tp: int,
    rank: int,
    all_gather: Callable[[torch.Tensor], torch.Tensor],
    out_dtype: torch.dtype | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """One rank of a real TP group: its subtree root, gathered with the others (``all_gather``
    returns every rank's root stacked in rank order), combined by the same tree."""
    plan = tree_plan(k, leaf, tp)
    root = subtree_root(x_local, w_local, plan, rank, impl)
    roots = all_gather(root)
    return tree_reduce(roots).to(out_dtype or x_local.dtype)
