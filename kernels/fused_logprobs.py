"""Token logprobs in one pass over vocabulary slabs per row block, forward and backward.

``log p(token | row) = z[token] - lse(z)`` with ``z = hidden @ W^T`` (the fp32 lm_head) never needs
a [tokens x vocab] tensor: a block of ``rows`` rows walks the vocabulary in slabs of ``slab``
columns, computing each slab's logits with the invariant GEMM, folding them into the row's
log-sum-exp state and picking the token's logit where the slab holds it. The backward recomputes
each slab's logits the same way and turns them into that slab's part of both gradients, so what is
kept for it is the hidden rows, the weight and one fp32 log-sum-exp per row.

Why the bits are the unchunked path's: every logit is the invariant GEMM's for the full weight's
tile configuration (a column of a slab is the same sum as that column of the whole head), and the
log-sum-exp is a per-row state of ``BLOCK_V`` lanes, lane ``j`` seeing columns ``j, j + BLOCK_V,
...`` in ascending order with an online (max, sum) update, then one fixed reduction across the
lanes. A slab is a whole number of ``BLOCK_V`` columns, so cutting the vocabulary into slabs
changes no lane's sequence of updates: ``rows`` and ``slab`` are launch choices, never arithmetic
ones. :mod:`isoaudit.kernels.logprobs` computes every invariant log-sum-exp (the engine's
log-softmax too) through the same lane kernels, whole rows being one slab.

:func:`native_chunked_token_logprobs` is the stock arithmetic (bf16 lm_head, ``torch.logsumexp``)
under the same chunking, the fair baseline for a trainer that chunks its own head; the native
``dispatch.token_logprobs`` takes it once a head outgrows one slab (:func:`one_slab`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ._triton import HAVE_TRITON, cdiv, jit, resolve, tl
from .gemm import _device_traits, gemm, gemm_reference
from .gemm_policy import GemmConfig, gemm_config

#: Lanes of a row's log-sum-exp state; a slab is a whole number of them.
BLOCK_V = 1024
#: Rows of one block (forward and backward).
ROWS = 4096
#: The most bytes one slab's fp32 logits may take (``rows x slab x 4``); the slab is the widest
#: whole number of BLOCK_V columns within it, at least BLOCK_V.
SLAB_BYTES = 256 << 20


if HAVE_TRITON:

    @jit(do_not_specialize=["col0"])
    def _lanes_kernel(
        z_ptr, tok_ptr, m_ptr, s_ptr, pick_ptr, W, col0, stride_z, HAS_TOK: tl.constexpr, BLOCK: tl.constexpr
    ):
        """One row's lanes over the ``W`` columns of its slab (vocabulary columns ``col0 ...``), the
        state read and written back; the token's logit picked where the slab holds it."""
        row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 at ~14k rows of a 152k vocabulary
        cols = tl.arange(0, BLOCK)
        m = tl.load(m_ptr + row * BLOCK + cols)
        s = tl.load(s_ptr + row * BLOCK + cols)
        for v0 in range(0, W, BLOCK):
            z = tl.load(z_ptr + row * stride_z + v0 + cols, mask=(v0 + cols) < W, other=float("-inf"))
            m_new = tl.maximum(m, z)
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - safe) + tl.exp(z - safe)
            m = m_new
        tl.store(m_ptr + row * BLOCK + cols, m)
        tl.store(s_ptr + row * BLOCK + cols, s)
        if HAS_TOK:
            t = tl.load(tok_ptr + row) - col0
            held = (t >= 0) & (t < W)
            zt = tl.load(z_ptr + row * stride_z + t, mask=held, other=0.0)
            tl.store(pick_ptr + row, zt, mask=held)

    @jit()
    def _finish_kernel(m_ptr, s_ptr, lse_ptr, pick_ptr, out_ptr, HAS_TOK: tl.constexpr, BLOCK: tl.constexpr):
        """A row's log-sum-exp from its lanes (one fixed reduction), and the token's logprob."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = tl.load(m_ptr + row * BLOCK + cols)
        s = tl.load(s_ptr + row * BLOCK + cols)
        mx = tl.max(m, axis=0)
        tot = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - mx)), axis=0)
        lse = mx + tl.log(tot)
        tl.store(lse_ptr + row, lse)
        if HAS_TOK:
            tl.store(out_ptr + row, tl.load(pick_ptr + row) - lse)


class Lanes:
    """The log-sum-exp state of ``t`` rows (``m``, ``s``: (t, BLOCK_V) fp32) and each row's picked
    token logit (``pick``); ``impl`` is ``"triton"`` or ``"torch"`` (the same arithmetic in torch)."""

    def __init__(self, t: int, device: torch.device, impl: str) -> None:
        self.m = torch.full((t, BLOCK_V), float("-inf"), dtype=torch.float32, device=device)
        self.s = torch.zeros(t, BLOCK_V, dtype=torch.float32, device=device)
        self.pick = torch.zeros(t, dtype=torch.float32, device=device)
        self.impl = impl

    def update(self, z: torch.Tensor, col0: int = 0, tokens: torch.Tensor | None = None) -> None:
        """Fold the fp32 logits ``z`` (t, W) of vocabulary columns ``col0 ... col0 + W`` into the
        state (``col0`` a multiple of BLOCK_V), picking ``tokens``' logits (int64, (t,)) they hold."""
        t, w = z.shape
        if self.impl == "torch":
            self._update_reference(z, col0, tokens)
        elif t:
            tok = tokens if tokens is not None else self.pick
            _lanes_kernel[(t,)](
                z, tok, self.m, self.s, self.pick, w, col0, z.stride(0),
                HAS_TOK=tokens is not None, BLOCK=BLOCK_V, num_warps=4,
            )  # fmt: skip

    def _update_reference(self, z: torch.Tensor, col0: int, tokens: torch.Tensor | None) -> None:
        t, w = z.shape
        m, s = self.m, self.s
        for v0 in range(0, w, BLOCK_V):
            width = min(BLOCK_V, w - v0)
            zz = z[:, v0 : v0 + BLOCK_V]
            if width < BLOCK_V:
                zz = torch.cat([zz, zz.new_full((t, BLOCK_V - width), float("-inf"))], 1)
            m_new = torch.maximum(m, zz)
            safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
            s = s * torch.exp(m - safe) + torch.exp(zz - safe)
            m = m_new
        self.m, self.s = m, s
        if tokens is not None:
            _pick(self.pick, z, tokens - col0)

    def finish(self, with_tokens: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(token logprobs, log-sum-exp) per row (the logprobs are meaningless without tokens)."""
        t = self.m.shape[0]
        if self.impl == "torch":
            mx = self.m.max(-1).values
            live = torch.where(
                self.m == float("-inf"), torch.zeros_like(self.s), self.s * torch.exp(self.m - mx[:, None])
            )
            lse = mx + torch.log(live.sum(-1))
            return self.pick - lse, lse
        lse = torch.empty(t, dtype=torch.float32, device=self.m.device)
        out = torch.empty(t, dtype=torch.float32, device=self.m.device)
        if t:
            _finish_kernel[(t,)](
                self.m, self.s, lse, self.pick, out, HAS_TOK=with_tokens, BLOCK=BLOCK_V, num_warps=4
            )
        return out, lse


def _pick(into: torch.Tensor, z: torch.Tensor, local: torch.Tensor) -> None:
    """``into[i] = z[i, local[i]]`` where ``0 <= local[i] < z.shape[1]`` (no host sync)."""
    held = (local >= 0) & (local < z.shape[1])
    got = z.gather(1, local.clamp(0, max(z.shape[1] - 1, 0))[:, None])[:, 0]
    into.copy_(torch.where(held, got, into))


def _chunks(t: int, v: int, rows: int | None, slab: int | None) -> tuple[int, int]:
    """(rows per block, columns per slab) for ``t`` rows over a vocabulary of ``v``."""
    r = max(1, min(t, rows or ROWS))
    if slab is None:
        slab = (SLAB_BYTES // (4 * r)) // BLOCK_V * BLOCK_V
    if slab % BLOCK_V:
        raise ValueError(f"slab: {slab} columns is not a multiple of BLOCK_V ({BLOCK_V})")
    return r, max(BLOCK_V, min(slab, cdiv(v, BLOCK_V) * BLOCK_V))


def one_slab(t: int, v: int) -> bool:
    """Whether the default chunking keeps a head of ``t`` rows over a vocabulary of ``v`` whole (one
    row block, one slab): its fp32 logits fit within :data:`SLAB_BYTES`, so holding them costs no
    more than one slab of the chunked path."""
    r, s = _chunks(t, v, None, None)
    return r >= t and s >= v


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two model-dtype operands accumulated and returned in fp32."""
    try:
        return torch.mm(a, b, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):  # torch without out_dtype, or a device without it
        return torch.mm(a, b).float()


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` into an fp32 ``acc`` (in the GEMM's epilogue where torch has it)."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (TypeError, RuntimeError, NotImplementedError):
        acc += _mm_fp32(a, b)


class _Invariant:
    """The invariant arithmetic: the invariant GEMM's fp32 logits (the whole head's tile
    configuration), the lane log-sum-exp."""

    def __init__(self, weight: torch.Tensor, impl: str) -> None:
        v, k = weight.shape
        self.impl = impl
        capability = _device_traits(weight.device)[0] if impl == "triton" else None
        self.config: GemmConfig = gemm_config(v, k, weight.dtype, capability)

    def logits(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.impl == "torch":
            return gemm_reference(
                h, w, out_dtype=torch.float32, block_k=self.config.block_k, k_split=self.config.k_split
            )
        return gemm(h, w, out_dtype=torch.float32, impl="triton", config=self.config)

    def start(self, t: int, device: torch.device) -> Any:
        return Lanes(t, device, self.impl)

    def update(self, state: Lanes, z: torch.Tensor, col0: int, tokens: torch.Tensor) -> None:
        state.update(z, col0, tokens)

    def finish(self, state: Lanes) -> tuple[torch.Tensor, torch.Tensor]:
        return state.finish()


class _Native:
    """The stock arithmetic: model-dtype lm_head cast to fp32, ``torch.logsumexp`` per slab,
    combined across slabs with ``logaddexp``."""

    def logits(self, h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(h, w).float()

    def start(self, t: int, device: torch.device) -> Any:
        return [torch.full((t,), float("-inf"), device=device), torch.zeros(t, device=device)]

    def update(self, state: Any, z: torch.Tensor, col0: int, tokens: torch.Tensor) -> None:
        state[0] = torch.logaddexp(state[0], torch.logsumexp(z, -1))
        _pick(state[1], z, tokens - col0)

    def finish(self, state: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return state[1] - state[0], state[0]


def _forward(
    arith: Any, h: torch.Tensor, weight: torch.Tensor, tok: torch.Tensor, r: int, s: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token logprobs, log-sum-exp) of every row, block by block, slab by slab."""
    t, v = h.shape[0], weight.shape[0]
    out = torch.empty(t, dtype=torch.float32, device=h.device)
    lse = torch.empty(t, dtype=torch.float32, device=h.device)
    for r0 in range(0, t, r):
        r1 = min(r0 + r, t)
        state = arith.start(r1 - r0, h.device)
        for v0 in range(0, v, s):
            z = arith.logits(h[r0:r1], weight[v0 : v0 + s])
            arith.update(state, z, v0, tok[r0:r1])
            del z
        out[r0:r1], lse[r0:r1] = arith.finish(state)
    return out, lse


class _SlabLogprobs(torch.autograd.Function):
    """Forward: :func:`_forward`, keeping one fp32 log-sum-exp per row. Backward: per block and
    slab, the slab's logits recomputed, ``d logp[tok] / dz = onehot - softmax`` scaled by the
    incoming gradient and rounded to the model dtype (what a native trainer's head does), then
    that slab's part of both gradients accumulated in fp32 (the gradient's bits are not the
    contract: the forward's are)."""

    @staticmethod
    def forward(ctx, hidden, weight, tokens, arith, r, s):
        h = hidden.reshape(-1, hidden.shape[-1])
        tok = tokens.reshape(-1).to(torch.int64)
        out, lse = _forward(arith, h, weight, tok, r, s)
        ctx.save_for_backward(hidden, weight, tok, lse)
        ctx.arith, ctx.r, ctx.s = arith, r, s
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, tok, lse = ctx.saved_tensors
        arith, r, s = ctx.arith, ctx.r, ctx.s
        h = hidden.reshape(-1, hidden.shape[-1])
        g = grad.reshape(-1).float()
        dt = weight.dtype
        t, v = h.shape[0], weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        gh = torch.empty(h.shape, dtype=hidden.dtype, device=h.device) if need_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_w else None
        for r0 in range(0, t, r):
            r1 = min(r0 + r, t)
            hr, gr, tr = h[r0:r1], g[r0:r1, None], tok[r0:r1]
            acc = torch.zeros(r1 - r0, h.shape[1], dtype=torch.float32, device=h.device) if need_h else None
            for v0 in range(0, v, s):
                wc = weight[v0 : v0 + s]
                z = arith.logits(hr, wc)
                gz = z.sub_(lse[r0:r1, None]).exp_().mul_(-gr)
                local = tr - v0
                held = (local >= 0) & (local < gz.shape[1])
                gz.scatter_add_(
                    1, local.clamp(0, gz.shape[1] - 1)[:, None], torch.where(held[:, None], gr, 0.0)
                )
                gzd = gz.to(dt)
                del z, gz
                if acc is not None:
                    _addmm_fp32(acc, gzd, wc)
                if gw is not None:
                    _addmm_fp32(gw[v0 : v0 + s], gzd.T, hr.to(dt))
            if gh is not None and acc is not None:
                gh[r0:r1] = acc.to(hidden.dtype)
        return (
            gh.reshape(hidden.shape) if gh is not None else None,
            gw.to(weight.dtype) if gw is not None else None,
            None,
            None,
            None,
            None,
        )


def fused_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    impl: str | None = None,
    rows: int | None = None,
    slab: int | None = None,
) -> torch.Tensor:
    """log p(token | row) per row of ``hidden`` (..., H) under the fp32 invariant head ``weight``
    (V, H), autograd-aware, in blocks of ``rows`` rows and slabs of ``slab`` columns (defaults:
    :data:`ROWS`, the widest within :data:`SLAB_BYTES`): the bits of the whole head's
    ``gemm`` + log-softmax + gather, for any ``rows`` and ``slab``."""
    h = hidden.reshape(-1, hidden.shape[-1])
    mode = resolve(impl, h)
    r, s = _chunks(h.shape[0], weight.shape[0], rows, slab)
    arith = _Invariant(weight, mode)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _SlabLogprobs.apply(hidden, weight, tokens, arith, r, s)
    return _forward(arith, h, weight, tokens.reshape(-1).to(torch.int64), r, s)[0]


def native_chunked_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    tokens: torch.Tensor,
    rows: int | None = None,
    slab: int | None = None,
) -> torch.Tensor:
    """The stock head (model-dtype lm_head, fp32 ``logsumexp``) under :func:`fused_token_logprobs`'s
    chunking and backward: the baseline a chunking trainer would run natively."""
    h = hidden.reshape(-1, hidden.shape[-1])
    r, s = _chunks(h.shape[0], weight.shape[0], rows, slab)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _SlabLogprobs.apply(hidden, weight, tokens, _Native(), r, s)
    return _forward(_Native(), h, weight, tokens.reshape(-1).to(torch.int64), r, s)[0]


__all__ = ["BLOCK_V", "Lanes", "fused_token_logprobs", "native_chunked_token_logprobs", "one_slab"]
