"""TP-invariant tree GEMM: the K reduction has one fixed shape however K is sharded.

The tree, exactly (``max_tp`` = the largest TP degree the plan serves, 8 by default):
  * K is cut into ``n = ceil(K / leaf)`` leaves of ``leaf`` columns (the last may be short).
  * Leaf ``i`` is ``x[:, i*leaf:(i+1)*leaf] @ w[:, i*leaf:(i+1)*leaf].T`` accumulated in fp32 from
    zero, in ascending k, in BLOCK_K steps (BLOCK_K divides ``leaf``).
  * The leaves are dealt into ``max_tp`` groups of ``L = ceil(n / max_tp)`` consecutive leaves;
    each group has ``next_pow2(L)`` slots, its leaves first and exact zeros after them. The groups
    sit side by side, so the tree has ``P = max_tp * next_pow2(L)`` slots.
  * Level by level, slot pairs ``(2j, 2j+1)`` are added in fp32 (left + right) until one remains;
    that root is rounded once to the output dtype.
  * With tensor parallelism ``tp`` (a power of two <= max_tp), rank ``r`` owns groups
    ``[r*max_tp/tp, (r+1)*max_tp/tp)``, i.e. one complete subtree and one contiguous, balanced
    range of K columns (ranks get equal shares whenever ``max_tp`` divides ``n``). It reduces its
    subtree locally; the ``tp`` roots are all-gathered (never all-reduced: NCCL's summation order
    is not ours) and combined by the same pairwise rule. Every add is the add TP=1 performs.

Two CUDA paths compute a rank's subtree, with the same adds (so the same bits):
  * where the subtree is at most ``MAX_GEMM_PARTS`` pairs of slots (``MAX_WIDE_GEMM_PARTS`` for
    leaves of at least ``WIDE_LEAF`` columns), each pair is the batch-invariant
    GEMM itself (:func:`isoaudit.kernels.gemm.gemm` with a fixed split-K of one leaf: two leaves summed from
    zero and added, ``0 + l0 + l1 == l0 + l1``), and the pairs' roots are added by the same tree in
    one launch (:func:`reduce_roots`); at TP=1 with one pair the GEMM rounds the root itself, so the
    whole tree is one launch. This is the path of *wide* plans (``leaf=0``: one leaf per group,
    ``ceil(K / max_tp)`` columns), sized to the job's largest TP degree: ``max_tp=2`` serves TP 1
    and 2 at about a plain GEMM's cost;
  * otherwise one kernel computes the subtree's roots in registers (leaves and pairwise adds), a
    program carrying MAX_PROGRAM_SLOTS slots (or one whole group); memory never holds one partial
    per leaf.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

import torch

from ._triton import (
    HAVE_TRITON,
    CachedLauncher,
    aligned,
    cdiv,
    dot_precision,
    jit,
    resolve,
    tl,
    triton,
    use_triton,
)
from .gemm import _device_traits, _ensure_allocator, _tma_operand, gemm, gemm_reference
from .gemm_policy import SPLIT_ALIGN, GemmConfig, gemm_config

MAX_TP = 8
# Slots one program carries in registers (2 + log2 of it live fp32 tiles); a rank's subtree wider
# than this is computed as equal complete subtrees, their roots added by the same tree in torch.
# 8 is the fastest on the H200 at the 8B-class K (16 or 32 slots need narrower tiles; one group per
# program writes more partials). A group may still hold up to 32 slots.
MAX_PROGRAM_SLOTS = 8
MAX_GROUP_SLOTS = 32
#: A rank's subtree of at most this many slot pairs takes the GEMM path (one batch-invariant GEMM
#: launch a pair, then one launch adding the pairs' roots); a wider one, the register kernel. Up to
#: MAX_WIDE_GEMM_PARTS pairs where leaves are at least WIDE_LEAF columns: long leaves keep the GEMM
#: launches ahead of the register kernel, short ones do not (figures in ``docs/kernels.md``).
MAX_GEMM_PARTS = 2
MAX_WIDE_GEMM_PARTS = 4
WIDE_LEAF = 1024
GEMM_PATH = True  # False: every CUDA call through the register kernel (the bench's and tests' other path)
#: ``leaf=WIDE``: one leaf per group, ceil(K / max_tp) columns rounded up to a multiple of
#: SPLIT_ALIGN (every BLOCK_K the GEMM may take divides it).
WIDE = 0


def _next_pow2(x: int) -> int:
    p = 1
    while p < x:
        p *= 2
    return p


@dataclass(frozen=True)
class TreePlan:
    """Where each rank's leaves sit in K and in the tree."""

    k: int
    leaf: int
    tp: int
    max_tp: int
    n_leaves: int
    group_leaves: int  # L: leaves per group (the last groups may hold fewer, or none)

    @property
    def group_slots(self) -> int:
        """Slots per group: L rounded up to a power of two."""
        return _next_pow2(self.group_leaves)

    @property
    def slots(self) -> int:
        return self.max_tp * self.group_slots

    @property
    def groups_per_rank(self) -> int:
        return self.max_tp // self.tp

    @property
    def slots_per_rank(self) -> int:
        return self.groups_per_rank * self.group_slots

    def k_range(self, rank: int) -> tuple[int, int]:
        """The K columns rank ``rank`` owns (possibly empty: its subtree is then all zeros)."""
        per_rank = self.groups_per_rank * self.group_leaves * self.leaf
        return min(rank * per_rank, self.k), min((rank + 1) * per_rank, self.k)


def tree_plan(k: int, leaf: int = 256, tp: int = 1, max_tp: int = MAX_TP) -> TreePlan:
    """The tree for a reduction of length ``k`` with leaves of ``leaf`` columns over ``tp`` ranks.

    ``leaf=WIDE`` (0) makes one leaf per group (:data:`WIDE`): the fewest adds, and with
    ``max_tp=2`` a tree the batch-invariant GEMM computes in one launch. Both sides of a job must
    use the same ``(leaf, max_tp)``: they set the bits."""
    for name, v in (("tp", tp), ("max_tp", max_tp)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, not {v}")
    if tp > max_tp:
        raise ValueError(f"tp={tp} exceeds the plan's max_tp={max_tp}")
    if k < 1 or leaf < 0:
        raise ValueError(f"k must be positive and leaf >= 0 (k={k}, leaf={leaf})")
    if leaf == WIDE:
        leaf = cdiv(cdiv(k, max_tp), SPLIT_ALIGN) * SPLIT_ALIGN
    n = -(-k // leaf)
    return TreePlan(k=k, leaf=leaf, tp=tp, max_tp=max_tp, n_leaves=n, group_leaves=-(-n // max_tp))


def _block_k(dtype: torch.dtype) -> int:
    return 32 if dtype == torch.float32 else 64


if HAVE_TRITON:

    @triton.jit
    def _tree_level(left, v, s, W: tl.constexpr):
        """Level W (1, 2, 4, ...) of the pairwise tree kept as a binary counter. Slot ``s``'s carry
        reaches it when the bits of ``s`` below W are all ones; there it is parked as the level's
        left subtree if bit W is 0, else added to it as the right operand (left + right)."""
        if s % (2 * W) == W - 1:
            left = v
        elif s % (2 * W) == 2 * W - 1:
            v = left + v
        return left, v

    @triton.jit
    def _push_leaf(leaf, s, left1, left2, left4, left8, left16, SLOTS: tl.constexpr):
        """Slot ``s``'s leaf into a tree of SLOTS slots. Returns (carry, lefts); after the last
        slot the carry is the root, and every add was a (left + right) of the tree."""
        left1, v = _tree_level(left1, leaf, s, 1)
        if SLOTS > 2:
            left2, v = _tree_level(left2, v, s, 2)
        if SLOTS > 4:
            left4, v = _tree_level(left4, v, s, 4)
        if SLOTS > 8:
            left8, v = _tree_level(left8, v, s, 8)
        if SLOTS > 16:
            left16, v = _tree_level(left16, v, s, 16)
        return v, left1, left2, left4, left8, left16

    @jit(do_not_specialize=["M"])
    def _subtree_kernel(
        a,
        b,
        c_ptr,
        M,
        N,
        K,
        GROUP_LEAVES,
        stride_am,
        stride_bn,
        stride_cg,
        stride_cm,
        stride_cn,
        LEAF: tl.constexpr,
        GROUP_SLOTS: tl.constexpr,
        GROUPS: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        TMA: tl.constexpr,
    ):
        """Program (m tile, n tile, part): the root of GROUPS consecutive groups (a complete
        subtree of GROUPS * GROUP_SLOTS slots), every leaf and add in registers.

        Per group, one pipelined loop walks its real leaves in BLOCK_K steps (a leaf's accumulator
        starts from zero, ascending k; steps past K read zeros, exact no-ops) and at each leaf end
        the leaf enters the tree (``_push_leaf``); the group's padding slots then enter as exact
        zeros. With TMA, ``a`` and ``b`` are pointers the kernel wraps in tensor descriptors."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        part = tl.program_id(2)
        if TMA:
            a = tl.make_tensor_descriptor(a, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
            b = tl.make_tensor_descriptor(b, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
        STEPS: tl.constexpr = LEAF // BLOCK_K
        SLOTS: tl.constexpr = GROUPS * GROUP_SLOTS
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        n_leaves = tl.cdiv(K, LEAF)
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = zero
        root = zero
        left1 = zero
        left2 = zero
        left4 = zero
        left8 = zero
        left16 = zero
        for g in range(0, GROUPS):
            first = (part * GROUPS + g) * GROUP_LEAVES
            real = tl.maximum(tl.minimum(GROUP_LEAVES, n_leaves - first), 0)
            for step in range(0, real * STEPS):
                k0 = first * LEAF + step * BLOCK_K
                if TMA:
                    x = a.load([pid_m * BLOCK_M, k0])
                    w = b.load([pid_n * BLOCK_N, k0])
                    acc = tl.dot(x, w.T, acc, input_precision=PRECISION)
                else:
                    ks = k0 + offs_k
                    x = tl.load(
                        a + offs_m[:, None] * stride_am + ks[None, :],
                        mask=(offs_m[:, None] < M) & (ks < K)[None, :],
                        other=0.0,
                    )
                    w = tl.load(
                        b + ks[:, None] + offs_n[None, :] * stride_bn,
                        mask=(ks < K)[:, None] & (offs_n[None, :] < N),
                        other=0.0,
                    )
                    acc = tl.dot(x, w, acc, input_precision=PRECISION)
                if step % STEPS == STEPS - 1:
                    root, left1, left2, left4, left8, left16 = _push_leaf(
                        acc, g * GROUP_SLOTS + step // STEPS, left1, left2, left4, left8, left16, SLOTS
                    )
                    acc = zero
            for j in range(real, GROUP_SLOTS):  # padding slots: exact zeros
                root, left1, left2, left4, left8, left16 = _push_leaf(
                    zero, g * GROUP_SLOTS + j, left1, left2, left4, left8, left16, SLOTS
                )
        tl.store(
            c_ptr + part * stride_cg + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
            root,
            mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
        )

    @jit()
    def _reduce_roots_kernel(
        r0, r1, r2, r3, r4, r5, r6, r7, out, n, ROOTS: tl.constexpr, BLOCK: tl.constexpr
    ):
        """out = tree(r0..r{ROOTS-1}) rounded once: the pairwise levels of :func:`tree_reduce`,
        (r0 + r1) + (r2 + r3) ..., on flat fp32 roots (ROOTS = 1, 2, 4 or 8)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        acc = tl.load(r0 + offs, mask=ok)
        if ROOTS > 1:
            acc = acc + tl.load(r1 + offs, mask=ok)
        if ROOTS > 2:
            acc = acc + (tl.load(r2 + offs, mask=ok) + tl.load(r3 + offs, mask=ok))
        if ROOTS > 4:
            left = tl.load(r4 + offs, mask=ok) + tl.load(r5 + offs, mask=ok)
            acc = acc + (left + (tl.load(r6 + offs, mask=ok) + tl.load(r7 + offs, mask=ok)))
        tl.store(out + offs, acc.to(out.dtype.element_ty), mask=ok)

    _REDUCE = CachedLauncher(_reduce_roots_kernel)


def reduce_roots(roots: list[torch.Tensor], out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The pairwise tree of a power-of-two list of same-shape fp32 roots, rounded once to
    ``out_dtype``: :func:`tree_reduce` in one launch (eight roots at a time) instead of a launch a
    level plus one for the rounding. A single fp32 root asked for in fp32 is returned itself."""
    count = len(roots)
    if count < 1 or count & (count - 1):
        raise ValueError(f"reduce_roots needs a power-of-two number of roots, not {count}")
    first = roots[0]
    if first.dtype != torch.float32:
        raise ValueError(f"roots must be fp32, not {first.dtype}")
    if count == 1 and out_dtype == torch.float32:
        # A tree of one root is the root: no launch (a copy is a sizeable share of a rank's time
        # on the wide plan).
        return first
    if not use_triton(first):
        return tree_reduce(torch.stack(roots)).to(out_dtype)
    while len(roots) > 8:  # a tree of 8-root subtrees is the same tree
        roots = [reduce_roots(roots[i : i + 8]) for i in range(0, len(roots), 8)]
    roots = [r.contiguous() for r in roots]
    out = torch.empty(first.shape, dtype=out_dtype, device=first.device)
    n = out.numel()
    if n:
        block = 2048
        ptrs = roots + [roots[0]] * (8 - len(roots))
        # n is specialised (a multiple of 16 lets every load be a full vector, far faster than
        # masked scalar loads), so its divisibility is part of the key.
        key = (len(roots), out_dtype, aligned(*roots, out), n % 16 == 0, n == 1)
        _REDUCE(
            key, (cdiv(n, block), 1, 1), (*ptrs, out, n), dict(ROOTS=len(roots), BLOCK=block), num_warps=4
        )
    return out


def _use_tma(w: torch.Tensor) -> bool:
    """TMA loads for 2-byte weights on Hopper and later."""
    capability, _ = _device_traits(w.device)
    return capability is not None and capability >= (9, 0) and w.element_size() == 2


def tree_reduce(slots: torch.Tensor) -> torch.Tensor:
    """Pairwise (left + right) reduction of a power-of-two stack of fp32 slots to one."""
    s = slots
    while s.shape[0] > 1:
        s = s[0::2] + s[1::2]
    return s[0]


def _tile(live: int, tma: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) for a program keeping ``live`` fp32 tiles in registers (launch
    shape only: no bit depends on it)."""
    if not tma:
        return 64, 64, 4
    if live <= 3:
        return 128, 128, 8
    return (128, 64, 8) if live <= 5 else (64, 64, 8)


@cache
def _pair_config(
    n: int, k: int, leaf: int, dtype: torch.dtype, capability: tuple[int, int] | None
) -> GemmConfig:
    """The GEMM config computing one slot pair: the weight's own config with a fixed split-K of one
    leaf, or none for a single leaf. On the H200 the 128 x 256 tile with the two fp32 tiles of a
    split (the span sum and the total, touched once a span) is the fastest. No bit depends on the
    tile (the k16 MMA chain does not change), only on the tree's leaves."""
    base = gemm_config(n, k, dtype, capability)
    return replace(base, k_split=0 if k <= leaf else leaf)


def _gemm_parts(plan: TreePlan, k_local: int) -> list[tuple[int, int]] | None:
    """The column ranges of a rank's slot pairs (level one of its subtree) when the GEMM path
    serves it, else None. A pair is one or two consecutive real leaves, or (lo, lo) when both of
    its slots are padding, an exact zero."""
    slots = plan.slots_per_rank
    most = MAX_WIDE_GEMM_PARTS if plan.leaf >= WIDE_LEAF else MAX_GEMM_PARTS
    if plan.leaf % SPLIT_ALIGN or cdiv(slots, 2) > most:
        return None
    gs, gl = plan.group_slots, plan.group_leaves
    parts = []
    for first in range(0, slots, 2):
        cols = []
        for s in range(first, min(first + 2, slots)):
            g, j = divmod(s, gs)
            if j < gl:  # a real leaf (empty if past the rank's last column)
                lo = min((g * gl + j) * plan.leaf, k_local)
                cols.append((lo, min(lo + plan.leaf, k_local)))
        cols = [c for c in cols if c[1] > c[0]]
        parts.append((cols[0][0], cols[-1][1]) if cols else (0, 0))
    return parts


def _pair_roots(
    x_local: torch.Tensor, w_local: torch.Tensor, plan: TreePlan, parts, out_dtype
) -> list[torch.Tensor]:
    """Each slot pair's root through the batch-invariant GEMM (rounded to ``out_dtype``)."""
    n = w_local.shape[0]
    capability, _ = _device_traits(w_local.device)
    roots = []
    for lo, hi in parts:
        if hi == lo:
            roots.append(torch.zeros(x_local.shape[0], n, dtype=out_dtype, device=x_local.device))
            continue
        cfg = _pair_config(n, hi - lo, plan.leaf, w_local.dtype, capability)
        roots.append(gemm(x_local[:, lo:hi], w_local[:, lo:hi], out_dtype=out_dtype, config=cfg))
    return roots


def _gemm_path(x_local: torch.Tensor, w_local: torch.Tensor, plan: TreePlan) -> list[tuple[int, int]] | None:
    """The slot pairs of the GEMM path, where it serves this call (Hopper, 2-byte weights, a
    narrow subtree), else None."""
    if not (GEMM_PATH and _use_tma(w_local)) or x_local.shape[0] == 0:
        return None
    return _gemm_parts(plan, x_local.shape[1])


def partial_roots(
    x_local: torch.Tensor, w_local: torch.Tensor, plan: TreePlan, impl: str | None = None
) -> torch.Tensor:
    """fp32 roots of consecutive, equal, complete subtrees of a rank's tree, in order (the
    :func:`tree_reduce` of them is the rank's root): shape (parts, M, N). On CUDA a program holds
    up to MAX_PROGRAM_SLOTS slots (at least one group) in registers; the torch path returns one
    root per group. (The register kernel's path: :func:`subtree_root` takes the GEMM path first.)
    ``x_local`` and ``w_local`` hold exactly the rank's K columns (``plan.k_range(rank)``)."""
    m, k = x_local.shape
    n = w_local.shape[0]
    bk = _block_k(w_local.dtype)
    if plan.leaf % bk:
        raise ValueError(f"leaf={plan.leaf} must be a multiple of BLOCK_K={bk}")
    gs, gl = plan.group_slots, plan.group_leaves
    if resolve(impl, x_local) == "torch":
        roots = []
        for g in range(plan.groups_per_rank):
            slots = []
            for s in range(gs):
                # A padding slot (s >= gl), or one past the rank's last column, is an empty leaf: 0.
                lo = min((g * gl + s) * plan.leaf, k) if s < gl else k
                hi = min(lo + plan.leaf, k)
                leaf = gemm_reference(x_local[:, lo:hi], w_local[:, lo:hi], None, torch.float32, bk)
                slots.append(leaf)
            roots.append(tree_reduce(torch.stack(slots)))
        return torch.stack(roots)
    if gs > MAX_GROUP_SLOTS:
        raise ValueError(
            f"a group of {gs} leaves exceeds {MAX_GROUP_SLOTS}: use a wider leaf (leaf={plan.leaf}, k={plan.k})"
        )
    groups = plan.groups_per_rank  # per program: the most whose slots fit (both powers of two)
    while groups > 1 and groups * gs > MAX_PROGRAM_SLOTS:
        groups //= 2
    parts = plan.groups_per_rank // groups
    out = torch.empty(parts, m, n, dtype=torch.float32, device=x_local.device)
    if m and n:
        tma = _use_tma(w_local)
        if tma:
            x_local, w_local = _tma_operand(x_local), _tma_operand(w_local)
            _ensure_allocator()
        elif x_local.stride(1) != 1 or w_local.stride(1) != 1:
            x_local, w_local = x_local.contiguous(), w_local.contiguous()
        bm, bn, warps = _tile(2 + (groups * gs).bit_length() - 1, tma)
        _subtree_kernel[(cdiv(m, bm), cdiv(n, bn), parts)](
            x_local,
            w_local,
            out,
            m,
            n,
            k,
            gl,
            x_local.stride(0),
            w_local.stride(0),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            LEAF=plan.leaf,
            GROUP_SLOTS=gs,
            GROUPS=groups,
            PRECISION=dot_precision(w_local.dtype),
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            TMA=tma,
            num_warps=warps,
            num_stages=3,
        )
    return out


def subtree_root(
    x_local: torch.Tensor, w_local: torch.Tensor, plan: TreePlan, rank: int, impl: str | None = None
) -> torch.Tensor:
    """What one rank computes: the fp32 root of its subtree, from its own K columns only."""
    lo, hi = plan.k_range(rank)
    if x_local.shape[1] != hi - lo or w_local.shape[1] != hi - lo:
        raise ValueError(f"rank {rank} must hold K columns [{lo}, {hi}) of the plan, got {x_local.shape[1]}")
    if resolve(impl, x_local) == "triton":
        pairs = _gemm_path(x_local, w_local, plan)
        if pairs is not None:
            return reduce_roots(_pair_roots(x_local, w_local, plan, pairs, torch.float32))
    return tree_reduce(partial_roots(x_local, w_local, plan, impl))


def tree_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    leaf: int = 256,
    tp: int = 1,
    out_dtype: torch.dtype | None = None,
    impl: str | None = None,
    max_tp: int = MAX_TP,
) -> torch.Tensor:
    """``x @ weight.T`` reduced over the fixed tree, the ``tp`` ranks simulated on this device."""
    plan = tree_plan(x.shape[-1], leaf, tp, max_tp)
    x2 = x.reshape(-1, x.shape[-1])
    odt = out_dtype or x.dtype
    if tp == 1 and resolve(impl, x2) == "triton":
        pairs = _gemm_path(x2, weight, plan)
        if pairs is not None and len(pairs) == 1 and pairs[0][1] > pairs[0][0]:
            # The whole tree is one pair: the GEMM adds it and rounds the root itself.
            out = _pair_roots(x2, weight, plan, pairs, odt)[0]
            return out.reshape(*x.shape[:-1], weight.shape[0])
    roots = []
    for r in range(tp):
        lo, hi = plan.k_range(r)
        roots.append(subtree_root(x2[:, lo:hi], weight[:, lo:hi], plan, r, impl))
    return reduce_roots(roots, odt).reshape(*x.shape[:-1], weight.shape[0])


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
    max_tp: int = MAX_TP,
) -> torch.Tensor:
    """One rank of a real TP group: its subtree root, gathered with the others (``all_gather``
    returns every rank's root stacked in rank order), combined by the same tree."""
    plan = tree_plan(k, leaf, tp, max_tp)
    root = subtree_root(x_local, w_local, plan, rank, impl)
    return reduce_roots(list(all_gather(root).unbind(0)), out_dtype or x_local.dtype)
