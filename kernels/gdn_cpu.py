"""Invariant Gated DeltaNet for CPU tensors (bf16, fp16 or fp32 inputs), without Triton.

The defining recurrence of :mod:`isoaudit.kernels.gdn` (state ``H`` (dk, dv) per head, fp32)::

    H <- a_t H,   u_t = b_t (v_t - H^T k_t),   H <- H + k_t u_t^T,   o_t = H^T q_t

evaluated token by token from :mod:`isoaudit.kernels.cpu`'s fixed-order pieces: ``a_t = exp(g_t)`` by
:func:`isoaudit.kernels.cpu.exp` (IEEE ops only), the two sums over dk as :func:`isoaudit.kernels.cpu.tree_sum` (a
fixed tree whose order depends on dk alone; here added in place, level by level), everything else one elementwise IEEE multiply or add
(never contracted). Each element of ``o`` and ``H`` is thus a fixed sequence of correctly rounded
operations on its own sequence's values: it depends neither on the other sequences in a call nor
on their order, nor on how the tokens were split into calls. Prefill, chunked prefill and decode
run the same step, so they give the same bits, the state included (the state after every token,
not only at chunk boundaries).

Why the recurrence and not the chunk form the GPU kernels evaluate: the chunk form is fast only
through BLAS products over a chunk's rows, whose order the CPU BLAS does not fix, and the exact
integer products of :mod:`isoaudit.kernels.cpu` need a scale per column of the right operand (``U'`` over a
chunk's rows), which a decode step does not know yet. The recurrence does the same order of work
(a few passes over the dk x dv state per token and head) without that constraint.

The trainer's backward is the torch chunk form's (:func:`isoaudit.kernels.gdn._chunk_backward`, the same
gradient as the GPU path): correct, not invariant (the contract is the forward's bits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu import _grad, exp
from .gdn import _GDN, CHUNK, GDNCache, _seqs

__all__ = ["gdn", "gdn_autograd", "gdn_incremental"]


BLOCK_BYTES = 1 << 19  # state bytes per block of (sequence, head) pairs: stays in a core's L2


def tree_sum_rows_(x: torch.Tensor) -> torch.Tensor:
    """:func:`isoaudit.kernels.cpu.tree_sum` over dim 1 of a temporary (P, n, m), the same tree and so the
    same bits, each level added in place into the lower half (no allocation per level)."""
    n = x.shape[1]
    if n == 0:
        return x.new_zeros(x.shape[0], x.shape[2])
    p = 1 << (n - 1).bit_length()
    if p != n:
        x = F.pad(x, (0, 0, 0, p - n))
    while p > 1:
        p //= 2
        x[:, :p].add_(x[:, p : 2 * p])
    return x[:, 0]


def _step(
    h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """One token of P (sequence, head) pairs: h (P, dk, dv) fp32 updated in place; q, k (P, dk),
    v (P, dv), a = e^g and b = beta (P,), all fp32. Returns o (P, dv)."""
    h.mul_(a[:, None, None])
    kc = k[:, :, None]
    u = (v - tree_sum_rows_(h * kc)).mul_(b[:, None])
    h.add_(kc * u[:, None, :])
    return tree_sum_rows_(h * q[:, :, None])


def _step_blocked(
    h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """:func:`_step` over blocks of pairs whose state fits in L2 (a few passes over each block,
    not over the whole batch's states from memory). Pairs are independent: no bit depends on it."""
    r = max(1, BLOCK_BYTES // (h.shape[1] * h.shape[2] * 4))
    if h.shape[0] <= r:
        return _step(h, q, k, v, a, b)
    o = torch.empty(h.shape[0], h.shape[2], dtype=torch.float32)
    for i in range(0, h.shape[0], r):
        j = i + r
        o[i:j] = _step(h[i:j], q[i:j], k[i:j], v[i:j], a[i:j], b[i:j])
    return o


def _run(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    starts: list[int],
    lens: list[int],
    h: torch.Tensor,
) -> torch.Tensor:
    """The packed sequences (``starts``, ``lens``) continue states ``h`` (B, H, dk, dv) fp32, which
    are updated in place. The sequences are taken longest first, so the ones still running at
    step t are a prefix of that order and every step works on one contiguous block of states;
    which block a sequence sits in changes no bit (every operation is elementwise per sequence)."""
    hh, dv = q.shape[1], v.shape[2]
    o = torch.empty(q.shape[0], hh, dv, dtype=torch.float32)
    if not lens or not max(lens):
        return o
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    ls = [lens[i] for i in order]
    live, n = [], len(ls)  # live[t]: how many sequences are still running at step t
    for t in range(ls[0]):
        while ls[n - 1] <= t:
            n -= 1
        live.append(n)
    rows = torch.tensor([starts[order[i]] + t for t, n in enumerate(live) for i in range(n)])
    # Flattened to (token, head) pairs: the pairs of step t are rows [i*H, (i+n)*H) of each.
    qs, ks, vs = (x.index_select(0, rows).float().flatten(0, 1) for x in (q, k, v))
    gs, bs = (x.index_select(0, rows).float().flatten() for x in (g, beta))
    a = exp(gs)
    perm = torch.tensor(order)
    hs = h.index_select(0, perm)
    flat = hs.view(-1, *hs.shape[2:])  # (B*H, dk, dv)
    out = torch.empty(rows.numel() * hh, dv, dtype=torch.float32)
    i = 0
    for n in live:
        p, e = i * hh, (i + n) * hh
        out[p:e] = _step_blocked(flat[: n * hh], qs[p:e], ks[p:e], vs[p:e], a[p:e], bs[p:e])
        i += n
    h.index_copy_(0, perm, hs)
    out = out.view(rows.numel(), hh, dv)
    o[rows] = out
    return o


def gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    h0: torch.Tensor | None = None,
    seqs: tuple[list[int], list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences (q, k (T, H, dk); v (T, H, dv); g, beta (T, H)) from states ``h0`` (default
    zero). Returns (o (T, H, dv) fp32, the state after each sequence's last token (B, H, dk, dv)
    fp32). ``seqs`` (starts, lengths), when the caller has them, saves reading ``cu_seqlens``."""
    starts, lens = seqs or _seqs(cu_seqlens)
    hh, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    if h0 is None:
        h = torch.zeros(len(lens), hh, dk, dv, dtype=torch.float32)
    else:
        h = h0.float().clone()
    return _run(q, k, v, g, beta, starts, lens, h), h


class _GDNCPU(_GDN):
    """Forward by the invariant recurrence; backward inherited (the torch chunk form's)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens, chunk):
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens)
        ctx.chunk, ctx.seqs = chunk, _seqs(cu_seqlens)
        return gdn(q, k, v, g, beta, cu_seqlens, seqs=ctx.seqs)[0]


def gdn_autograd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """The trainer's path: the invariant forward from a zero state, differentiable (``chunk`` is
    the backward's chunk size; it changes no forward bit)."""
    if _grad(q, k, v, g, beta):
        return _GDNCPU.apply(q, k, v, g, beta, cu_seqlens, chunk)
    return gdn(q, k, v, g, beta, cu_seqlens)[0]


def gdn_incremental(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: list[int],
    cache: GDNCache,
) -> torch.Tensor:
    """The engine's path: new tokens of several sequences (packed; any number each: a prefill, a
    prefill chunk, a decode token) continue the running states ``cache.h[slots]``. The cache keeps
    the state after the last token, as the native mode does, so the open-chunk fields stay unused.
    Returns o (T, H, dv) fp32."""
    sl = torch.tensor(slots, dtype=torch.long)
    if bool(cache.buf_len.index_select(0, sl).any()):
        raise ValueError(
            "GDNCache.buf_len is non-zero for a slot: this cache holds an open chunk of the Triton "
            "path (isoaudit.kernels.dispatch.set_cpu_impl('triton')); the CPU path needs a cache it filled itself"
        )
    starts, lens = _seqs(cu_seqlens)
    h = cache.h.index_select(0, sl)
    o = _run(q, k, v, g, beta, starts, lens, h)
    cache.h.index_copy_(0, sl, h)
    return o
