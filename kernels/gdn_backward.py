"""The backward of CPR Gated DeltaNet's chunk form, on tensor cores (four kernels).

Not part of the bitwise contract (the rollout never runs it), so it only has to be the exact
gradient of the chunk form, computed fast and in a fixed order (run to run the same bits). It
reuses what the forward kept per chunk (:class:`isoaudit.kernels.gdn._Workspace`: ``W``, ``U'``, the state
entering the chunk ``H``, ``G``) and recomputes ``T`` as the forward does. With ``dH'`` the
gradient reaching the state leaving a chunk, ``P = tril(q k^T e^{G_i - G_j})`` and
``kd = e^{G_C - G} k``:

1. *value-local* (all chunks in parallel): ``P^T dO``, the part of ``dU'`` that needs no state.
2. *state* (each sequence's chunks in reverse, one program per head and dv block)::

       dU' = P^T dO + kd dH'
       dH  = e^{G_C} dH' + (e^G q)^T dO - W^T dU'   (the gradient entering the previous chunk)

3. *query/key* (all chunks, one program per dk block): the products with ``H`` and ``dH'`` summed
   over dv (``dq``, the ``dH'`` and ``P`` parts of ``dk``, ``dW = -dU' H^T``, their ``dg`` terms).
4. *WY* (all chunks): through ``W = T (b e^G k)``, ``U = T (b v)`` and ``T = (I + A)^{-1}``
   (``dA = -T^T dT T^T``): ``dv``, ``dbeta``, the rest of ``dk`` and ``dg`` as the reverse cumsum
   of ``dG``.

The split keeps each kernel's live tiles within the registers (one kernel doing 3 and 4 together
spilled 676 registers on the H200 and took 2.6 ms of a 3.5 ms step). Dot operands are in the
inputs' dtype with fp32 accumulation, as in the forward and in flash-linear-attention's backward
(``BackwardConfig.low_precision``; fp32 inputs take exact fp32 products, what the CPU interpreter
tests against the fp64 recurrence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import HAVE_TRITON, cdiv, dot_precision, jit, tl, triton
from .gdn import CHUNK, _kernel_inputs, _Runs, _tile_widths, _Workspace

if HAVE_TRITON:
    from .gdn import _decay, _wy_inverse

    @triton.jit
    def _operand(x, dt: tl.constexpr, LOWP: tl.constexpr):
        """A dot operand: the inputs' dtype where ``LOWP``, else fp32 (tf32 products)."""
        if LOWP:
            y = x.to(dt)
        else:
            y = x.to(tl.float32)
        return y

    @triton.jit
    def _chunk_at(start_ptr, len_ptr, coff_ptr, b, h, ic, H, C: tl.constexpr):
        """Chunk ``ic`` of sequence ``b``: its length n, first row t0, workspace index, the valid
        mask and the rows (int64) of its C positions."""
        n = tl.load(len_ptr + b)
        t0 = ic * C
        c = tl.arange(0, C)
        ws = ((tl.load(coff_ptr + b) + ic) * H + h).to(tl.int64)
        row = (tl.load(start_ptr + b) + t0 + c).to(tl.int64)
        return n, t0, ws, (t0 + c) < n, row

    @jit()
    def _gdn_bwd_value_local_kernel(
        q_ptr,
        k_ptr,
        gc_ptr,
        do_ptr,
        dvn_ptr,
        start_ptr,
        len_ptr,
        coff_ptr,
        H,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_dot,
        stride_doh,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        C: tl.constexpr,
        PREC: tl.constexpr,
        LOWP: tl.constexpr,
    ):
        """``P^T dO`` of one (sequence, chunk, head, dv block) into ``dvn``: the state-free part
        of dU', out of the state kernel's sequential loop."""
        ic = tl.program_id(0)
        bh = tl.program_id(1)
        iv = tl.program_id(2)
        b = bh // H
        h = bh % H
        n, t0, ws, ok, row = _chunk_at(start_ptr, len_ptr, coff_ptr, b, h, ic, H, C)
        if t0 < n:
            dt = k_ptr.dtype.element_ty
            c = tl.arange(0, C)
            kk = tl.arange(0, BK)
            vv = iv * BV + tl.arange(0, BV)
            vok = vv < DV
            im = ok[:, None] & (kk < DK)[None, :]
            q_s = tl.load(q_ptr + row[:, None] * stride_qt + h * stride_qh + kk[None, :], mask=im, other=0.0)
            k_s = tl.load(k_ptr + row[:, None] * stride_kt + h * stride_kh + kk[None, :], mask=im, other=0.0)
            G = tl.load(gc_ptr + ws * C + c)
            # P^T: row j, column i holds (q_i . k_j) e^{G_i - G_j} for i >= j.
            kq = tl.dot(k_s, tl.trans(q_s), input_precision=PREC)
            upper = c[None, :] >= c[:, None]
            pt = tl.where(upper, kq * tl.exp(tl.where(upper, G[None, :] - G[:, None], 0.0)), 0.0)
            do_s = tl.load(
                do_ptr + row[:, None] * stride_dot + h * stride_doh + vv[None, :],
                mask=ok[:, None] & vok[None, :],
                other=0.0,
            )
            dvl = tl.dot(_operand(pt, dt, LOWP), _operand(do_s, dt, LOWP), input_precision=PREC)
            tl.store(dvn_ptr + (ws * C + c[:, None]) * DV + vv[None, :], dvl, mask=vok[None, :])

    @jit()
    def _gdn_bwd_state_kernel(
        q_ptr,
        k_ptr,
        w_ptr,
        gc_ptr,
        do_ptr,
        dhn_ptr,
        dvn_ptr,
        start_ptr,
        len_ptr,
        coff_ptr,
        H,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_dot,
        stride_doh,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        C: tl.constexpr,
        PREC: tl.constexpr,
        LOWP: tl.constexpr,
    ):
        """dU' (``dvn`` += kd dH') and the gradient of the state leaving each chunk, for one
        (sequence, head, dv block), chunks in reverse. The last chunk leaves no state that
        anything reads (an open chunk crosses no boundary; the final state has no gradient), so
        dH' starts at zero."""
        bh = tl.program_id(0)
        iv = tl.program_id(1)
        b = bh // H
        h = bh % H
        dt = k_ptr.dtype.element_ty
        start = tl.load(start_ptr + b)
        n = tl.load(len_ptr + b)
        coff = tl.load(coff_ptr + b)
        c = tl.arange(0, C)
        kk = tl.arange(0, BK)
        vv = iv * BV + tl.arange(0, BV)
        kok = kk < DK
        vok = vv < DV
        hmask = kok[:, None] & vok[None, :]
        dh = tl.zeros((BK, BV), tl.float32)
        nch = (n + C - 1) // C
        for r in range(0, nch):
            ci = coff + nch - 1 - r
            t0 = (ci - coff) * C
            ws = (ci * H + h).to(tl.int64)
            ok = (t0 + c) < n
            row = (start + t0 + c).to(tl.int64)
            dh_op = _operand(dh, dt, LOWP)
            tl.store(dhn_ptr + ws * DK * DV + kk[:, None] * DV + vv[None, :], dh.to(dt), mask=hmask)
            im = ok[:, None] & kok[None, :]
            q_s = tl.load(q_ptr + row[:, None] * stride_qt + h * stride_qh + kk[None, :], mask=im, other=0.0)
            k_s = tl.load(k_ptr + row[:, None] * stride_kt + h * stride_kh + kk[None, :], mask=im, other=0.0)
            w_s = tl.load(w_ptr + (ws * C + c[:, None]) * DK + kk[None, :], mask=kok[None, :], other=0.0)
            G = tl.load(gc_ptr + ws * C + c)
            g_last = tl.load(gc_ptr + ws * C + C - 1)
            do_s = tl.load(
                do_ptr + row[:, None] * stride_dot + h * stride_doh + vv[None, :],
                mask=ok[:, None] & vok[None, :],
                other=0.0,
            )
            dvn_at = dvn_ptr + (ws * C + c[:, None]) * DV + vv[None, :]
            dvn = tl.load(dvn_at, mask=vok[None, :], other=0.0)
            kd = _operand(k_s.to(tl.float32) * tl.exp(g_last - G)[:, None], dt, LOWP)
            dvn = tl.dot(kd, dh_op, dvn, input_precision=PREC)
            tl.store(dvn_at, dvn, mask=vok[None, :])
            qg = _operand(q_s.to(tl.float32) * tl.exp(G)[:, None], dt, LOWP)
            dh = dh * tl.exp(g_last)
            dh = tl.dot(tl.trans(qg), _operand(do_s, dt, LOWP), dh, input_precision=PREC)
            dh = tl.dot(tl.trans(_operand(-w_s, dt, LOWP)), _operand(dvn, dt, LOWP), dh, input_precision=PREC)

    @jit()
    def _gdn_bwd_query_key_kernel(
        q_ptr,
        k_ptr,
        gc_ptr,
        hc_ptr,
        vn_ptr,
        dvn_ptr,
        dhn_ptr,
        do_ptr,
        dq_ptr,
        dkp_ptr,
        dw_ptr,
        dgp_ptr,
        start_ptr,
        len_ptr,
        coff_ptr,
        H,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_dot,
        stride_doh,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BKB: tl.constexpr,
        BDV: tl.constexpr,
        BV: tl.constexpr,
        NKB: tl.constexpr,
        C: tl.constexpr,
        PREC: tl.constexpr,
        LOWP: tl.constexpr,
    ):
        """One (sequence, chunk, head, dk block): ``dq`` (final), the ``P`` and ``dH'`` parts of
        ``dk`` (into ``dkp``), ``dW = -dU' H^T`` (into ``dw``) and this block's share of ``dG``
        (into ``dgp``), from dv-block sums of the products with ``H``, ``dH'``, ``U'``, ``dU'``."""
        ic = tl.program_id(0)
        bh = tl.program_id(1)
        ik = tl.program_id(2)
        b = bh // H
        h = bh % H
        n, t0, ws, ok, row = _chunk_at(start_ptr, len_ptr, coff_ptr, b, h, ic, H, C)
        if t0 < n:
            dt = k_ptr.dtype.element_ty
            c = tl.arange(0, C)
            kd_ = ik * BKB + tl.arange(0, BKB)
            kok = kd_ < DK
            im = ok[:, None] & kok[None, :]
            G = tl.load(gc_ptr + ws * C + c)
            g_last = tl.load(gc_ptr + ws * C + C - 1)
            eg = tl.exp(G)
            dq_inter = tl.zeros((C, BKB), tl.float32)  # (e^G dO) H^T
            dkd = tl.zeros((C, BKB), tl.float32)  # U' dH'^T
            dw = tl.zeros((C, BKB), tl.float32)  # -dU' H^T
            # dO U'^T: each dk block's program forms it again, cheaper than a kernel of its own
            dp = tl.zeros((C, C), tl.float32)
            hdh = tl.zeros((BKB,), tl.float32)  # sum(H * dH') by rows
            for v0 in tl.static_range(0, BDV, BV):
                vv = v0 + tl.arange(0, BV)
                vok = vv < DV
                sm = kok[:, None] & vok[None, :]
                do_b = tl.load(
                    do_ptr + row[:, None] * stride_dot + h * stride_doh + vv[None, :],
                    mask=ok[:, None] & vok[None, :],
                    other=0.0,
                ).to(tl.float32)
                vn_b = tl.load(
                    vn_ptr + (ws * C + c[:, None]) * DV + vv[None, :], mask=vok[None, :], other=0.0
                )
                dvn_b = tl.load(
                    dvn_ptr + (ws * C + c[:, None]) * DV + vv[None, :], mask=vok[None, :], other=0.0
                )
                hc_b = tl.load(hc_ptr + ws * DK * DV + kd_[:, None] * DV + vv[None, :], mask=sm, other=0.0)
                dhn_b = tl.load(dhn_ptr + ws * DK * DV + kd_[:, None] * DV + vv[None, :], mask=sm, other=0.0)
                hc_t = tl.trans(_operand(hc_b, dt, LOWP))
                dq_inter = tl.dot(
                    _operand(do_b * eg[:, None], dt, LOWP), hc_t, dq_inter, input_precision=PREC
                )
                dp = tl.dot(
                    _operand(do_b, dt, LOWP), tl.trans(_operand(vn_b, dt, LOWP)), dp, input_precision=PREC
                )
                dkd = tl.dot(
                    _operand(vn_b, dt, LOWP), tl.trans(_operand(dhn_b, dt, LOWP)), dkd, input_precision=PREC
                )
                dw = tl.dot(_operand(-dvn_b, dt, LOWP), hc_t, dw, input_precision=PREC)
                hdh += tl.sum(hc_b.to(tl.float32) * dhn_b.to(tl.float32), axis=1)
            q_s = tl.load(q_ptr + row[:, None] * stride_qt + h * stride_qh + kd_[None, :], mask=im, other=0.0)
            k_s = tl.load(k_ptr + row[:, None] * stride_kt + h * stride_kh + kd_[None, :], mask=im, other=0.0)
            causal = c[:, None] >= c[None, :]
            dpd = tl.where(causal, dp * _decay(G, c), 0.0)
            dpd_op = _operand(dpd, dt, LOWP)
            q_op = _operand(q_s, dt, LOWP)
            k_op = _operand(k_s, dt, LOWP)
            dq = tl.dot(dpd_op, k_op, dq_inter, input_precision=PREC)
            dk = tl.dot(tl.trans(dpd_op), q_op, input_precision=PREC)
            kscale = tl.exp(g_last - G)
            dk += dkd * kscale[:, None]
            qk = tl.dot(q_op, tl.trans(k_op), input_precision=PREC)  # this dk block's share of q k^T
            dpp = dpd * qk  # dP * P
            dG = tl.sum(dpp, axis=1) - tl.sum(dpp, axis=0)
            dG += tl.sum(q_s.to(tl.float32) * dq_inter, axis=1)
            ekd = tl.sum(dkd * (k_s.to(tl.float32) * kscale[:, None]), axis=1)
            dG -= ekd
            dG += tl.where(c == C - 1, tl.sum(ekd, axis=0) + tl.exp(g_last) * tl.sum(hdh, axis=0), 0.0)
            tl.store(
                dq_ptr + row[:, None] * (H * DK) + h * DK + kd_[None, :],
                dq.to(dq_ptr.dtype.element_ty),
                mask=im,
            )
            blk = (ws * C + c[:, None]) * DK + kd_[None, :]
            tl.store(dkp_ptr + blk, dk, mask=kok[None, :])
            tl.store(dw_ptr + blk, dw, mask=kok[None, :])
            tl.store(dgp_ptr + (ws * NKB + ik) * C + c, dG)

    @jit()
    def _gdn_bwd_wy_kernel(
        k_ptr,
        v_ptr,
        b_ptr,
        gc_ptr,
        dvn_ptr,
        dkp_ptr,
        dw_ptr,
        dgp_ptr,
        dk_ptr,
        dv_ptr,
        db_ptr,
        dg_ptr,
        start_ptr,
        len_ptr,
        coff_ptr,
        H,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_bt,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BK: tl.constexpr,
        BKB: tl.constexpr,
        BDV: tl.constexpr,
        BV: tl.constexpr,
        NKB: tl.constexpr,
        C: tl.constexpr,
        SQUARINGS: tl.constexpr,
        PREC: tl.constexpr,
        LOWP: tl.constexpr,
        DV_LOWP: tl.constexpr,
    ):
        """One (sequence, chunk, head): ``dv``, ``dbeta``, ``dk`` (adding ``dkp``) and ``dg``
        through ``W = T (b e^G k)``, ``U = T (b v)`` and ``T = (I + A)^{-1}``."""
        ic = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        n, t0, ws, ok, row = _chunk_at(start_ptr, len_ptr, coff_ptr, b, h, ic, H, C)
        if t0 < n:
            dt = k_ptr.dtype.element_ty
            c = tl.arange(0, C)
            kf = tl.arange(0, BK)
            k_s = tl.load(
                k_ptr + row[:, None] * stride_kt + h * stride_kh + kf[None, :],
                mask=ok[:, None] & (kf < DK)[None, :],
                other=0.0,
            )
            bc = tl.load(b_ptr + row * stride_bt + h, mask=ok, other=0.0).to(tl.float32)
            G = tl.load(gc_ptr + ws * C + c)
            eg = tl.exp(G)
            kk, a, t = _wy_inverse(k_s, bc, G, c, SQUARINGS, PREC)
            tt = tl.trans(t)
            tt_op = _operand(tt, dt, LOWP)
            dt_ = tl.zeros((C, C), tl.float32)  # dU (b v)^T + dW (b e^G k)^T
            dbeta = tl.zeros((C,), tl.float32)
            for v0 in tl.static_range(0, BDV, BV):
                vv = v0 + tl.arange(0, BV)
                vok = vv < DV
                rm = ok[:, None] & vok[None, :]
                dvn_b = tl.load(
                    dvn_ptr + (ws * C + c[:, None]) * DV + vv[None, :], mask=vok[None, :], other=0.0
                )
                v_b = tl.load(
                    v_ptr + row[:, None] * stride_vt + h * stride_vh + vv[None, :], mask=rm, other=0.0
                )
                v_b = v_b.to(tl.float32)
                dvn_op = _operand(dvn_b, dt, LOWP)
                dt_ = tl.dot(
                    dvn_op, tl.trans(_operand(v_b * bc[:, None], dt, LOWP)), dt_, input_precision=PREC
                )
                dsv = tl.dot(_operand(tt, dt, DV_LOWP), _operand(dvn_b, dt, DV_LOWP), input_precision=PREC)
                tl.store(
                    dv_ptr + row[:, None] * (H * DV) + h * DV + vv[None, :],
                    (dsv * bc[:, None]).to(dv_ptr.dtype.element_ty),
                    mask=rm,
                )
                dbeta += tl.sum(dsv * v_b, axis=1)
            dG = tl.zeros((C,), tl.float32)
            for ik in tl.static_range(NKB):
                dG += tl.load(dgp_ptr + (ws * NKB + ik) * C + c)
            beg = bc * eg
            # dW's terms, a dk block at a time: dT += dW sk^T with sk = b e^G k, and dk, dbeta,
            # dG through W = T sk.
            for k0 in tl.static_range(0, BK, BKB):
                kd_ = k0 + tl.arange(0, BKB)
                kok = kd_ < DK
                k_b = tl.load(
                    k_ptr + row[:, None] * stride_kt + h * stride_kh + kd_[None, :],
                    mask=ok[:, None] & kok[None, :],
                    other=0.0,
                ).to(tl.float32)
                dw_b = tl.load(
                    dw_ptr + (ws * C + c[:, None]) * DK + kd_[None, :], mask=kok[None, :], other=0.0
                )
                sk = k_b * beg[:, None]
                dw_op = _operand(dw_b, dt, LOWP)
                dt_ = tl.dot(dw_op, tl.trans(_operand(sk, dt, LOWP)), dt_, input_precision=PREC)
                dsk = tl.dot(tt_op, dw_op, input_precision=PREC)
                dbeta += tl.sum(dsk * k_b, axis=1) * eg
                dG += tl.sum(dsk * sk, axis=1)
            da = -tl.dot(
                _operand(tl.dot(tt_op, _operand(dt_, dt, LOWP), input_precision=PREC), dt, LOWP),
                tt_op,
                input_precision=PREC,
            )
            da = tl.where(c[:, None] > c[None, :], da, 0.0)
            decay = _decay(G, c)
            e = da * a
            dG += tl.sum(e, axis=1) - tl.sum(e, axis=0)
            dbeta += tl.sum(da * kk * decay, axis=1)
            dkk = _operand(da * decay * bc[:, None], dt, LOWP)
            for k0 in tl.static_range(0, BK, BKB):
                kd_ = k0 + tl.arange(0, BKB)
                kok = kd_ < DK
                k_b = tl.load(
                    k_ptr + row[:, None] * stride_kt + h * stride_kh + kd_[None, :],
                    mask=ok[:, None] & kok[None, :],
                    other=0.0,
                )
                # T^T dW again rather than kept from the first loop: the whole C x dk tile would
                # not fit the registers beside T, dA and their products.
                blk = (ws * C + c[:, None]) * DK + kd_[None, :]
                dw_b = tl.load(dw_ptr + blk, mask=kok[None, :], other=0.0)
                dk = tl.load(dkp_ptr + blk, mask=kok[None, :], other=0.0)
                dk += tl.dot(tt_op, _operand(dw_b, dt, LOWP), input_precision=PREC) * beg[:, None]
                k_op = _operand(k_b, dt, LOWP)
                dk = tl.dot(dkk, k_op, dk, input_precision=PREC)
                dk = tl.dot(tl.trans(dkk), k_op, dk, input_precision=PREC)
                tl.store(
                    dk_ptr + row[:, None] * (H * DK) + h * DK + kd_[None, :],
                    dk.to(dk_ptr.dtype.element_ty),
                    mask=ok[:, None] & kok[None, :],
                )
            dg = tl.sum(tl.where(c[:, None] >= c[None, :], dG[:, None], 0.0), axis=0)  # sum_{i >= j} dG_i
            tl.store(db_ptr + row * H + h, dbeta.to(db_ptr.dtype.element_ty), mask=ok)
            tl.store(dg_ptr + row * H + h, dg.to(dg_ptr.dtype.element_ty), mask=ok)


@dataclass
class BackwardConfig:
    """Launch parameters of the backward kernels, and the dot operands' precision."""

    state_warps: int = 4
    state_bv: int = 32  # dv block of the state kernel (one program per sequence, head and block)
    value_bv: int = 64  # dv block of the value-local kernel
    value_warps: int = 4
    query_key_bk: int = 64  # dk block of the query/key kernel (one program per block)
    query_key_warps: int = 4
    wy_warps: int = 4
    bv: int = 64  # dv block the query/key and WY kernels' loops step by
    low_precision: bool = True  # dot operands in the inputs' dtype (bf16: fla's precision), else tf32
    # T^T dU' (dv and dbeta) on bf16 operands: with the loops stepping 32 dv columns it gave
    # 1e30 in dv and dbeta on the H200 (Triton 3.6) while the same dot with dW was right; at 64
    # columns it measured right (rel L2 3.4e-3 to the fp64 recurrence against 3.0e-3 on tf32).
    # tf32 operands there until the cause is known.
    dv_low_precision: bool = False


BACKWARD_CONFIG = BackwardConfig()


def gdn_chunk_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    runs: _Runs,
    work: _Workspace,
    grad_o: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, ...]:
    """Gradients of q, k, v, g and beta (each in its input's dtype) from the forward's ``runs``
    and ``work`` (a zero initial state) and the output's gradient ``grad_o`` (T, H, dv)."""
    hh, dk = q.shape[1], q.shape[2]
    dv = v.shape[2]
    nb = runs.table.shape[1]
    q, k, v, g, beta, grad_o = _kernel_inputs(q, k, v, g, beta, grad_o)
    dev = q.device
    # Zeros: rows outside every sequence (none in a packed batch) get no gradient.
    grads = [torch.zeros(x.shape, dtype=x.dtype, device=dev) for x in (q, k, v, g, beta)]
    dq, dk_, dv_, dg, db = grads
    if not nb:
        return tuple(grads)
    f32 = torch.float32
    dhn = torch.empty(runs.total, hh, dk, dv, dtype=k.dtype, device=dev)
    dvn = torch.empty(runs.total, hh, chunk, dv, dtype=f32, device=dev)
    start, length, coff = runs.table[0], runs.table[1], runs.table[2]
    bk, bdv = _tile_widths(dk, dv)
    cfg = BACKWARD_CONFIG
    prec, lowp = dot_precision(k.dtype), cfg.low_precision and k.dtype != f32
    bv = min(cfg.bv, bdv)
    bkb = min(cfg.query_key_bk, bk)
    nkb = cdiv(dk, bkb)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    do_strides = (grad_o.stride(0), grad_o.stride(1))
    bvl = min(cfg.value_bv, bdv)
    _gdn_bwd_value_local_kernel[(runs.chunks, nb * hh, cdiv(dv, bvl))](
        q, k, work.g, grad_o, dvn, start, length, coff, hh, *strides, *do_strides,
        DK=dk, DV=dv, BK=bk, BV=bvl, C=chunk, PREC=prec, LOWP=lowp, num_warps=cfg.value_warps,
    )  # fmt: skip
    bvs = min(cfg.state_bv, bdv)
    _gdn_bwd_state_kernel[(nb * hh, cdiv(dv, bvs))](
        q, k, work.w, work.g, grad_o, dhn, dvn, start, length, coff, hh, *strides, *do_strides,
        DK=dk, DV=dv, BK=bk, BV=bvs, C=chunk, PREC=prec, LOWP=lowp, num_warps=cfg.state_warps,
    )  # fmt: skip
    dkp = torch.empty(runs.total, hh, chunk, dk, dtype=f32, device=dev)
    dw = torch.empty_like(dkp)
    dgp = torch.empty(runs.total, hh, nkb, chunk, dtype=f32, device=dev)
    _gdn_bwd_query_key_kernel[(runs.chunks, nb * hh, nkb)](
        q, k, work.g, work.h, work.u, dvn, dhn, grad_o, dq, dkp, dw, dgp, start, length, coff, hh,
        *strides, *do_strides,
        DK=dk, DV=dv, BKB=bkb, BDV=bdv, BV=bv, NKB=nkb, C=chunk, PREC=prec, LOWP=lowp,
        num_warps=cfg.query_key_warps,
    )  # fmt: skip
    _gdn_bwd_wy_kernel[(runs.chunks, nb * hh)](
        k, v, beta, work.g, dvn, dkp, dw, dgp, dk_, dv_, db, dg, start, length, coff, hh,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), beta.stride(0),
        DK=dk, DV=dv, BK=bk, BKB=bkb, BDV=bdv, BV=bv, NKB=nkb, C=chunk,
        SQUARINGS=chunk.bit_length() - 2, PREC=prec, LOWP=lowp, DV_LOWP=lowp and cfg.dv_low_precision,
        num_warps=cfg.wy_warps,
    )  # fmt: skip
    return dq, dk_, dv_, dg, db
