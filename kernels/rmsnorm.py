"""RMSNorm (and the fused residual add), one program per row with a fixed reduction tree.

Why it is invariant: a row is reduced by one program over a power-of-two block fixed by the
hidden size, so its bits never depend on the number of rows. The fused variant rounds ``x + r`` to
the activation dtype first (that rounded sum is the new residual stream) and normalises that, so
it equals the unfused "add, then norm" bit for bit. ``l2`` mode (sum instead of mean, no weight)
serves the q/k normalisation of Gated DeltaNet.
"""

from __future__ import annotations

import warnings

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

    @jit(do_not_specialize=["n_rows"])
    def _rmsnorm_bwd_kernel(
        x_ptr, w_ptr, g_ptr, gx_ptr, gw_ptr, n_rows, D, eps, stride_x, stride_g, stride_gx,
        HAS_W: tl.constexpr, L2: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    ):  # fmt: skip
        """``ROWS`` rows per program, in order: the input gradient of each row, and (with a
        weight) the program's partial weight gradient, summed over its rows in order."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK,), tl.float32)
        for i in range(ROWS):
            row = (pid * ROWS + i).to(tl.int64)
            m = ok & ((tl.zeros((BLOCK,), tl.int64) + row) < n_rows)
            x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
            ss = tl.sum(x * x, axis=0)
            if L2:
                inv = 1.0 / tl.sqrt(ss + eps)
            else:
                inv = 1.0 / tl.sqrt(ss / D + eps)
            xhat = x * inv
            if HAS_W:
                gy = g * w
                acc += g * xhat
            else:
                gy = g
            dot = tl.sum(gy * xhat, axis=0)
            if L2:
                gx = inv * (gy - xhat * dot)
            else:
                gx = inv * (gy - xhat * (dot / D))
            tl.store(gx_ptr + row * stride_gx + cols, gx.to(gx_ptr.dtype.element_ty), mask=m)
        if HAS_W:
            tl.store(gw_ptr + pid * BLOCK + cols, acc, mask=ok)


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
    """Forward through the invariant kernel; backward by :func:`rms_norm_backward` (Triton) on
    CUDA, elsewhere by differentiating the torch reference."""

    @staticmethod
    def forward(ctx, x, weight, eps, l2):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.l2 = eps, l2
        return rms_norm(x, weight, eps, l2=l2)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gx = gw = None
        if x.is_cuda and resolve(None, x) == "triton" and not _FAILED:
            try:
                gx, gw = rms_norm_backward(x, weight, grad, ctx.eps, ctx.l2)
            except Exception as exc:  # noqa: BLE001 - a kernel that does not build here: the reference serves
                _backward_failed(exc)
        if gx is None:
            gx, gw = _backward_reference(x, weight, grad, ctx.eps, ctx.l2)
        return (
            gx if ctx.needs_input_grad[0] else None,
            gw if weight is not None and ctx.needs_input_grad[1] else None,
            None,
            None,
        )


_FAILED = False


def _backward_failed(exc: Exception) -> None:
    """Remember (and say once) that the Triton backward could not run here."""
    global _FAILED
    _FAILED = True
    warnings.warn(
        f"isoaudit.kernels.rmsnorm: the Triton backward failed ({exc!r}); using the reference", stacklevel=3
    )


#: Rows one backward program walks (its partial weight gradient covers them).
BACKWARD_ROWS = 16


def rms_norm_backward(
    x: torch.Tensor, weight: torch.Tensor | None, grad: torch.Tensor, eps: float, l2: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of the fp32 RMSNorm (``x * inv * w``, the forward's roundings not
    differentiated) in one pass: ``gx = inv * (gw - xhat * mean(gw * xhat))`` per row (sum for
    ``l2``), and the weight's gradient as per-program partials summed in a fixed order."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d).contiguous()
    g2 = grad.reshape(-1, d).contiguous()
    n = x2.shape[0]
    gx = torch.empty_like(x2)
    block = next_power_of_2(d)
    programs = max(1, -(-n // BACKWARD_ROWS))
    partial = torch.empty(programs, block, dtype=torch.float32, device=x.device) if weight is not None else gx
    if n:
        _rmsnorm_bwd_kernel[(programs,)](
            x2, weight if weight is not None else x2, g2, gx, partial, n, d, eps,
            x2.stride(0), g2.stride(0), gx.stride(0),
            HAS_W=weight is not None, L2=l2, BLOCK=block, ROWS=BACKWARD_ROWS,
            num_warps=4 if block <= 2048 else 8,
        )  # fmt: skip
    gw = None
    if weight is not None:
        gw = (partial[:, :d].sum(0) if n else torch.zeros(d, device=x.device)).to(weight.dtype)
    return gx.reshape(x.shape), gw


def _backward_reference(
    x: torch.Tensor, weight: torch.Tensor | None, grad: torch.Tensor, eps: float, l2: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same gradients by autograd through the fp32 torch reference."""
    with torch.enable_grad():
        xd = x.detach().requires_grad_(True)
        wd = weight.detach().requires_grad_(True) if weight is not None else None
        xf = xd.float()
        ss = (xf * xf).sum(-1, keepdim=True)
        inv = torch.rsqrt(ss + eps) if l2 else torch.rsqrt(ss / x.shape[-1] + eps)
        y = xf * inv
        if wd is not None:
            y = y * wd.float()
        inputs = [t for t in (xd, wd) if t is not None]
        grads = torch.autograd.grad(y, inputs, grad.float())
    gw = grads[1].to(weight.dtype) if weight is not None else None
    return grads[0].to(x.dtype), gw


def rms_norm_autograd(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6, l2: bool = False
) -> torch.Tensor:
    """Autograd-aware invariant RMSNorm (no fused residual: autograd sees the add separately)."""
    return _RMSNorm.apply(x, weight, eps, l2)
