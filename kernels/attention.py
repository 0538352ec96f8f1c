"""Causal attention with the same bits for prefill, chunked prefill and decode.

Why it is invariant: a query row at absolute position ``p`` always walks the keys in tiles of
BLOCK_N at absolute positions ``[0, BLOCK_N), [BLOCK_N, 2*BLOCK_N), ...`` in ascending order with
the same online-softmax update, whether it arrives in a 4,096-token prefill, a chunk, or alone in
a decode step; there is no split-KV. Tiles past a row's position that a block still visits are
exact no-ops for that row (scores -inf, rescale factor exactly 1, added products exactly 0), and
keys beyond a sequence's cached length are loaded as zeros, never as stale memory. The tile shape
and warps depend on (head_dim, GQA group, dtype) only.

Layout: queries are packed ``(T, Hq, D)`` with ``cu_q`` (B+1 offsets); keys/values live in a cache
``(S, L, Hkv, D)`` addressed by ``slots`` (B), with the absolute position of each sequence's first
query ``q_pos0`` (B) and its cached length ``kv_len`` (B). GQA heads of one KV head are packed into
the rows of a block (row = token * G + head-in-group).
"""

from __future__ import annotations

import math

import torch

from ._triton import HAVE_TRITON, dot_precision, jit, resolve, tl, triton

BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2

if HAVE_TRITON:

    @jit()
    def _attn_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        o_ptr,
        cu_q_ptr,
        qpos0_ptr,
        kvlen_ptr,
        slot_ptr,
        qk_scale,
        HKV,
        stride_qt,
        stride_qh,
        stride_ks,
        stride_kt,
        stride_kh,
        stride_vs,
        stride_vt,
        stride_vh,
        stride_ot,
        stride_oh,
        G: tl.constexpr,
        D: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        qb = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // HKV
        hk = bh % HKV
        q_start = tl.load(cu_q_ptr + b)
        q_len = tl.load(cu_q_ptr + b + 1) - q_start
        TOK: tl.constexpr = BLOCK_M // G
        if qb * TOK < q_len:
            rows = tl.arange(0, BLOCK_M)
            tok = qb * TOK + rows // G
            hq = hk * G + rows % G
            valid = tok < q_len
            pos0 = tl.load(qpos0_ptr + b)
            # Padding rows look at key 0 only, so they never produce NaN.
            pos = tl.where(valid, pos0 + tok, 0)
            kv_len = tl.load(kvlen_ptr + b)
            slot = tl.load(slot_ptr + b).to(tl.int64)
            d = tl.arange(0, BLOCK_D)
            dok = d < D
            q = tl.load(
                q_ptr
                + (q_start + tok)[:, None].to(tl.int64) * stride_qt
                + hq[:, None] * stride_qh
                + d[None, :],
                mask=valid[:, None] & dok[None, :],
                other=0.0,
            )
            n_end = pos0 + tl.minimum(qb * TOK + TOK, q_len)
            m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
            l_i = tl.zeros((BLOCK_M,), tl.float32)
            acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
            k_base = k_ptr + slot * stride_ks + hk * stride_kh
            v_base = v_ptr + slot * stride_vs + hk * stride_vh
            for n0 in range(0, n_end, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                cok = cols < kv_len
                k = tl.load(
                    k_base + cols[:, None].to(tl.int64) * stride_kt + d[None, :],
                    mask=cok[:, None] & dok[None, :],
                    other=0.0,
                )
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                s = tl.where(cols[None, :] <= pos[:, None], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                v = tl.load(
                    v_base + cols[:, None].to(tl.int64) * stride_vt + d[None, :],
                    mask=cok[:, None] & dok[None, :],
                    other=0.0,
                )
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
            out = acc / l_i[:, None]
            tl.store(
                o_ptr
                + (q_start + tok)[:, None].to(tl.int64) * stride_ot
                + hq[:, None] * stride_oh
                + d[None, :],
                out.to(o_ptr.dtype.element_ty),
                mask=valid[:, None] & dok[None, :],
            )


def _check(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    hq, hkv = q.shape[1], k_cache.shape[2]
    g = hq // hkv
    if hq % hkv or g & (g - 1) or g > BLOCK_M:
        raise ValueError(f"GQA group {hq}/{hkv} must be a power of two <= {BLOCK_M}")
    return g


def attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    q_pos0: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """The kernel's arithmetic in torch: per sequence, fp32 scores per BLOCK_N key tile in
    ascending absolute position, base-2 online softmax, probabilities rounded to the value dtype
    before the PV product, one division at the end."""
    g = _check(q, k_cache)
    d = q.shape[-1]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    qk_scale = scale * 1.4426950408889634
    out = torch.empty_like(q)
    for b in range(cu_q.numel() - 1):
        s0, s1 = int(cu_q[b]), int(cu_q[b + 1])
        if s1 == s0:
            continue
        p0, n_kv, slot = int(q_pos0[b]), int(kv_len[b]), int(slots[b])
        qb = q[s0:s1].float()  # (Lq, Hq, D)
        pos = torch.arange(p0, p0 + s1 - s0, device=q.device)
        k = k_cache[slot, :n_kv].repeat_interleave(g, dim=1)  # (Lk, Hq, D)
        v = v_cache[slot, :n_kv].repeat_interleave(g, dim=1)
        m = torch.full((q.shape[1], s1 - s0), float("-inf"), device=q.device)
        den = torch.zeros_like(m)
        acc = torch.zeros(q.shape[1], s1 - s0, d, device=q.device)
        for n0 in range(0, int(pos[-1]) + 1, BLOCK_N):
            kt = k[n0 : n0 + BLOCK_N].float().transpose(0, 1)  # (Hq, n, D)
            vt = v[n0 : n0 + BLOCK_N].transpose(0, 1)
            cols = torch.arange(n0, n0 + kt.shape[1], device=q.device)
            s = (qb.transpose(0, 1) @ kt.transpose(1, 2)) * qk_scale
            s = torch.where(cols[None, None, :] <= pos[None, :, None], s, float("-inf"))
            m_new = torch.maximum(m, s.max(-1).values)
            alpha = torch.exp2(m - m_new)
            p = torch.exp2(s - m_new[..., None])
            den = den * alpha + p.sum(-1)
            acc = acc * alpha[..., None] + p.to(vt.dtype).float() @ vt.float()
            m = m_new
        out[s0:s1] = (acc / den[..., None]).transpose(0, 1).to(q.dtype)
    return out


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    q_pos0: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor | None = None,
    scale: float | None = None,
    impl: str | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Invariant causal attention for packed queries against a KV cache (see the module doc).
    ``config`` = (BLOCK_M, BLOCK_N, warps, stages) overrides the fixed tiles (for tuning only:
    prefill and decode must use the same one)."""
    b = cu_q.numel() - 1
    if slots is None:
        slots = torch.arange(b, device=q.device, dtype=torch.int32)
    if resolve(impl, q) == "torch":
        return attention_reference(q, k_cache, v_cache, cu_q, q_pos0, kv_len, slots, scale)
    g = _check(q, k_cache)
    d = q.shape[-1]
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty_like(q)
    cu = cu_q.to(device=q.device, dtype=torch.int32)
    lens = cu[1:] - cu[:-1]
    max_len = int(lens.max()) if b else 0
    if max_len == 0:
        return out
    bm, bn, warps, stages = config or (BLOCK_M, BLOCK_N, NUM_WARPS, NUM_STAGES)
    tok = bm // g
    hkv = k_cache.shape[2]
    grid = (triton.cdiv(max_len, tok), b * hkv)
    _attn_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        cu,
        q_pos0.to(device=q.device, dtype=torch.int32),
        kv_len.to(device=q.device, dtype=torch.int32),
        slots.to(device=q.device, dtype=torch.int32),
        scale * 1.4426950408889634,
        hkv,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        G=g,
        D=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_M=bm,
        BLOCK_N=bn,
        PRECISION=dot_precision(q.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return out


def _math_attention(q, k, v, cu_q, q_pos0, kv_len, slots, scale):
    """Plain fp32 softmax attention (differentiable), for the backward pass."""
    hq, hkv = q.shape[1], k.shape[2]
    outs = []
    for b in range(cu_q.numel() - 1):
        s0, s1 = int(cu_q[b]), int(cu_q[b + 1])
        p0, n_kv, slot = int(q_pos0[b]), int(kv_len[b]), int(slots[b])
        qb = q[s0:s1].float().transpose(0, 1)
        kb = k[slot, :n_kv].float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        vb = v[slot, :n_kv].float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        s = qb @ kb.transpose(1, 2) * scale
        pos = torch.arange(p0, p0 + s1 - s0, device=q.device)
        cols = torch.arange(n_kv, device=q.device)
        s = s.masked_fill(cols[None, None, :] > pos[None, :, None], float("-inf"))
        outs.append((torch.softmax(s, -1) @ vb).transpose(0, 1))
    return torch.cat(outs)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, q_pos0, kv_len, slots, scale):  # type: ignore[override]
        ctx.save_for_backward(q, k, v, cu_q, q_pos0, kv_len, slots)
        ctx.scale = scale
        return attention(q, k, v, cu_q, q_pos0, kv_len, slots, scale)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, cu_q, q_pos0, kv_len, slots = ctx.saved_tensors
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = _math_attention(qd, kd, vd, cu_q, q_pos0, kv_len, slots, ctx.scale)
            gq, gk, gv = torch.autograd.grad(out, (qd, kd, vd), grad.float())
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype), None, None, None, None, None


def attention_autograd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    q_pos0: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Autograd-aware :func:`attention` (same forward bits; backward recomputes in fp32 torch)."""
    if slots is None:
        slots = torch.arange(cu_q.numel() - 1, device=q.device, dtype=torch.int32)
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _Attention.apply(q, k, v, cu_q, q_pos0, kv_len, slots, scale)
