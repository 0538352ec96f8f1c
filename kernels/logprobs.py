"""fp32 lm_head, log_softmax and the gather of sampled-token logprobs, batch-invariant.

The logits come from the invariant GEMM with fp32 output; each row's log-sum-exp is a state of
BLOCK_V lanes that walks the vocabulary in ascending BLOCK_V slabs with an online (max, sum) update,
then one fixed reduction across the lanes (:class:`~isoaudit.kernels.fused_logprobs.Lanes`), so a
row's logprob never depends on the batch. The token's logprob is ``logit[token] - lse``. Token
logprobs run in one pass over vocabulary slabs per row block
(:mod:`isoaudit.kernels.fused_logprobs`): the same bits, with no [tokens x vocab] tensor held.
"""

from __future__ import annotations

import torch

from ._triton import resolve
from .fused_logprobs import Lanes, _mm_fp32, fused_token_logprobs
from .gemm import gemm, linear


def _lse_reference(z: torch.Tensor) -> torch.Tensor:
    """The lanes' arithmetic in torch over whole rows of fp32 logits (T, V)."""
    lanes = Lanes(z.shape[0], z.device, "torch")
    lanes.update(z)
    return lanes.finish(with_tokens=False)[1]


def logsumexp_rows(logits: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """Per-row log-sum-exp of fp32 logits (T, V), invariant to T."""
    z = logits.float().contiguous()
    lanes = Lanes(z.shape[0], z.device, resolve(impl, z))
    lanes.update(z)
    return lanes.finish(with_tokens=False)[1]


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
    """Same arithmetic as :func:`token_logprobs`, all in torch, over the whole vocabulary at once."""
    z = lm_head_logits(hidden.reshape(-1, hidden.shape[-1]), weight, impl="torch")
    lse = _lse_reference(z)
    return z.gather(1, tokens.reshape(-1, 1).long())[:, 0] - lse


def token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, tokens: torch.Tensor, impl: str | None = None
) -> torch.Tensor:
    """log p(token) per row of ``hidden`` (T, H): fp32 lm_head, log_softmax, gather; no autograd
    (in row blocks and vocabulary slabs: no [T x V] tensor)."""
    with torch.no_grad():
        return fused_token_logprobs(hidden, weight, tokens, impl)


#: Rows of the logits' gradient built at once in :class:`_TokenLogprobs`'s backward (each chunk is
#: one fp32 block of ``rows x V`` and one GEMM per weight; bounded so no operand exceeds 2**31
#: elements).
BACKWARD_ROWS = 8192


class _TokenLogprobs(torch.autograd.Function):
    """The head with its fp32 logits kept for the backward (what :mod:`isoaudit.kernels.cpu`'s
    exact head builds on): softmax from the saved logits, the logits' gradient rounded to the model
    dtype, and model-dtype GEMMs, in row chunks (a single 16k x 152k block overflows cuBLAS's 32-bit
    sizes). The trainer's path, :func:`token_logprobs_autograd`, keeps no logits."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens):
        z = lm_head_logits(hidden.reshape(-1, hidden.shape[-1]), weight)
        lse = logsumexp_rows(z)
        ctx.save_for_backward(hidden, weight, tokens, z, lse)
        return z.gather(1, tokens.reshape(-1, 1).long())[:, 0] - lse

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
    """Autograd-aware :func:`token_logprobs` (the trainer's path): the same forward bits, one pass
    over vocabulary slabs per row block forward and backward, no [T x V] tensor kept."""
    return fused_token_logprobs(hidden, weight, tokens)


__all__ = [
    "log_softmax",
    "lm_head_logits",
    "logsumexp_rows",
    "token_logprobs",
    "token_logprobs_autograd",
    "token_logprobs_reference",
    "linear",
]
