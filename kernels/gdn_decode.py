"""CPR Gated DeltaNet decode: one token per sequence with the trainer's bits, at the cost of the
16-row slab that holds the token rather than the whole open chunk.

The trainer (:mod:`isoaudit.kernels.gdn`) computes every row-``i`` quantity of a chunk as a dot whose left
operand is row ``i`` of ``A``, a power of ``A``, ``T``, ``P`` or an input. On the H200 a 64-row
``tl.dot`` (``wgmma``) and a 16-row one (``mma.sync``) give each row the same bits for the same K
and N (probed over bf16 and tf32 operands, with and without an accumulator, and covered by
``test_gdn.py``'s split tests), so decode evaluates those dots on the 16 rows of the new token's
slab only. What a slab's dots read from the rows before it is cached per slot, as the trainer's
registers held it:

* the powers ``-A, A^2, A^4, ..., A^(C/2)`` in fp32 (the right operands of ``T``'s repeated
  squaring, ``T = (I - A)(I + A^2)...``), one (C, C) matrix each;
* ``U' = U - W H`` in the inputs' dtype (the right operand of the output's ``P U'`` and of the
  boundary state's update);
* the boundary state rounded to the inputs' dtype, as the chunk kernels read it.

A row depends on the rows before it alone, so cached rows stay final until the chunk fills; the
rows after the token are masked to zero (the trainer's later rows meet exact-zero coefficients).

One program per (sequence, head, dv block), one launch per step. The value columns are
independent: ``A``, its powers, ``T`` and ``W`` read keys, gates and betas alone, and a column of
``U``, ``U'``, the output and the state reads the same column of ``v``, ``U'`` and the state, each
through a dot whose K side is the whole chunk or the whole dk. So each program evaluates the
key-side chain (the same code, the same bits in every block) and its own columns; the N tile of a
dot changes no bit of its elements (``test_gdn_decode.py``). A program takes the token from its
inputs in registers, appends it to the open chunk (for the later steps), recomputes the token's
slab (and, after a prefill left an open chunk, the slabs not yet cached, in order), stores the
rows the cache lacks, emits its columns of the token's output and, when the chunk is full, writes
its columns of the next boundary state with the trainer's state dot; the slot's last program to
finish (an atomic count) moves its counters on. The launch parameters (the dv block, the warps)
come from :data:`DECODE_TABLE` by batch size; none of them changes a bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import HAVE_TRITON, CachedLauncher, aligned, cdiv, dot_precision, jit, tl, triton
from .gdn import CHUNK, GDNCache, _kernel_inputs, _tile_widths

SLAB = 16  # the rows one decode step computes: tl.dot's smallest M


@dataclass(frozen=True)
class DecodeLaunch:
    """One launch configuration of the decode step: ``bv`` value columns per program (a power of
    two >= 16; the grid has ``ceil(dv / bv)`` programs per sequence and head), ``warps`` and
    ``stages`` (Triton's ``num_warps`` and ``num_stages``)."""

    bv: int
    warps: int
    stages: int = 1


#: (largest batch, launch), in increasing batch order; the last row serves any larger batch. Small
#: batches split the value columns over more programs (a step at B=1 is latency: 16 heads alone
#: fill 16 of the GPU's SMs); large ones keep whole heads (every block repeats the key-side chain).
DECODE_TABLE: tuple[tuple[int, DecodeLaunch], ...] = (
    (1, DecodeLaunch(32, 4)),
    (4, DecodeLaunch(64, 4)),
    (1 << 30, DecodeLaunch(128, 4)),
)

#: What ``bench/kernels.py --only fla_decode_tune`` times (and ``test_gdn_decode.py`` checks bit
#: for bit against the chunk form): every launch the table may be given.
DECODE_CANDIDATES: tuple[DecodeLaunch, ...] = (
    DecodeLaunch(16, 1),
    DecodeLaunch(16, 2),
    DecodeLaunch(16, 4),
    DecodeLaunch(32, 2),
    DecodeLaunch(32, 4),
    DecodeLaunch(32, 8),
    DecodeLaunch(64, 2),
    DecodeLaunch(64, 4),
    DecodeLaunch(64, 8),
    DecodeLaunch(128, 4),
    DecodeLaunch(128, 8),
    DecodeLaunch(128, 4, 2),
)


def decode_launch(batch: int) -> DecodeLaunch:
    """The :data:`DECODE_TABLE` row for ``batch`` sequences."""
    for most, launch in DECODE_TABLE:
        if batch <= most:
            return launch
    return DECODE_TABLE[-1][1]


def _input_strides(q, k, v, g, beta) -> tuple[int, ...]:
    """The token and head strides of the kernels' inputs (g and beta: the token stride only)."""
    return (
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
    )


if HAVE_TRITON:
    from .gdn import _cumsum_chain, _decay_rows

    @triton.jit
    def _slab_of(x, s, NS: tl.constexpr, S: tl.constexpr):
        """Rows ``s * S ...`` of the (NS * S,) vector ``x``, exactly (the others add zeros)."""
        return tl.sum(tl.where((tl.arange(0, NS) == s)[:, None], tl.reshape(x, (NS, S)), 0.0), axis=0)

    @triton.jit
    def _with_slab(full, slab, s, NS: tl.constexpr, S: tl.constexpr):
        """``full`` (NS * S, N) with rows ``s * S ...`` replaced by ``slab`` (S, N)."""
        n: tl.constexpr = full.shape[1]
        f3 = tl.reshape(full, (NS, S, n))
        f3 = tl.where((tl.arange(0, NS) == s)[:, None, None], slab[None, :, :], f3)
        return tl.reshape(f3, (NS * S, n))

    @triton.jit
    def _chunk_rows(buf_ptr, row, ok, cols, cok, NC: tl.constexpr):
        """Rows ``row`` (int64 row indices of a (rows, NC) buffer of the open chunks) where ``ok``,
        columns ``cols`` where ``cok``; zero elsewhere."""
        return tl.load(
            buf_ptr + row[:, None] * NC + cols[None, :], mask=ok[:, None] & cok[None, :], other=0.0
        )

    @triton.jit
    def _slab_vnew(
        s0,
        i,
        cached,
        slot,
        h,
        H,
        c,
        G,
        k_all,
        kw,
        vw,
        entering,
        k_t,
        b_t,
        kb_ptr,
        bb_ptr,
        pw,
        vn_at,
        kd,
        kok,
        vv,
        vok,
        DK: tl.constexpr,
        DV: tl.constexpr,
        C: tl.constexpr,
        S: tl.constexpr,
        SQUARINGS: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """U' of the slab from row ``s0`` (this program's columns): its rows of A's powers (from
        the cached rows before it, with its own put in from registers), of T, W and U. Stores the
        rows from ``cached`` to ``i`` (the cache's new rows) of the powers and of U'."""
        dt = kb_ptr.dtype.element_ty
        r = s0 + tl.arange(0, S)
        rat = r == i
        before = (c < s0)[:, None]
        new = ((r >= cached) & (r <= i))[:, None]
        rrow = ((slot * C + r) * H + h).to(tl.int64)
        k_r = tl.where(rat[:, None], k_t[None, :], _chunk_rows(kb_ptr, rrow, r < i, kd, kok, DK))
        b_r = tl.where(rat, b_t, tl.load(bb_ptr + rrow, mask=r < i, other=0.0))
        G_r = _slab_of(G, s0 // S, C // S, S)
        kk = tl.dot(k_r, tl.trans(k_all), input_precision=PREC)
        power = -tl.where(r[:, None] > c[None, :], (b_r[:, None] * kk) * _decay_rows(G_r, G, r, c), 0.0)
        t = tl.where(r[:, None] == c[None, :], 1.0, 0.0) + power
        tl.store(pw + r[:, None] * C + c[None, :], power, mask=new)
        full = tl.load(pw + c[:, None] * C + c[None, :], mask=before, other=0.0)
        full = _with_slab(full, power, s0 // S, C // S, S)
        for p in tl.static_range(SQUARINGS):
            # issued before the dot, so its latency hides behind it
            nxt = tl.load(pw + (p + 1) * C * C + c[:, None] * C + c[None, :], mask=before, other=0.0)
            power = tl.dot(power, full, input_precision=PREC)
            tl.store(pw + (p + 1) * C * C + r[:, None] * C + c[None, :], power, mask=new)
            full = _with_slab(nxt, power, s0 // S, C // S, S)
            t = tl.dot(t, full, t, input_precision=PREC)
        t = t.to(dt)
        w = tl.dot(t, kw, input_precision=PREC).to(dt)
        u = tl.dot(t, vw, input_precision=PREC).to(dt)
        vn = (u.to(tl.float32) - tl.dot(w, entering, input_precision=PREC)).to(dt)
        tl.store(vn_at + r[:, None] * DV + vv[None, :], vn, mask=new & vok[None, :])
        return vn

    @jit()
    def _gdn_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        b_ptr,
        slot_ptr,
        len_ptr,
        cached_ptr,
        arrived_ptr,
        qb_ptr,
        kb_ptr,
        vb_ptr,
        gb_ptr,
        bb_ptr,
        h_ptr,
        he_ptr,
        pw_ptr,
        vn_ptr,
        o_ptr,
        H,
        stride_qb,
        stride_qh,
        stride_kb,
        stride_kh,
        stride_vb,
        stride_vh,
        stride_gb,
        stride_bb,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        C: tl.constexpr,
        S: tl.constexpr,
        SQUARINGS: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """Token ``bi`` of head ``h``, value columns ``iv * BV ...``: its row ``i`` of the slot's
        open chunk, the slab of rows ``i`` is in (and any earlier slab not cached), o_i, and at
        ``i = C - 1`` the boundary state."""
        bi = tl.program_id(0)
        h = tl.program_id(1)
        iv = tl.program_id(2)
        slot = tl.load(slot_ptr + bi)
        i = tl.load(len_ptr + slot)
        cached = tl.load(cached_ptr + slot)
        dt = kb_ptr.dtype.element_ty
        kd = tl.arange(0, BK)
        vv = iv * BV + tl.arange(0, BV)
        kok = kd < DK
        vok = vv < DV
        # The token in the buffers' dtype (as its store into the open chunk rounds it, which the
        # later steps read); this step takes it from registers.
        q_t = tl.load(q_ptr + bi * stride_qb + h * stride_qh + kd, mask=kok, other=0.0).to(
            qb_ptr.dtype.element_ty
        )
        k_t = tl.load(k_ptr + bi * stride_kb + h * stride_kh + kd, mask=kok, other=0.0).to(dt)
        v_t = tl.load(v_ptr + bi * stride_vb + h * stride_vh + vv, mask=vok, other=0.0).to(
            vb_ptr.dtype.element_ty
        )
        g_t = tl.load(g_ptr + bi * stride_gb + h).to(gb_ptr.dtype.element_ty)
        b_t = tl.load(b_ptr + bi * stride_bb + h).to(bb_ptr.dtype.element_ty)
        irow = ((slot * C + i) * H + h).to(tl.int64)
        tl.store(vb_ptr + irow * DV + vv, v_t, mask=vok)
        if iv == 0:
            tl.store(qb_ptr + irow * DK + kd, q_t, mask=kok)
            tl.store(kb_ptr + irow * DK + kd, k_t, mask=kok)
            tl.store(gb_ptr + irow, g_t)
            tl.store(bb_ptr + irow, b_t)

        # The chunk's rows (those after i are zero, as the trainer's masked tail).
        c = tl.arange(0, C)
        at_i = c == i
        crow = ((slot * C + c) * H + h).to(tl.int64)
        gc = tl.where(at_i, g_t, tl.load(gb_ptr + crow, mask=c < i, other=0.0))
        bc = tl.where(at_i, b_t, tl.load(bb_ptr + crow, mask=c < i, other=0.0))
        G = _cumsum_chain(gc, C)
        k_all = tl.where(at_i[:, None], k_t[None, :], _chunk_rows(kb_ptr, crow, c < i, kd, kok, DK))
        v_all = tl.where(at_i[:, None], v_t[None, :], _chunk_rows(vb_ptr, crow, c < i, vv, vok, DV))
        kw = (k_all.to(tl.float32) * (bc * tl.exp(G))[:, None]).to(dt)
        vw = (v_all.to(tl.float32) * bc[:, None]).to(dt)
        hs = (slot * H + h).to(tl.int64)
        hmask = kok[:, None] & vok[None, :]
        h_at = h_ptr + hs * DK * DV + kd[:, None] * DV + vv[None, :]
        # The state entering the chunk in the inputs' dtype, as the chunk kernels read it: rounded
        # from the fp32 state at the chunk's first decode step (or the first after a prefill),
        # then read as it was kept (half the bytes of the fp32 state, every step).
        he_at = he_ptr + hs * DK * DV + kd[:, None] * DV + vv[None, :]
        fresh = (tl.zeros((BK, 1), tl.int32) + cached) == 0  # as a mask: no branch
        rounded = tl.load(h_at, mask=hmask & fresh, other=0.0).to(dt)
        tl.store(he_at, rounded, mask=hmask & fresh)
        entering = tl.where(fresh, rounded, tl.load(he_at, mask=hmask & ~fresh, other=0.0))
        pw = pw_ptr + hs * (SQUARINGS + 1) * C * C
        vn_at = vn_ptr + hs * C * DV

        # The output's parts that read no U': (q H) e^G and P = tril(q k^T e^{G_i - G_j}) on i's slab.
        s_i = i // S * S
        r = s_i + tl.arange(0, S)
        rrow = ((slot * C + r) * H + h).to(tl.int64)
        q_r = tl.where((r == i)[:, None], q_t[None, :], _chunk_rows(qb_ptr, rrow, r < i, kd, kok, DK))
        G_r = _slab_of(G, s_i // S, C // S, S)
        qk = tl.dot(q_r, tl.trans(k_all), input_precision=PREC)
        p_r = tl.where(r[:, None] >= c[None, :], qk * _decay_rows(G_r, G, r, c), 0.0).to(dt)
        o = tl.dot(q_r, entering, input_precision=PREC) * tl.exp(G_r)[:, None]

        # The slabs before i's not cached yet (after a prefill), in order; then i's own. A slab's
        # right operands are the cached rows before it with the slab's own rows from registers.
        for s0 in range(cached // S * S, s_i, S):
            _slab_vnew(s0, i, cached, slot, h, H, c, G, k_all, kw, vw, entering, k_t, b_t, kb_ptr, bb_ptr,
                       pw, vn_at, kd, kok, vv, vok, DK, DV, C, S, SQUARINGS, PREC)  # fmt: skip
            tl.debug_barrier()  # its stores, read by the next slab
        vn = _slab_vnew(s_i, i, cached, slot, h, H, c, G, k_all, kw, vw, entering, k_t, b_t, kb_ptr, bb_ptr,
                        pw, vn_at, kd, kok, vv, vok, DK, DV, C, S, SQUARINGS, PREC)  # fmt: skip

        # o_i = (q H) e^G + P U'.
        vn_all = tl.load(
            vn_at + c[:, None] * DV + vv[None, :], mask=(c < s_i)[:, None] & vok[None, :], other=0.0
        )
        vn_all = _with_slab(vn_all, vn, s_i // S, C // S, S)
        o = tl.dot(p_r, vn_all, o, input_precision=PREC)
        o_at = o_ptr + (bi * H + h).to(tl.int64) * DV + vv[None, :] + 0 * r[:, None]
        tl.store(o_at, o, mask=(r == i)[:, None] & vok[None, :])

        # A full chunk crosses its boundary: H <- e^{G_C} H + (e^{G_C - G} k)^T U'.
        if i == C - 1:
            g_last = tl.sum(tl.where(c == C - 1, G, 0.0), axis=0)
            kt = (tl.trans(k_all).to(tl.float32) * tl.exp(g_last - G)[None, :]).to(dt)
            state = tl.load(h_at, mask=hmask, other=0.0)
            state = tl.dot(kt, vn_all, state * tl.exp(g_last), input_precision=PREC)
            tl.store(h_at, state, mask=hmask)

        # The slot's last program to finish moves its counters on: one more row, all of them cached
        # (a full chunk starts over at 0). Every program read them before it arrived.
        tl.debug_barrier()
        if tl.atomic_add(arrived_ptr + slot, 1, sem="acq_rel", scope="gpu") == H * tl.num_programs(2) - 1:
            n = tl.where(i + 1 == C, 0, i + 1)
            tl.store(len_ptr + slot, n)
            tl.store(cached_ptr + slot, n)
            tl.atomic_xchg(arrived_ptr + slot, 0, sem="relaxed", scope="gpu")

    _L_DECODE = CachedLauncher(_gdn_decode_kernel)


def gdn_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    cache: GDNCache,
    chunk: int = CHUNK,
    launch: DecodeLaunch | None = None,
) -> torch.Tensor:
    """One new token for each of B sequences (q (B, H, dk) ...; ``slots`` (B,) int on the device,
    no repeats), invariant mode, no host sync, one launch (``launch``: :func:`decode_launch` of B
    unless given). Returns o (B, H, dv) fp32."""
    nb, hh, dk = q.shape
    dv = v.shape[2]
    o = torch.empty(nb, hh, dv, dtype=torch.float32, device=q.device)
    if not nb:
        return o
    q, k, v, g, beta = _kernel_inputs(q, k, v, g, beta)
    bk, bdv = _tile_widths(dk, dv)
    cfg = launch or decode_launch(nb)
    bv = min(cfg.bv, bdv)
    strides = _input_strides(q, k, v, g, beta)
    # Everything Triton specialises on: the integers follow from these, and the cache's and o's
    # pointers are allocations of their own (aligned).
    key = (nb, hh, dk, dv, chunk, q.dtype, strides, aligned(q, k, v, g, beta, slots), slots.dtype, cfg)
    _L_DECODE(
        key,
        (nb, hh, cdiv(dv, bv)),
        (
            q,
            k,
            v,
            g,
            beta,
            slots,
            cache.buf_len,
            cache.cached,
            cache.arrived,
            *cache.buf,
            cache.h,
            cache.h_entering,
            cache.powers,
            cache.vnew,
            o,
            hh,
            *strides,
        ),
        dict(
            DK=dk,
            DV=dv,
            BK=bk,
            BV=bv,
            C=chunk,
            S=min(SLAB, chunk),
            SQUARINGS=chunk.bit_length() - 2,
            PREC=dot_precision(k.dtype),
        ),
        num_warps=cfg.warps,
        num_stages=cfg.stages,
    )
    return o
