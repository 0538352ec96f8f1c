"""Causal attention with the same bits for prefill, chunked prefill and decode.

The arithmetic of one query row at absolute position ``p``: the keys ``[0, p]`` are cut into
splits of a fixed SPLIT keys at absolute positions ``[0, SPLIT), [SPLIT, 2*SPLIT), ...``. Within a
split, a fresh base-2 online softmax walks BLOCK_N key tiles in ascending order, giving fp32
``(m_s, l_s, acc_s)``; the splits are then merged in ascending order by one formula (running max,
rescale, add) and divided once at the end. SPLIT and BLOCK_N are fixed constants, never chosen
from the batch, so the row gets the same bits in a 4,096-token prefill, in any chunk, or alone in
a decode step.

Two launch paths compute exactly that: prefill walks all its tiles in one pipelined loop and, at
each split end, merges the split's state in registers and starts afresh; decode (few queries per
sequence, long context) launches one program per (query block, KV head, split) writing fp32
partials, and the last of a block's splits to finish merges them, in ascending split order. The tile step, the merge and the final division are
written once (``_tile``, ``_merge``, ``_store_rows``) and used by both, with ``tl.fma`` pinning
every multiply-add so no kernel can contract it differently. Tiles past a row's position are
exact no-ops (scores -inf, rescale 1, added products 0); a split that starts after a row's position
is skipped for that row by a select; keys beyond a sequence's cached length load as zeros, never as
stale memory. The two paths may use different BLOCK_M and warps: a row's bits do not depend on
them as long as each warp holds whole tile rows (measured on the H200: 128 rows / 8 warps, 64 / 4
and 16 / 1 agree bitwise; 16 rows over 4 warps, which splits a row's sum across warps, does not).
``tests/kernels/test_attention.py`` checks the shipped pair bitwise.

Layout: queries are packed ``(T, Hq, D)`` with ``cu_q`` (B+1 offsets); keys/values live in a cache
``(S, L, Hkv, D)`` addressed by ``slots`` (B), with the absolute position of each sequence's first
query ``q_pos0`` (B) and its cached length ``kv_len`` (B). GQA heads of one KV head are packed into
the rows of a block (row = token * G + head-in-group). A query's position must be below the cache
length L (its own key is cached).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import NamedTuple

import torch

from ._triton import (
    HAVE_TRITON,
    CachedLauncher,
    aligned,
    cdiv,
    dot_precision,
    interpreting,
    jit,
    next_power_of_2,
    resolve,
    tl,
    triton,
    use_triton,
)
from .gemm import _ensure_allocator

LOG2E = 1.4426950408889634


class AttnConfig(NamedTuple):
    """Launch shape, one row of the tuning table per phase. ``split`` and ``block_n`` define the
    forward's arithmetic (one pair for prefill, chunked prefill and decode alike); the rest only
    decides how the work is laid on the GPU: prefill (block_m, warps, stages; ``tma``: K/V tiles
    through TMA descriptors; ``ws``: warp-specialised key loop), decode (``dec_*``). The backward's
    query and key tiles (``bwd_*``) fix the gradients' summation order; its warps and stages do not;
    ``bwd_fused`` (dQ summed in the dK/dV kernel, in descending key-block order) states another
    dQ arithmetic (dK and dV keep theirs)."""

    block_m: int = 128
    block_n: int = 128
    warps: int = 8
    stages: int = 2
    split: int = 1024
    dec_block_m: int = 64
    dec_warps: int = 4
    dec_stages: int = 3
    tma: bool = False
    ws: bool = False
    dec_tma: bool = False
    bwd_dq_m: int = 64
    bwd_dq_n: int = 64
    bwd_dkv_m: int = 64
    bwd_dkv_n: int = 64
    bwd_warps: int = 4
    bwd_stages: int = 3
    bwd_fused: bool = False


#: The shipped configuration: the table's picks on Hopper (``bench/kernels.py --only attention_tune``),
#: decode keys through TMA and a two-stage backward; neither changes a bit.
CONFIG = AttnConfig(dec_tma=True, bwd_stages=2)

#: The tuning table: launch candidates per phase, each a set of :class:`AttnConfig` fields over
#: :data:`CONFIG`. Prefill and decode candidates change no bit by design (asserted on the GPU by
#: ``tests/kernels/test_attention_table.py``, timed against SDPA by ``bench/kernels.py --only
#: attention_tune``). Backward candidates that keep ``bwd_dq_n`` and ``bwd_dkv_m`` keep the
#: gradients' bits; the others state a new backward arithmetic. Four stages of 128-key tiles need
#: more shared memory than Hopper's 227 KiB; a decode block of 32 rows on 2 warps, and 128-key
#: dK/dV blocks under 64-row dQ blocks, gave other bits than the shipped row on an H100, and 32-row
#: dK/dV query tiles under 128-key blocks gave other gradients run to run: none is a candidate.
LAUNCH_CANDIDATES: dict[str, tuple[dict[str, int | bool], ...]] = {
    "prefill": (
        {},
        dict(stages=3),
        dict(tma=True),
        dict(tma=True, stages=3),
        dict(block_m=64, warps=4, stages=3),
        dict(block_m=64, warps=4, stages=3, tma=True),
        dict(block_m=128, warps=4, stages=3, tma=True),
        dict(tma=True, ws=True),  # warp specialisation last: the least proven on Triton 3.6
        dict(tma=True, ws=True, stages=3),
    ),
    "decode": (
        {},
        dict(dec_stages=2),
        dict(dec_tma=True),
        dict(dec_block_m=16, dec_warps=1, dec_stages=3),
        dict(dec_block_m=16, dec_warps=1, dec_stages=4, dec_tma=True),
    ),
    "backward": (
        {},
        dict(bwd_stages=2),
        dict(bwd_dq_m=128, bwd_dkv_n=128, bwd_warps=8, bwd_stages=2),
        dict(bwd_dq_m=128, bwd_dkv_n=128, bwd_warps=8, bwd_stages=3),
        dict(bwd_dq_m=128, bwd_dq_n=128, bwd_dkv_m=128, bwd_dkv_n=128, bwd_warps=8, bwd_stages=2),
        dict(bwd_fused=True),
        dict(bwd_fused=True, bwd_dq_m=128, bwd_dkv_n=128, bwd_warps=8, bwd_stages=2),
        dict(bwd_fused=True, bwd_dq_m=128, bwd_dkv_n=128, bwd_warps=8, bwd_stages=3),
    ),
}
#: Arithmetic candidates (split, block_n): each a different stated forward arithmetic, applied
#: alike to prefill, chunked prefill and decode.
ARITHMETIC_CANDIDATES: tuple[tuple[int, int], ...] = ((1024, 128), (512, 128), (2048, 128), (1024, 64))
# The split-KV path's fp32 partials are bounded to this many elements (else prefill's path serves).
MAX_PARTIAL_ELEMS = 1 << 25

if HAVE_TRITON:

    @triton.jit
    def _locate(cu_ptr, j, B, TOK: tl.constexpr, BLOCK_B: tl.constexpr):
        """Program ``j`` of the flat list of (sequence, query block) pairs, heaviest block of each
        sequence first; returns (sequence, block, first query row, query count); past the end the
        block is negative."""
        i = tl.arange(0, BLOCK_B)
        lo = tl.load(cu_ptr + i, mask=i < B, other=0)
        hi = tl.load(cu_ptr + i + 1, mask=i < B, other=0)
        nb = (hi - lo + TOK - 1) // TOK
        end = tl.cumsum(nb, 0)
        b = tl.sum((end <= j).to(tl.int32), 0)
        sel = i == b
        qb = tl.sum(tl.where(sel, end - 1, 0), 0) - j
        return b, qb, tl.sum(tl.where(sel, lo, 0), 0), tl.sum(tl.where(sel, hi - lo, 0), 0)

    @triton.jit
    def _fresh(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """An empty softmax state: max -inf, denominator 0, accumulator 0."""
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        return m, tl.zeros((BLOCK_M,), tl.float32), tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    @triton.jit
    def _load_tile(base, off, cols, kv_len, dok, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
        """A K or V tile (``off``: the in-tile offsets, hoisted out of the loop); rows at or past
        ``kv_len`` load as zeros. Fully cached tiles of a power-of-two head load without masks."""
        if MASKED:
            x = tl.load(base + off, mask=(cols < kv_len)[:, None] & dok[None, :], other=0.0)
        elif EVEN_D:
            x = tl.load(base + off)
        else:
            x = tl.load(base + off, mask=dok[None, :], other=0.0)
        return x

    @triton.jit
    def _kv_tile(
        src, off, stride_t, n0, cols, kv_len, dok,
        MASKED: tl.constexpr, EVEN_D: tl.constexpr, TMA: tl.constexpr,
    ):  # fmt: skip
        """The K or V tile at key ``n0``: through the TMA descriptor ``src`` (its extent is the
        cached length and the head size, so rows past ``kv_len`` and columns past D load as zeros,
        as the masked pointer loads give), else by pointers from the base ``src``."""
        if TMA:
            x = src.load([n0, 0])
        else:
            x = _load_tile(src + tl.cast(n0, tl.int64) * stride_t, off, cols, kv_len, dok, MASKED, EVEN_D)
        return x

    @triton.jit
    def _tile(
        q, k_base, v_base, k_off, v_off, stride_kt, stride_vt, n0, dok, pos, kv_len, m_i, l_i, acc, c,
        BLOCK_N: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
        TMA: tl.constexpr,
    ):  # fmt: skip
        """One online-softmax step over keys [n0, n0 + BLOCK_N); scores stay unscaled (``c`` folds
        the softmax scale and log2 e into the exponent's fma). ``k_base``/``v_base``: descriptors
        with TMA, else pointers. How a tile is loaded changes no bit."""
        cols = n0 + tl.arange(0, BLOCK_N)
        k = _kv_tile(k_base, k_off, stride_kt, n0, cols, kv_len, dok, MASKED, EVEN_D, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if MASKED:
            s = tl.where(cols[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2((m_i - m_new) * c)
        p = tl.exp2(tl.fma(s, c, -(m_new * c)[:, None]))
        l_i = tl.fma(l_i, alpha, tl.sum(p, 1))
        v = _kv_tile(v_base, v_off, stride_vt, n0, cols, kv_len, dok, MASKED, EVEN_D, TMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _split(
        q, k_base, v_base, k_off, v_off, stride_kt, stride_vt, lo, hi, full, dok, pos, kv_len, c,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
        PRECISION: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr,
    ):  # fmt: skip
        """Fresh online softmax over the tiles of [lo, hi); tiles below ``full`` are visible to
        every row and cached, so they skip the masks (a mask that selects everything is exact)."""
        m, den, acc = _fresh(BLOCK_M, BLOCK_D)
        mid = lo + (tl.maximum(tl.minimum(full, hi) - lo, 0) // BLOCK_N) * BLOCK_N
        for n0 in tl.range(lo, mid, BLOCK_N, warp_specialize=WS):
            m, den, acc = _tile(
                q, k_base, v_base, k_off, v_off, stride_kt, stride_vt, n0, dok, pos, kv_len, m, den, acc, c,
                BLOCK_N, False, EVEN_D, PRECISION, TMA,
            )  # fmt: skip
        for n0 in range(mid, hi, BLOCK_N):
            m, den, acc = _tile(
                q, k_base, v_base, k_off, v_off, stride_kt, stride_vt, n0, dok, pos, kv_len, m, den, acc, c,
                BLOCK_N, True, EVEN_D, PRECISION, TMA,
            )  # fmt: skip
        return m, den, acc

    @triton.jit
    def _merge(m_run, l_run, acc_run, m, den, acc, take, c):
        """Fold one split's (m, den, acc) into the running state, for rows where ``take``."""
        m_new = tl.maximum(m_run, m)
        a = tl.exp2((m_run - m_new) * c)
        b = tl.exp2((m - m_new) * c)
        l_out = tl.where(take, tl.fma(l_run, a, den * b), l_run)
        acc_out = tl.where(take[:, None], tl.fma(acc_run, a[:, None], acc * b[:, None]), acc_run)
        return tl.where(take, m_new, m_run), l_out, acc_out

    @triton.jit
    def _after_tile(
        m_run, l_run, acc_run, m, den, acc, end, pos, c,
        SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """Prefill's walk after the tile ending at key ``end``: at a split end, merge the split's
        state into the running one and start the next split afresh."""
        if end % SPLIT == 0:
            m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m, den, acc, pos >= end - SPLIT, c)
            m, den, acc = _fresh(BLOCK_M, BLOCK_D)
        return m_run, l_run, acc_run, m, den, acc

    @triton.jit
    def _store_rows(o_ptr, acc, den, rows_t, hq, d, row_ok, stride_ot, stride_oh):
        """The one division, then the rows' store."""
        out = acc / den[:, None]
        ptrs = o_ptr + rows_t[:, None].to(tl.int64) * stride_ot + hq[:, None] * stride_oh + d[None, :]
        tl.store(ptrs, out.to(o_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _combine(
        o_ptr, pacc_ptr, pml_ptr, prow0, nsp, pos, valid, row_ok, d, rows_t, hq, c, stride_ot, stride_oh,
        SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """Merge a block's first ``nsp`` split partials in ascending split order (``_merge``, the
        formula prefill uses in registers), then the one division and the store. The partials
        were written by other programs: read them from L2 (``.cg``), never a stale L1 line."""
        m_run, l_run, acc_run = _fresh(BLOCK_M, BLOCK_D)
        for sp in range(0, nsp):
            take = valid & (pos >= sp * SPLIT)
            m = tl.load(pml_ptr + 2 * (prow0 + sp), mask=take, other=float("-inf"), cache_modifier=".cg")
            den = tl.load(pml_ptr + 2 * (prow0 + sp) + 1, mask=take, other=0.0, cache_modifier=".cg")
            acc = tl.load(
                pacc_ptr + (prow0 + sp)[:, None] * BLOCK_D + d[None, :],
                mask=take[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
            m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m, den, acc, take, c)
        _store_rows(o_ptr, acc_run, l_run, rows_t, hq, d, row_ok, stride_ot, stride_oh)

    @jit()
    def _attn_fwd(
        q_ptr, k_ptr, v_ptr, o_ptr, pacc_ptr, pml_ptr, cnt_base, cu_ptr, qpos0_ptr, kvlen_ptr, slot_ptr,
        c, B, NSPLIT, HQ,
        stride_qt, stride_qh, stride_ks, stride_kt, stride_kh, stride_vs, stride_vt, stride_vh,
        stride_ot, stride_oh,
        G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, BLOCK_B: tl.constexpr, SPLIT_KV: tl.constexpr,
        HAS_SLOTS: tl.constexpr, ONE_SPLIT: tl.constexpr, FUSED_COMBINE: tl.constexpr,
        PRECISION: tl.constexpr, TMA: tl.constexpr, WS: tl.constexpr,
    ):  # fmt: skip
        """Prefill (SPLIT_KV=False): all splits, merged in registers, output stored (ONE_SPLIT: the
        cache holds at most one split). Split-KV: only split ``program_id(2)``, its fp32 partials
        stored; with FUSED_COMBINE the block's last split to finish merges them (``_combine``),
        else ``_attn_combine`` does, launched after."""
        hk = tl.program_id(0)
        TOK: tl.constexpr = BLOCK_M // G
        EVEN_D: tl.constexpr = BLOCK_D == D
        b, qb, q_start, q_len = _locate(cu_ptr, tl.program_id(1), B, TOK, BLOCK_B)
        lo = tl.program_id(2) * SPLIT
        pos0 = tl.load(qpos0_ptr + b, mask=b < B, other=0)
        pmax = pos0 + tl.minimum(qb * TOK + TOK, q_len) - 1
        if (qb >= 0) & (qb * TOK < q_len) & (lo <= pmax):
            rows = tl.arange(0, BLOCK_M)
            tok = qb * TOK + rows // G
            hq = hk * G + rows % G
            valid = (tok < q_len) & (rows < TOK * G)  # a group that does not divide BLOCK_M idles the tail
            pos = pos0 + tok
            kv_len = tl.load(kvlen_ptr + b)
            if HAS_SLOTS:
                slot = tl.load(slot_ptr + b).to(tl.int64)
            else:
                slot = b.to(tl.int64)
            d = tl.arange(0, BLOCK_D)
            dok = d < D
            row_ok = valid[:, None] & dok[None, :]
            q = tl.load(
                q_ptr
                + (q_start + tok)[:, None].to(tl.int64) * stride_qt
                + hq[:, None] * stride_qh
                + d[None, :],
                mask=row_ok,
                other=0.0,
            )
            full = tl.minimum(pos0 + qb * TOK + 1, kv_len)
            k_base = k_ptr + slot * stride_ks + hk * stride_kh
            v_base = v_ptr + slot * stride_vs + hk * stride_vh
            if TMA:
                # One descriptor per program over its (sequence, KV head)'s cached keys: loads
                # past the cached length or the head size are zeros, no mask needed.
                k_base = tl.make_tensor_descriptor(k_base, [kv_len, D], [stride_kt, 1], [BLOCK_N, BLOCK_D])
                v_base = tl.make_tensor_descriptor(v_base, [kv_len, D], [stride_vt, 1], [BLOCK_N, BLOCK_D])
            k_off = tl.arange(0, BLOCK_N)[:, None] * stride_kt + d[None, :]
            v_off = tl.arange(0, BLOCK_N)[:, None] * stride_vt + d[None, :]
            if SPLIT_KV:
                m, den, acc = _split(
                    q, k_base, v_base, k_off, v_off, stride_kt, stride_vt, lo, tl.minimum(lo + SPLIT, pmax + 1),
                    full, dok, pos, kv_len, c, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, PRECISION, TMA, WS,
                )  # fmt: skip
                prow0 = ((q_start + tok) * HQ + hq).to(tl.int64) * NSPLIT
                prow = prow0 + tl.program_id(2)
                tl.store(pml_ptr + 2 * prow, m, mask=valid)
                tl.store(pml_ptr + 2 * prow + 1, den, mask=valid)
                tl.store(pacc_ptr + prow[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok)
                if FUSED_COMBINE:
                    # The last of the block's splits to finish merges them all (ascending, whatever
                    # the arrival order) and re-arms the counter: no second launch.
                    tl.debug_barrier()  # every thread's partials are stored before the count
                    cnt_ptr = cnt_base + hk * tl.num_programs(1) + tl.program_id(1)
                    nsp = tl.minimum(pmax // SPLIT + 1, NSPLIT)
                    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == nsp - 1:
                        tl.debug_barrier()
                        _combine(
                            o_ptr, pacc_ptr, pml_ptr, prow0, nsp, pos, valid, row_ok, d, q_start + tok, hq, c,
                            stride_ot, stride_oh, SPLIT, BLOCK_M, BLOCK_D,
                        )  # fmt: skip
                        tl.store(cnt_ptr, 0)
            elif ONE_SPLIT:
                # Every key is in split 0: merging one split into the fresh running state is exact
                # (scale 1, added 0), so the split's own state is the result, and no running state
                # needs registers.
                m, den, acc = _split(
                    q, k_base, v_base, k_off, v_off, stride_kt, stride_vt, 0, pmax + 1,
                    full, dok, pos, kv_len, c, BLOCK_M, BLOCK_N, BLOCK_D, EVEN_D, PRECISION, TMA, WS,
                )  # fmt: skip
                _store_rows(o_ptr, acc, den, q_start + tok, hq, d, row_ok, stride_ot, stride_oh)
            else:
                # One pipelined walk over all tiles, the split state merged and reset at each split
                # end (a loop per split restarts the pipeline: 10% slower on the H200).
                m_run, l_run, acc_run = _fresh(BLOCK_M, BLOCK_D)
                m, den, acc = _fresh(BLOCK_M, BLOCK_D)
                mid = (full // BLOCK_N) * BLOCK_N
                for n0 in tl.range(0, mid, BLOCK_N, warp_specialize=WS):
                    m, den, acc = _tile(
                        q, k_base, v_base, k_off, v_off, stride_kt, stride_vt, n0, dok, pos, kv_len, m, den, acc,
                        c, BLOCK_N, False, EVEN_D, PRECISION, TMA,
                    )  # fmt: skip
                    m_run, l_run, acc_run, m, den, acc = _after_tile(
                        m_run, l_run, acc_run, m, den, acc, n0 + BLOCK_N, pos, c, SPLIT, BLOCK_M, BLOCK_D
                    )
                for n0 in range(mid, pmax + 1, BLOCK_N):
                    m, den, acc = _tile(
                        q, k_base, v_base, k_off, v_off, stride_kt, stride_vt, n0, dok, pos, kv_len, m, den, acc,
                        c, BLOCK_N, True, EVEN_D, PRECISION, TMA,
                    )  # fmt: skip
                    m_run, l_run, acc_run, m, den, acc = _after_tile(
                        m_run, l_run, acc_run, m, den, acc, n0 + BLOCK_N, pos, c, SPLIT, BLOCK_M, BLOCK_D
                    )
                end = tl.cdiv(pmax + 1, BLOCK_N) * BLOCK_N
                if end % SPLIT != 0:
                    s0 = end - end % SPLIT
                    m_run, l_run, acc_run = _merge(m_run, l_run, acc_run, m, den, acc, pos >= s0, c)
                _store_rows(o_ptr, acc_run, l_run, q_start + tok, hq, d, row_ok, stride_ot, stride_oh)

    @jit()
    def _attn_combine(
        o_ptr, pacc_ptr, pml_ptr, cu_ptr, qpos0_ptr, c, B, NSPLIT, HQ, stride_ot, stride_oh,
        G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        SPLIT: tl.constexpr, BLOCK_B: tl.constexpr,
    ):  # fmt: skip
        """The split-KV merge as its own launch, one program per (KV head, query block)."""
        hk = tl.program_id(0)
        TOK: tl.constexpr = BLOCK_M // G
        b, qb, q_start, q_len = _locate(cu_ptr, tl.program_id(1), B, TOK, BLOCK_B)
        if (qb >= 0) & (qb * TOK < q_len):
            rows = tl.arange(0, BLOCK_M)
            tok = qb * TOK + rows // G
            hq = hk * G + rows % G
            valid = (tok < q_len) & (rows < TOK * G)
            pos0 = tl.load(qpos0_ptr + b)
            pmax = pos0 + tl.minimum(qb * TOK + TOK, q_len) - 1
            d = tl.arange(0, BLOCK_D)
            _combine(
                o_ptr, pacc_ptr, pml_ptr, ((q_start + tok) * HQ + hq).to(tl.int64) * NSPLIT,
                tl.minimum(pmax // SPLIT + 1, NSPLIT), pos0 + tok, valid, valid[:, None] & (d < D)[None, :], d,
                q_start + tok, hq, c, stride_ot, stride_oh, SPLIT, BLOCK_M, BLOCK_D,
            )  # fmt: skip

    _LAUNCH_FWD = CachedLauncher(_attn_fwd)
    _LAUNCH_COMBINE = CachedLauncher(_attn_combine)


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 split-arrival counters, one per (KV head, query block); the
    kernel re-arms each to zero after use. One set per stream: calls on a stream run in order."""
    key = (device, torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[key] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf


_PARTIALS: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _partials(device: torch.device, n_acc: int, n_ml: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 split partials (accumulators; max and denominator). Written and read by one call's
    launches, so eager calls on a stream, which run in order, share one pair (two allocations
    per call were ~4 us of host time); a call being captured into a CUDA graph gets its own."""
    if device.type != "cuda" or torch._C._cuda_isCurrentStreamCapturing():
        return torch.empty(n_acc, device=device), torch.empty(n_ml, device=device)
    key = (device, torch._C._cuda_getCurrentRawStream(device.index))
    bufs = _PARTIALS.get(key)
    if bufs is None or bufs[0].numel() < n_acc or bufs[1].numel() < n_ml:
        old = bufs or (torch.empty(0), torch.empty(0))
        bufs = _PARTIALS[key] = (
            torch.empty(max(n_acc, old[0].numel()), device=device),
            torch.empty(max(n_ml, old[1].numel()), device=device),
        )
    return bufs


def _fuse_combine(q: torch.Tensor) -> bool:
    """Merge split-KV partials inside the split launch when running eagerly: one launch instead
    of two saves ~35 us of host time, which bounds small decode steps. Under CUDA-graph capture
    the host cost is gone and the separate merge is ~7% less device time (no arrival fences)."""
    return not (q.is_cuda and torch._C._cuda_isCurrentStreamCapturing())


def _check_heads(hq: int, hkv: int, cfg: AttnConfig) -> int:
    """The GQA group (query heads per KV head): any size that fits a query block. A block holds
    ``BLOCK_M // G`` whole tokens (its last ``BLOCK_M % G`` rows idle), so a row's arithmetic is
    the same whatever the group. A group above the decode block takes the prefill block."""
    largest = max(cfg.block_m, cfg.dec_block_m)
    if hkv < 1 or hq % hkv or hq // hkv > largest:
        raise ValueError(
            f"GQA group {hq}/{hkv}: query heads must be a multiple of KV heads, at most {largest} per KV head"
        )
    if cfg.split % cfg.block_n:
        raise ValueError(f"split {cfg.split} must be a multiple of block_n {cfg.block_n}")
    return hq // hkv


def _check(q: torch.Tensor, k_cache: torch.Tensor, cfg: AttnConfig) -> int:
    return _check_heads(q.shape[1], k_cache.shape[2], cfg)


def attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_q: torch.Tensor,
    q_pos0: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    config: AttnConfig | None = None,
) -> torch.Tensor:
    """The kernel's arithmetic in torch: per row, fixed splits of absolute key positions, each a
    fresh fp32 base-2 online softmax over BLOCK_N tiles in ascending order (probabilities rounded
    to the value dtype before the PV product), splits merged in ascending order, one division.
    ``config`` gives (split, block_n) other than :data:`CONFIG`'s."""
    cfg = config or CONFIG
    g = _check(q, k_cache, cfg)
    d = q.shape[-1]
    c = (scale if scale is not None else 1.0 / math.sqrt(d)) * LOG2E
    out = torch.empty_like(q)
    for b in range(cu_q.numel() - 1):
        s0, s1 = int(cu_q[b]), int(cu_q[b + 1])
        if s1 == s0:
            continue
        p0, n_kv, slot = int(q_pos0[b]), int(kv_len[b]), int(slots[b])
        qb = q[s0:s1].float().transpose(0, 1)  # (Hq, Lq, D)
        pos = torch.arange(p0, p0 + s1 - s0, device=q.device)
        last = int(pos[-1]) + 1
        k = torch.zeros(last, *k_cache.shape[2:], dtype=k_cache.dtype, device=q.device)
        v = torch.zeros_like(k)
        k[: min(n_kv, last)] = k_cache[slot, : min(n_kv, last)]  # past kv_len: zeros
        v[: min(n_kv, last)] = v_cache[slot, : min(n_kv, last)]
        k = k.repeat_interleave(g, dim=1).transpose(0, 1)  # (Hq, Lk, D)
        v = v.repeat_interleave(g, dim=1).transpose(0, 1)
        shape = (q.shape[1], s1 - s0)
        m_run, l_run = torch.full(shape, float("-inf"), device=q.device), torch.zeros(shape, device=q.device)
        acc_run = torch.zeros(*shape, d, device=q.device)
        for lo in range(0, last, cfg.split):
            m, den = torch.full(shape, float("-inf"), device=q.device), torch.zeros(shape, device=q.device)
            acc = torch.zeros(*shape, d, device=q.device)
            for n0 in range(lo, min(lo + cfg.split, last), cfg.block_n):
                kt, vt = k[:, n0 : n0 + cfg.block_n], v[:, n0 : n0 + cfg.block_n]
                cols = torch.arange(n0, n0 + kt.shape[1], device=q.device)
                s = qb @ kt.float().transpose(1, 2)
                s = torch.where(cols[None, None, :] <= pos[None, :, None], s, float("-inf"))
                m_new = torch.maximum(m, s.max(-1).values)
                alpha = torch.exp2((m - m_new) * c)
                p = torch.exp2(s * c - (m_new * c)[..., None])
                den = den * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + p.to(vt.dtype).float() @ vt.float()
                m = m_new
            take = pos[None, :] >= lo
            m_new = torch.maximum(m_run, m)
            a, bb = torch.exp2((m_run - m_new) * c), torch.exp2((m - m_new) * c)
            l_run = torch.where(take, l_run * a + den * bb, l_run)
            acc_run = torch.where(take[..., None], acc_run * a[..., None] + acc * bb[..., None], acc_run)
            m_run = torch.where(take, m_new, m_run)
        out[s0:s1] = (acc_run / l_run[..., None]).transpose(0, 1).to(q.dtype)
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
    config: AttnConfig | None = None,
) -> torch.Tensor:
    """Invariant causal attention for packed queries against a KV cache (see the module doc).
    ``config`` overrides :data:`CONFIG` (tuning and tests only: every call that must agree in
    bits must use the same ``split`` and ``block_n``). No host synchronisation: the grid is sized
    from tensor shapes and each program finds its sequence on the device."""
    cfg = config or CONFIG
    b = cu_q.numel() - 1
    if resolve(impl, q) == "torch":
        if slots is None:
            slots = torch.arange(b, device=q.device, dtype=torch.int32)
        return attention_reference(q, k_cache, v_cache, cu_q, q_pos0, kv_len, slots, scale, cfg)
    t, hq, d = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    out = torch.empty_like(q)
    if b == 0 or t == 0:
        _check(q, k_cache, cfg)
        return out
    tma = (cfg.tma or cfg.dec_tma) and _tma_ok(k_cache, v_cache)
    plan = _plan(t, b, hq, k_cache.shape[2], d, k_cache.shape[1], q.dtype, cfg, _fuse_combine(q), tma)
    if plan.fwd_constexprs[0]["TMA"] and q.is_cuda:
        _ensure_allocator()  # the kernel-built descriptors live in Triton's global scratch
    c = (scale if scale is not None else 1.0 / math.sqrt(d)) * LOG2E
    dev = q.device
    if plan.split_kv:
        pacc, pml = _partials(dev, plan.pacc_elems, plan.pml_elems)
    else:
        pacc = pml = out
    cu, pos0, kvl = _i32(cu_q, dev), _i32(q_pos0, dev), _i32(kv_len, dev)
    sl = cu if slots is None else _i32(slots, dev)
    counters = _arrival_counters(dev, plan.counters) if plan.fused else cu
    args = (
        q, k_cache, v_cache, out, pacc, pml, counters, cu, pos0, kvl, sl,
        c, b, plan.nsplit, hq, *q.stride()[:2], *k_cache.stride()[:3], *v_cache.stride()[:3], *out.stride()[:2],
    )  # fmt: skip
    # Triton specialises on the integers (all fixed by the plan and the strides in the key) and
    # on the pointers' alignment; the fresh buffers (out, partials, counters) are always aligned.
    key = (plan, slots is None, q.stride(), k_cache.stride(), v_cache.stride(),
           aligned(q, k_cache, v_cache, cu, pos0, kvl, sl), dev)  # fmt: skip
    _LAUNCH_FWD(key, plan.grid, args, plan.fwd_constexprs[slots is not None], **plan.fwd_options)
    if plan.split_kv and not plan.fused:
        cargs = (out, pacc, pml, cu, pos0, c, b, plan.nsplit, hq, *out.stride()[:2])
        _LAUNCH_COMBINE(key, plan.grid[:2] + (1,), cargs, plan.common, num_warps=4)
    return out


def _tma_ok(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether each (sequence, KV head)'s keys and values can be TMA descriptors: a GPU that has
    TMA (Hopper on), 16-byte aligned bases and row strides (else the pointer loads serve, with the
    same bits)."""
    if k_cache.is_cuda and _capability(k_cache.device) < (9, 0):
        return False
    return all(
        t.data_ptr() % 16 == 0 and all(st * t.element_size() % 16 == 0 for st in t.stride()[:3])
        for t in (k_cache, v_cache)
    )


@cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _i32(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` as int32 on ``device`` (itself when it already is: a ``.to`` call costs ~1 us)."""
    if t.dtype == torch.int32 and t.device == device:
        return t
    return t.to(device=device, dtype=torch.int32)


@dataclass(frozen=True, eq=False)
class _Plan:
    """What a call's shapes fix: the launch path, grid, buffer sizes, constexprs and options
    (one object per shape, so launches key on its identity)."""

    split_kv: bool
    fused: bool
    nsplit: int
    grid: tuple[int, int, int]
    counters: int
    pacc_elems: int
    pml_elems: int
    common: dict
    fwd_options: dict
    fwd_constexprs: tuple[dict, dict]  # without, with slots


@lru_cache(maxsize=4096)
def _plan(
    t: int,
    b: int,
    hq: int,
    hkv: int,
    d: int,
    cache_len: int,
    dtype: torch.dtype,
    cfg: AttnConfig,
    fuse: bool,
    tma_ok: bool = False,
) -> _Plan:
    g = hq // hkv
    _check_heads(hq, hkv, cfg)
    block_d = max(16, next_power_of_2(d))
    nsplit = cdiv(cache_len, cfg.split)
    pre = (cfg.block_m, cfg.warps, cfg.stages)
    dec = (cfg.dec_block_m, cfg.dec_warps, cfg.dec_stages) if cfg.dec_block_m >= g else pre
    decode_shaped = t <= b * (dec[0] // g) and t * hq * nsplit * (block_d + 2) <= MAX_PARTIAL_ELEMS
    split_kv = decode_shaped and nsplit > 1  # one split needs no partials: its state is the result
    bm, warps, stages = dec if decode_shaped else pre
    blocks = cdiv(t, bm // g) + b  # >= the sum over sequences of their query blocks
    fused = split_kv and fuse
    common = dict(G=g, D=d, BLOCK_D=block_d, BLOCK_M=bm, SPLIT=cfg.split, BLOCK_B=next_power_of_2(b + 1))
    fwd = dict(
        common,
        PRECISION=dot_precision(dtype),
        BLOCK_N=cfg.block_n,
        SPLIT_KV=split_kv,
        ONE_SPLIT=nsplit == 1,
        FUSED_COMBINE=fused,
        TMA=tma_ok and (cfg.dec_tma if decode_shaped else cfg.tma),
        WS=cfg.ws and not decode_shaped,
    )
    return _Plan(
        split_kv, fused, nsplit, (hkv, blocks, nsplit if split_kv else 1), hkv * blocks,
        t * hq * nsplit * block_d, t * hq * nsplit * 2, common, dict(num_warps=warps, num_stages=stages),
        (dict(fwd, HAS_SLOTS=False), dict(fwd, HAS_SLOTS=True)),
    )  # fmt: skip


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


if HAVE_TRITON:

    @jit()
    def _bwd_dq_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, dq_ptr, lse_ptr, delta_ptr, slot_ptr,
        c, scale, lq, p0, n_kv, HQ,
        stride_qt, stride_qh, stride_ks, stride_kt, stride_kh, stride_vs, stride_vt, stride_vh,
        G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, LSE_ONLY: tl.constexpr,
    ):  # fmt: skip
        """One (query block, sequence x query head): the rows' base-2 log-sum-exp over their keys
        (a fresh online pass), then dQ = scale * sum_n dS K over the key tiles in ascending order;
        also stores the rows' lse and delta = rowsum(dO * O) for the dK/dV kernel. LSE_ONLY: the
        lse and delta alone (the dK/dV kernel then sums dQ)."""
        m0 = tl.program_id(0) * BLOCK_M
        bh = tl.program_id(1)
        bi = bh // HQ
        hq = bh % HQ
        hk = hq // G
        offs_m = m0 + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        qmask = offs_m < lq
        row_ok = qmask[:, None] & (d < D)[None, :]
        rows = (bi * lq + offs_m).to(tl.int64)
        qo = rows[:, None] * stride_qt + hq * stride_qh + d[None, :]
        q = tl.load(q_ptr + qo, mask=row_ok, other=0.0)
        do = tl.load(do_ptr + qo, mask=row_ok, other=0.0)
        o = tl.load(o_ptr + qo, mask=row_ok, other=0.0)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        pos = p0 + offs_m
        slot = tl.load(slot_ptr + bi).to(tl.int64)
        k_base = k_ptr + slot * stride_ks + hk * stride_kh
        v_base = v_ptr + slot * stride_vs + hk * stride_vh
        hi = tl.minimum(n_kv, p0 + tl.minimum(m0 + BLOCK_M, lq))
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        for n0 in range(0, hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            kv_ok = (cols < n_kv)[:, None] & (d < D)[None, :]
            k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kt + d[None, :], mask=kv_ok, other=0.0)
            sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * c
            sc = tl.where((cols[None, :] <= pos[:, None]) & (cols < n_kv)[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, 1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(sc - m_new[:, None]), 1)
            m_i = m_new
        lse = m_i + tl.log2(l_i)
        dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for n0 in range(0, 0 if LSE_ONLY else hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            kv_ok = (cols < n_kv)[:, None] & (d < D)[None, :]
            k = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kt + d[None, :], mask=kv_ok, other=0.0)
            v = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vt + d[None, :], mask=kv_ok, other=0.0)
            sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * c
            vis = (cols[None, :] <= pos[:, None]) & (cols < n_kv)[None, :]
            p = tl.where(vis, tl.exp2(sc - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
        if not LSE_ONLY:
            tl.store(dq_ptr + qo, (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok)
        ml = (bi * HQ + hq).to(tl.int64) * lq + offs_m
        tl.store(lse_ptr + ml, lse, mask=qmask)
        tl.store(delta_ptr + ml, delta, mask=qmask)

    @jit()
    def _bwd_dkv_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, slot_ptr, dqacc_ptr, turn_ptr,
        c, scale, lq, p0, n_kv, HQ, HKV,
        stride_qt, stride_qh, stride_ks, stride_kt, stride_kh, stride_vs, stride_vt, stride_vh,
        G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, FUSED_DQ: tl.constexpr,
    ):  # fmt: skip
        """One (key block, sequence x KV head): dV = sum P^T dO and dK = scale * sum dS^T Q over
        the group's query heads in order, each over its query tiles in ascending order.

        FUSED_DQ: also dS K, added into the fp32 ``dqacc`` in descending key-block order, whatever
        the timing: each (sequence, query head, query tile) has a turn counter, and key block j
        adds its part when the counter says every contributing block above j has added. Programs
        run key blocks from the last down (block j is program ``nb - 1 - j``), so a block only
        waits for programs launched before it, and the causal wavefront rarely waits at all."""
        nb = tl.num_programs(0)
        jb = nb - 1 - tl.program_id(0) if FUSED_DQ else tl.program_id(0)
        n0 = jb * BLOCK_N
        bh = tl.program_id(1)
        bi = bh // HKV
        hk = bh % HKV
        cols = n0 + tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        kv_ok = (cols < n_kv)[:, None] & (d < D)[None, :]
        slot = tl.load(slot_ptr + bi).to(tl.int64)
        ko = slot * stride_ks + cols[:, None].to(tl.int64) * stride_kt + hk * stride_kh + d[None, :]
        vo = slot * stride_vs + cols[:, None].to(tl.int64) * stride_vt + hk * stride_vh + d[None, :]
        k = tl.load(k_ptr + ko, mask=kv_ok, other=0.0)
        v = tl.load(v_ptr + vo, mask=kv_ok, other=0.0)
        dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
        m_lo = (tl.maximum(n0 - p0, 0) // BLOCK_M) * BLOCK_M  # earlier queries see none of these keys
        for g in range(G):
            hq = hk * G + g
            for m0 in range(m_lo, lq, BLOCK_M):
                offs_m = m0 + tl.arange(0, BLOCK_M)
                qmask = offs_m < lq
                row_ok = qmask[:, None] & (d < D)[None, :]
                qo = (bi * lq + offs_m).to(tl.int64)[:, None] * stride_qt + hq * stride_qh + d[None, :]
                q = tl.load(q_ptr + qo, mask=row_ok, other=0.0)
                do = tl.load(do_ptr + qo, mask=row_ok, other=0.0)
                ml = (bi * HQ + hq).to(tl.int64) * lq + offs_m
                lse = tl.load(lse_ptr + ml, mask=qmask, other=0.0)
                delta = tl.load(delta_ptr + ml, mask=qmask, other=0.0)
                pos = p0 + offs_m
                sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * c
                vis = (cols[None, :] <= pos[:, None]) & (cols < n_kv)[None, :] & qmask[:, None]
                p = tl.where(vis, tl.exp2(sc - lse[:, None]), 0.0)
                dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=PRECISION)
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
                ds = p * (dp - delta[:, None])
                dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=PRECISION)
                if FUSED_DQ:
                    part = tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
                    # Blocks above jb that reach this tile (its last row's position bounds them).
                    turn = tl.minimum(nb - 1, (p0 + tl.minimum(m0 + BLOCK_M, lq) - 1) // BLOCK_N) - jb
                    cnt = turn_ptr + ((bi * HQ + hq) * tl.cdiv(lq, BLOCK_M) + m0 // BLOCK_M)
                    while tl.atomic_cas(cnt, turn, turn, sem="acquire") != turn:
                        pass
                    tl.debug_barrier()
                    acc_ptrs = dqacc_ptr + qo
                    acc = tl.load(acc_ptrs, mask=row_ok, other=0.0, cache_modifier=".cg")
                    tl.store(acc_ptrs, acc + part, mask=row_ok)
                    tl.debug_barrier()  # every thread's store precedes the next block's turn
                    tl.atomic_xchg(cnt, turn + 1, sem="release")
        tl.store(dk_ptr + ko, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_ok)
        tl.store(dv_ptr + vo, dv.to(dv_ptr.dtype.element_ty), mask=kv_ok)


def _triton_uniform_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, grad: torch.Tensor,
    lq: int, p0: int, n_kv: int, slots: torch.Tensor, scale: float, config: AttnConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The uniform batch's gradients by two Triton kernels with a fixed order of accumulation (no
    atomics: each gradient element is one program's): dQ per query block, then dK/dV per key
    block. Probabilities are recomputed from the scores and the rows' log-sum-exp; products take
    the model dtype's tensor cores with fp32 accumulation, as flash attention's backward does.
    Tiles from ``config`` (:data:`CONFIG`) on CUDA: the dQ kernel's key tile and the dK/dV
    kernel's query tile fix the summation order; under the interpreter all tiles are 16."""
    b = slots.numel()
    hq, hkv, d = q.shape[1], k.shape[2], q.shape[2]
    g = hq // hkv
    q, grad, out = q.contiguous(), grad.contiguous().to(q.dtype), out.contiguous()
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    dev = q.device
    cfg = config or CONFIG
    tiles = (cfg.bwd_dq_m, cfg.bwd_dq_n, cfg.bwd_dkv_m, cfg.bwd_dkv_n) if q.is_cuda else (16, 16, 16, 16)
    block_d = max(16, next_power_of_2(d))
    c = scale * LOG2E
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    fused = cfg.bwd_fused
    lse = torch.empty(b * hq * lq, dtype=torch.float32, device=dev)
    delta = torch.empty_like(lse)
    sl = slots.to(device=dev, dtype=torch.int32)
    common = dict(G=g, D=d, BLOCK_D=block_d, PRECISION=dot_precision(q.dtype))
    opts = dict(num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages) if q.is_cuda else dict(num_warps=4)
    strides = (*q.stride()[:2], *k.stride()[:3], *v.stride()[:3])
    _bwd_dq_kernel[(cdiv(lq, tiles[0]), b * hq)](
        q,
        k,
        v,
        out,
        grad,
        dq,
        lse,
        delta,
        sl,
        c,
        scale,
        lq,
        p0,
        n_kv,
        hq,
        *strides,
        BLOCK_M=tiles[0],
        BLOCK_N=tiles[1],
        LSE_ONLY=fused,
        **common,
        **opts,
    )
    if fused:
        dqacc = torch.zeros(q.shape, dtype=torch.float32, device=dev)
        turns = torch.zeros(b * hq * cdiv(lq, tiles[2]), dtype=torch.int32, device=dev)
    else:
        dqacc, turns = dq, sl  # unused
    _bwd_dkv_kernel[(cdiv(n_kv, tiles[3]), b * hkv)](
        q, k, v, grad, dk, dv, lse, delta, sl, dqacc, turns, c, scale, lq, p0, n_kv, hq, hkv, *strides,
        BLOCK_M=tiles[2], BLOCK_N=tiles[3], FUSED_DQ=fused, **common, **opts,
    )  # fmt: skip
    if fused:
        dq = (dqacc * scale).to(q.dtype)
    return dq, dk, dv


_TRITON_BACKWARD_FAILED = False


def _backward_failed(exc: Exception) -> None:
    """Remember (and say once) that the Triton backward could not run here."""
    global _TRITON_BACKWARD_FAILED
    _TRITON_BACKWARD_FAILED = True
    warnings.warn(
        f"isoaudit.kernels.attention: the Triton backward failed ({exc!r}); using the torch chain",
        stacklevel=3,
    )


#: Bound on the fp32 score blocks the batched backward holds at once (bytes); sequences beyond it
#: are processed in groups, in order.
BACKWARD_BYTES = 1 << 31


def _uniform_batch_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad: torch.Tensor,
    cu_q: torch.Tensor,
    q_pos0: torch.Tensor,
    kv_len: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Gradients of :func:`_math_attention` for the trainer's batch, all sequences at once.

    A trainer's batch is uniform: every sequence has the same query count, first position and key
    count, each in its own slot. Then the fp32 math (scores, masked softmax, probabilities times
    values) is one batched matmul chain per group of sequences, and its gradients are the textbook
    formulas (dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K, dK = dS^T Q), summed over
    each KV head's query heads in a fixed order: no atomics, one host read of the metadata instead
    of several per sequence. Returns None for any other batch (the per-sequence path serves).
    With the forward's output and Triton, the two kernels of :func:`_triton_uniform_backward`."""
    b = cu_q.numel() - 1
    if b == 0:
        return None
    meta = torch.cat(
        [
            cu_q.reshape(-1).long(),
            q_pos0.reshape(-1).long(),
            kv_len.reshape(-1).long(),
            slots.reshape(-1).long(),
        ]
    )
    cu, p0, nk, sl = (lambda x: (x[: b + 1], x[b + 1 : 2 * b + 1], x[2 * b + 1 : 3 * b + 1], x[3 * b + 1 :]))(
        meta.tolist()
    )
    lq = cu[1] - cu[0]
    if (
        lq <= 0
        or any(cu[i + 1] - cu[i] != lq for i in range(b))
        or len(set(p0)) != 1
        or len(set(nk)) != 1
        or len(set(sl)) != b
    ):
        return None
    p0_, n_kv = p0[0], nk[0]
    # On the CPU only under the interpreter in fp32 (structure tests): its bf16 products are not
    # the hardware's, and the torch chain is faster there.
    triton_here = q.is_cuda or (interpreting() and q.dtype == torch.float32)
    if out is not None and triton_here and use_triton(q) and cu[0] == 0 and not _TRITON_BACKWARD_FAILED:
        try:
            return _triton_uniform_backward(q, k, v, out, grad, lq, p0_, n_kv, torch.tensor(sl), scale)
        except Exception as exc:  # noqa: BLE001 - a kernel that does not build here: the torch chain serves
            _backward_failed(exc)
    hq, hkv, d = q.shape[1], k.shape[2], q.shape[2]
    g = hq // hkv
    dev = q.device
    pos = torch.arange(p0_, p0_ + lq, device=dev)
    masked = torch.arange(n_kv, device=dev)[None, :] > pos[:, None]  # (lq, n_kv)
    gq = torch.empty(q.shape, dtype=torch.float32, device=dev)
    gk = torch.zeros(k.shape, dtype=torch.float32, device=dev)
    gv = torch.zeros(v.shape, dtype=torch.float32, device=dev)
    per_seq = hq * lq * n_kv * 4 * 3  # scores, probabilities, their gradient
    step = max(1, BACKWARD_BYTES // max(per_seq, 1))
    slot_t = torch.tensor(sl, device=dev)
    for s0 in range(0, b, step):
        s1 = min(s0 + step, b)
        nb = s1 - s0
        rows = slice(cu[s0], cu[s1])
        idx = slot_t[s0:s1]
        qb = q[rows].float().view(nb, lq, hkv, g, d).permute(0, 2, 3, 1, 4)  # (nb, Hkv, G, lq, D)
        kb = k.index_select(0, idx)[:, :n_kv].float().permute(0, 2, 1, 3)[:, :, None]  # (nb, Hkv, 1, n, D)
        vb = v.index_select(0, idx)[:, :n_kv].float().permute(0, 2, 1, 3)[:, :, None]
        do = grad[rows].float().view(nb, lq, hkv, g, d).permute(0, 2, 3, 1, 4)
        sc = (qb @ kb.transpose(-1, -2)) * scale
        p = torch.softmax(sc.masked_fill(masked, float("-inf")), -1)
        o = p @ vb
        dv = (p.transpose(-1, -2) @ do).sum(2)  # (nb, Hkv, n, D), the group's heads summed
        dp = do @ vb.transpose(-1, -2)
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        dq = (ds @ kb) * scale
        dk = ((ds.transpose(-1, -2) @ qb) * scale).sum(2)
        gq[rows] = dq.permute(0, 3, 1, 2, 4).reshape(nb * lq, hq, d)
        gk[idx, :n_kv] = dk.permute(0, 2, 1, 3)
        gv[idx, :n_kv] = dv.permute(0, 2, 1, 3)
    return gq, gk, gv


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, q_pos0, kv_len, slots, scale):
        out = attention(q, k, v, cu_q, q_pos0, kv_len, slots, scale)
        ctx.save_for_backward(q, k, v, cu_q, q_pos0, kv_len, slots, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, cu_q, q_pos0, kv_len, slots, out = ctx.saved_tensors
        fast = _uniform_batch_backward(q, k, v, grad, cu_q, q_pos0, kv_len, slots, ctx.scale, out)
        if fast is not None:
            gq, gk, gv = fast
            return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype), None, None, None, None, None
        with torch.enable_grad():
            qd, kd, vd = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = _math_attention(qd, kd, vd, cu_q, q_pos0, kv_len, slots, ctx.scale)
            gq, gk, gv = torch.autograd.grad(out, (qd, kd, vd), grad.float())
        return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype), None, None, None, None, None


def attention_modes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: list[int],
    decode_at: list[int],
    config: AttnConfig | None = None,
) -> list[torch.Tensor]:
    """The module's promise, made checkable: one sequence (queries ``q``, cache slot 0 of ``k``/``v``)
    as a whole prefill, as chunked prefill for each chunk size, and decoded at the positions
    ``decode_at`` in a batch beside another sequence of another length (in slot 1, listed first);
    each result restricted to the rows ``decode_at``. Under one ``config`` all must be bitwise equal."""
    n, dev = q.shape[0], q.device

    def call(qq: torch.Tensor, kk: torch.Tensor, vv: torch.Tensor, *meta: list[int]) -> torch.Tensor:
        cu, p0, kl, *sl = (torch.tensor(x, device=dev, dtype=torch.int32) for x in meta)
        return attention(qq, kk, vv, cu, p0, kl, sl[0] if sl else None, config=config)

    outs = [call(q, k, v, [0, n], [0], [n])]
    for c in chunks:
        parts = [call(q[s : s + c], k, v, [0, min(c, n - s)], [s], [min(s + c, n)]) for s in range(0, n, c)]
        outs.append(torch.cat(parts))
    other = torch.randn(3, *q.shape[1:], device=dev, dtype=q.dtype)
    kk = torch.stack([k[0], torch.randn_like(k[0])])
    vv = torch.stack([v[0], torch.randn_like(v[0])])
    rows = [
        call(torch.cat([other, q[p : p + 1]]), kk, vv, [0, 3, 4], [p % 7, p], [p % 7 + 3, p + 1], [1, 0])[3:]
        for p in decode_at
    ]
    return [o[decode_at] for o in outs] + [torch.cat(rows)]


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
