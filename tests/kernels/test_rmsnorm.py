"""RMSNorm (with the fused residual add): bitwise invariant across 1 to 4,096 tokens."""

from __future__ import annotations

import torch
from isoaudit.kernels.rmsnorm import rms_norm, rms_norm_autograd, rms_norm_reference

from .conftest import bits_equal, gpu, needs_triton

pytestmark = needs_triton


def _check(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, counts: list[int]) -> None:
    y, res = rms_norm(x, w, 1e-6, residual=r, impl="triton")
    y_unfused = rms_norm((x.float() + r.float()).to(x.dtype), w, 1e-6, impl="triton")
    assert bits_equal(y, y_unfused)
    for n in counts:
        yn, rn = rms_norm(x[:n], w, 1e-6, residual=r[:n], impl="triton")
        assert bits_equal(yn, y[:n]) and bits_equal(rn, res[:n]), f"n={n}"
    perm = torch.randperm(x.shape[0], device=x.device)
    assert bits_equal(rms_norm(x[perm], w, 1e-6, residual=r[perm], impl="triton")[0], y[perm])


def test_invariant_cpu(dev: str) -> None:
    torch.manual_seed(0)
    x, r, w = torch.randn(40, 200, device=dev), torch.randn(40, 200, device=dev), torch.randn(200, device=dev)
    _check(x, r, w, [1, 2, 3, 17, 39, 40])
    ref_y, ref_r = rms_norm_reference(x, w, 1e-6, residual=r)
    y, res = rms_norm(x, w, 1e-6, residual=r, impl="triton")
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
    assert bits_equal(res, ref_r)
    torch.testing.assert_close(
        rms_norm(x, None, 1e-6, l2=True, impl="triton"),
        torch.nn.functional.normalize(x, dim=-1),
        rtol=1e-5,
        atol=1e-6,
    )


def test_autograd(dev: str) -> None:
    x = torch.randn(6, 64, device=dev, requires_grad=True)
    w = torch.randn(64, device=dev, requires_grad=True)
    rms_norm_autograd(x, w).square().sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-6) * w2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-4)


@gpu
def test_invariant_gpu() -> None:
    torch.manual_seed(0)
    for d in (4096, 2560):
        x = torch.randn(4096, d, device="cuda").bfloat16()
        r = torch.randn(4096, d, device="cuda").bfloat16()
        w = torch.randn(d, device="cuda").bfloat16()
        _check(x, r, w, [1, 2, 3, 7, 64, 255, 256, 257, 1000, 2048, 4095, 4096])


def test_backward_kernel_matches_autograd(dev: str) -> None:
    """The one-pass backward kernel (rows in programs of BACKWARD_ROWS, weight partials summed in
    order) against autograd through the fp32 reference, with and without a weight, mean and l2."""
    from isoaudit.kernels.rmsnorm import _backward_reference, rms_norm_backward

    torch.manual_seed(0)
    for rows, d in ((37, 200), (5, 64)):
        x, g, w = (
            torch.randn(rows, d, device=dev),
            torch.randn(rows, d, device=dev),
            torch.randn(d, device=dev),
        )
        for weight, l2 in ((w, False), (None, False), (None, True)):
            gx, gw = rms_norm_backward(x, weight, g, 1e-6, l2)
            rx, rw = _backward_reference(x, weight, g, 1e-6, l2)
            torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-5)
            if weight is not None:
                torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-4)


@gpu
def test_backward_gpu() -> None:
    torch.manual_seed(0)
    x = torch.randn(3000, 896, device="cuda").bfloat16().requires_grad_()
    w = torch.randn(896, device="cuda").bfloat16().requires_grad_()
    g = torch.randn(3000, 896, device="cuda").bfloat16()
    rms_norm_autograd(x, w).backward(g)
    x2, w2 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    (x2 * torch.rsqrt(x2.pow(2).mean(-1, keepdim=True) + 1e-6) * w2).backward(g.float())
    for got, want in ((x.grad, x2.grad), (w.grad, w2.grad)):
        assert ((got.float() - want).norm() / want.norm()) < 1e-2
