"""CPR Gated DeltaNet: the gated delta rule evaluated chunkwise in parallel on tensor cores,
bit-identical for the trainer (whole sequences) and the rollout engine (token by token).

The recurrence (state ``H`` of shape (dk, dv), per head; ``a_t = exp(g_t)``, ``g_t <= 0``)::

    H_t = a_t (I - b_t k_t k_t^T) H_{t-1} + b_t k_t v_t^T,     o_t = H_t^T q_t

is the defining function (:func:`gdn_recurrent`, run in fp64 it is the accuracy reference). It is
*evaluated* in chunks of C tokens aligned to each sequence's first token. Within a chunk, with
``G = cumsum(g)``, ``A = tril(b_i (k_i.k_j) e^{G_i-G_j}, -1)`` and ``T = (I + A)^{-1}``::

    W = T (b e^G k),   U = T (b v),   U' = U - W H_0
    O = (q H_0) e^G + tril(q k^T e^{G_i-G_j}) U'
    H_C = e^{G_C} H_0 + (e^{G_C - G} k)^T U'

Three kernels, each a few tensor-core dots per chunk (the operands in the inputs' dtype with fp32
accumulation, fp32 intermediates as tf32; fp32 inputs take exact fp32 products instead, which is
what the CPU interpreter tests): *prep* (all chunks in parallel: ``G``, ``A``, ``T`` by repeated
squaring ``T = (I - A)(I + A^2)(I + A^4)...``, ``W``, ``U``), *state* (each sequence's chunks in
order: ``U'`` and the boundary states) and *out* (all chunks in parallel: ``O``).

Why decode gets the trainer's bits. Every quantity of row ``i`` is a dot whose left operand is row
``i`` of a lower-triangular matrix (``A``, its powers, ``T``, the causal ``P``) or row ``i`` of an
input, so it reads other rows only through exact-zero coefficients: rows after ``i``, whatever
they hold (the trainer's later tokens, or the engine's zero padding), never change row ``i``. A
dot's element depends on its row and column alone: for the same K and N, a 64-row dot and a
16-row one give a row the same tensor-core arithmetic (``wgmma`` and ``mma.sync`` agree bit for bit
on the H200, :mod:`isoaudit.kernels.gdn_decode`). Hence a chunk
holding its first ``n`` tokens yields the trainer's first ``n`` rows bit for bit, and the state
crosses a chunk boundary only when the chunk is full, from the same inputs. Decode
(:mod:`isoaudit.kernels.gdn_decode`) keeps per slot the state at the last chunk boundary and the open
chunk, and evaluates the same dots on the 16 rows around each new token. Prefill/decode splits
anywhere, packed or not, give the trainer's bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple

import torch

from ._triton import (
    HAVE_TRITON,
    cdiv,
    dot_precision,
    jit,
    next_power_of_2,
    resolve,
    tl,
    triton,
)

CHUNK = 64


@dataclass(frozen=True)
class GDNConfig:
    """Launch parameters of the chunk kernels (the decode step's: :mod:`isoaudit.kernels.gdn_decode`):
    the warps and the column blocks (the N side of the dots). A dot's
    element is the same chain over K whatever the N tile, so none of them changes a bit
    (``test_launch_config_changes_no_bit_gpu``); the K sides and the chunk are fixed."""

    prep_warps: int = 4
    prep_nb: int = 64  # column block of W and U
    state_warps: int = 4
    state_bv: int = 32  # dv block of the state kernel (one program per sequence, head and block)
    out_warps: int = 4
    out_bv: int = 64  # dv block of the output kernel


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
    def _decay_rows(g_rows, g_cols, r, c):
        """``exp(G_r - G_c)`` for rows ``r`` against columns ``c``, on and below the diagonal, 1
        above (masked by the caller). Elementwise, so a row's values do not depend on the tile."""
        return tl.exp(tl.where(r[:, None] >= c[None, :], g_rows[:, None] - g_cols[None, :], 0.0))

    @triton.jit
    def _decay(g, c):
        """``exp(G_i - G_j)`` of one chunk (:func:`_decay_rows` over all its rows)."""
        return _decay_rows(g, g, c, c)

    @triton.jit
    def _wy_inverse(k_s, bc, G, c, SQUARINGS: tl.constexpr, PREC: tl.constexpr):
        """``k k^T``, ``A = tril(b_i (k_i.k_j) e^{G_i-G_j}, -1)`` and ``T = (I + A)^{-1}`` of one
        chunk, T as ``(I - A)(I + A^2)(I + A^4)...`` (A is nilpotent); row i of each reads rows
        <= i alone. Shared by the forward and the backward."""
        kk = tl.dot(k_s, tl.trans(k_s), input_precision=PREC)
        a = tl.where(c[:, None] > c[None, :], (bc[:, None] * kk) * _decay(G, c), 0.0)
        power = -a
        t = tl.where(c[:, None] == c[None, :], 1.0, 0.0) + power
        for _ in tl.static_range(SQUARINGS):
            power = tl.dot(power, power, input_precision=PREC)
            t = tl.dot(t, power, t, input_precision=PREC)
        return kk, a, t

    @jit()
    def _gdn_prep_kernel(
        k_ptr,
        v_ptr,
        g_ptr,
        b_ptr,
        w_ptr,
        u_ptr,
        gc_ptr,
        start_ptr,
        len_ptr,
        coff_ptr,
        H,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_gt,
        stride_bt,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BK: tl.constexpr,
        BDV: tl.constexpr,
        C: tl.constexpr,
        NB: tl.constexpr,
        SQUARINGS: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """Intra-chunk quantities of one (sequence, chunk, head), all chunks in parallel: G, A,
        T = (I - A)(I + A^2)...(I + A^(C/2)) (A is nilpotent: A^C = 0), W = T (b e^G k) and
        U = T (b v), stored in the inputs' dtype. Rows past the sequence's end are zero inputs."""
        ic = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        n = tl.load(len_ptr + b)
        t0 = ic * C
        if t0 < n:
            dt = k_ptr.dtype.element_ty
            start = tl.load(start_ptr + b)
            ws = ((tl.load(coff_ptr + b) + ic) * H + h).to(tl.int64)
            c = tl.arange(0, C)
            ok = (t0 + c) < n
            row = (start + t0 + c).to(tl.int64)
            gc = tl.load(g_ptr + row * stride_gt + h, mask=ok, other=0.0).to(tl.float32)
            bc = tl.load(b_ptr + row * stride_bt + h, mask=ok, other=0.0).to(tl.float32)
            G = _cumsum_chain(gc, C)
            tl.store(gc_ptr + ws * C + c, G)
            kd = tl.arange(0, BK)
            k_at = k_ptr + row[:, None] * stride_kt + h * stride_kh + kd[None, :]
            k_s = tl.load(k_at, mask=ok[:, None] & (kd < DK)[None, :], other=0.0)
            t = _wy_inverse(k_s, bc, G, c, SQUARINGS, PREC)[2].to(dt)
            kscale = bc * tl.exp(G)
            for d0 in tl.static_range(0, BK, NB):
                d = d0 + tl.arange(0, NB)
                km = ok[:, None] & (d < DK)[None, :]
                ks = tl.load(
                    k_ptr + row[:, None] * stride_kt + h * stride_kh + d[None, :], mask=km, other=0.0
                )
                w = tl.dot(t, (ks.to(tl.float32) * kscale[:, None]).to(dt), input_precision=PREC)
                tl.store(w_ptr + (ws * C + c[:, None]) * DK + d[None, :], w.to(dt), mask=(d < DK)[None, :])
            for v0 in tl.static_range(0, BDV, NB):
                vv = v0 + tl.arange(0, NB)
                vm = ok[:, None] & (vv < DV)[None, :]
                vs = tl.load(
                    v_ptr + row[:, None] * stride_vt + h * stride_vh + vv[None, :], mask=vm, other=0.0
                )
                u = tl.dot(t, (vs.to(tl.float32) * bc[:, None]).to(dt), input_precision=PREC)
                tl.store(u_ptr + (ws * C + c[:, None]) * DV + vv[None, :], u.to(dt), mask=(vv < DV)[None, :])

    @triton.jit
    def _chunk_vnew(
        w_ptr, u_ptr, hc_ptr, state, ws, c, kk, vv, kok, vok, DK, DV, C: tl.constexpr, PREC: tl.constexpr
    ):
        """One chunk of the state kernel before its boundary: stores the state entering it (in the
        inputs' dtype) and U' = U - W H over U; returns U'."""
        dt = w_ptr.dtype.element_ty
        entering = state.to(dt)
        tl.store(
            hc_ptr + ws * DK * DV + kk[:, None] * DV + vv[None, :], entering, mask=kok[:, None] & vok[None, :]
        )
        w = tl.load(w_ptr + (ws * C + c[:, None]) * DK + kk[None, :], mask=kok[None, :], other=0.0)
        u_at = u_ptr + (ws * C + c[:, None]) * DV + vv[None, :]
        u = tl.load(u_at, mask=vok[None, :], other=0.0).to(tl.float32)
        vn = (u - tl.dot(w, entering, input_precision=PREC)).to(dt)
        tl.store(u_at, vn, mask=vok[None, :])
        return vn

    @jit()
    def _gdn_state_kernel(
        k_ptr,
        w_ptr,
        u_ptr,
        gc_ptr,
        hc_ptr,
        h0_ptr,
        ht_ptr,
        start_ptr,
        len_ptr,
        slot_ptr,
        coff_ptr,
        H,
        stride_kt,
        stride_kh,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BK: tl.constexpr,
        BV: tl.constexpr,
        C: tl.constexpr,
        PREC: tl.constexpr,
    ):
        """The chunk-to-chunk recurrence of one (sequence, head, dv block), in order: stores the
        state entering each chunk (in the inputs' dtype, for the output kernel), U' = U - W H over
        U, and crosses a boundary, H <- e^{G_C} H + (e^{G_C - G} k)^T U', only after a full chunk.
        Reads the state from ``h0[slot]`` and writes the last boundary state to ``ht[slot]`` (the
        same tensor is allowed: each program reads its block before it writes it)."""
        bh = tl.program_id(0)
        iv = tl.program_id(1)
        b = bh // H
        h = bh % H
        dt = k_ptr.dtype.element_ty
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
        state = tl.load(h0_ptr + hs + kk[:, None] * DV + vv[None, :], mask=hmask, other=0.0)
        # Full chunks first, in a loop without a branch (so the next chunk's loads overlap this
        # one's dots), then the open chunk, which does not cross a boundary.
        for ci in range(coff, coff + n // C):
            ws = (ci * H + h).to(tl.int64)
            vn = _chunk_vnew(w_ptr, u_ptr, hc_ptr, state, ws, c, kk, vv, kok, vok, DK, DV, C, PREC)
            G = tl.load(gc_ptr + ws * C + c)
            g_last = tl.load(gc_ptr + ws * C + C - 1)
            row = (start + (ci - coff) * C + c).to(tl.int64)
            kt = tl.load(
                k_ptr + row[None, :] * stride_kt + h * stride_kh + kk[:, None], mask=kok[:, None], other=0.0
            )
            kt = (kt.to(tl.float32) * tl.exp(g_last - G)[None, :]).to(dt)
            state = tl.dot(kt, vn, state * tl.exp(g_last), input_precision=PREC)
        if n % C != 0:
            ws = ((coff + n // C) * H + h).to(tl.int64)
            _chunk_vnew(w_ptr, u_ptr, hc_ptr, state, ws, c, kk, vv, kok, vok, DK, DV, C, PREC)
        tl.store(ht_ptr + hs + kk[:, None] * DV + vv[None, :], state, mask=hmask)

    @jit()
    def _gdn_out_kernel(
        q_ptr,
        k_ptr,
        u_ptr,
        gc_ptr,
        hc_ptr,
        o_ptr,
        start_ptr,
        len_ptr,
        coff_ptr,
        emit_ptr,
        ostart_ptr,
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
        PREC: tl.constexpr,
    ):
        """O of one (sequence, chunk, head, dv block), all chunks in parallel: (q H) e^G +
        P U' with P = tril(q k^T e^{G_i - G_j}); rows from ``emit[b]`` on are written, from
        ``ostart[b]`` (a re-run open chunk emits only its new rows)."""
        ic = tl.program_id(0)
        bh = tl.program_id(1)
        iv = tl.program_id(2)
        b = bh // H
        h = bh % H
        n = tl.load(len_ptr + b)
        emit = tl.load(emit_ptr + b)
        t0 = ic * C
        if (t0 < n) & (t0 + C > emit):
            dt = k_ptr.dtype.element_ty
            start = tl.load(start_ptr + b)
            ws = ((tl.load(coff_ptr + b) + ic) * H + h).to(tl.int64)
            c = tl.arange(0, C)
            ok = (t0 + c) < n
            row = (start + t0 + c).to(tl.int64)
            kd = tl.arange(0, BK)
            vv = iv * BV + tl.arange(0, BV)
            kok = kd < DK
            vok = vv < DV
            im = ok[:, None] & kok[None, :]
            q_s = tl.load(q_ptr + row[:, None] * stride_qt + h * stride_qh + kd[None, :], mask=im, other=0.0)
            k_s = tl.load(k_ptr + row[:, None] * stride_kt + h * stride_kh + kd[None, :], mask=im, other=0.0)
            G = tl.load(gc_ptr + ws * C + c)
            qk = tl.dot(q_s, tl.trans(k_s), input_precision=PREC)
            p = tl.where(c[:, None] >= c[None, :], qk * _decay(G, c), 0.0).to(dt)
            hc = tl.load(
                hc_ptr + ws * DK * DV + kd[:, None] * DV + vv[None, :],
                mask=kok[:, None] & vok[None, :],
                other=0.0,
            )
            vn = tl.load(u_ptr + (ws * C + c[:, None]) * DV + vv[None, :], mask=vok[None, :], other=0.0)
            o = tl.dot(q_s, hc, input_precision=PREC) * tl.exp(G)[:, None]
            o = tl.dot(p, vn, o, input_precision=PREC)
            orow = (tl.load(ostart_ptr + b) + t0 + c - emit).to(tl.int64)
            keep = ok & (t0 + c >= emit)
            tl.store(
                o_ptr + orow[:, None] * stride_ot + h * stride_oh + vv[None, :],
                o,
                mask=keep[:, None] & vok[None, :],
            )


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
    q, k, v, g, beta = inputs
    with torch.enable_grad():
        parts = _chunk_parts(q, k, v, g, beta, seqs, chunk, "triangular")
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


def _tile_widths(dk: int, dv: int) -> tuple[int, int]:
    """Power-of-two register widths (at least 16, the dot's minimum) for dk and dv."""
    return max(16, next_power_of_2(dk)), max(16, next_power_of_2(dv))


class _Runs(NamedTuple):
    """The sequences one launch of the chunk kernels evaluates, as a (6, B) int32 device table:
    rows start, length, chunk offset (the sequence's first chunk in the workspaces), state slot,
    first row to emit and its output row. ``chunks``: the largest sequence's chunk count;
    ``total``: the workspaces' chunk count (host ints, for the grids and the allocations)."""

    table: torch.Tensor
    chunks: int
    total: int


def _runs(
    starts: list[int],
    lens: list[int],
    slots: list[int],
    emits: list[int],
    out_starts: list[int],
    device: torch.device,
    chunk: int,
) -> _Runs:
    n_ch = [-(-n // chunk) for n in lens]
    offs = [0, *accumulate(n_ch)][:-1]
    table = _device_ints([*starts, *lens, *offs, *slots, *emits, *out_starts], device).view(6, len(lens))
    return _Runs(table, max(n_ch + [1]), max(sum(n_ch), 1))


class _Workspace(NamedTuple):
    """Per (chunk, head): W, U (then U'), the state entering the chunk (in the inputs' dtype) and
    G. Every launch writes what it reads, so decode reuses one per batch size."""

    w: torch.Tensor
    u: torch.Tensor
    h: torch.Tensor
    g: torch.Tensor

    @classmethod
    def empty(cls, chunks: int, k: torch.Tensor, dv: int, chunk: int) -> _Workspace:
        hh, dk, dt, dev = k.shape[1], k.shape[2], k.dtype, k.device
        return cls(
            torch.empty(chunks, hh, chunk, dk, dtype=dt, device=dev),
            torch.empty(chunks, hh, chunk, dv, dtype=dt, device=dev),
            torch.empty(chunks, hh, dk, dv, dtype=dt, device=dev),
            torch.empty(chunks, hh, chunk, dtype=torch.float32, device=dev),
        )


def _launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    runs: _Runs,
    h_in: torch.Tensor,
    h_out: torch.Tensor,
    o: torch.Tensor,
    chunk: int,
    work: _Workspace | None = None,
) -> None:
    """Run the three chunk kernels over ``runs``, reading sequence b's state from
    ``h_in[slot_b]``, writing its last boundary state to ``h_out[slot_b]`` (the same tensor is
    allowed) and its emitted rows into ``o`` (fp32 (rows, H, dv))."""
    hh, dk = q.shape[1], q.shape[2]
    dv = v.shape[2]
    nb = runs.table.shape[1]
    if not nb:
        return
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and g.stride(-1) == beta.stride(-1) == 1
    assert h_in.is_contiguous() and h_out.is_contiguous() and h_in.dtype == torch.float32
    assert chunk >= 16 and chunk & (chunk - 1) == 0, "chunk must be a power of two >= 16"
    dt = k.dtype
    ws_w, ws_u, ws_h, ws_g = work or _Workspace.empty(runs.total, k, dv, chunk)
    start, length, coff, slot, emit, ostart = runs.table
    bk, bdv = _tile_widths(dk, dv)
    cfg, prec = CONFIG, dot_precision(dt)
    nbw = min(cfg.prep_nb, max(bk, bdv))
    _gdn_prep_kernel[(runs.chunks, nb * hh, 1)](
        k,
        v,
        g,
        beta,
        ws_w,
        ws_u,
        ws_g,
        start,
        length,
        coff,
        hh,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        DK=dk,
        DV=dv,
        BK=bk,
        BDV=bdv,
        C=chunk,
        NB=nbw,
        SQUARINGS=chunk.bit_length() - 2,
        PREC=prec,
        num_warps=cfg.prep_warps,
        num_stages=1,
    )
    bv = min(cfg.state_bv, bdv)
    _gdn_state_kernel[(nb * hh, cdiv(dv, bv), 1)](
        k,
        ws_w,
        ws_u,
        ws_g,
        ws_h,
        h_in,
        h_out,
        start,
        length,
        slot,
        coff,
        hh,
        k.stride(0),
        k.stride(1),
        DK=dk,
        DV=dv,
        BK=bk,
        BV=bv,
        C=chunk,
        PREC=prec,
        num_warps=cfg.state_warps,
    )
    bo = min(cfg.out_bv, bdv)
    _gdn_out_kernel[(runs.chunks, nb * hh, cdiv(dv, bo))](
        q,
        k,
        ws_u,
        ws_g,
        ws_h,
        o,
        start,
        length,
        coff,
        emit,
        ostart,
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
        BV=bo,
        C=chunk,
        PREC=prec,
        num_warps=cfg.out_warps,
    )


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
    return _chunk_forward(q, k, v, g, beta, seqs or _seqs(cu_seqlens), h0, chunk)[:2]


def _chunk_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    seqs: tuple[list[int], list[int]],
    h0: torch.Tensor | None,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor, _Runs, _Workspace]:
    """:func:`gdn_chunk` on the kernels (``h0`` None: a zero state), also returning the run table
    and the per-chunk workspace (what the backward reads)."""
    starts, lens = seqs
    nb = len(lens)
    if h0 is None:
        h0 = torch.zeros(nb, q.shape[1], q.shape[2], v.shape[2], dtype=torch.float32, device=q.device)
    h0 = h0.float().contiguous()
    ht = torch.empty_like(h0)
    o = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
    q, k, v, g, beta = _kernel_inputs(q, k, v, g, beta)
    runs = _runs(starts, lens, list(range(nb)), [0] * nb, starts, q.device, chunk)
    work = _Workspace.empty(runs.total, k, v.shape[2], chunk)
    _launch(q, k, v, g, beta, runs, h0, ht, o, chunk, work)
    return o, ht, runs, work


class _GDN(torch.autograd.Function):
    """Forward through the kernels; backward through :mod:`isoaudit.kernels.gdn_backward` (kernels too,
    from the forward's per-chunk workspace), or the torch chunk form where the kernels do not
    run (CPU tensors without the interpreter)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens, chunk):
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens)
        # Read the sequence bounds back once: a second read in backward would be a host sync
        # that stalls the backward's launches behind this forward's kernels.
        ctx.chunk, ctx.seqs = chunk, _seqs(cu_seqlens)
        if resolve(None, q) != "triton":
            return gdn_chunk(q, k, v, g, beta, cu_seqlens, None, chunk, seqs=ctx.seqs)[0]
        o, _, ctx.runs, ctx.work = _chunk_forward(q, k, v, g, beta, ctx.seqs, None, chunk)
        return o

    @staticmethod
    def backward(ctx, grad):
        q, k, v, g, beta, _ = ctx.saved_tensors
        # The gradient is not part of the bitwise contract; accuracy is checked against fp64.
        if getattr(ctx, "work", None) is not None:
            from .gdn_backward import gdn_chunk_backward

            dq, dk, dv, dg, db = gdn_chunk_backward(q, k, v, g, beta, ctx.runs, ctx.work, grad, ctx.chunk)
            ctx.work = None
            grads = (dq, dk, dv, dg, db)
        else:
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
    chunk's inputs (``buf``, ``buf_len`` tokens) and what :mod:`isoaudit.kernels.gdn_decode` caches of its
    first ``cached`` rows (the powers of A, U', the state in the inputs' dtype); native mode keeps
    the running state only."""

    h: torch.Tensor  # (S, H, dk, dv) fp32
    buf: list[torch.Tensor]  # q, k (S, C, H, dk); v (S, C, H, dv); g, beta (S, C, H) fp32
    buf_len: torch.Tensor  # (S,) int32, on the device
    powers: torch.Tensor  # (S, H, log2(C), C, C) fp32: -A, A^2, ..., A^(C/2) of the open chunk
    vnew: torch.Tensor  # (S, H, C, dv) in the inputs' dtype: U' of the open chunk
    h_entering: torch.Tensor  # (S, H, dk, dv) in the inputs' dtype: h rounded, once a chunk
    cached: torch.Tensor  # (S,) int32: open-chunk rows whose powers and U' (and h_entering) are cached
    arrived: torch.Tensor  # (S,) int32: heads done with the current decode step (0 between steps)

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

        f32, i32 = torch.float32, torch.int32
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
            buf_len=z(slots, dt=i32),
            powers=z(slots, heads, chunk.bit_length() - 1, chunk, chunk, dt=f32),
            vnew=z(slots, heads, chunk, dv),
            h_entering=z(slots, heads, dk, dv),
            cached=z(slots, dt=i32),
            arrived=z(slots, dt=i32),
        )


def _kernel_inputs(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The kernels read rows with unit element stride: anything else is copied once."""
    return tuple(x if x.stride(-1) == 1 else x.contiguous() for x in xs)


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
    Invariant mode: single tokens take :func:`isoaudit.kernels.gdn_decode.gdn_decode_step`; otherwise each
    open chunk is re-run with the new tokens by the chunk kernels (same bits as the trainer) and
    the new open chunk is cached. Native mode is the usual one: chunk form for a prefill, the recurrence for single
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
        from .gdn_decode import gdn_decode_step

        return gdn_decode_step(q, k, v, g, beta, sl.to(torch.int32), cache, chunk)
    n0s = cache.buf_len.tolist()
    parts: list[list[torch.Tensor]] = [[] for _ in new]
    cu2 = [0]
    for s, n, slot in zip(starts, lens, slots, strict=True):
        n0 = n0s[slot]
        for j, x in enumerate(new):
            parts[j].append(torch.cat([cache.buf[j][slot, :n0], x[s : s + n].to(cache.buf[j].dtype)]))
        cu2.append(cu2[-1] + n0 + n)
    packed = [torch.cat(p) for p in parts]
    lens2 = [b - a for a, b in zip(cu2[:-1], cu2[1:], strict=True)]
    emits = [n0s[slot] for slot in slots]
    if kernel:
        o = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float32, device=q.device)
        runs = _runs(cu2[:-1], lens2, slots, emits, starts, q.device, chunk)
        pq, pk, pv, pg, pb = _kernel_inputs(*packed)
        _launch(pq, pk, pv, pg, pb, runs, cache.h, cache.h, o, chunk)  # the slots' states in place
    else:
        cu_t = torch.tensor(cu2, device=q.device, dtype=torch.int32)
        pq, pk, pv, pg, pb = packed
        o_all, h = gdn_chunk(pq, pk, pv, pg, pb, cu_t, cache.h[sl], chunk, impl)
        cache.h[sl] = h
        o = torch.cat([o_all[a + e : b] for a, b, e in zip(cu2[:-1], cu2[1:], emits, strict=True)])
    for i, slot in enumerate(slots):
        rem = lens2[i] % chunk
        for j in range(len(new)):
            cache.buf[j][slot, :rem] = packed[j][cu2[i + 1] - rem : cu2[i + 1]]
        cache.buf_len[slot] = rem
        cache.cached[slot] = 0  # the decode caches of this chunk are rebuilt from its inputs
    return o
