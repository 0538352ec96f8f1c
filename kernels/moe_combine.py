"""The MoE combine in one launch: ``out[t] = round(sum_s w[t, s] * y[row(t, s)])``.

The arithmetic is exactly :func:`isoaudit.kernels.moe.combine`'s torch ops, element by element: fp32, the
first term one rounded product ``w0 * y0``, then ``acc = acc + w_s * y_s`` for s = 1..k-1 in
order, each a rounded multiply then a rounded add (compiled with ``enable_fp_fusion=False``: no
FMA contraction), and one round-to-nearest-even cast to the output dtype. ``rows`` (T*k,) optional
gathers the (token, slot) row from expert-sorted outputs (the ``_place`` step fused in).
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, CachedLauncher, aligned, cdiv, jit, tl

BLOCK_H = 1024

if HAVE_TRITON:

    @jit()
    def _combine_kernel(
        y,
        w,
        rows,
        out,
        H,
        stride_y,
        stride_w,
        stride_o,
        K: tl.constexpr,
        GATHER: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < H
        if GATHER:
            r = tl.load(rows + t * K).to(tl.int64)
        else:
            r = t * K
        acc = tl.load(w + t * stride_w) * tl.load(y + r * stride_y + offs, mask=ok, other=0.0).to(tl.float32)
        for s in tl.static_range(1, K):
            if GATHER:
                r = tl.load(rows + t * K + s).to(tl.int64)
            else:
                r = t * K + s
            p = tl.load(w + t * stride_w + s) * tl.load(y + r * stride_y + offs, mask=ok, other=0.0).to(
                tl.float32
            )
            acc = acc + p
        tl.store(out + t * stride_o + offs, acc.to(out.dtype.element_ty), mask=ok)

    _LAUNCH = CachedLauncher(_combine_kernel)


def combine_rows(
    y: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """(T, H) in ``dtype``: token t's slot-s output is ``y[rows[t*k+s]]`` (``y`` (R, H)), or with
    ``rows`` None ``y`` is (T, k, H) in place. Bits of :func:`isoaudit.kernels.moe.combine`. Forward only."""
    t, k = weights.shape
    h = y.shape[-1]
    y2 = y.reshape(-1, h)
    if y2.stride(-1) != 1:
        y2 = y2.contiguous()
    w = weights if weights.dtype == torch.float32 else weights.float()
    w = w if w.stride(-1) == 1 else w.contiguous()
    out = torch.empty(t, h, dtype=dtype, device=y.device)
    if t == 0 or h == 0:
        return out
    gather = rows is not None
    rows_arg = rows if rows is not None else w
    args = (y2, w, rows_arg, out, h, y2.stride(0), w.stride(0), out.stride(0))
    cx = dict(K=k, GATHER=gather, BLOCK=BLOCK_H)
    key = (y2.dtype, dtype, rows_arg.dtype, *args[4:], k, gather, aligned(y2, w, rows_arg, out), y.device)
    _LAUNCH(key, (t, cdiv(h, BLOCK_H), 1), args, cx, num_warps=4, enable_fp_fusion=False)
    return out
