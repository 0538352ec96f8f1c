"""The backward of CPR Gated DeltaNet's chunk form, on tensor cores (two kernels).

Not part of the bitwise contract (the rollout never runs it), so it only has to be the exact
gradient of the chunk form, computed fast and in a fixed order (run to run the same bits). It
reuses what the forward kept per chunk (:class:`kernels.gdn._Workspace`: ``W``, ``U'``, the state
entering the chunk ``H``, ``G``) and recomputes ``A`` and ``T`` as the forward does. With
``dH'`` the gradient reaching the state leaving a chunk:

* *state* kernel, each sequence's chunks in reverse (one program per head and dv block)::

      dU' = P^T dO + kd dH'                       (kd = e^{G_C - G} k)
      dH  = e^{G_C} dH' + (e^G q)^T dO - W^T dU'  (the gradient entering the previous chunk)

* *local* kernel, all chunks in parallel: ``dq``, ``dk``, ``dv``, ``dbeta`` and ``dg`` of the
  chunk's terms (``P``, ``e^G (q H)``, ``kd``, ``W = T (b e^G k)``, ``U = T (b v)`` and
  ``dA = -T^T dT T^T`` through ``T = (I + A)^{-1}``), then ``dg`` as the reverse cumsum of
  ``dG``. The dv-dependent products run over dv blocks, so few tiles are live at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import HAVE_TRITON, cdiv, dot_precision, jit, tl
from .gdn import CHUNK, _kernel_inputs, _Runs, _tile_widths, _Workspace

if HAVE_TRITON:
    from .gdn import _decay, _wy_inverse

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
    ):
        """dU' and the gradient of the state leaving each chunk, for one (sequence, head, dv
        block), chunks in reverse. The last chunk leaves no state that anything reads (an open
        chunk crosses no boundary; the final state has no gradient), so dH' starts at zero."""
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
            tl.store(dhn_ptr + ws * DK * DV + kk[:, None] * DV + vv[None, :], dh.to(dt), mask=hmask)
            im = ok[:, None] & kok[None, :]
            q_s = tl.load(q_ptr + row[:, None] * stride_qt + h * stride_qh + kk[None, :], mask=im, other=0.0)
            k_s = tl.load(k_ptr + row[:, None] * stride_kt + h * stride_kh + kk[None, :], mask=im, other=0.0)
            G = tl.load(gc_ptr + ws * C + c)
            g_last = tl.load(gc_ptr + ws * C + C - 1)
            do_s = tl.load(
                do_ptr + row[:, None] * stride_dot + h * stride_doh + vv[None, :],
                mask=ok[:, None] & vok[None, :],
                other=0.0,
            ).to(tl.float32)
            # P^T: row j, column i holds (q_i . k_j) e^{G_i - G_j} for i >= j.
            kq = tl.dot(k_s, tl.trans(q_s), input_precision=PREC)
            upper = c[None, :] >= c[:, None]
            pt = tl.where(upper, kq * tl.exp(tl.where(upper, G[None, :] - G[:, None], 0.0)), 0.0)
            kd = k_s.to(tl.float32) * tl.exp(g_last - G)[:, None]
            dvn = tl.dot(pt, do_s, input_precision=PREC)
            dvn = tl.dot(kd, dh, dvn, input_precision=PREC)
            tl.store(dvn_ptr + (ws * C + c[:, None]) * DV + vv[None, :], dvn, mask=vok[None, :])
            w_s = tl.load(w_ptr + (ws * C + c[:, None]) * DK + kk[None, :], mask=kok[None, :], other=0.0)
            qg = q_s.to(tl.float32) * tl.exp(G)[:, None]
            dh = dh * tl.exp(g_last)
            dh = tl.dot(tl.trans(qg), do_s, dh, input_precision=PREC)
            dh = tl.dot(tl.trans(-w_s.to(tl.float32)), dvn, dh, input_precision=PREC)

    @jit()
    def _gdn_bwd_local_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        b_ptr,
        gc_ptr,
        hc_ptr,
        vn_ptr,
        dvn_ptr,
        dhn_ptr,
        do_ptr,
        dq_ptr,
        dk_ptr,
        dv_ptr,
        db_ptr,
        dg_ptr,
        start_ptr,
        len_ptr,
        coff_ptr,
        H,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_bt,
        stride_dot,
        stride_doh,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BK: tl.constexpr,
        BDV: tl.constexpr,
        BV: tl.constexpr,
        C: tl.constexpr,
        SQUARINGS: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """Every input's gradient from one (sequence, chunk, head)'s terms."""
        ic = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        n = tl.load(len_ptr + b)
        t0 = ic * C
        if t0 < n:
            start = tl.load(start_ptr + b)
            ws = ((tl.load(coff_ptr + b) + ic) * H + h).to(tl.int64)
            c = tl.arange(0, C)
            ok = (t0 + c) < n
            row = (start + t0 + c).to(tl.int64)
            kd_ = tl.arange(0, BK)
            kok = kd_ < DK
            im = ok[:, None] & kok[None, :]
            k_s = tl.load(k_ptr + row[:, None] * stride_kt + h * stride_kh + kd_[None, :], mask=im, other=0.0)
            k_s = k_s.to(tl.float32)
            bc = tl.load(b_ptr + row * stride_bt + h, mask=ok, other=0.0).to(tl.float32)
            G = tl.load(gc_ptr + ws * C + c)
            g_last = tl.load(gc_ptr + ws * C + C - 1)
            eg = tl.exp(G)
            strict = c[:, None] > c[None, :]
            causal = c[:, None] >= c[None, :]
            kk, a, t = _wy_inverse(k_s, bc, G, c, SQUARINGS, PREC)
            tt = tl.trans(t)
            # The dv-dependent products, a dv block at a time.
            dq_inter = tl.zeros((C, BK), tl.float32)  # (e^G dO) H^T
            dp = tl.zeros((C, C), tl.float32)  # dO U'^T
            dkd = tl.zeros((C, BK), tl.float32)  # U' dH'^T
            dw = tl.zeros((C, BK), tl.float32)  # -dU' H^T
            dt_ = tl.zeros((C, C), tl.float32)  # dU (b v)^T, then + dW (b e^G k)^T
            dbeta = tl.zeros((C,), tl.float32)
            hdh = tl.zeros((BK,), tl.float32)  # sum(H * dH') by rows
            for v0 in tl.static_range(0, BDV, BV):
                vv = v0 + tl.arange(0, BV)
                vok = vv < DV
                rm = ok[:, None] & vok[None, :]
                sm = kok[:, None] & vok[None, :]
                do_b = tl.load(
                    do_ptr + row[:, None] * stride_dot + h * stride_doh + vv[None, :], mask=rm, other=0.0
                )
                do_b = do_b.to(tl.float32)
                vn_b = tl.load(
                    vn_ptr + (ws * C + c[:, None]) * DV + vv[None, :], mask=vok[None, :], other=0.0
                )
                vn_b = vn_b.to(tl.float32)
                dvn_b = tl.load(
                    dvn_ptr + (ws * C + c[:, None]) * DV + vv[None, :], mask=vok[None, :], other=0.0
                )
                hc_b = tl.load(hc_ptr + ws * DK * DV + kd_[:, None] * DV + vv[None, :], mask=sm, other=0.0)
                hc_b = hc_b.to(tl.float32)
                dhn_b = tl.load(dhn_ptr + ws * DK * DV + kd_[:, None] * DV + vv[None, :], mask=sm, other=0.0)
                dhn_b = dhn_b.to(tl.float32)
                v_b = tl.load(
                    v_ptr + row[:, None] * stride_vt + h * stride_vh + vv[None, :], mask=rm, other=0.0
                )
                v_b = v_b.to(tl.float32)
                dq_inter = tl.dot(do_b * eg[:, None], tl.trans(hc_b), dq_inter, input_precision=PREC)
                dp = tl.dot(do_b, tl.trans(vn_b), dp, input_precision=PREC)
                dkd = tl.dot(vn_b, tl.trans(dhn_b), dkd, input_precision=PREC)
                dw = tl.dot(-dvn_b, tl.trans(hc_b), dw, input_precision=PREC)
                dt_ = tl.dot(dvn_b, tl.trans(v_b * bc[:, None]), dt_, input_precision=PREC)
                dsv = tl.dot(tt, dvn_b, input_precision=PREC)
                tl.store(dv_ptr + row[:, None] * (H * DV) + h * DV + vv[None, :], dsv * bc[:, None], mask=rm)
                dbeta += tl.sum(dsv * v_b, axis=1)
                hdh += tl.sum(hc_b * dhn_b, axis=1)
            sk = k_s * (bc * eg)[:, None]
            dt_ = tl.dot(dw, tl.trans(sk), dt_, input_precision=PREC)
            dsk = tl.dot(tt, dw, input_precision=PREC)
            dk = dsk * (bc * eg)[:, None]
            dbeta += tl.sum(dsk * k_s, axis=1) * eg
            dG = tl.sum(dsk * sk, axis=1)
            da = -tl.dot(tl.dot(tt, dt_, input_precision=PREC), tt, input_precision=PREC)
            da = tl.where(strict, da, 0.0)
            decay = _decay(G, c)
            e = da * a
            dG += tl.sum(e, axis=1) - tl.sum(e, axis=0)
            dbeta += tl.sum(da * kk * decay, axis=1)
            dkk = da * decay * bc[:, None]
            dk = tl.dot(dkk, k_s, dk, input_precision=PREC)
            dk = tl.dot(tl.trans(dkk), k_s, dk, input_precision=PREC)
            q_s = tl.load(q_ptr + row[:, None] * stride_qt + h * stride_qh + kd_[None, :], mask=im, other=0.0)
            q_s = q_s.to(tl.float32)
            qk = tl.dot(q_s, tl.trans(k_s), input_precision=PREC)
            dpd = tl.where(causal, dp * decay, 0.0)
            dq = tl.dot(dpd, k_s, dq_inter, input_precision=PREC)
            dk = tl.dot(tl.trans(dpd), q_s, dk, input_precision=PREC)
            dpp = dpd * qk  # dP * P
            dG += tl.sum(dpp, axis=1) - tl.sum(dpp, axis=0)
            dG += tl.sum(q_s * dq_inter, axis=1)
            kscale = tl.exp(g_last - G)
            dk += dkd * kscale[:, None]
            ekd = tl.sum(dkd * (k_s * kscale[:, None]), axis=1)
            dG -= ekd
            dG += tl.where(c == C - 1, tl.sum(ekd, axis=0) + tl.exp(g_last) * tl.sum(hdh, axis=0), 0.0)
            dg = tl.sum(tl.where(causal, dG[:, None], 0.0), axis=0)  # dg_j = sum_{i >= j} dG_i
            at = row[:, None] * (H * DK) + h * DK + kd_[None, :]
            tl.store(dq_ptr + at, dq, mask=im)
            tl.store(dk_ptr + at, dk, mask=im)
            tl.store(db_ptr + row * H + h, dbeta, mask=ok)
            tl.store(dg_ptr + row * H + h, dg, mask=ok)


@dataclass
class BackwardConfig:
    """Launch parameters of the two backward kernels (no bit of the forward depends on them)."""

    state_warps: int = 4
    state_bv: int = 32  # dv block of the state kernel (one program per sequence, head and block)
    local_warps: int = 8
    local_bv: int = 32  # dv block the local kernel's loop steps by
    local_stages: int = 1


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
    """Gradients (fp32) of q, k, v, g and beta from the forward's ``runs`` and ``work`` (a zero
    initial state) and the output's gradient ``grad_o`` (T, H, dv)."""
    hh, dk = q.shape[1], q.shape[2]
    dv = v.shape[2]
    nb = runs.table.shape[1]
    q, k, v, g, beta, grad_o = _kernel_inputs(q, k, v, g, beta, grad_o)
    f32, dev = torch.float32, q.device
    dq = torch.zeros(q.shape, dtype=f32, device=dev)
    dk_ = torch.zeros(k.shape, dtype=f32, device=dev)
    dv_ = torch.zeros(v.shape, dtype=f32, device=dev)
    dg = torch.zeros(g.shape, dtype=f32, device=dev)
    db = torch.zeros(beta.shape, dtype=f32, device=dev)
    if not nb:
        return dq, dk_, dv_, dg, db
    dhn = torch.empty(runs.total, hh, dk, dv, dtype=k.dtype, device=dev)
    dvn = torch.empty(runs.total, hh, chunk, dv, dtype=f32, device=dev)
    start, length, coff = runs.table[0], runs.table[1], runs.table[2]
    bk, bdv = _tile_widths(dk, dv)
    cfg = BACKWARD_CONFIG
    bv = min(cfg.state_bv, bdv)
    prec = dot_precision(k.dtype)
    _gdn_bwd_state_kernel[(nb * hh, cdiv(dv, bv))](
        q,
        k,
        work.w,
        work.g,
        grad_o,
        dhn,
        dvn,
        start,
        length,
        coff,
        hh,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        grad_o.stride(0),
        grad_o.stride(1),
        DK=dk,
        DV=dv,
        BK=bk,
        BV=bv,
        C=chunk,
        PREC=prec,
        num_warps=cfg.state_warps,
    )
    _gdn_bwd_local_kernel[(runs.chunks, nb * hh)](
        q,
        k,
        v,
        beta,
        work.g,
        work.h,
        work.u,
        dvn,
        dhn,
        grad_o,
        dq,
        dk_,
        dv_,
        db,
        dg,
        start,
        length,
        coff,
        hh,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        beta.stride(0),
        grad_o.stride(0),
        grad_o.stride(1),
        DK=dk,
        DV=dv,
        BK=bk,
        BDV=bdv,
        BV=min(cfg.local_bv, bdv),
        C=chunk,
        SQUARINGS=chunk.bit_length() - 2,
        PREC=prec,
        num_warps=cfg.local_warps,
        num_stages=cfg.local_stages,
    )
    return dq, dk_, dv_, dg, db
