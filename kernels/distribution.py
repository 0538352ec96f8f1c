"""The full-vocabulary distribution sketch ``Rᵀ √p`` in one pass over the log-probabilities.

The sketch (:mod:`isoaudit.audit.distribution`) projects each position's ``√p`` on a ``[vocab,
32]`` matrix of signs ±``SKETCH_SCALE``, in float64. In torch that is a float64 copy of the rows,
an ``exp``, a product and a cast, a chunk of positions at a time; here each program takes 16
positions and one fixed chunk of the vocabulary (``CHUNK_V`` tokens: the split depends on the
vocabulary alone, never on the batch), reads each float32 log-probability once, takes ``exp(lp /
2)`` in float64, builds the slab's signs from one int32 of sign bits per token
(:func:`~isoaudit.audit.distribution.sketch_sign_bits`) and adds the slab's product into a float64
partial; the chunks' partials are then summed in float64 and rounded once. The
same float64 arithmetic as the host's ``np.exp(lp * 0.5) @ R`` but for the order of the sums, so
both round to the same float32 sketch but for sums within a float64 rounding of a float32
boundary. Splitting the vocabulary keeps the GPU busy at a few hundred positions, where one
program per 16 positions walking the whole vocabulary leaves most SMs idle.
"""

from __future__ import annotations

import torch

from ._triton import HAVE_TRITON, CachedLauncher, aligned, cdiv, jit, tl

SKETCH_DIM = 32  # isoaudit.audit.distribution.SKETCH_DIM (kernels import nothing of ours)
BLOCK_R, BLOCK_V, WARPS = 16, 64, 4
#: Tokens per program: the vocabulary's fixed split (151,936 tokens: 10 chunks).
CHUNK_V = 16384

if HAVE_TRITON:

    @jit(do_not_specialize=["n_rows"])
    def _sketch_kernel(
        lp_ptr, bits_ptr, out_ptr, n_rows, vocab, stride_lp, scale,
        BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, SK: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        """Rows ``[pid0 * BLOCK_R, +BLOCK_R)`` of ``lp`` (float32, unit column stride) over tokens
        ``[pid1 * CHUNK, +CHUNK)``: their float64 partial sketch at ``out[pid1]`` (``[chunks, n,
        SK]``, contiguous). ``scale``: the signs' magnitude."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        chunk = tl.program_id(1)
        row_ok = rows < n_rows
        cols_sk = tl.arange(0, SK)
        acc = tl.zeros((BLOCK_R, SK), tl.float64)
        base = lp_ptr + rows.to(tl.int64) * stride_lp
        start = chunk * CHUNK
        stop = tl.minimum(start + CHUNK, vocab)  # a short vocabulary: its own slabs only
        for v0 in range(start, stop, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            col_ok = cols < vocab
            ok = row_ok[:, None] & col_ok[None, :]
            lp = tl.load(base[:, None] + cols[None, :], mask=ok, other=float("-inf"))
            root = tl.exp(lp.to(tl.float64) * 0.5)  # exp(-inf) = 0: masked tokens add nothing
            bits = tl.load(bits_ptr + cols, mask=col_ok, other=0)
            signs = tl.where(((bits[:, None] >> cols_sk[None, :]) & 1) == 1, scale, -scale).to(tl.float64)
            acc = tl.dot(root, signs, acc, out_dtype=tl.float64)
        out = out_ptr + (chunk * n_rows + rows[:, None]).to(tl.int64) * SK + cols_sk[None, :]
        tl.store(out, acc, mask=row_ok[:, None])

    _LAUNCH = CachedLauncher(_sketch_kernel)


def sketch_rows(
    rows: torch.Tensor, sign_bits: torch.Tensor, scale: float, chunk: int = CHUNK_V
) -> torch.Tensor:
    """The float32 ``[n, 32]`` sketch of ``rows`` (float32 ``[n, vocab]`` log-probabilities, -inf
    where a sampler masked a token) with signs ``sign_bits`` (int32 ``[vocab]`` on the same
    device, bit ``c`` set: column ``c`` is ``+scale``). ``chunk``: tokens per program (a multiple
    of ``BLOCK_V``; the vocabulary's split, the same for every batch)."""
    if rows.dim() != 2 or rows.dtype != torch.float32:
        raise ValueError(f"rows: expected float32 [positions, vocab], got {rows.dtype} {list(rows.shape)}")
    n, vocab = rows.shape
    if sign_bits.shape != (vocab,) or sign_bits.dtype != torch.int32 or sign_bits.device != rows.device:
        raise ValueError(
            f"sign_bits: expected int32 [{vocab}] on {rows.device}, got {sign_bits.dtype} "
            f"{list(sign_bits.shape)} on {sign_bits.device}"
        )
    if chunk <= 0 or chunk % BLOCK_V:
        raise ValueError(f"chunk: expected a positive multiple of {BLOCK_V}, got {chunk}")
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    chunks = max(1, cdiv(vocab, chunk))
    partial = torch.empty(chunks, n, SKETCH_DIM, dtype=torch.float64, device=rows.device)
    if n:
        args = (rows, sign_bits, partial, n, vocab, rows.stride(0), float(scale))
        cx = dict(BLOCK_R=BLOCK_R, BLOCK_V=BLOCK_V, SK=SKETCH_DIM, CHUNK=chunk)
        key = (vocab, rows.stride(0), chunk, aligned(rows, sign_bits, partial), rows.device)
        _LAUNCH(key, (cdiv(n, BLOCK_R), chunks, 1), args, cx, num_warps=WARPS)
    # the chunks' float64 partials added by one reduction (deterministic for a shape), rounded once
    return partial.sum(0).to(torch.float32)
