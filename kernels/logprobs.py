"""fp32 lm_head, log_softmax and the gather of sampled-token logprobs, batch-invariant.

The logits come from the invariant GEMM with fp32 output; each row's log-sum-exp is one program
that walks the vocabulary in fixed BLOCK_V slabs in ascending order with an online (max, sum)
update, so a row's logprob never depends on the batch. The token's logprob is
``logit[token] - (max + log(sum))``.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, jit, resolve, tl
from .gemm import gemm, linear

BLOCK_V = 1024

if HAVE_TRITON:

    @jit(do_not_specialize=["n_rows"])
    def _lse_kernel(
        z_ptr, tok_ptr, lse_ptr, out_ptr, n_rows, V, stride_z, HAS_TOK: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 at ~14k rows of a 152k vocabulary
        cols = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        # Lane-wise online max/sum over the slabs, then one fixed tree across lanes.
        for v0 in range(0, V, BLOCK):
            z = tl.load(z_ptr + row * stride_z + v0 + cols, mask=(v0 + cols) < V, other=float("-inf"))
            m_new = tl.maximum(m, z)
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - safe) + tl.exp(z - safe)
            m = m_new
        mx = tl.max(m, axis=0)
        tot = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - mx)), axis=0)
        lse = mx + tl.log(tot)
        tl.store(lse_ptr + row, lse)
        if HAS_TOK:
            t = tl.load(tok_ptr + row)
            zt = tl.load(z_ptr + row * stride_z + t)
            tl.store(out_ptr + row, zt - lse)


def _lse_reference(z: torch.Tensor, block: int = BLOCK_V) -> torch.Tensor:
    """The kernel's arithmetic in torch: lane-wise online max/sum over BLOCK_V slabs, then lanes."""
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


def logsumexp_rows(logits: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """Per-row log-sum-exp of fp32 logits (T, V), invariant to T."""
    z = logits.float().contiguous()
    if resolve(impl, z) == "torch":
        return _lse_reference(z)
    t, v = z.shape
    lse = torch.empty(t, dtype=torch.float32, device=z.device)
    if t:
        _lse_kernel[(t,)](z, z, lse, lse, t, v, z.stride(0), HAS_TOK=False, BLOCK=BLOCK_V, num_warps=4)
    return lse


def log_softmax(logits: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """Invariant fp32 log_softmax over the last dim."""
    z = logits.float().reshape(-1, logits.shape[-1])
    return (z - logsumexp_rows(z, impl)[:, None]).reshape(logits.shape)


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """fp32 logits from the invariant GEMM (products of the stored weights, fp32 accumulation)."""
    return gemm(hidden, weight, out_dtype=torch.float32, impl=impl)


def token_logprobs_reference(
    hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor
) -> torch.Tensor:
    """Same arithmetic as :func:`token_logprobs`, all in torch."""
    z = lm_head_logits(hidden.reshape(-1, hidden.shape[-1]), weight, impl="torch")
    lse = _lse_reference(z)
    return z.gather(1, tokens.reshape(-1, 1).long())[:, 0] - lse


def token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, impl: str | None = None
) -> torch.Tensor:
    """log p(token) per row of ``hidden`` (T, H): fp32 lm_head, log_softmax, gather; no autograd."""
    h = hidden.reshape(-1, hidden.shape[-1])
    if resolve(impl, h) == "torch":
        return token_logprobs_reference(h, weight, tokens)
    z = lm_head_logits(h, weight, impl)
    t, v = z.shape
    lse = torch.empty(t, dtype=torch.float32, device=z.device)
    out = torch.empty(t, dtype=torch.float32, device=z.device)
    if t:
        tok = tokens.reshape(-1).to(torch.int64).contiguous()
        _lse_kernel[(t,)](z, tok, lse, out, t, v, z.stride(0), HAS_TOK=True, BLOCK=BLOCK_V, num_warps=4)
    return out


#: Rows of the logits' gradient built at once in the backward (each chunk is one fp32 block of
#: ``rows x V`` and one GEMM per weight; bounded so no operand exceeds 2**31 elements).
BACKWARD_ROWS = 8192


def _forward_with_lse(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor):
    """:func:`token_logprobs`'s bits, also returning the fp32 logits and their row log-sum-exp."""
    h = hidden.reshape(-1, hidden.shape[-1])
    if resolve(None, h) == "torch":
        z = lm_head_logits(h, weight, impl="torch")
        lse = _lse_reference(z)
        return z.gather(1, tokens.reshape(-1, 1).long())[:, 0] - lse, z, lse
    z = lm_head_logits(h, weight)
    t, v = z.shape
    lse = torch.empty(t, dtype=torch.float32, device=z.device)
    out = torch.empty(t, dtype=torch.float32, device=z.device)
    if t:
        tok = tokens.reshape(-1).to(torch.int64).contiguous()
        _lse_kernel[(t,)](z, tok, lse, out, t, v, z.stride(0), HAS_TOK=True, BLOCK=BLOCK_V, num_warps=4)
    return out, z, lse


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two model-dtype operands accumulated and returned in fp32."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # torch without out_dtype, or a device without it
        return torch.mm(a, b).float()


class _TokenLogprobs(torch.autograd.Function):
    """The forward is the invariant fp32 head; the backward is what a native trainer's is (the
    forward's bits are what must match the rollout, not the gradient's): softmax from the saved
    fp32 logits, the logits' gradient rounded to the model dtype, and model-dtype GEMMs, in row
    chunks (a single 16k x 152k block overflows cuBLAS's 32-bit sizes)."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens):
        out, z, lse = _forward_with_lse(hidden, weight, tokens)
        ctx.save_for_backward(hidden, weight, tokens, z, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, tokens, z, lse = ctx.saved_tensors
        h = hidden.reshape(-1, hidden.shape[-1])
        g = grad.reshape(-1).float()
        tok = tokens.reshape(-1).long()
        dt = weight.dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gh = torch.empty(h.shape, dtype=hidden.dtype, device=h.device) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_w else None
        for r0 in range(0, h.shape[0], BACKWARD_ROWS):
            r1 = min(r0 + BACKWARD_ROWS, h.shape[0])
            gc = g[r0:r1, None]
            gz = torch.exp(z[r0:r1] - lse[r0:r1, None]).mul_(-gc)  # d logp[tok] / dz = onehot - softmax
            gz.scatter_add_(1, tok[r0:r1, None], gc)
            gz = gz.to(dt)
            if gh is not None:
                gh[r0:r1] = torch.mm(gz, weight).to(hidden.dtype)
            if gw is not None:
                gw += _mm_fp32(gz.T, h[r0:r1].to(dt))
        return (
            gh.reshape(hidden.shape) if gh is not None else None,
            gw.to(weight.dtype) if gw is not None else None,
            None,
        )


def token_logprobs_autograd(hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Autograd-aware :func:`token_logprobs` (the trainer's path); same forward bits."""
    return _TokenLogprobs.apply(hidden, weight, tokens)


__all__ = [
    "log_softmax",
    "lm_head_logits",
    "logsumexp_rows",
    "token_logprobs",
    "token_logprobs_autograd",
    "token_logprobs_reference",
    "linear",
]
