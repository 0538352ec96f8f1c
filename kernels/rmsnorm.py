"""RMSNorm (and the fused residual add), one program per row with a fixed reduction tree.

Why it is invariant: a row is reduced by one program over a power-of-two block fixed by the
hidden size, so its bits never depend on the number of rows. The fused variant rounds ``x + r`` to
the activation dtype first (that rounded sum is the new residual stream) and normalises that, so
it equals the unfused "add, then norm" bit for bit. ``l2`` mode (sum instead of mean, no weight)
serves the q/k normalisation of Gated DeltaNet.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, jit, next_power_of_2, resolve, tl

if HAVE_TRITON:

    @jit(do_not_specialize=["n_rows"])
    def _rmsnorm_kernel(
        x_ptr,
        r_ptr,
        w_ptr,
        y_ptr,
        ro_ptr,
        n_rows,
        D,
        eps,
        stride_x,
        stride_r,
        stride_y,
        stride_ro,
        HAS_RES: tl.constexpr,
        HAS_W: tl.constexpr,
        L2: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        if HAS_RES:
            r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(ro_ptr + row * stride_ro + cols, x, mask=ok)
        xf = x.to(tl.float32)
        ss = tl.sum(xf * xf, axis=0)
        if L2:
            inv = 1.0 / tl.sqrt(ss + eps)
        else:
            inv = 1.0 / tl.sqrt(ss / D + eps)
        y = (xf * inv).to(x_ptr.dtype.element_ty)
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=ok, other=0.0)
            y = (y.to(tl.float32) * w.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


def _reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, l2: bool) -> torch.Tensor:
    xf = x.float()
    ss = (xf * xf).sum(-1, keepdim=True)
    inv = 1.0 / torch.sqrt(ss + eps) if l2 else 1.0 / torch.sqrt(ss / x.shape[-1] + eps)
    y = (xf * inv).to(x.dtype)
    if weight is not None:
        y = (y.float() * weight.float()).to(torch.promote_types(x.dtype, weight.dtype))
    return y


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    l2: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The arithmetic the kernel defines: optional ``x + residual`` rounded to x's dtype, fp32
    sum of squares, ``1/sqrt(mean + eps)``, round to x's dtype, times the weight in fp32, round."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
        return _reference(x, weight, eps, l2), x
    return _reference(x, weight, eps, l2)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
    l2: bool = False,
    impl: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Batch-invariant RMSNorm over the last dim; with ``residual``, returns (normed, new residual)."""
    if resolve(impl, x) == "torch":
        return rms_norm_reference(x, weight, eps, residual, l2)
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out_dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    r2 = residual.reshape(-1, d).contiguous() if residual is not None else x2
    ro = torch.empty_like(x2) if residual is not None else x2
    n = x2.shape[0]
    if n:
        block = next_power_of_2(d)
        _rmsnorm_kernel[(n,)](
            x2,
            r2,
            weight if weight is not None else x2,
            y,
            ro,
            n,
            d,
            eps,
            x2.stride(0),
            r2.stride(0),
            y.stride(0),
            ro.stride(0),
            HAS_RES=residual is not None,
            HAS_W=weight is not None,
            L2=l2,
            BLOCK=block,
            num_warps=4 if block <= 2048 else 8,
        )
    y = y.reshape(x.shape)
    if residual is not None:
        return y, ro.reshape(x.shape)
    return y


class _RMSNorm(torch.autograd.Function):
    """Forward through the invariant kernel, backward by differentiating the torch reference."""

    @staticmethod
    def forward(ctx, x, weight, eps, l2):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.l2 = eps, l2
        return rms_norm(x, weight, eps, l2=l2)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            xd = x.detach().requires_grad_(ctx.needs_input_grad[0])
            wd = weight.detach().requires_grad_(ctx.needs_input_grad[1]) if weight is not None else None
            xf = xd.float()
            ss = (xf * xf).sum(-1, keepdim=True)
            inv = torch.rsqrt(ss + ctx.eps) if ctx.l2 else torch.rsqrt(ss / x.shape[-1] + ctx.eps)
            y = xf * inv
            if wd is not None:
                y = y * wd.float()
            inputs = [t for t in (xd, wd) if t is not None and t.requires_grad]
            grads = torch.autograd.grad(y, inputs, grad.float()) if inputs else ()
        it = iter(grads)
        gx = next(it).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = next(it).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        return gx, gw, None, None


def rms_norm_autograd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, l2: bool = False
) -> torch.Tensor:
    """Autograd-aware invariant RMSNorm (no fused residual: autograd sees the add separately)."""
    return _RMSNorm.apply(x, weight, eps, l2)
