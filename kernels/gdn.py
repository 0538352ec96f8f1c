"""CPR Gated DeltaNet: the gated delta rule evaluated chunkwise in parallel, bit-identical for the
trainer (whole sequences) and the rollout engine (token by token).

The recurrence (state ``H`` of shape (dk, dv), per head; ``a_t = exp(g_t)``, ``g_t <= 0``)::

    H_t = a_t (I - b_t k_t k_t^T) H_{t-1} + b_t k_t v_t^T,     o_t = H_t^T q_t

is the defining function (:func:`gdn_recurrent`, run in fp64 it is the accuracy reference). It is
*evaluated* in chunks of C tokens aligned to each sequence's first token. Within a chunk, with
``G = cumsum(g)``, ``A = tril(b_i (k_i.k_j) e^{G_i-G_j}, -1)`` and ``T = (I + A)^{-1}`` (forward
substitution ``T_i = e_i - sum_j A_ij T_j``, evaluated as Jacobi sweeps ``T <- I - A T``, each row
final once the rows above it are)::

    W = T (b e^G k),   U = T (b v),   U' = U - W H_0
    O = (e^G q) H_0 + tril(q k^T e^{G_i-G_j}) U'
    H_C = e^{G_C} H_0 + (e^{G_C - G} k)^T U'

Every row ``i`` of every quantity depends on rows ``<= i`` only (later rows enter as exact zeros),
so a chunk that holds only the first ``n`` tokens yields the same first ``n`` output rows, bit for
bit, as the full chunk. That is how decode matches the trainer: the engine keeps the state at the
last chunk boundary plus the tokens since (at most C-1), recomputes the open chunk with the same
kernel at each step, and re-synchronises the state when the chunk fills. Everything is fp32 with
exact fp32 products (no tf32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import HAVE_TRITON, jit, resolve, tl, triton

CHUNK = 64

if HAVE_TRITON:

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
        BK: tl.constexpr,
        BDV: tl.constexpr,
        C: tl.constexpr,
    ):
        """Intra-chunk quantities of one (sequence, chunk, head), all chunks in parallel:
        G = cumsum(g), T = (I + A)^-1, W = T (b e^G k), U = T (b v), P = tril(q k^T e^{G_i-G_j})."""
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
            kk = tl.arange(0, BK)
            vv = tl.arange(0, BDV)
            kok = kk < DK
            vok = vv < DV
            ok = (t0 + c) < n
            row = (start + t0 + c).to(tl.int64)
            kc = tl.load(
                k_ptr + row[:, None] * stride_kt + h * stride_kh + kk[None, :],
                mask=ok[:, None] & kok[None, :],
                other=0.0,
            ).to(tl.float32)
            gc = tl.load(g_ptr + row * stride_gt + h, mask=ok, other=0.0).to(tl.float32)
            bc = tl.load(b_ptr + row * stride_bt + h, mask=ok, other=0.0).to(tl.float32)
            G = tl.cumsum(gc, 0)
            causal = c[:, None] >= c[None, :]
            decay = tl.exp(tl.where(causal, G[:, None] - G[None, :], 0.0))
            kkt = tl.dot(kc, tl.trans(kc), input_precision="ieee")
            A = tl.where(c[:, None] > c[None, :], (bc[:, None] * kkt) * decay, 0.0)
            # T = (I + A)^-1 as the fixed point of T <- I - A T (Jacobi sweeps of forward
            # substitution): after sweep m rows <= m are final and later sweeps recompute them to
            # the same bits, so n_valid - 1 sweeps give the bits of C - 1 sweeps.
            eye = tl.where(c[:, None] == c[None, :], 1.0, 0.0)
            T = eye
            for _ in range(1, tl.minimum(n - t0, C)):
                T = eye - tl.dot(A, T, input_precision="ieee")
            W = tl.dot(T, kc * (bc * tl.exp(G))[:, None], input_precision="ieee")
            tl.store(w_ptr + ws * C * DK + c[:, None] * DK + kk[None, :], W, mask=kok[None, :])
            vc = tl.load(
                v_ptr + row[:, None] * stride_vt + h * stride_vh + vv[None, :],
                mask=ok[:, None] & vok[None, :],
                other=0.0,
            ).to(tl.float32)
            U = tl.dot(T, vc * bc[:, None], input_precision="ieee")
            tl.store(u_ptr + ws * C * DV + c[:, None] * DV + vv[None, :], U, mask=vok[None, :])
            qc = tl.load(
                q_ptr + row[:, None] * stride_qt + h * stride_qh + kk[None, :],
                mask=ok[:, None] & kok[None, :],
                other=0.0,
            ).to(tl.float32)
            P = tl.where(causal, tl.dot(qc, tl.trans(kc), input_precision="ieee") * decay, 0.0)
            tl.store(p_ptr + ws * C * C + c[:, None] * C + c[None, :], P)
            tl.store(gc_ptr + ws * C + c, G)

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
        """The chunk-to-chunk recurrence of one (sequence, head, dv block), in order:
        U' = U - W H, O = (e^G q) H + P U', H <- e^{G_C} H + (e^{G_C - G} k)^T U' (full chunks)."""
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
        hbase = (slot * H + h).to(tl.int64) * DK * DV
        hmask = kok[:, None] & vok[None, :]
        state = tl.load(h0_ptr + hbase + kk[:, None] * DV + vv[None, :], mask=hmask, other=0.0)
        for t0 in range(0, n, C):
            ws = ((coff + t0 // C) * H + h).to(tl.int64)
            ok = (t0 + c) < n
            row = (start + t0 + c).to(tl.int64)
            qc = tl.load(
                q_ptr + row[:, None] * stride_qt + h * stride_qh + kk[None, :],
                mask=ok[:, None] & kok[None, :],
                other=0.0,
            ).to(tl.float32)
            kc = tl.load(
                k_ptr + row[:, None] * stride_kt + h * stride_kh + kk[None, :],
                mask=ok[:, None] & kok[None, :],
                other=0.0,
            ).to(tl.float32)
            W = tl.load(
                w_ptr + ws * C * DK + c[:, None] * DK + kk[None, :],
                mask=ok[:, None] & kok[None, :],
                other=0.0,
            )
            U = tl.load(
                u_ptr + ws * C * DV + c[:, None] * DV + vv[None, :],
                mask=ok[:, None] & vok[None, :],
                other=0.0,
            )
            P = tl.load(p_ptr + ws * C * C + c[:, None] * C + c[None, :])
            G = tl.load(gc_ptr + ws * C + c)
            Up = U - tl.dot(W, state, input_precision="ieee")
            o = tl.dot(qc * tl.exp(G)[:, None], state, input_precision="ieee") + tl.dot(
                P, Up, input_precision="ieee"
            )
            tl.store(
                o_ptr + row[:, None] * stride_ot + h * stride_oh + vv[None, :],
                o,
                mask=ok[:, None] & vok[None, :],
            )
            gl = tl.sum(tl.where(c == C - 1, G, 0.0), 0)
            kd = kc * tl.exp(gl - G)[:, None]
            new_state = state * tl.exp(gl) + tl.dot(tl.trans(kd), Up, input_precision="ieee")
            state = tl.where(t0 + C <= n, new_state, state)
        tl.store(ht_ptr + hbase + kk[:, None] * DV + vv[None, :], state, mask=hmask)


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


def _seqs(cu_seqlens: torch.Tensor) -> tuple[list[int], list[int]]:
    cu = [int(x) for x in cu_seqlens.tolist()]
    return cu[:-1], [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk form in torch (differentiable). ``solve="substitution"`` is the kernel's
    arithmetic (forward substitution as Jacobi sweeps); ``"triangular"`` (a library triangular solve) and
    ``state_at="end"`` (the state after the last, possibly partial, chunk) make it the native
    chunk-form baseline. Returns (o (T, H, dv) fp32, state (B, H, dk, dv) fp32)."""
    starts, lens = _seqs(cu_seqlens)
    nb, hh, dk, dv = len(starts), q.shape[1], q.shape[2], v.shape[2]
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
    W = T @ (kc * (bc * eg)[..., None])
    U = T @ (vc * bc[..., None])
    P = torch.where(causal, (qc @ kc.transpose(-1, -2)) * decay, torch.zeros_like(decay))
    qg = qc * eg[..., None]
    gl = G[..., -1]
    kd = kc * torch.exp(gl[..., None] - G)[..., None]
    h = h0.float() if h0 is not None else q.new_zeros(nb, hh, dk, dv, dtype=torch.float32)
    lens_t = torch.tensor(lens, device=q.device)
    outs = []
    for ci in range(nc):
        up = U[:, ci] - W[:, ci] @ h
        outs.append(qg[:, ci] @ h + P[:, ci] @ up)
        new_h = h * torch.exp(gl[:, ci])[..., None, None] + kd[:, ci].transpose(-1, -2) @ up
        if state_at == "end":
            upd = lens_t > ci * chunk
        else:
            upd = lens_t >= (ci + 1) * chunk
        h = torch.where(upd[:, None, None, None], new_h, h)
    o = _unchunkify(torch.stack(outs, 1), starts, lens, q.shape[0])
    return o, h


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


def _launch(
    q,
    k,
    v,
    g,
    beta,
    starts,
    lens,
    state_slots,
    h_in,
    h_out,
    chunk,
    chunk_off: torch.Tensor | None = None,
    max_chunks: int | None = None,
) -> torch.Tensor:
    """Run the two kernels over sequences given by token ``starts``/``lens`` (device int32),
    reading the state of sequence b from ``h_in[state_slots[b]]`` and writing
    ``h_out[state_slots[b]]`` (the same tensor is allowed: each program reads its block before it
    writes it). ``chunk_off``/``max_chunks`` (the workspace index of each sequence's first chunk)
    are computed here unless given, which costs one host sync."""
    t, hh, dk = q.shape
    dv = v.shape[2]
    o = torch.empty(t, hh, dv, dtype=torch.float32, device=q.device)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    g, beta = g.contiguous(), beta.contiguous()
    assert h_in.is_contiguous() and h_out.is_contiguous() and h_in.dtype == torch.float32
    nb = starts.numel()
    if not nb:
        return o
    if chunk_off is None:
        n_ch = [-(-int(n) // chunk) for n in lens.tolist()]
        max_chunks = max(n_ch + [1])
        offs = [0]
        for x in n_ch[:-1]:
            offs.append(offs[-1] + x)
        chunk_off = torch.tensor(offs, device=q.device, dtype=torch.int32)
        total = sum(n_ch)
    else:
        total = nb * (max_chunks or 1)
    bk = max(16, triton.next_power_of_2(dk))
    bdv = max(16, triton.next_power_of_2(dv))
    bv = min(64, bdv)
    ws_w = torch.empty(max(total, 1), hh, chunk, dk, dtype=torch.float32, device=q.device)
    ws_u = torch.empty(max(total, 1), hh, chunk, dv, dtype=torch.float32, device=q.device)
    ws_p = torch.empty(max(total, 1), hh, chunk, chunk, dtype=torch.float32, device=q.device)
    ws_g = torch.empty(max(total, 1), hh, chunk, dtype=torch.float32, device=q.device)
    _gdn_prep_kernel[(max_chunks or 1, nb * hh)](
        q,
        k,
        v,
        g,
        beta,
        ws_w,
        ws_u,
        ws_p,
        ws_g,
        starts,
        lens,
        chunk_off,
        hh,
        q.stride(0),
        q.stride(1),
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
        num_warps=8,
        num_stages=1,
    )
    _gdn_state_kernel[(nb * hh, triton.cdiv(dv, bv))](
        q,
        k,
        ws_w,
        ws_u,
        ws_p,
        ws_g,
        h_in,
        o,
        h_out,
        starts,
        lens,
        state_slots,
        chunk_off,
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
        num_warps=8,
        num_stages=1,
    )
    return o


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """The invariant chunk form over packed sequences (q, k (T, H, dk); v (T, H, dv); g, beta (T, H)).
    Returns (o (T, H, dv) fp32, the state at each sequence's last chunk boundary (B, H, dk, dv))."""
    if resolve(impl, q) == "torch":
        return gdn_chunk_reference(q, k, v, g, beta, cu_seqlens, h0, chunk)
    hh, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    nb = cu.numel() - 1
    starts, lens = cu[:-1].contiguous(), (cu[1:] - cu[:-1]).contiguous()
    if h0 is None:
        h0 = torch.zeros(nb, hh, dk, dv, dtype=torch.float32, device=q.device)
    h0 = h0.float().contiguous()
    ht = torch.empty_like(h0)
    slots = torch.arange(nb, device=q.device, dtype=torch.int32)
    return _launch(q, k, v, g, beta, starts, lens, slots, h0, ht, chunk), ht


class _GDN(torch.autograd.Function):
    """Forward through the kernel; backward by differentiating the torch chunk form in fp32,
    recomputed from the saved inputs."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens, chunk):  # type: ignore[override]
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens)
        ctx.chunk = chunk
        return gdn_chunk(q, k, v, g, beta, cu_seqlens, None, chunk)[0]

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        q, k, v, g, beta, cu = ctx.saved_tensors
        with torch.enable_grad():
            ins = [t.detach().requires_grad_(True) for t in (q, k, v, g, beta)]
            # The gradient is not part of the bitwise contract: differentiate the same chunk form
            # with a library triangular solve (fast); accuracy is checked against fp64.
            o, _ = gdn_chunk_reference(*ins, cu, None, ctx.chunk, solve="triangular")
            grads = torch.autograd.grad(o, ins, grad.float())
        return (*(gr.to(t.dtype) for gr, t in zip(grads, (q, k, v, g, beta), strict=True)), None, None)


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
    """Per-slot decode state. Invariant mode keeps the state at the last chunk boundary plus the
    open chunk's inputs (``buf``, ``buf_len`` tokens); native mode keeps the running state only."""

    h: torch.Tensor  # (S, H, dk, dv) fp32
    buf: list[torch.Tensor]  # q, k (S, C, H, dk); v (S, C, H, dv); g, beta (S, C, H)
    buf_len: torch.Tensor  # (S,) int32, on the device

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

        buf = [
            z(slots, chunk, heads, dk),
            z(slots, chunk, heads, dk),
            z(slots, chunk, heads, dv),
            z(slots, chunk, heads, dt=torch.float32),
            z(slots, chunk, heads, dt=torch.float32),
        ]
        return cls(
            h=z(slots, heads, dk, dv, dt=torch.float32),
            buf=buf,
            buf_len=torch.zeros(slots, dtype=torch.int32, device=device),
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
    """One new token for each of B sequences (q (B, H, dk) ...), invariant mode, no host sync:
    append to each open chunk, re-run the chunk kernel on it from the boundary state, and when a
    chunk fills the kernel has already written the re-synchronised state."""
    slots = slots.to(torch.long)
    n0 = cache.buf_len[slots].long()
    for buf, x in zip(cache.buf, (q, k, v, g, beta), strict=True):
        buf[slots, n0] = x.to(buf.dtype)
    flat = [b.view(b.shape[0] * chunk, *b.shape[2:]) for b in cache.buf]
    starts = (slots * chunk).to(torch.int32)
    lens = (n0 + 1).to(torch.int32)
    o = _launch(
        *flat,
        starts,
        lens,
        slots.to(torch.int32),
        cache.h,
        cache.h,
        chunk,
        chunk_off=torch.arange(slots.numel(), device=q.device, dtype=torch.int32),
        max_chunks=1,
    )
    cache.buf_len[slots] = torch.where(lens == chunk, 0, lens).to(torch.int32)
    return o[slots * chunk + n0]


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
    Invariant mode re-runs each open chunk with the kernel (same bits as the trainer); native
    mode is the usual one: chunk form for a prefill, the recurrence for single tokens."""
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
    if decode and resolve(impl, q) == "triton":
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
    cu_t = torch.tensor(cu2, device=q.device, dtype=torch.int32)
    o_all, h = gdn_chunk(*packed, cu_t, cache.h[sl], chunk, impl)
    cache.h[sl] = h
    outs = []
    for i, (n, slot) in enumerate(zip(lens, slots, strict=True)):
        n0 = n0s[slot]
        total = n0 + n
        outs.append(o_all[cu2[i] + n0 : cu2[i + 1]])
        rem = total % chunk
        for j in range(len(new)):
            if rem:
                cache.buf[j][slot, :rem] = packed[j][cu2[i + 1] - rem : cu2[i + 1]]
        cache.buf_len[slot] = rem
    return torch.cat(outs)
