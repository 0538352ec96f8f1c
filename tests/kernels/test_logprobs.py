"""fp32 lm_head + log_softmax + gather of sampled-token logprobs: batch-invariant."""

from __future__ import annotations

import pytest
import torch
from isoaudit.kernels.logprobs import (
    log_softmax,
    token_logprobs,
    token_logprobs_autograd,
    token_logprobs_reference,
)

from .conftest import bits_equal, gpu, needs_triton

pytestmark = needs_triton


def test_invariant_cpu(dev: str) -> None:
    torch.manual_seed(0)
    h, w = torch.randn(33, 48, device=dev), torch.randn(2100, 48, device=dev)
    tok = torch.randint(0, 2100, (33,), device=dev)
    full = token_logprobs(h, w, tok, impl="triton")
    for n in (1, 2, 5, 32):
        assert bits_equal(token_logprobs(h[:n], w, tok[:n], impl="triton"), full[:n])
    ref = torch.log_softmax(h @ w.T, -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(full, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(full, token_logprobs_reference(h, w, tok), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        log_softmax(h @ w.T, impl="triton"), torch.log_softmax(h @ w.T, -1), rtol=1e-5, atol=1e-5
    )


def test_autograd(dev: str) -> None:
    h = torch.randn(7, 32, device=dev, requires_grad=True)
    w = torch.randn(300, 32, device=dev, requires_grad=True)
    tok = torch.randint(0, 300, (7,), device=dev)
    token_logprobs_autograd(h, w, tok).sum().backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.log_softmax(h2 @ w2.T, -1).gather(1, tok[:, None]).sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-4)


@gpu
def test_invariant_gpu() -> None:
    torch.manual_seed(0)
    h = torch.randn(2048, 1024, device="cuda").bfloat16()
    w = (torch.randn(151_936, 1024, device="cuda") / 32).bfloat16()
    tok = torch.randint(0, w.shape[0], (2048,), device="cuda")
    full = token_logprobs(h, w, tok)
    for n in (1, 3, 16, 255, 256, 257, 2047):
        assert bits_equal(token_logprobs(h[:n], w, tok[:n]), full[:n]), n
    perm = torch.randperm(2048, device="cuda")
    assert bits_equal(token_logprobs(h[perm], w, tok[perm]), full[perm])
    ref = torch.log_softmax(h.double() @ w.double().T, -1).gather(1, tok[:, None])[:, 0]
    assert (full.double() - ref).abs().max().item() < 1e-3


def test_autograd_row_chunks(dev: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head that keeps its logits (what the exact CPU head builds on) builds their gradient in
    row chunks: the chunking changes nothing."""
    import isoaudit.kernels.logprobs as lp

    h = torch.randn(11, 32, device=dev, requires_grad=True)
    w = torch.randn(300, 32, device=dev, requires_grad=True)
    tok = torch.randint(0, 300, (11,), device=dev)
    lp._TokenLogprobs.apply(h, w, tok).sum().backward()
    want_h, want_w = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    monkeypatch.setattr(lp, "BACKWARD_ROWS", 3)
    lp._TokenLogprobs.apply(h, w, tok).sum().backward()
    torch.testing.assert_close(h.grad, want_h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, want_w, rtol=1e-5, atol=1e-5)


@gpu
def test_backward_at_trainer_size_gpu() -> None:
    """64 x 255 completion rows over a 151,936 vocabulary (2.5e9 logits: one block of that size
    failed in cuBLAS): the backward runs and matches the native bf16 head's gradient."""
    torch.manual_seed(0)
    h = (torch.randn(64 * 255, 896, device="cuda") / 4).bfloat16().requires_grad_()
    w = (torch.randn(151_936, 896, device="cuda") / 30).bfloat16().requires_grad_()
    tok = torch.randint(0, w.shape[0], (h.shape[0],), device="cuda")
    token_logprobs_autograd(h, w, tok).sum().backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.log_softmax((h2 @ w2.T).float(), -1).gather(1, tok[:, None]).sum().backward()
    for got, want in ((h.grad, h2.grad), (w.grad, w2.grad)):
        rel = (got.float() - want.float()).norm() / want.float().norm()
        assert rel < 2e-2, rel
