"""Token logprobs in one pass over vocabulary slabs per row block: the whole head's bits for any
row block and slab, gradients that match the head that keeps its logits, and no [tokens x vocab]
tensor anywhere in the forward or the backward."""

from __future__ import annotations

import pytest
import torch
from isoaudit.kernels import fused_logprobs as FL
from isoaudit.kernels.fused_logprobs import BLOCK_V, fused_token_logprobs, native_chunked_token_logprobs
from isoaudit.kernels.gemm import REFERENCE_ROWS
from isoaudit.kernels.logprobs import (
    _TokenLogprobs,
    lm_head_logits,
    logsumexp_rows,
    token_logprobs,
    token_logprobs_reference,
)
from torch.utils._python_dispatch import TorchDispatchMode

from .conftest import bits_equal, gpu, needs_triton


def _previous_lse_reference(z: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """The log-sum-exp of the head before it ran in slabs, verbatim: lane-wise online max/sum over
    BLOCK_V slabs of the whole row, then the lanes (kept here to prove the slabs keep its bits)."""
    t, v = z.shape
    m = torch.full((t, block), float("-inf"), device=z.device)
    s = torch.zeros(t, block, device=z.device)
    for v0 in range(0, v, block):
        zz = torch.full((t, block), float("-inf"), device=z.device)
        w = min(block, v - v0)
        zz[:, :w] = z[:, v0 : v0 + w]
        m_new = torch.maximum(m, zz)
        safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        s = s * torch.exp(m - safe) + torch.exp(zz - safe)
        m = m_new
    mx = m.max(-1).values
    tot = torch.where(m == float("-inf"), torch.zeros_like(s), s * torch.exp(m - mx[:, None])).sum(-1)
    return mx + torch.log(tot)


def _inputs(t: int = 40, h: int = 48, v: int = 5000, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(t, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5 * 4  # logits spread over ~±10
    tokens = torch.randint(0, v, (t,), generator=g)
    tokens[:3] = torch.tensor([0, v - 1, (v - 1) // BLOCK_V * BLOCK_V])  # first, last, a slab's first column
    return hidden, weight, tokens


def test_same_bits_as_the_whole_head_reference() -> None:
    """The torch reference: every slab and row block gives the bits of the unchunked head, the
    previous release's log-sum-exp included (a vocabulary of 5,000: the last lane block is
    partial). Row blocks of several rows: the reference's products are the CPU BLAS's, which takes
    another path for a single row (the Triton kernels are batch-invariant down to one row, below)."""
    hidden, weight, tokens = _inputs()
    z = lm_head_logits(hidden, weight, impl="torch")
    previous = z.gather(1, tokens[:, None])[:, 0] - _previous_lse_reference(z)
    assert bits_equal(token_logprobs_reference(hidden, weight, tokens), previous)
    for rows, slab in [(8, BLOCK_V), (7, 2 * BLOCK_V), (20, 3 * BLOCK_V), (40, BLOCK_V), (None, None)]:
        got = fused_token_logprobs(hidden, weight, tokens, impl="torch", rows=rows, slab=slab)
        assert bits_equal(got, previous), (rows, slab)
    ref = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(1, tokens[:, None])[:, 0]
    assert (previous.double() - ref).abs().max().item() < 1e-4


@needs_triton
def test_same_bits_as_the_whole_head_triton() -> None:
    """The Triton kernels (fp32, interpreter): every (rows, slab) gives the bits of the whole
    head's GEMM and a log-sum-exp over whole rows, and those are the previous release's lanes."""
    hidden, weight, tokens = _inputs(t=9, v=2100)
    z = lm_head_logits(hidden, weight, impl="triton")
    lse = logsumexp_rows(z, impl="triton")
    whole = z.gather(1, tokens[:, None])[:, 0] - lse
    torch.testing.assert_close(lse, _previous_lse_reference(z), rtol=1e-6, atol=1e-6)
    for rows, slab in [(1, BLOCK_V), (4, 2 * BLOCK_V), (None, None)]:
        got = fused_token_logprobs(hidden, weight, tokens, impl="triton", rows=rows, slab=slab)
        assert bits_equal(got, whole), (rows, slab)
    assert bits_equal(token_logprobs(hidden, weight, tokens, impl="triton"), whole)
    torch.testing.assert_close(whole, token_logprobs_reference(hidden, weight, tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=needs_triton)])
def test_gradients_match_the_head_that_keeps_its_logits(impl: str) -> None:
    """The backward recomputes each slab: gradients of hidden and weight agree with the unfused
    head's (softmax from its saved logits) and with float64 autograd, for any chunking."""
    hidden, weight, tokens = _inputs(t=10, v=2100)
    upstream = torch.randn(10, generator=torch.Generator().manual_seed(1))
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    (torch.log_softmax(h64 @ w64.T, -1).gather(1, tokens[:, None])[:, 0] * upstream.double()).sum().backward()
    h0, w0 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    (_TokenLogprobs.apply(h0, w0, tokens) * upstream).sum().backward()
    for rows, slab in [(3, BLOCK_V), (None, None)]:
        h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fused_token_logprobs(h1, w1, tokens, impl=impl, rows=rows, slab=slab)
        (out * upstream).sum().backward()
        for got, kept, want in ((h1.grad, h0.grad, h64.grad), (w1.grad, w0.grad, w64.grad)):
            torch.testing.assert_close(got, kept, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


@pytest.mark.parametrize("native", [False, True])
def test_no_tokens_by_vocabulary_tensor(native: bool) -> None:
    """Forward and backward at 40 tokens over a 5,000 vocabulary in blocks of 8 rows and slabs of
    1,024 columns: no tensor but the weight and its gradient spans the vocabulary, and none holds
    more logits than one block's slab."""
    hidden, weight, tokens = _inputs()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with _Shapes() as seen:
        if native:
            out = native_chunked_token_logprobs(h, w, tokens, rows=8, slab=BLOCK_V)
        else:
            out = fused_token_logprobs(h, w, tokens, impl="torch", rows=8, slab=BLOCK_V)
        out.sum().backward()
    t, v, k = tokens.shape[0], weight.shape[0], hidden.shape[1]
    padded = -(-8 // REFERENCE_ROWS) * REFERENCE_ROWS  # the torch reference GEMM pads a block's rows
    assert seen.shapes
    for shape in seen.shapes:
        if shape == (v, k):  # the weight, its fp32 gradient
            continue
        assert v not in shape, shape
        if shape[-1:] == (k,):  # hidden rows, a block of them
            assert shape[0] in (t, 8, t % 8, padded, BLOCK_V, v % BLOCK_V) or len(shape) == 1, shape
        elif len(shape) == 2 and any(a in (BLOCK_V, v % BLOCK_V) and b <= k for a, b in (shape, shape[::-1])):
            continue  # a slab of the weight, a BLOCK_K piece of it, or its transpose
        else:  # logits and their gradient: one (padded) block's slab at most
            assert torch.Size(shape).numel() <= max(8, padded) * BLOCK_V, shape


def test_native_chunked_is_the_stock_head() -> None:
    """The bench's native baseline: the model-dtype head and torch's log-softmax, chunked."""
    hidden, weight, tokens = _inputs(t=12, v=2300)
    hb, wb = hidden.bfloat16(), weight.bfloat16()
    want = torch.log_softmax((hb @ wb.T).float(), -1).gather(1, tokens[:, None])[:, 0]
    got = native_chunked_token_logprobs(hb, wb, tokens, rows=5, slab=BLOCK_V)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_slab_is_whole_lane_blocks() -> None:
    hidden, weight, tokens = _inputs(t=4, v=2300)
    with pytest.raises(ValueError, match="slab: 1000 columns is not a multiple of BLOCK_V"):
        fused_token_logprobs(hidden, weight, tokens, impl="torch", slab=1000)
    assert FL._chunks(32_768, 151_936, None, None) == (4096, 16 * BLOCK_V)  # 256 MiB of logits a slab
    assert FL._chunks(16, 151_936, None, None) == (16, 149 * BLOCK_V)  # a decode batch: one slab


@gpu
def test_same_bits_and_gradients_gpu() -> None:
    """The 0.5B head (hidden 896, vocab 151,936) in bf16: the fused path's logprobs are the whole
    head's bits (its GEMM, a log-sum-exp over whole rows) and the previous release's lanes for
    every chunking, batch-invariant; its gradients match the head that keeps its logits."""
    torch.manual_seed(0)
    h = (torch.randn(3000, 896, device="cuda") / 4).bfloat16()
    w = (torch.randn(151_936, 896, device="cuda") / 30).bfloat16()
    tok = torch.randint(0, w.shape[0], (3000,), device="cuda")
    z = lm_head_logits(h, w)
    whole = z.gather(1, tok[:, None])[:, 0] - logsumexp_rows(z)
    for rows, slab in [(1, BLOCK_V), (257, 4 * BLOCK_V), (2048, 16 * BLOCK_V), (None, None)]:
        assert bits_equal(fused_token_logprobs(h, w, tok, rows=rows, slab=slab), whole), (rows, slab)
    for n in (1, 16, 255, 2999):
        assert bits_equal(token_logprobs(h[:n], w, tok[:n]), whole[:n]), n
    torch.testing.assert_close(logsumexp_rows(z), _previous_lse_reference(z), rtol=2e-6, atol=2e-6)
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    fused_token_logprobs(h1, w1, tok).sum().backward()
    h0, w0 = h.clone().requires_grad_(), w.clone().requires_grad_()
    _TokenLogprobs.apply(h0, w0, tok).sum().backward()
    for got, want in ((h1.grad, h0.grad), (w1.grad, w0.grad)):
        rel = (got.float() - want.float()).norm() / want.float().norm()
        assert rel < 1e-2, rel
