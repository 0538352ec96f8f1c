"""Row-wise elementwise kernels for the transcendental activations (SiLU, GDN gates).

Why: a torch CPU elementwise kernel evaluates the vector body and the scalar tail with different
exp/sigmoid code, so an element's bits depend on where it falls in the tensor, i.e. on the batch.
(CUDA's elementwise kernels do not have that problem.) One program per row over a block fixed by
the row width puts element ``j`` of a row in lane ``j`` whatever the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, jit, next_power_of_2, resolve, tl

if HAVE_TRITON:

    @jit(do_not_specialize=["n_rows"])
    def _silu_kernel(x_ptr, y_ptr, n_rows, D, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < D
        x = tl.load(x_ptr + row * D + cols, mask=ok, other=0.0).to(tl.float32)
        y = x / (1.0 + tl.exp(-x))
        tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=ok)

    @jit(do_not_specialize=["n_rows"])
    def _gates_kernel(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, n_rows, H, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < H
        a = tl.load(a_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * H + cols, mask=ok, other=0.0).to(tl.float32)
        alog = tl.load(alog_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        dtb = tl.load(dtb_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        z = a + dtb
        sp = tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
        tl.store(g_ptr + row * H + cols, -tl.exp(alog) * sp, mask=ok)
        tl.store(beta_ptr + row * H + cols, 1.0 / (1.0 + tl.exp(-b)), mask=ok)


def silu(x: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """SiLU computed in fp32 and rounded once to x's dtype."""
    if resolve(impl, x) == "torch":
        return F.silu(x.float()).to(x.dtype)
    xc = x.contiguous()
    d = x.shape[-1]
    y = torch.empty_like(xc)
    n = xc.numel() // d if d else 0
    if n:
        _silu_kernel[(n,)](xc, y, n, d, BLOCK=next_power_of_2(d), num_warps=4)
    return y


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, impl: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN decay and write strength from the (T, H) projections: ``g = -exp(A_log) * softplus(a +
    dt_bias)`` (log-space decay, <= 0) and ``beta = sigmoid(b)``, both fp32."""
    if resolve(impl, a) == "torch":
        g = -torch.exp(a_log.float()) * F.softplus(a.float() + dt_bias.float())
        return g, torch.sigmoid(b.float())
    ac, bc = a.contiguous(), b.contiguous()
    t, h = ac.shape
    g = torch.empty(t, h, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if t:
        _gates_kernel[(t,)](
            ac,
            bc,
            a_log.contiguous(),
            dt_bias.contiguous(),
            g,
            beta,
            t,
            h,
            BLOCK=max(16, next_power_of_2(h)),
            num_warps=1,
        )
    return g, beta


class _Silu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return silu(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x.float())
        return (grad.float() * s * (1 + x.float() * (1 - s))).to(x.dtype)


class _Gates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, a_log, dt_bias):
        ctx.save_for_backward(a, b, a_log, dt_bias)
        return gdn_gates(a, b, a_log, dt_bias)

    @staticmethod
    def backward(ctx, gg, gbeta):
        a, b, a_log, dt_bias = ctx.saved_tensors
        with torch.enable_grad():
            ins = [t.detach().requires_grad_(True) for t in (a, b, a_log, dt_bias)]
            outs = gdn_gates(*ins, impl="torch")
            grads = torch.autograd.grad(outs, ins, (gg, gbeta), allow_unused=True)
        return tuple(
            None if g is None else g.to(t.dtype) for g, t in zip(grads, (a, b, a_log, dt_bias), strict=True)
        )


def silu_autograd(x: torch.Tensor) -> torch.Tensor:
    return _Silu.apply(x)


def gdn_gates_autograd(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _Gates.apply(a, b, a_log, dt_bias)
