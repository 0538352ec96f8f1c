"""Batch-invariant grouped GEMM for MoE experts: one launch for every expert's rows.

Rows arrive grouped (group g's rows contiguous, ``offsets[g]:offsets[g+1]``, group g multiplied
by ``weight[experts[g]]``). A program computes one (BLOCK_M rows of one group) x BLOCK_N tile:
tiles never straddle groups (rows past the group's end load as zeros and are not stored), the tile
shape is a function of (N, K, dtype) only, there is no split-K, and each output accumulates in fp32
over K in ascending BLOCK_K steps (the pointer path of :mod:`kernels.gemm`). So a row's bits depend
on that row and its expert's weight alone: not on how many rows its expert got, which other
experts share the launch, or where the row sits in a tile; one expert alone (a single-group call)
gives the same bits as the whole layer's launch.
"""

from __future__ import annotations

from functools import cache

import torch

from ._triton import HAVE_TRITON, cdiv, dot_precision, jit, next_power_of_2, tl


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
    def forward(ctx, x, weight, experts, offsets):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.groups = (experts, offsets)
        return grouped_gemm(x, weight, experts, offsets)

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        experts, offsets = ctx.groups
        gx = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        gw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for i, e in enumerate(experts):
            lo, hi = offsets[i], offsets[i + 1]
            if hi > lo:
                if gx is not None:
                    gx[lo:hi] = (g[lo:hi] @ weight[e]).to(x.dtype)
                if gw is not None:
                    gw[e] += (g[lo:hi].T @ x[lo:hi]).to(weight.dtype)
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
    _grouped_dev_kernel[(cdiv(s, bm) + n_exp, cdiv(n, bn))](
        x,
        weight,
        out,
        groups,
        n_exp,
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
        E_P2=next_power_of_2(n_exp),
        num_warps=warps,
        num_stages=stages,
    )
    return out
