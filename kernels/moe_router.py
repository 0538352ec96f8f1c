"""The MoE router's epilogue in one launch: fp32 logits (T, E) to the selected experts (T, k) and
their weights (T, k), with the bits of :func:`isoaudit.kernels.moe.route`'s torch ops.

Why: those ops are ~50 small launches (the order key, top-k, gather, the IEEE-only ``exp`` of
:mod:`isoaudit.kernels.cpu`, the slot sum, the division); on a slow host each costs more than the work.

The arithmetic, element by element, is the torch path's:

* the key of :func:`isoaudit.kernels.moe._order_key`: ``nan_to_num(z + 0, nan=-inf)`` (so -0 is +0, NaN
  becomes -inf, and +-inf become +-FLT_MAX, as ``nan_to_num``'s defaults do), its bits made
  monotone, times 2^16, plus ``2^16 - 1 - index``; k rounds of a row maximum over these unique
  int64 keys give ``topk(sorted=True)``'s answer;
* the selected raw logits (NaN kept), minus slot 0's; :func:`isoaudit.kernels.cpu.exp` op for op (clamp,
  the scaled round, the Cody-Waite reduction, Horner with one rounding per step, the exponent
  add, the edge cases), every constant the fp32 value torch rounds the Python scalar to;
* ``den`` summed over the slots left to right (``norm_topk_prob``), or the fixed tree of
  :func:`isoaudit.kernels.cpu.tree_sum` over all experts, then IEEE division (``tl.div_rn``: Triton's
  ``/`` on fp32 is an approximate division on NVIDIA GPUs).

Compiled with ``enable_fp_fusion=False``, so no multiply and add contract into an FMA. Rows are
independent (blocks of rows per program): a row's results do not depend on the batch.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ._triton import HAVE_TRITON, CachedLauncher, aligned, cdiv, jit, next_power_of_2, tl, triton

MAX_EXPERTS = 4096  # wider rows take the torch path (one row of int64 keys per program)


def _f32(c: float) -> float:
    """The fp32 value torch computes with when a Python scalar meets an fp32 tensor."""
    return float(np.float32(c))


# isoaudit.kernels.cpu.exp's constants, as torch's fp32 ops see them
_LOG2E = _f32(1.4426950408889634)
_LN2_HI = _f32(0.693359375)
_LN2_LO = _f32(-2.12194440e-4)
_C = [_f32(1.0 / math.factorial(k)) for k in range(7, -1, -1)]
_LO_EDGE, _HI_EDGE = _f32(-86.6), _f32(88.72)
_ROUND = 12582912.0  # 1.5 * 2^23: (y + R) - R is rint(y) for |y| < 2^22 (the reduced y is < 128)
_FLT_MAX = float(np.finfo(np.float32).max)

if HAVE_TRITON:
    LOG2E: tl.constexpr = tl.constexpr(_LOG2E)
    LN2_HI: tl.constexpr = tl.constexpr(_LN2_HI)
    LN2_LO: tl.constexpr = tl.constexpr(_LN2_LO)
    C0: tl.constexpr = tl.constexpr(_C[0])
    C1: tl.constexpr = tl.constexpr(_C[1])
    C2: tl.constexpr = tl.constexpr(_C[2])
    C3: tl.constexpr = tl.constexpr(_C[3])
    C4: tl.constexpr = tl.constexpr(_C[4])
    C5: tl.constexpr = tl.constexpr(_C[5])
    C6: tl.constexpr = tl.constexpr(_C[6])
    C7: tl.constexpr = tl.constexpr(_C[7])
    LO_EDGE: tl.constexpr = tl.constexpr(_LO_EDGE)
    HI_EDGE: tl.constexpr = tl.constexpr(_HI_EDGE)
    ROUND: tl.constexpr = tl.constexpr(_ROUND)
    FLT_MAX: tl.constexpr = tl.constexpr(_FLT_MAX)

    @triton.jit
    def _ieee_exp(x):
        """:func:`isoaudit.kernels.cpu.exp` op for op (each step rounds: the kernel has no FMA fusion)."""
        xc = tl.minimum(tl.maximum(x, -87.0), 88.5)  # NaN lanes are replaced below
        y = xc * LOG2E
        n = (y + ROUND) - ROUND  # torch.round (half to even): |y| < 128
        r = (xc - n * LN2_HI) - n * LN2_LO
        p = r * C0
        p = p + C1
        p = p * r
        p = p + C2
        p = p * r
        p = p + C3
        p = p * r
        p = p + C4
        p = p * r
        p = p + C5
        p = p * r
        p = p + C6
        p = p * r
        p = p + C7
        p = (p.to(tl.int32, bitcast=True) + (n.to(tl.int32) << 23)).to(tl.float32, bitcast=True)
        return tl.where(x < LO_EDGE, 0.0, tl.where(x > HI_EDGE, float("inf"), tl.where(x == x, p, x)))

    @jit(do_not_specialize=["T"])
    def _router_kernel(
        logits,
        experts,
        weights,
        T,
        E,
        stride_l,
        K: tl.constexpr,
        K_P2: tl.constexpr,
        E_P2: tl.constexpr,
        BLOCK_T: tl.constexpr,
        NORM: tl.constexpr,
        LOG_E: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        rows64 = rows.to(tl.int64)
        cols = tl.arange(0, E_P2)
        col_ok = cols < E
        base = logits + rows64 * stride_l
        z = tl.load(base[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        # _order_key: nan_to_num(z + 0, nan=-inf) then monotone int bits, ties to the lower index
        zn = tl.where(z == 0.0, 0.0, z)
        zn = tl.where(zn == float("inf"), FLT_MAX, zn)
        zn = tl.where(zn == float("-inf"), -FLT_MAX, zn)
        zn = tl.where(zn != zn, float("-inf"), zn)
        b = zn.to(tl.int32, bitcast=True)
        ordered = tl.where(b >= 0, b, -(b & 0x7FFFFFFF) - 1).to(tl.int64)
        key = ordered * 65536 + (65535 - cols[None, :]).to(tl.int64)
        lowest = -9223372036854775807 - 1
        key = tl.where(col_ok[None, :], key, lowest)
        slots = tl.arange(0, K_P2)
        # slot 0: the best logit m; every exponent is l_j - m
        best = tl.max(key, axis=1)
        idx = 65535 - (best & 65535)
        tl.store(experts + rows64 * K, idx, mask=row_ok)
        key = tl.where(cols[None, :] == idx[:, None], lowest, key)
        m = tl.load(base + idx, mask=row_ok, other=0.0)
        p = _ieee_exp(m - m)
        ps = tl.where(slots[None, :] == 0, p[:, None], 0.0)
        den = p
        for s in tl.static_range(1, K):
            best = tl.max(key, axis=1)
            idx = 65535 - (best & 65535)
            tl.store(experts + rows64 * K + s, idx, mask=row_ok)
            key = tl.where(cols[None, :] == idx[:, None], lowest, key)
            v = tl.load(base + idx, mask=row_ok, other=0.0)
            p = _ieee_exp(v - m)
            ps = tl.where(slots[None, :] == s, p[:, None], ps)
            den = den + p  # slot order, left to right
        if not NORM:  # isoaudit.kernels.cpu.tree_sum over all experts: the upper half onto the lower
            q = tl.where(col_ok[None, :], _ieee_exp(z - m[:, None]), 0.0)
            for lvl in tl.static_range(LOG_E):
                q = tl.sum(tl.reshape(q, (BLOCK_T, 2, E_P2 >> (lvl + 1))), axis=1)
            den = tl.reshape(q, (BLOCK_T,))
        w = tl.div_rn(ps, den[:, None])
        tl.store(
            weights + rows64[:, None] * K + slots[None, :], w, mask=row_ok[:, None] & (slots[None, :] < K)
        )

    _LAUNCH = CachedLauncher(_router_kernel)


def supported(logits: torch.Tensor, top_k: int) -> bool:
    """Whether :func:`route_logits` takes these logits (else the torch path)."""
    return HAVE_TRITON and logits.dtype == torch.float32 and 1 <= top_k <= logits.shape[-1] <= MAX_EXPERTS


def route_logits(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts (T, k) int64 best first, weights (T, k) fp32) of fp32 logits (T, E): the bits of
    :func:`isoaudit.kernels.moe.stable_topk` and the torch weights of :func:`isoaudit.kernels.moe.route`. Forward
    only (no autograd)."""
    t, e = logits.shape
    lg = logits if logits.stride(-1) == 1 else logits.contiguous()
    experts = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t == 0:
        return experts, weights
    e_p2 = next_power_of_2(e)
    block_t = max(1, min(64, 2048 // e_p2))
    args = (lg, experts, weights, t, e, lg.stride(0))
    cx = dict(
        K=top_k,
        K_P2=next_power_of_2(top_k),
        E_P2=e_p2,
        BLOCK_T=block_t,
        NORM=bool(norm_topk_prob),
        LOG_E=e_p2.bit_length() - 1,
    )
    key = (e, lg.stride(0), top_k, bool(norm_topk_prob), aligned(lg, experts, weights), lg.device)
    _LAUNCH(key, (cdiv(t, block_t), 1, 1), args, cx, num_warps=4, enable_fp_fusion=False)
    return experts, weights
