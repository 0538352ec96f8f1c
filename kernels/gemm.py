"""Batch-invariant GEMM: ``y = x @ w.T (+ bias)`` whose every row is independent of the batch.

Why it is invariant: the tile shape (BLOCK_M, BLOCK_N, BLOCK_K), warps and pipeline depth are a
function of the weight shape and dtype only, never of M; there is no split-K and no atomics; each
output element is accumulated in fp32 over K in ascending BLOCK_K steps. So a row's bits do not
depend on how many other rows are in the batch or where it sits (M is also excluded from Triton's
integer specialisation, so M=1 compiles to the same code as M=2048).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import HAVE_TRITON, dot_precision, jit, resolve, tl, triton


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape for one weight shape; fixed for every M."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def gemm_config(n: int, k: int, dtype: torch.dtype) -> GemmConfig:
    """The one tile configuration for a weight of shape (n, k): depends on (n, k, dtype), never on M."""
    if dtype == torch.float32:
        return GemmConfig(64, 64, 32, 4, 2)
    if n >= 256 and k >= 64:
        return GemmConfig(256, 128, 64, 8, 3)  # best of 8 candidates on an H200 (bench_tune)
    return GemmConfig(64, 64, 64, 4, 3)


if HAVE_TRITON:

    @jit(do_not_specialize=["M"])
    def _gemm_kernel(
        a_ptr,
        b_ptr,
        c_ptr,
        bias_ptr,
        M,
        N,
        K,
        stride_am,
        stride_ak,
        stride_bn,
        stride_bk,
        stride_cm,
        stride_cn,
        HAS_BIAS: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        # Grouped launch order for L2 reuse; it changes which program runs a tile, not the tile's sums.
        group = GROUP_M * num_n
        first_m = (pid // group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + ((pid % group) % size_m)
        pid_n = (pid % group) // size_m
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def gemm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """The arithmetic the kernel defines: fp32 products, fp32 partial sums per BLOCK_K slab, the
    slabs added in ascending k, bias added in fp32, one rounding to ``out_dtype`` at the end.
    (Inside one slab the hardware's dot order applies, so kernel and reference agree to rounding.)"""
    n, k = weight.shape
    bk = block_k or gemm_config(n, k, weight.dtype).block_k
    xf = x.reshape(-1, k).float()
    wf = weight.float()
    acc = torch.zeros(xf.shape[0], n, dtype=torch.float32, device=x.device)
    for k0 in range(0, k, bk):
        acc = acc + xf[:, k0 : k0 + bk] @ wf[:, k0 : k0 + bk].T
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype or x.dtype).reshape(*x.shape[:-1], n)


def gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    impl: str | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Batch-invariant ``x @ weight.T + bias`` for x of shape (..., K) and weight (N, K).
    ``config`` overrides the tile choice (for tuning; both sides must use the same one)."""
    if resolve(impl, x) == "torch":
        return gemm_reference(x, weight, bias, out_dtype)
    n, k = weight.shape
    if x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    a = x.reshape(-1, k)
    m = a.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m > 0:
        cfg = config or gemm_config(n, k, weight.dtype)
        grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
        _gemm_kernel[grid](
            a,
            weight,
            out,
            bias if bias is not None else weight,
            m,
            n,
            k,
            a.stride(0),
            a.stride(1),
            weight.stride(0),
            weight.stride(1),
            out.stride(0),
            out.stride(1),
            HAS_BIAS=bias is not None,
            PRECISION=dot_precision(weight.dtype),
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            GROUP_M=8,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return out.reshape(*x.shape[:-1], n)


class _Linear(torch.autograd.Function):
    """Forward through the invariant GEMM; backward through torch (the gradient's bits are not the
    contract, the forward's are)."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return gemm(x, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = (g2.to(weight.dtype) @ weight).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (g2.T.to(weight.dtype) @ x.reshape(-1, x.shape[-1]).to(weight.dtype)).to(weight.dtype)
        gb = g2.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Autograd-aware batch-invariant linear layer (``F.linear`` semantics)."""
    return _Linear.apply(x, weight, bias, out_dtype)
