"""CPR Gated DeltaNet: the gated delta rule evaluated chunkwise in parallel, bit-identical for the
trainer (whole sequences) and the rollout engine (token by token).

The recurrence (state ``H`` of shape (dk, dv), per head; ``a_t = exp(g_t)``, ``g_t <= 0``)::

    H_t = a_t (I - b_t k_t k_t^T) H_{t-1} + b_t k_t v_t^T,     o_t = H_t^T q_t

is the defining function (:func:`gdn_recurrent`, run in fp64 it is the accuracy reference). It is
*evaluated* in chunks of C tokens aligned to each sequence's first token. Within a chunk, with
``G = cumsum(g)``, ``A = tril(b_i (k_i.k_j) e^{G_i-G_j}, -1)`` and ``T = (I + A)^{-1}``::

    W = T (b e^G k),   U = T (b v),   U' = U - W H_0
    O = (e^G q) H_0 + tril(q k^T e^{G_i-G_j}) U'
    H_C = e^{G_C} H_0 + (e^{G_C - G} k)^T U'

Every sum is one fp32 FMA chain in ascending index, so each element has a single op sequence
whatever the tiling, the warps or the number of rows computed:

* ``G_i = (...(g_0 + g_1) + ...) + g_i``: the chain of a lower-triangular-ones dot;
* ``k_i.k_j``, ``q_i.k_j`` over d; ``T_i = e_i - sum_j A_ij T_j`` (forward substitution, evaluated
  as Jacobi sweeps ``T <- I - A T``: after sweep m rows <= m are final and later sweeps recompute
  them to the same bits); ``W_i, U_i = sum_j T_ij (...)_j``: fp32 ``ieee`` dots, which Triton
  lowers to exactly these chains (row-major operands, no tl.trans, so the interpreter's BLAS
  agrees); the d-sums run as KS-wide dots continuing one accumulator;
* ``U' = U - (W H_0)``, ``O = (P U' continuing (e^G q) H_0)``, ``H_C = ((e^{G_C-G} k)^T U'
  continuing e^{G_C} H_0)``: explicit outer-product ``tl.fma`` loops over d or j (the state
  kernel keeps H in memory, so nothing large stays live and nothing spills);
* a term with a zero coefficient (``A_ij``, ``T_ij``, ``P_ij`` for later j) is an exact no-op, so
  later rows, or stale finite values in their place, never touch row ``i``.

Hence a chunk holding its first ``n`` tokens yields the trainer's first ``n`` rows bit for bit, and
so does computing row ``i`` alone from the final rows above it. Decode does exactly that in
O(one row): the engine keeps per slot the boundary state, the open chunk's inputs and its final
``T`` and ``U'`` rows; each step (:func:`gdn_decode_step`: one kernel plus a one-word bump, no host
sync) appends the token, computes row ``i`` by the same chains (``tl.fma`` loops), caches its ``T``
and ``U'`` rows, and when the chunk fills writes the re-synchronised state. Everything is fp32
with exact fp32 products (no tf32).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

import torch

from ._triton import HAVE_TRITON, cdiv, interpreting, jit, next_power_of_2, resolve, tl, triton

CHUNK = 64


@dataclass(frozen=True)
class GDNConfig:
    """Launch parameters. None of them changes a bit (every element is one FMA chain whatever the
    tiling or the number of warps); they only keep the kernels free of register spills."""

    prep_warps: int = 8
    prep_ks: int = 32  # d-slice of the q.k / k.k dots (one slice under the interpreter: its dot
    # adds the accumulator after rounding instead of continuing the chain)
    prep_nb: int = 32  # column block of W and U
    state_warps: int = 4
    state_bv: int = 16  # dv block of the state kernel (one program per sequence, head and block)
    decode_warps: int = 4


CONFIG = GDNConfig()

if HAVE_TRITON:

    @triton.jit
    def _cumsum_chain(x, C: tl.constexpr):
        """Inclusive prefix sum in ascending order: the FMA chain of a lower-triangular-ones dot
        (a scan's tree, and so its bits, would depend on the layout)."""
        c = tl.arange(0, C)
        lower = tl.where(c[:, None] >= c[None, :], 1.0, 0.0)
        cols = x[:, None] + tl.zeros((C, 16), tl.float32)
        return tl.max(tl.dot(lower, cols, input_precision="ieee"), axis=1)

    @triton.jit
    def _pick(x, i, c):
        """``x[i]`` of a vector indexed by ``c``, exactly (one term plus zeros)."""
        return tl.sum(tl.where(c == i, x, 0.0), axis=0)

    @triton.jit
    def _decay(g_rows, g_cols, rows, cols):
        return tl.exp(tl.where(rows[:, None] >= cols[None, :], g_rows[:, None] - g_cols[None, :], 0.0))

    @jit()
    def _gdn_prep_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        b_ptr,
        w_ptr,
        u_ptr,
        p_ptr,
        gc_ptr,
        t_ptr,
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
        stride_gt,
        stride_bt,
        DK: tl.constexpr,
        DV: tl.constexpr,
        C: tl.constexpr,
        KS: tl.constexpr,
        NB: tl.constexpr,
    ):
        """Intra-chunk quantities of one (sequence, chunk, head), all chunks in parallel:
        G = cumsum(g), P (stored transposed), A, T = (I + A)^-1 by Jacobi sweeps ``T <- I - A T``
        (after sweep m rows <= m are final and stay so; T is stored for the engine's cache),
        W = T (b e^G k) (stored transposed), U = T (b v). Every element is one ascending FMA chain:
        the d-sums run in KS-wide dots continuing one accumulator, W and U in NB-wide column
        blocks; operands are row-major loads (no tl.trans)."""
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
            q_at = q_ptr + row * stride_qt + h * stride_qh
            k_at = k_ptr + row * stride_kt + h * stride_kh
            v_at = v_ptr + row * stride_vt + h * stride_vh
            gc = tl.load(g_ptr + row * stride_gt + h, mask=ok, other=0.0).to(tl.float32)
            bc = tl.load(b_ptr + row * stride_bt + h, mask=ok, other=0.0).to(tl.float32)
            G = _cumsum_chain(gc, C)
            tl.store(gc_ptr + ws * C + c, G)
            qk = tl.zeros((C, C), tl.float32)
            kk = tl.zeros((C, C), tl.float32)
            for d0 in range(0, DK, KS):
                d = d0 + tl.arange(0, KS)
                dm = ok[:, None] & (d < DK)[None, :]
                kt = tl.load(k_at[None, :] + d[:, None], mask=tl.trans(dm), other=0.0).to(tl.float32)
                q_s = tl.load(q_at[:, None] + d[None, :], mask=dm, other=0.0).to(tl.float32)
                k_s = tl.load(k_at[:, None] + d[None, :], mask=dm, other=0.0).to(tl.float32)
                qk = tl.dot(q_s, kt, qk, input_precision="ieee")
                kk = tl.dot(k_s, kt, kk, input_precision="ieee")
            decay = _decay(G, G, c, c)
            P = tl.where(c[:, None] >= c[None, :], qk * decay, 0.0)
            tl.store(p_ptr + ws * C * C + c[None, :] * C + c[:, None], P)
            A = tl.where(c[:, None] > c[None, :], (bc[:, None] * kk) * decay, 0.0)
            eye = tl.where(c[:, None] == c[None, :], 1.0, 0.0)
            T = eye
            for _ in range(1, tl.minimum(n - t0, C)):
                T = eye - tl.dot(A, T, input_precision="ieee")
            tl.store(t_ptr + ws * C * C + c[:, None] * C + c[None, :], T)
            for d0 in range(0, DK, NB):
                d = d0 + tl.arange(0, NB)
                dm = ok[:, None] & (d < DK)[None, :]
                k_s = tl.load(k_at[:, None] + d[None, :], mask=dm, other=0.0).to(tl.float32)
                W = tl.dot(T, k_s * (bc * tl.exp(G))[:, None], input_precision="ieee")
                tl.store(w_ptr + ws * C * DK + d[None, :] * C + c[:, None], W, mask=(d < DK)[None, :])
            for v0 in range(0, DV, NB):
                vv = v0 + tl.arange(0, NB)
                vm = ok[:, None] & (vv < DV)[None, :]
                v_s = tl.load(v_at[:, None] + vv[None, :], mask=vm, other=0.0).to(tl.float32)
                U = tl.dot(T, v_s * bc[:, None], input_precision="ieee")
                tl.store(u_ptr + ws * C * DV + c[:, None] * DV + vv[None, :], U, mask=(vv < DV)[None, :])

    @jit()
    def _gdn_state_kernel(
        q_ptr,
        k_ptr,
        w_ptr,
        u_ptr,
        p_ptr,
        gc_ptr,
        h0_ptr,
        o_ptr,
        ht_ptr,
        start_ptr,
        len_ptr,
        slot_ptr,
        coff_ptr,
        H,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_ot,
        stride_oh,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        C: tl.constexpr,
    ):
        """The chunk-to-chunk recurrence of one (sequence, head, dv block), in order, as explicit
        outer-product FMA chains (ascending d or j; a row of any of them is what decode computes):
        U' = U - (W H), O = (P U' continuing (e^G q) H), H <- (e^{G_C - G} k)^T U' continuing
        e^{G_C} H (full chunks). The state lives in ``ht`` (rows are read back after a barrier);
        U' overwrites U (the engine caches an open chunk's rows)."""
        bh = tl.program_id(0)
        iv = tl.program_id(1)
        b = bh // H
        h = bh % H
        start = tl.load(start_ptr + b)
        n = tl.load(len_ptr + b)
        coff = tl.load(coff_ptr + b)
        slot = tl.load(slot_ptr + b)
        c = tl.arange(0, C)
        kk = tl.arange(0, BK)
        vv = iv * BV + tl.arange(0, BV)
        kok = kk < DK
        vok = vv < DV
        hmask = kok[:, None] & vok[None, :]
        hs = (slot * H + h).to(tl.int64) * DK * DV
        h_at = ht_ptr + hs + kk[:, None] * DV + vv[None, :]
        tl.store(
            h_at, tl.load(h0_ptr + hs + kk[:, None] * DV + vv[None, :], mask=hmask, other=0.0), mask=hmask
        )
        tl.debug_barrier()
        for t0 in range(0, n, C):
            ws = ((coff + t0 // C) * H + h).to(tl.int64)
            ok = (t0 + c) < n
            row = (start + t0 + c).to(tl.int64)
            G = tl.load(gc_ptr + ws * C + c)
            eg = tl.exp(G)
            wh = tl.zeros((C, BV), tl.float32)
            qh = tl.zeros((C, BV), tl.float32)
            for d in range(DK):
                s_row = tl.load(ht_ptr + hs + d * DV + vv, mask=vok, other=0.0)
                w_col = tl.load(w_ptr + ws * C * DK + d * C + c)
                q_col = tl.load(q_ptr + row * stride_qt + h * stride_qh + d, mask=ok, other=0.0)
                wh = tl.fma(w_col[:, None], s_row[None, :], wh)
                qh = tl.fma((q_col.to(tl.float32) * eg)[:, None], s_row[None, :], qh)
            u_at = u_ptr + ws * C * DV + c[:, None] * DV + vv[None, :]
            up = tl.load(u_at, mask=ok[:, None] & vok[None, :], other=0.0) - wh
            tl.store(u_at, up, mask=vok[None, :])
            tl.debug_barrier()
            o = qh
            for j in range(0, tl.minimum(n - t0, C)):  # later rows have P = 0 for the valid rows
                p_col = tl.load(p_ptr + ws * C * C + j * C + c)
                up_row = tl.load(u_ptr + ws * C * DV + j * DV + vv, mask=vok, other=0.0)
                o = tl.fma(p_col[:, None], up_row[None, :], o)
            tl.store(
                o_ptr + row[:, None] * stride_ot + h * stride_oh + vv[None, :],
                o,
                mask=ok[:, None] & vok[None, :],
            )
            if t0 + C <= n:
                gl = _pick(G, C - 1, c)
                s = tl.load(h_at, mask=hmask, other=0.0) * tl.exp(gl)
                for j in range(C):
                    g_j = tl.load(gc_ptr + ws * C + j)
                    kd = tl.load(
                        k_ptr + (start + t0 + j).to(tl.int64) * stride_kt + h * stride_kh + kk,
                        mask=kok,
                        other=0.0,
                    )
                    up_row = tl.load(u_ptr + ws * C * DV + j * DV + vv, mask=vok, other=0.0)
                    s = tl.fma((kd.to(tl.float32) * tl.exp(gl - g_j))[:, None], up_row[None, :], s)
                tl.debug_barrier()
                tl.store(h_at, s, mask=hmask)
                tl.debug_barrier()

    @jit()
    def _gdn_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        g_ptr,
        b_ptr,
        slot_ptr,
        len_ptr,
        qb_ptr,
        kb_ptr,
        vb_ptr,
        gb_ptr,
        bb_ptr,
        h_ptr,
        t_ptr,
        up_ptr,
        scr_ptr,
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
        BDV: tl.constexpr,
        FV: tl.constexpr,
        C: tl.constexpr,
    ):
        """One new token of one (sequence, head): row i = buf_len of the open chunk, computed from
        its inputs and the cached final T / U' rows above it by the same FMA chains the chunk
        kernels perform for that row (O(one row)). Caches row i's T and U' and the token; at the
        chunk's last row writes the state. ``scr`` holds this row's A, P, G and W for the scalar
        reads of the chains (after a barrier). buf_len is bumped by a second launch."""
        bh = tl.program_id(0)
        bi = bh // H
        h = bh % H
        slot = tl.load(slot_ptr + bi).to(tl.int64)
        i = tl.load(len_ptr + slot)
        sh = slot * H + h
        c = tl.arange(0, C)
        kk = tl.arange(0, BK)
        vv = tl.arange(0, BDV)
        kok = kk < DK
        vok = vv < DV
        # Append the token first (the store rounds it to the buffers' dtype, as the trainer's inputs
        # are); every read below then comes from the buffers. Rows after i would enter the chains
        # only with exact-zero coefficients (A, P, T are causal), so the loops stop at row i and
        # stale cache rows (another request's, say) never reach this row.
        crow = (slot * C + c) * H + h
        irow = (slot * C + i) * H + h
        qi, ki, vi = qb_ptr + irow * DK, kb_ptr + irow * DK, vb_ptr + irow * DV
        tl.store(qi + kk, tl.load(q_ptr + bi * stride_qb + h * stride_qh + kk, mask=kok), mask=kok)
        tl.store(ki + kk, tl.load(k_ptr + bi * stride_kb + h * stride_kh + kk, mask=kok), mask=kok)
        tl.store(vi + vv, tl.load(v_ptr + bi * stride_vb + h * stride_vh + vv, mask=vok), mask=vok)
        tl.store(gb_ptr + irow, tl.load(g_ptr + bi * stride_gb + h))
        tl.store(bb_ptr + irow, tl.load(b_ptr + bi * stride_bb + h))
        tl.debug_barrier()
        G = _cumsum_chain(tl.load(gb_ptr + crow, mask=c <= i, other=0.0).to(tl.float32), C)
        g_i = _pick(G, i, c)
        b_i = tl.load(bb_ptr + irow).to(tl.float32)
        # kk_ij = k_i.k_j and qk_ij = q_i.k_j, chains over d.
        kk_i = tl.zeros((C,), tl.float32)
        qk_i = tl.zeros((C,), tl.float32)
        for d in range(DK):
            k_col = tl.load(kb_ptr + crow * DK + d, mask=c <= i, other=0.0).to(tl.float32)
            kk_i = tl.fma(tl.load(ki + d).to(tl.float32), k_col, kk_i)
            qk_i = tl.fma(tl.load(qi + d).to(tl.float32), k_col, qk_i)
        decay = tl.exp(tl.where(i >= c, g_i - G, 0.0))
        scr = scr_ptr + bh.to(tl.int64) * (3 * C + BK)
        tl.store(scr + c, tl.where(i > c, (b_i * kk_i) * decay, 0.0))  # A_i
        tl.store(scr + C + c, tl.where(i >= c, qk_i * decay, 0.0))  # P_i
        tl.store(scr + 2 * C + c, G)
        tl.debug_barrier()
        # T_i = e_i - sum_j A_ij T_j over the cached final rows.
        t_base = t_ptr + sh * C * C
        acc = tl.zeros((C,), tl.float32)
        for j in range(0, i):
            acc = tl.fma(tl.load(scr + j), tl.load(t_base + j * C + c), acc)
        tl.store(t_base + i * C + c, tl.where(c == i, 1.0, 0.0) - acc)
        tl.debug_barrier()
        # W_i = sum_j T_ij (b_j e^{G_j} k_j), U_i = sum_j T_ij (b_j v_j).
        w_i = tl.zeros((BK,), tl.float32)
        u_i = tl.zeros((BDV,), tl.float32)
        for j in range(0, i + 1):
            jrow = (slot * C + j) * H + h
            t_ij = tl.load(t_base + i * C + j)
            b_j = tl.load(bb_ptr + jrow).to(tl.float32)
            k_j = tl.load(kb_ptr + jrow * DK + kk, mask=kok, other=0.0).to(tl.float32)
            v_j = tl.load(vb_ptr + jrow * DV + vv, mask=vok, other=0.0).to(tl.float32)
            w_i = tl.fma(t_ij, k_j * (b_j * tl.exp(tl.load(scr + 2 * C + j))), w_i)
            u_i = tl.fma(t_ij, v_j * b_j, u_i)
        tl.store(scr + 3 * C + kk, w_i)
        tl.debug_barrier()
        # U'_i = U_i - W_i H and (e^{G_i} q_i) H, chains over d.
        h_base = h_ptr + sh * DK * DV
        wh = tl.zeros((BDV,), tl.float32)
        qh = tl.zeros((BDV,), tl.float32)
        eg_i = tl.exp(g_i)
        for d in range(DK):
            s_row = tl.load(h_base + d * DV + vv, mask=vok, other=0.0)
            wh = tl.fma(tl.load(scr + 3 * C + d), s_row, wh)
            qh = tl.fma(tl.load(qi + d).to(tl.float32) * eg_i, s_row, qh)
        up_base = up_ptr + sh * C * DV
        tl.store(up_base + i * DV + vv, u_i - wh, mask=vok)
        tl.debug_barrier()
        # o_i = sum_j P_ij U'_j continuing (e^{G_i} q_i) H.
        o = qh
        for j in range(0, i + 1):
            o = tl.fma(tl.load(scr + C + j), tl.load(up_base + j * DV + vv, mask=vok, other=0.0), o)
        tl.store(o_ptr + bh.to(tl.int64) * DV + vv, o, mask=vok)
        if i == C - 1:  # the chunk is full: H <- e^{G_C} H + (e^{G_C - G} k)^T U'
            for f in range(BDV // FV):
                fv = f * FV + tl.arange(0, FV)
                fmask = kok[:, None] & (fv < DV)[None, :]
                s = tl.load(h_base + kk[:, None] * DV + fv[None, :], mask=fmask, other=0.0) * tl.exp(g_i)
                for j in range(C):
                    jrow = (slot * C + j) * H + h
                    k_j = tl.load(kb_ptr + jrow * DK + kk, mask=kok, other=0.0).to(tl.float32)
                    kd = k_j * tl.exp(g_i - tl.load(scr + 2 * C + j))
                    up_row = tl.load(up_base + j * DV + fv, mask=fv < DV, other=0.0)
                    s = tl.fma(kd[:, None], up_row[None, :], s)
                tl.store(h_base + kk[:, None] * DV + fv[None, :], s, mask=fmask)

    @jit()
    def _gdn_bump_kernel(slot_ptr, len_ptr, C: tl.constexpr):
        """buf_len[slot] += 1, wrapping to 0 when the chunk is full (after every decode program read it)."""
        slot = tl.load(slot_ptr + tl.program_id(0))
        n = tl.load(len_ptr + slot) + 1
        tl.store(len_ptr + slot, tl.where(n == C, 0, n))


def _chunkify(x: torch.Tensor, starts: list[int], lens: list[int], nc: int, c: int) -> torch.Tensor:
    """(T, H, ...) packed -> (B, nc, H, C, ...) zero-padded chunks aligned to each sequence start."""
    b = len(starts)
    out = x.new_zeros((b, nc * c) + tuple(x.shape[1:]))
    for i, (s, n) in enumerate(zip(starts, lens, strict=True)):
        out[i, :n] = x[s : s + n]
    out = out.reshape((b, nc, c) + tuple(x.shape[1:]))
    return out.transpose(2, 3)


def _unchunkify(y: torch.Tensor, starts: list[int], lens: list[int], total: int) -> torch.Tensor:
    b, nc, h, c = y.shape[:4]
    flat = y.transpose(2, 3).reshape((b, nc * c, h) + tuple(y.shape[4:]))
    return (
        torch.cat([flat[i, :n] for i, n in enumerate(lens)]) if b else flat.new_zeros((0,) + flat.shape[2:])
    )


def _device_ints(values: list[int], device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A small host list on ``device`` without a stream sync (a pageable copy would wait for every
    kernel queued before it; a pinned one is queued behind them)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _seqs(cu_seqlens: torch.Tensor) -> tuple[list[int], list[int]]:
    cu = [int(x) for x in cu_seqlens.tolist()]
    return cu[:-1], [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]


class ChunkParts(NamedTuple):
    """The chunk form's per-chunk terms, each (B, nc, H, ...): everything that does not depend on
    the state carried between chunks, so all chunks are computed at once."""

    W: torch.Tensor  # T (b e^G k)           (C, dk)
    U: torch.Tensor  # T (b v)               (C, dv)
    P: torch.Tensor  # tril(q k^T e^{G_i-G_j}) (C, C)
    qg: torch.Tensor  # e^G q                (C, dk)
    kd: torch.Tensor  # e^{G_C - G} k        (C, dk)
    egl: torch.Tensor  # e^{G_C}             ()


def _chunk_parts(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    seqs: tuple[list[int], list[int]],
    chunk: int,
    solve: str,
) -> ChunkParts:
    """:class:`ChunkParts` of packed sequences, in fp32 torch (differentiable)."""
    starts, lens = seqs
    nc = max([-(-n // chunk) for n in lens] + [1])
    qc, kc, vc = (_chunkify(t.float(), starts, lens, nc, chunk) for t in (q, k, v))
    gc, bc = (_chunkify(t.float(), starts, lens, nc, chunk) for t in (g, beta))  # (B, nc, H, C)
    G = torch.cumsum(gc, -1)
    idx = torch.arange(chunk, device=q.device)
    strict = idx[:, None] > idx[None, :]
    causal = idx[:, None] >= idx[None, :]
    gdiff = G[..., :, None] - G[..., None, :]
    decay = torch.exp(torch.where(causal, gdiff, torch.zeros_like(gdiff)))
    A = torch.where(strict, (bc[..., :, None] * (kc @ kc.transpose(-1, -2))) * decay, torch.zeros_like(decay))
    eye = torch.eye(chunk, device=q.device).expand_as(A)
    if solve == "triangular":
        T = torch.linalg.solve_triangular(eye + A, eye, upper=False, unitriangular=True)
    else:
        T = eye
        for _ in range(1, chunk):
            T = eye - A @ T
    eg = torch.exp(G)
    gl = G[..., -1]
    return ChunkParts(
        W=T @ (kc * (bc * eg)[..., None]),
        U=T @ (vc * bc[..., None]),
        P=torch.where(causal, (qc @ kc.transpose(-1, -2)) * decay, torch.zeros_like(decay)),
        qg=qc * eg[..., None],
        kd=kc * torch.exp(gl[..., None] - G)[..., None],
        egl=torch.exp(gl),
    )


def gdn_chunk_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    h0: torch.Tensor | None = None,
    chunk: int = CHUNK,
    solve: str = "substitution",
    state_at: str = "boundary",
    seqs: tuple[list[int], list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk form in torch (differentiable). ``solve="substitution"`` is the kernels' algorithm
    (forward substitution as Jacobi sweeps; torch's summation order, not their bits); ``"triangular"`` (a library triangular solve) and
    ``state_at="end"`` (the state after the last, possibly partial, chunk) make it the native
    chunk-form baseline. Returns (o (T, H, dv) fp32, state (B, H, dk, dv) fp32)."""
    starts, lens = seqs or _seqs(cu_seqlens)
    nb, hh, dk, dv = len(starts), q.shape[1], q.shape[2], v.shape[2]
    parts = _chunk_parts(q, k, v, g, beta, (starts, lens), chunk, solve)
    h = h0.float() if h0 is not None else q.new_zeros(nb, hh, dk, dv, dtype=torch.float32)
    lens_t = _device_ints(lens, q.device, torch.int64)
    outs = []
    for ci in range(parts.W.shape[1]):
        up = parts.U[:, ci] - parts.W[:, ci] @ h
        outs.append(parts.qg[:, ci] @ h + parts.P[:, ci] @ up)
        new_h = h * parts.egl[:, ci][..., None, None] + parts.kd[:, ci].transpose(-1, -2) @ up
        if state_at == "end":
            upd = lens_t > ci * chunk
        else:
            upd = lens_t >= (ci + 1) * chunk
        h = torch.where(upd[:, None, None, None], new_h, h)
    o = _unchunkify(torch.stack(outs, 1), starts, lens, q.shape[0])
    return o, h


def _chunk_backward(
    inputs: list[torch.Tensor], grad_o: torch.Tensor, seqs: tuple[list[int], list[int]], chunk: int
) -> tuple[torch.Tensor | None, ...]:
    """Gradients of the chunk form's output (zero initial state) with respect to ``inputs``
    (q, k, v, g, beta, each requiring grad).

    Autograd through the chunk loop launches ~20 small kernels per chunk each way; here only the
    state recurrence runs chunk by chunk, one batched matmul per chunk each way. With
    ``F = e^{G_C} I - kd^T W`` the forward state is ``H' = F H + kd^T U`` and, for ``dN`` the
    gradient reaching ``H'``, ``dH = (qg - P W)^T dO + F^T dN``. The per-chunk terms' gradients
    (``dup = P^T dO + kd dN``; ``dqg = dO H^T``, ``dP = dO up^T``, ``dU = dup``, ``dW = -dup H^T``,
    ``dkd = up dN^T``, ``degl = <H, dN>``) are then batched over every chunk and handed to autograd
    for the intra-chunk part (all chunks at once)."""
    starts, lens = seqs
    with torch.enable_grad():
        parts = _chunk_parts(*inputs, seqs, chunk, "triangular")
    W, U, P, qg, kd, egl = (t.detach() for t in parts)
    b, nc, hh, c, dk = W.shape
    dv = U.shape[-1]
    do = _chunkify(grad_o.float(), starts, lens, nc, chunk)
    eye = torch.eye(dk, device=W.device)
    kd_t = kd.transpose(-1, -2)
    F = egl[..., None, None] * eye - kd_t @ W  # (B, nc, H, dk, dk)
    KU = kd_t @ U
    Y = (qg - P @ W).transpose(-1, -2) @ do
    states = torch.empty(b, nc, hh, dk, dv, device=W.device)  # H entering each chunk
    grads_in = torch.empty_like(states)  # dN: the gradient reaching the state leaving each chunk
    h = W.new_zeros(b * hh, dk, dv)
    for ci in range(nc):
        states[:, ci] = h.view(b, hh, dk, dv)
        h = torch.baddbmm(KU[:, ci].reshape(-1, dk, dv), F[:, ci].reshape(-1, dk, dk), h)
    dn = W.new_zeros(b * hh, dk, dv)
    for ci in reversed(range(nc)):
        grads_in[:, ci] = dn.view(b, hh, dk, dv)
        dn = torch.baddbmm(Y[:, ci].reshape(-1, dk, dv), F[:, ci].reshape(-1, dk, dk).transpose(-1, -2), dn)
    up = U - W @ states
    dup = P.transpose(-1, -2) @ do + kd @ grads_in
    grads = ChunkParts(
        W=-(dup @ states.transpose(-1, -2)),
        U=dup,
        P=do @ up.transpose(-1, -2),
        qg=do @ states.transpose(-1, -2),
        kd=up @ grads_in.transpose(-1, -2),
        egl=(states * grads_in).sum((-1, -2)),
    )
    return torch.autograd.grad(tuple(parts), inputs, tuple(grads), allow_unused=True)


def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    h0: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The defining recurrence, token by token (fp64 with ``dtype=torch.float64``: the accuracy
    reference; fp32: the native recurrent-form baseline). Returns (o, final state)."""
    starts, lens = _seqs(cu_seqlens)
    nb, hh, dk, dv = len(starts), q.shape[1], q.shape[2], v.shape[2]
    h = h0.to(dtype) if h0 is not None else q.new_zeros(nb, hh, dk, dv, dtype=dtype)
    o = q.new_zeros(q.shape[0], hh, dv, dtype=dtype)
    states = []
    for i, (s, n) in enumerate(zip(starts, lens, strict=True)):
        hs = h[i]
        for t in range(s, s + n):
            qt, kt, vt = q[t].to(dtype), k[t].to(dtype), v[t].to(dtype)
            a = torch.exp(g[t].to(dtype))[:, None, None]
            hs = hs * a
            pred = torch.einsum("hk,hkv->hv", kt, hs)
            hs = hs + beta[t].to(dtype)[:, None, None] * kt[:, :, None] * (vt - pred)[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", qt, hs)
        states.append(hs)
    return o, torch.stack(states) if states else h


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


def _tile_widths(dk: int, dv: int) -> tuple[int, int]:
    """Power-of-two register widths (at least 16, the dot's minimum) for dk and dv."""
    return max(16, next_power_of_2(dk)), max(16, next_power_of_2(dv))


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    starts: list[int],
    lens: list[int],
    slots: torch.Tensor,
    h_in: torch.Tensor,
    h_out: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Run the two chunk kernels over the sequences ``starts``/``lens``, reading the state of
    sequence b from ``h_in[slots[b]]`` and writing ``h_out[slots[b]]`` (the same tensor is allowed:
    each program reads its block before it writes it). Returns (o, the T workspace, the U/U'
    workspace, each sequence's first chunk index in them)."""
    t, hh, dk = q.shape
    dv = v.shape[2]
    o = torch.empty(t, hh, dv, dtype=torch.float32, device=q.device)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g, beta = g.contiguous(), beta.contiguous()
    assert h_in.is_contiguous() and h_out.is_contiguous() and h_in.dtype == torch.float32
    assert chunk >= 16 and chunk & (chunk - 1) == 0, "chunk must be a power of two >= 16"
    n_ch = [-(-n // chunk) for n in lens]
    offs = [0, *accumulate(n_ch)][:-1]
    total = max(sum(n_ch), 1)
    ws_w = torch.empty(total, hh, chunk, dk, dtype=torch.float32, device=q.device)
    ws_u = torch.empty(total, hh, chunk, dv, dtype=torch.float32, device=q.device)
    ws_p = torch.empty(total, hh, chunk, chunk, dtype=torch.float32, device=q.device)
    ws_t = torch.empty(total, hh, chunk, chunk, dtype=torch.float32, device=q.device)
    ws_g = torch.empty(total, hh, chunk, dtype=torch.float32, device=q.device)
    nb = len(lens)
    if not nb:
        return o, ws_t, ws_u, offs
    starts_t, lens_t, coff = (_device_ints(x, q.device) for x in (starts, lens, offs))
    bk, bdv = _tile_widths(dk, dv)
    bv = min(CONFIG.state_bv, bdv)
    cfg = CONFIG
    _gdn_prep_kernel[(max(n_ch + [1]), nb * hh)](
        q,
        k,
        v,
        g,
        beta,
        ws_w,
        ws_u,
        ws_p,
        ws_g,
        ws_t,
        starts_t,
        lens_t,
        coff,
        hh,
        *_input_strides(q, k, v, g, beta),
        DK=dk,
        DV=dv,
        C=chunk,
        KS=bk if interpreting() else min(bk, cfg.prep_ks),
        NB=min(max(bk, bdv), cfg.prep_nb),
        num_warps=cfg.prep_warps,
        enable_fp_fusion=True,  # the dots' multiply-adds must lower to fma, as tl.fma does
        num_stages=1,
    )
    _gdn_state_kernel[(nb * hh, cdiv(dv, bv))](
        q,
        k,
        ws_w,
        ws_u,
        ws_p,
        ws_g,
        h_in,
        o,
        h_out,
        starts_t,
        lens_t,
        slots,
        coff,
        hh,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        o.stride(0),
        o.stride(1),
        DK=dk,
        DV=dv,
        BK=bk,
        BV=bv,
        C=chunk,
        num_warps=cfg.state_warps,
        num_stages=1,
    )
    return o, ws_t, ws_u, offs


def gdn_recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, h: torch.Tensor
) -> torch.Tensor:
    """One token for each of B sequences (q, k (B, H, dk) ...), updating ``h`` (B, H, dk, dv) in
    place: the native recurrent-form decode step. Returns o (B, H, dv) fp32."""
    h.mul_(torch.exp(g.float())[..., None, None])
    kf = k.float()
    pred = torch.einsum("bhk,bhkv->bhv", kf, h)
    h.add_((beta.float()[..., None] * (v.float() - pred))[:, :, None, :] * kf[..., None])
    return torch.einsum("bhk,bhkv->bhv", q.float(), h)


def gdn_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    h0: torch.Tensor | None = None,
    chunk: int = CHUNK,
    impl: str | None = None,
    seqs: tuple[list[int], list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The invariant chunk form over packed sequences (q, k (T, H, dk); v (T, H, dv); g, beta (T, H)).
    Returns (o (T, H, dv) fp32, the state at each sequence's last chunk boundary (B, H, dk, dv)).
    ``seqs`` (starts, lengths as lists), when the caller has them, saves reading ``cu_seqlens`` back."""
    if resolve(impl, q) == "torch":
        return gdn_chunk_reference(q, k, v, g, beta, cu_seqlens, h0, chunk, seqs=seqs)
    hh, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    starts, lens = seqs or _seqs(cu_seqlens)
    nb = len(lens)
    if h0 is None:
        h0 = torch.zeros(nb, hh, dk, dv, dtype=torch.float32, device=q.device)
    h0 = h0.float().contiguous()
    ht = torch.empty_like(h0)
    slots = torch.arange(nb, device=q.device, dtype=torch.int32)
    return _launch(q, k, v, g, beta, starts, lens, slots, h0, ht, chunk)[0], ht


class _GDN(torch.autograd.Function):
    """Forward through the kernel; backward through :func:`_chunk_backward` (the torch chunk form
    in fp32, recomputed from the saved inputs)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens, chunk):  # type: ignore[override]
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens)
        # Read the sequence bounds back once: a second read in backward would be a host sync
        # that stalls the backward's launches behind this forward's kernels.
        ctx.chunk, ctx.seqs = chunk, _seqs(cu_seqlens)
        return gdn_chunk(q, k, v, g, beta, cu_seqlens, None, chunk, seqs=ctx.seqs)[0]

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, g, beta, _ = ctx.saved_tensors
        # The gradient is not part of the bitwise contract: the same chunk form with a library
        # triangular solve, differentiated by hand across chunks; accuracy is checked against fp64.
        ins = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
        grads = _chunk_backward(ins, grad, ctx.seqs, ctx.chunk)
        return (
            *(
                None if gr is None else gr.to(t.dtype)
                for gr, t in zip(grads, (q, k, v, g, beta), strict=True)
            ),
            None,
            None,
        )


def gdn_chunk_autograd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """The trainer's path: invariant forward from a zero state, with a backward for training."""
    return _GDN.apply(q, k, v, g, beta, cu_seqlens, chunk)


@dataclass
class GDNCache:
    """Per-slot decode state. Invariant mode keeps the state at the last chunk boundary, the open
    chunk's inputs (``buf``, ``buf_len`` tokens) and that chunk's final rows of T and U' (so a decode
    step computes one new row); native mode keeps the running state only."""

    h: torch.Tensor  # (S, H, dk, dv) fp32
    buf: list[torch.Tensor]  # q, k (S, C, H, dk); v (S, C, H, dv); g, beta (S, C, H)
    buf_len: torch.Tensor  # (S,) int32, on the device
    t: torch.Tensor  # (S, H, C, C) fp32: rows < buf_len of the open chunk's T
    up: torch.Tensor  # (S, H, C, dv) fp32: rows < buf_len of the open chunk's U' = U - W H

    @classmethod
    def empty(
        cls,
        slots: int,
        heads: int,
        dk: int,
        dv: int,
        dtype: torch.dtype,
        device: torch.device,
        chunk: int = CHUNK,
    ) -> GDNCache:
        def z(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dt, device=device)

        f32 = torch.float32
        buf = [
            z(slots, chunk, heads, dk),
            z(slots, chunk, heads, dk),
            z(slots, chunk, heads, dv),
            z(slots, chunk, heads, dt=f32),
            z(slots, chunk, heads, dt=f32),
        ]
        return cls(
            h=z(slots, heads, dk, dv, dt=f32),
            buf=buf,
            buf_len=torch.zeros(slots, dtype=torch.int32, device=device),
            t=z(slots, heads, chunk, chunk, dt=f32),
            up=z(slots, heads, chunk, dv, dt=f32),
        )


def gdn_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    cache: GDNCache,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """One new token for each of B sequences (q (B, H, dk) ...; ``slots`` (B,) int on the device),
    invariant mode, no host sync: two launches (the row kernel, then the buf_len bump).
    Returns o (B, H, dv) fp32."""
    nb, hh, dk = q.shape
    dv = v.shape[2]
    o = torch.empty(nb, hh, dv, dtype=torch.float32, device=q.device)
    if not nb:
        return o
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and g.stride(-1) == beta.stride(-1) == 1
    bk, bdv = _tile_widths(dk, dv)
    scratch = torch.empty(nb * hh, 3 * chunk + bk, dtype=torch.float32, device=q.device)
    _gdn_decode_kernel[(nb * hh,)](
        q,
        k,
        v,
        g,
        beta,
        slots,
        cache.buf_len,
        *cache.buf,
        cache.h,
        cache.t,
        cache.up,
        scratch,
        o,
        hh,
        *_input_strides(q, k, v, g, beta),
        DK=dk,
        DV=dv,
        BK=bk,
        BDV=bdv,
        FV=min(64, bdv),
        C=chunk,
        num_warps=CONFIG.decode_warps,
        num_stages=1,
    )
    _gdn_bump_kernel[(nb,)](slots, cache.buf_len, C=chunk)
    return o


def gdn_incremental(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    slots: list[int],
    cache: GDNCache,
    invariant: bool,
    chunk: int = CHUNK,
    impl: str | None = None,
) -> torch.Tensor:
    """The engine's path: new tokens of several sequences (packed) continue their cached state.
    Invariant mode: single tokens take :func:`gdn_decode_step`; otherwise each open chunk is re-run
    with the new tokens by the chunk kernels (same bits as the trainer) and its final T / U' rows
    are cached. Native mode is the usual one: chunk form for a prefill, the recurrence for single
    tokens."""
    starts, lens = _seqs(cu_seqlens)
    new = (q, k, v, g, beta)
    sl = torch.tensor(slots, device=q.device)
    decode = bool(lens) and max(lens) == 1 and min(lens) == 1
    if not invariant:
        if decode:
            h = cache.h[sl]
            o = gdn_recurrent_step(q, k, v, g, beta, h)
        else:
            o, h = gdn_chunk_reference(
                *new, cu_seqlens, cache.h[sl], chunk, solve="triangular", state_at="end"
            )
        cache.h[sl] = h
        return o
    kernel = resolve(impl, q) == "triton"
    if decode and kernel:
        return gdn_decode_step(q, k, v, g, beta, sl, cache, chunk)
    n0s = cache.buf_len.tolist()
    parts: list[list[torch.Tensor]] = [[] for _ in new]
    cu2 = [0]
    for s, n, slot in zip(starts, lens, slots, strict=True):
        n0 = n0s[slot]
        for j, x in enumerate(new):
            parts[j].append(torch.cat([cache.buf[j][slot, :n0], x[s : s + n].to(cache.buf[j].dtype)]))
        cu2.append(cu2[-1] + n0 + n)
    packed = [torch.cat(p) for p in parts]
    if kernel:
        h_all = cache.h  # the kernels read and write the slots' states in place
        lens2 = [b - a for a, b in zip(cu2[:-1], cu2[1:], strict=True)]
        sl32 = sl.to(torch.int32)
        o_all, ws_t, ws_up, offs = _launch(*packed, cu2[:-1], lens2, sl32, h_all, h_all, chunk)
    else:
        cu_t = torch.tensor(cu2, device=q.device, dtype=torch.int32)
        o_all, h = gdn_chunk(*packed, cu_t, cache.h[sl], chunk, impl)
        cache.h[sl] = h
    outs = []
    for i, (n, slot) in enumerate(zip(lens, slots, strict=True)):
        n0 = n0s[slot]
        total = n0 + n
        outs.append(o_all[cu2[i] + n0 : cu2[i + 1]])
        rem = total % chunk
        if rem:
            for j in range(len(new)):
                cache.buf[j][slot, :rem] = packed[j][cu2[i + 1] - rem : cu2[i + 1]]
            if kernel:
                last = offs[i] + total // chunk
                cache.t[slot, :, :rem] = ws_t[last, :, :rem]
                cache.up[slot, :, :rem] = ws_up[last, :, :rem]
        cache.buf_len[slot] = rem
    return torch.cat(outs)
