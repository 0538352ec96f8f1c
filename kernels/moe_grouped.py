"""Batch-invariant grouped GEMM for MoE experts: one launch for every expert's rows.

Rows arrive grouped (group g's rows contiguous, ``offsets[g]:offsets[g+1]``, group g multiplied
by ``weight[experts[g]]``). A program computes one (BLOCK_M rows of one group) x BLOCK_N tile:
tiles never straddle groups (rows past the group's end load as zeros and are not stored), the tile
shape is a function of (N, K, dtype) only, there is no split-K, and each output accumulates in fp32
over K in ascending BLOCK_K steps (the pointer path of :mod:`isoaudit.kernels.gemm`). So a row's bits depend
on that row and its expert's weight alone: not on how many rows its expert got, which other
experts share the launch, or where the row sits in a tile; one expert alone (a single-group call)
gives the same bits as the whole layer's launch.
"""

from __future__ import annotations

import os
from functools import cache

import torch

from ._triton import HAVE_TRITON, CachedLauncher, aligned, cdiv, dot_precision, jit, next_power_of_2, tl


@cache
def grouped_config(n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for a weight (N, K): never depends on the rows."""
    if dtype == torch.float32:
        return 64, 64, 32, 4, 2
    return (64, 128, 64, 4, 3) if n >= 128 else (64, 64, 64, 4, 3)


if HAVE_TRITON:

    @jit()
    def _grouped_kernel(
        a,
        w,
        c,
        tiles,  # (3, n_tiles) int32: expert, first row, end row of the tile's group
        n_tiles,
        N,
        K,
        stride_am,
        stride_we,
        stride_wn,
        stride_cm,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
        e = tl.load(tiles + t).to(tl.int64)
        r0 = tl.load(tiles + n_tiles + t)
        r1 = tl.load(tiles + 2 * n_tiles + t)
        offs_m = r0 + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        rows = offs_m < r1
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            x = tl.load(
                a + offs_m[:, None].to(tl.int64) * stride_am + (k0 + offs_k)[None, :],
                mask=rows[:, None] & k_ok[None, :],
                other=0.0,
            )
            wt = tl.load(
                w + e * stride_we + (k0 + offs_k)[:, None] + offs_n[None, :] * stride_wn,
                mask=k_ok[:, None] & (offs_n[None, :] < N),
                other=0.0,
            )
            acc = tl.dot(x, wt, acc, input_precision=PRECISION)
        tl.store(
            c + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :],
            acc.to(c.dtype.element_ty),
            mask=rows[:, None] & (offs_n[None, :] < N),
        )


def _tile_table(experts: list[int], offsets: list[int], block_m: int, dev: torch.device) -> torch.Tensor:
    ex, r0, r1 = [], [], []
    for g, e in enumerate(experts):
        lo, hi = offsets[g], offsets[g + 1]
        for s in range(lo, hi, block_m):
            ex.append(e)
            r0.append(s)
            r1.append(hi)
    return torch.tensor([ex, r0, r1], dtype=torch.int32).to(dev, non_blocking=True)


def grouped_gemm(
    x: torch.Tensor, weight: torch.Tensor, experts: list[int], offsets: list[int]
) -> torch.Tensor:
    """``out[offsets[g]:offsets[g+1]] = x[offsets[g]:offsets[g+1]] @ weight[experts[g]].T`` for
    x (S, K) and weight (E, N, K), in x's dtype, one launch."""
    s, k = x.shape
    _, n, _ = weight.shape
    out = torch.empty(s, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = grouped_config(n, k, weight.dtype)
    table = _tile_table(experts, offsets, bm, x.device)
    n_tiles = table.shape[1]
    if n_tiles == 0 or n == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    _grouped_kernel[(n_tiles, cdiv(n, bn))](
        x,
        weight,
        out,
        table,
        n_tiles,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        PRECISION=dot_precision(weight.dtype),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        num_warps=warps,
        num_stages=stages,
    )
    return out


class _Grouped(torch.autograd.Function):
    """Forward: the kernel. Backward: per group in torch (correct, not invariant: the contract is
    the forward's bits)."""

    @staticmethod
    def forward(ctx, x, weight, experts, offsets):
        ctx.save_for_backward(x, weight)
        ctx.groups = (experts, offsets)
        return grouped_gemm(x, weight, experts, offsets)

    @staticmethod
    def backward(ctx, g):
        """Per group in the weight's dtype (``x`` and the gradient cast to it where they differ, as
        a straight-through FP8 forward's are): ``dx = g @ W_e``, ``dW_e += g.T @ x``."""
        x, weight = ctx.saved_tensors
        experts, offsets = ctx.groups
        gx = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for i, e in enumerate(experts):
            lo, hi = offsets[i], offsets[i + 1]
            if hi > lo:
                g2 = g[lo:hi].to(weight.dtype)
                if gx is not None:
                    gx[lo:hi] = (g2 @ weight[e]).to(x.dtype)
                if gw is not None:
                    gw[e] += (g2.T @ x[lo:hi].to(weight.dtype)).to(weight.dtype)
        return gx, gw, None, None


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, experts: list[int], offsets: list[int]
) -> torch.Tensor:
    """:func:`grouped_gemm`, differentiable."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _Grouped.apply(x, weight, experts, offsets)
    return grouped_gemm(x, weight, experts, offsets)


# ---------------------------------------------------------------------------------------------
# Device tile table: groups are experts 0..E-1 in order, row counts on the device (no host sync).

if HAVE_TRITON:

    @jit()
    def _grouped_dev_kernel(
        a,
        w,
        c,
        groups,  # (3, E) int32: inclusive cumsum of each expert's tiles, first row, end row
        idx,  # (S,) int32 routing index of each sorted row (GATHER / SCATTER), else unused
        E,
        N,
        K,
        stride_am,
        stride_we,
        stride_wn,
        stride_cm,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        E_P2: tl.constexpr,
        GATHER: tl.constexpr,  # row r of a is token idx[r] // TOPK (the dispatch gather fused in)
        GLU: tl.constexpr,  # weight rows [0, N) gate and [N, 2N) up: store silu(gate) * up
        SCATTER: tl.constexpr,  # row r goes to c[idx[r]] (back to routing order)
        TOPK: tl.constexpr,
    ):
        t = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_e = tl.arange(0, E_P2)
        tile_cum = tl.load(groups + offs_e, mask=offs_e < E, other=2147483647)
        n_tiles = tl.load(groups + E - 1)
        if t < n_tiles:  # the grid is an upper bound: programs past the real tiles do nothing
            e32 = tl.sum((tile_cum <= t).to(tl.int32), axis=0)  # the expert whose tiles hold t
            lo = tl.load(groups + E + e32)
            r1 = tl.load(groups + 2 * E + e32)
            first = tl.load(groups + e32) - (r1 - lo + BLOCK_M - 1) // BLOCK_M
            r0 = lo + (t - first) * BLOCK_M
            e = e32.to(tl.int64)
            offs_m = r0 + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = tl.arange(0, BLOCK_K)
            rows = offs_m < r1
            a_rows = offs_m.to(tl.int64)
            c_rows = offs_m.to(tl.int64)
            if GATHER or SCATTER:
                src = tl.load(idx + offs_m, mask=rows, other=0).to(tl.int64)
                if GATHER:
                    a_rows = src // TOPK
                if SCATTER:
                    c_rows = src
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = (k0 + offs_k) < K
                x = tl.load(
                    a + a_rows[:, None] * stride_am + (k0 + offs_k)[None, :],
                    mask=rows[:, None] & k_ok[None, :],
                    other=0.0,
                )
                wt = tl.load(
                    w + e * stride_we + (k0 + offs_k)[:, None] + offs_n[None, :] * stride_wn,
                    mask=k_ok[:, None] & (offs_n[None, :] < N),
                    other=0.0,
                )
                acc = tl.dot(x, wt, acc, input_precision=PRECISION)
                if GLU:
                    wu = tl.load(
                        w + e * stride_we + (k0 + offs_k)[:, None] + (N + offs_n)[None, :] * stride_wn,
                        mask=k_ok[:, None] & (offs_n[None, :] < N),
                        other=0.0,
                    )
                    acc_up = tl.dot(x, wu, acc_up, input_precision=PRECISION)
            if GLU:
                # the unfused path's roundings: gate and up stored in c's dtype, SiLU in fp32 as
                # isoaudit.kernels.elementwise computes it, rounded, then the product rounded (torch's mul)
                g = acc.to(c.dtype.element_ty).to(tl.float32)
                sg = (g / (1.0 + tl.exp(-g))).to(c.dtype.element_ty).to(tl.float32)
                out = (sg * acc_up.to(c.dtype.element_ty).to(tl.float32)).to(c.dtype.element_ty)
            else:
                out = acc.to(c.dtype.element_ty)
            tl.store(
                c + c_rows[:, None] * stride_cm + offs_n[None, :],
                out,
                mask=rows[:, None] & (offs_n[None, :] < N),
            )

    _LAUNCH_DEV = CachedLauncher(_grouped_dev_kernel)

    @jit(do_not_specialize=["S"])
    def _silu_mul_kernel(gu, out, S, N, stride_g, BLOCK: tl.constexpr):
        """silu(gu[:, :N]) * gu[:, N:] with the unfused path's roundings (the GLU fallback)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        g = tl.load(gu + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gu + row * stride_g + N + cols, mask=ok, other=0.0).to(tl.float32)
        sg = (g / (1.0 + tl.exp(-g))).to(out.dtype.element_ty).to(tl.float32)
        tl.store(out + row * N + cols, (sg * u).to(out.dtype.element_ty), mask=ok)

    _LAUNCH_SILU_MUL = CachedLauncher(_silu_mul_kernel)

    @jit(do_not_specialize=["S"])
    def _sort_kernel(
        flat,
        perm,
        groups,
        S,
        E,
        BLOCK: tl.constexpr,
        SUB: tl.constexpr,
        HIST: tl.constexpr,
        NB: tl.constexpr,
        BM1: tl.constexpr,
        BM2: tl.constexpr,
    ):
        """A stable counting sort of the (token, slot) rows by expert, and the tile tables."""
        pid = tl.program_id(0)
        bins = tl.arange(0, NB)
        total = tl.zeros((NB,), dtype=tl.int32)
        before = tl.zeros((NB,), dtype=tl.int32)  # rows of each expert in earlier blocks
        first = pid * BLOCK
        for c in range(0, tl.cdiv(S, HIST)):
            offs = c * HIST + tl.arange(0, HIST)
            ex = tl.load(flat + offs, mask=offs < S, other=E).to(tl.int32)  # bin E: no expert
            total += tl.histogram(ex, NB)
            if c * HIST < first:
                before += tl.histogram(tl.where(offs < first, ex, E), NB)
        end = tl.cumsum(total, axis=0)
        start = end - total
        if pid == 0:
            ok = bins < E
            tl.store(groups + bins, tl.cumsum((total + BM1 - 1) // BM1, axis=0), mask=ok)
            tl.store(groups + E + bins, start, mask=ok)
            tl.store(groups + 2 * E + bins, end, mask=ok)
            tl.store(groups + 3 * E + bins, tl.cumsum((total + BM2 - 1) // BM2, axis=0), mask=ok)
            tl.store(groups + 4 * E + bins, start, mask=ok)
            tl.store(groups + 5 * E + bins, end, mask=ok)
        base = start + before
        j = tl.arange(0, SUB)
        for sb in range(0, BLOCK, SUB):
            i = pid * BLOCK + sb + j
            ok = i < S
            ex = tl.load(flat + i, mask=ok, other=E).to(tl.int32)
            hit = ex[:, None] == bins[None, :]
            at = tl.sum(tl.where(hit, base[None, :], 0), axis=1)
            earlier = (ex[:, None] == ex[None, :]) & (j[None, :] < j[:, None])
            pos = at + tl.sum(earlier.to(tl.int32), axis=1)
            tl.store(perm + pos, i, mask=ok)
            base += tl.sum(hit.to(tl.int32), axis=0)

    _LAUNCH_SORT = CachedLauncher(_sort_kernel)


def device_groups(counts: torch.Tensor, block_m: int) -> torch.Tensor:
    """(3, E) int32 on counts' device, from (E,) rows per expert (experts in order, rows
    contiguous): inclusive cumsum of tiles, first row, end row. A few launches, no host read."""
    c = counts.to(torch.int32)
    end = torch.cumsum(c, 0, dtype=torch.int32)
    tiles = torch.cumsum(torch.div(c + (block_m - 1), block_m, rounding_mode="floor"), 0, dtype=torch.int32)
    return torch.stack([tiles, end - c, end])


def grouped_gemm_counts(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, groups: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`grouped_gemm` with groups = experts 0..E-1 in order and ``counts`` (E,) their rows,
    a device tensor: the tile table is built and read on the device (no host sync), the grid is
    the upper bound cdiv(S, BLOCK_M) + E tiles and programs past the real tile count return. The
    tiles (and so every row's bits) are those of the host-table call. ``groups``: a precomputed
    :func:`device_groups` for this BLOCK_M (the two projections share it when BLOCK_M agrees)."""
    s, k = x.shape
    n_exp, n, _ = weight.shape
    out = torch.empty(s, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = grouped_config(n, k, weight.dtype)
    if s == 0 or n == 0:
        return out
    if groups is None:
        groups = device_groups(counts, bm)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    _launch_dev(x, weight, out, groups, None, n, bm, bn, bk, warps, stages)
    return out


def _launch_dev(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    groups: torch.Tensor,
    idx: torch.Tensor | None,
    n: int,
    bm: int,
    bn: int,
    bk: int,
    warps: int,
    stages: int,
    *,
    gather: int = 0,
    glu: bool = False,
    scatter: bool = False,
) -> None:
    """One launch of the device-table kernel over ``out``'s rows (the rows of a sorted row
    table); ``gather`` is top-k (row r reads x[idx[r] // top-k]) or 0."""
    n_exp = weight.shape[0]
    k = x.shape[1]
    args = (
        x, weight, out, groups, idx if idx is not None else groups, n_exp, n, k,
        x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
    )  # fmt: skip
    cx = dict(
        PRECISION=dot_precision(weight.dtype),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        E_P2=next_power_of_2(n_exp),
        GATHER=bool(gather),
        GLU=glu,
        SCATTER=scatter,
        TOPK=max(gather, 1),
    )
    grid = (cdiv(out.shape[0], bm) + n_exp, cdiv(n, bn), 1)
    key = (
        x.dtype, weight.dtype, out.dtype, *args[5:], bm, bn, bk, warps, stages, gather, glu, scatter,
        aligned(x, weight, out, groups, args[4]), x.device,
    )  # fmt: skip
    _LAUNCH_DEV(key, grid, args, cx, num_warps=warps, num_stages=stages)


def sort_groups(
    flat: torch.Tensor, n_experts: int, block_ms: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch: ``perm`` (S,) int32, the (token, slot) rows ``flat`` (S,) sorted by expert
    (stable: ``torch.sort(flat, stable=True).indices``), and (2, 3, E) int32 :func:`device_groups`
    tables for the two BLOCK_Ms. No host read."""
    s = flat.numel()
    perm = torch.empty(s, dtype=torch.int32, device=flat.device)
    groups = torch.empty(2, 3, n_experts, dtype=torch.int32, device=flat.device)
    block = max(64, min(1024, next_power_of_2(cdiv(s, 128))))  # about one program per SM
    nb = next_power_of_2(n_experts + 1)
    sub = min(64, max(16, 16384 // nb))  # the one-hot (SUB, NB) tile stays small
    f = flat if flat.is_contiguous() else flat.contiguous()
    args = (f, perm, groups, s, n_experts)
    cx = dict(
        BLOCK=block,
        SUB=sub,
        HIST=min(1024, max(16, next_power_of_2(s))),
        NB=nb,
        BM1=block_ms[0],
        BM2=block_ms[1],
    )
    key = (f.dtype, n_experts, block, sub, cx["HIST"], *block_ms, aligned(f, perm, groups), f.device)
    _LAUNCH_SORT(key, (max(1, cdiv(s, block)), 1, 1), args, cx, num_warps=4)
    return perm, groups


def grouped_glu(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    groups: torch.Tensor,
    perm: torch.Tensor,
    top_k: int,
    fused: bool = True,
) -> torch.Tensor:
    """(S, I): ``silu(g) * u`` of ``[g, u] = x[perm[r] // top_k] @ gate_up[e].T`` for each sorted
    row r of expert e, every rounding that of the unfused ops (the grouped GEMM's output in x's
    dtype, :func:`isoaudit.kernels.elementwise.silu`, torch's multiply). ``fused``: in the GEMM's epilogue
    (one launch), else the GEMM then one SiLU-times-up launch. ``ISOAUDIT_MOE_GLU_WARPS`` sets the
    fused launch's warps (default the GEMM's 4: the same MMA instruction shape as the unfused
    GEMM; 8 halves the instruction's N, which the `gpu` tests must show keeps the bits)."""
    s = perm.numel()
    _, n2, h = gate_up.shape
    n = n2 // 2
    bm, bn, bk, warps, stages = grouped_config(n2, h, gate_up.dtype)
    x = x if x.stride(-1) == 1 else x.contiguous()
    gate_up = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    out = torch.empty(s, n, dtype=x.dtype, device=x.device)
    if s == 0 or n == 0:
        return out
    if fused:  # two fp32 accumulators: more warps hold them without spilling (GLU_WARPS)
        glu_warps = int(os.environ.get("ISOAUDIT_MOE_GLU_WARPS", warps))
        _launch_dev(x, gate_up, out, groups, perm, n, bm, bn, bk, glu_warps, stages, gather=top_k, glu=True)
        return out
    gu = torch.empty(s, n2, dtype=x.dtype, device=x.device)
    _launch_dev(x, gate_up, gu, groups, perm, n2, bm, bn, bk, warps, stages, gather=top_k)
    return silu_mul(gu, out)


def silu_mul(gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(S, N): ``silu(gu[:, :N]) * gu[:, N:]`` of an (S, 2N) gate-up output with unit inner
    stride, one launch, the roundings of ``dispatch.silu(g) * u`` (SiLU in fp32 as
    :mod:`isoaudit.kernels.elementwise` computes it, rounded to gu's dtype, then torch's multiply)."""
    s, n2 = gu.shape
    n = n2 // 2
    if out is None:
        out = torch.empty(s, n, dtype=gu.dtype, device=gu.device)
    if s == 0 or n == 0:
        return out
    block = min(1024, next_power_of_2(n))
    key = (gu.dtype, n, gu.stride(0), block, aligned(gu, out), gu.device)
    _LAUNCH_SILU_MUL(
        key, (s, cdiv(n, block), 1), (gu, out, s, n, gu.stride(0)), dict(BLOCK=block), num_warps=4
    )
    return out


def grouped_scatter(
    y: torch.Tensor, down: torch.Tensor, groups: torch.Tensor, perm: torch.Tensor
) -> torch.Tensor:
    """(S, H): sorted row r of expert e through ``down[e]``, stored at row ``perm[r]`` (routing
    order): :func:`grouped_gemm_counts` then the ``index_copy_`` back, in one launch."""
    s = perm.numel()
    _, n, k = down.shape
    bm, bn, bk, warps, stages = grouped_config(n, k, down.dtype)
    y = y if y.stride(-1) == 1 else y.contiguous()
    down = down if down.stride(-1) == 1 else down.contiguous()
    out = torch.empty(s, n, dtype=y.dtype, device=y.device)
    if s and n:
        _launch_dev(y, down, out, groups, perm, n, bm, bn, bk, warps, stages, scatter=True)
    return out
