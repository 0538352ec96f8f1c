"""One fused pass over an activation computing every per-row fingerprint field.

The fields (defined by the collector, DESIGN.md "Fingerprints"): the *digest*, the wrapping int64
sum over columns of ``bits(x_j) * w_j`` where ``bits`` is the element's bit pattern sign-extended
from its width and ``w_j`` an odd 64-bit weight; the *ladder*, the same sum after clearing low
mantissa bits (``bits & mask_r``, one rung per mask); the *sketch*, ``x @ P`` for a [hidden, 16]
fp32 projection; the row's *L2* norm and its *max-abs*.

The torch path reads the activation about ten times (an int64 copy, one product per rung, a
float copy, a matmul, a norm, an abs). :func:`fingerprint_rows` reads it once: one program per
``BLOCK_R`` rows walks the columns in ``BLOCK_H`` slabs and keeps all seven accumulators in
registers.

Which bits are promised: digest, ladder and max-abs are exact (integer sums wrap modulo 2**64 in
any order; the max of absolute values is taken on their bit patterns, which order non-negative
floats as their values do), so they equal the torch path's bit for bit on every device. Sketch and
L2 are fp32 sums whose order this kernel fixes (both through fp32 dots, never tf32: columns
ascending, slab after slab): a row gets the same bits whatever the row count, its position or the
kernel (one region or many) that reads it, but
they may differ from cuBLAS's sums in the last bits (relative 1e-6), as two BLAS libraries do.

Rows wider than :data:`WIDE_ROW` (a vocabulary's logits) are split into fixed column chunks of
:data:`CHUNK_H`, one program per chunk and row block, so a thousand rows of 151,936 logits keep
every SM busy; a second launch adds each row's chunk sums in ascending chunk order (the integer
fields wrap as before, so they are unchanged; sketch and L2 are then sums of chunk sums, an order
fixed by the width alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

import torch

from ._triton import HAVE_TRITON, CachedLauncher, aligned, cdiv, jit, resolve, tl, triton

SKETCH_DIM = 16

# dtype -> (integer view, stored mantissa bits). The launch shape is fixed (never from the row
# count), so a row's float sums have one order.
_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
#: KIND of bf16/fp16 rows fingerprinted as their (exact) fp32 values: the fields of ``x.float()``,
#: read at the rows' own width, with no fp32 copy made (a vocabulary's logits, canonically fp32)
_KIND_AS_FP32 = {torch.bfloat16: 3, torch.float16: 4, torch.float32: 2}
BLOCK_R, BLOCK_H, WARPS = 16, 128, 4
#: Rows wider than ``WIDE_ROW`` columns (a vocabulary's logits) are summed in chunks of ``CHUNK_H``
#: columns, one program each, and the chunks' sums added in ascending order. The split depends on
#: the width alone, never on the rows; one program walking 151,936 columns per 16 rows leaves most
#: SMs idle at a trainer's thousand rows.
WIDE_ROW, CHUNK_H = 32768, 8192


def column_chunks(hidden: int) -> int:
    """How many column chunks a row of ``hidden`` elements is summed in (0: whole, in one program)."""
    return cdiv(hidden, CHUNK_H) if hidden > WIDE_ROW else 0


class Fingerprints(NamedTuple):
    """Per-row fields, torch tensors on the activation's device."""

    digest: torch.Tensor  # int64 [n] (read as uint64)
    ladder: torch.Tensor  # int64 [n, R]
    sketch: torch.Tensor  # float32 [n, 16]
    l2: torch.Tensor  # float32 [n]
    maxabs: torch.Tensor  # float32 [n]


def supported(x: torch.Tensor) -> bool:
    """Whether :func:`fingerprint_rows` takes this dtype (fp64 is left to the torch path)."""
    return x.dtype in _INT_VIEW


if HAVE_TRITON:

    @triton.jit
    def _fingerprint_tile(
        base, row_ok, w_ptr, p_ptr, m_ptr, hidden,
        R: tl.constexpr, KIND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, SK: tl.constexpr,
    ):  # fmt: skip
        """The sums of ``BLOCK_R`` rows over ``hidden`` columns (``base``: each row's first element,
        as the integer view; ``row_ok``: which rows are real): (digest, ladder, sketch, sum of
        squares, largest |x| as a bit pattern). The one definition of a row's arithmetic: every
        kernel here calls it, on a whole row or on one of its column chunks, so they give the same
        bits."""
        sk_cols = tl.arange(0, SK)
        # Each 64-bit weight w = (hi + b) * 2**32 + lo_s, lo_s its low word read as signed: then
        # x * w = x * lo_s + 2**32 * (x * (hi + b)) mod 2**64, one widening 32-bit product and one
        # wrapping 32-bit product instead of a 64-bit one; the sums wrap the same way.
        dig_lo = tl.zeros((BLOCK_R,), tl.int64)
        dig_hi = tl.zeros((BLOCK_R,), tl.int32)
        r_idx = tl.arange(0, R)
        lad_lo = tl.zeros((BLOCK_R, R), tl.int64)
        lad_hi = tl.zeros((BLOCK_R, R), tl.int32)
        # Sums of squares through a dot with ones: a dot's fp32 products are added in ascending
        # column order whatever the register layout, where ``tl.sum``'s tree follows the layout
        # the compiler picks for the load (which differs with what it knows of the address: a
        # pointer argument's alignment, a table's address). Each slab is summed from zero and the
        # slab sums added in turn: rounding grows with BLOCK_H + slabs, not with the width.
        sq_acc = tl.zeros((BLOCK_R, SK), tl.float32)
        ones = tl.full((BLOCK_H, SK), 1.0, tl.float32)
        sketch = tl.zeros((BLOCK_R, SK), tl.float32)
        amax = tl.zeros((BLOCK_R,), tl.int32)  # the largest |x| as a bit pattern
        for h0 in range(0, hidden, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            col_ok = cols < hidden
            ok = row_ok[:, None] & col_ok[None, :]
            xi = tl.load(base[:, None] + cols[None, :], mask=ok, other=0)
            w = tl.load(w_ptr + cols, mask=col_ok, other=0)
            w_lo = w.to(tl.int32)  # truncates: the low word, as signed
            w_hi = ((w - w_lo.to(tl.int64)) >> 32).to(tl.int32)
            if KIND == 3:  # bf16 read as its fp32 value: the fp32 bit pattern, exactly
                x32 = xi.to(tl.int32) << 16
            elif KIND == 4:  # fp16 read as its fp32 value (exact), then its fp32 bit pattern
                x32 = xi.to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
            else:
                x32 = xi.to(tl.int32)  # sign-extends the bit pattern
            dig_lo += tl.sum(x32.to(tl.int64) * w_lo.to(tl.int64)[None, :], 1)
            dig_hi += tl.sum(x32 * w_hi[None, :], 1)
            for r in tl.static_range(R):
                m = tl.load(m_ptr + r).to(tl.int32)  # all high bits set: its low word keeps the sign
                xm = x32 & m
                lo = tl.sum(xm.to(tl.int64) * w_lo.to(tl.int64)[None, :], 1)
                hi = tl.sum(xm * w_hi[None, :], 1)
                lad_lo += tl.where(r_idx[None, :] == r, lo[:, None], 0)
                lad_hi += tl.where(r_idx[None, :] == r, hi[:, None], 0)
            if KIND == 0:
                xf = (xi.to(tl.int32) << 16).to(tl.float32, bitcast=True)  # bf16 -> fp32 exactly
                amax = tl.maximum(amax, tl.max(xi.to(tl.int32) & 0x7FFF, 1))
            elif KIND == 1:
                xf = xi.to(tl.float16, bitcast=True).to(tl.float32)
                amax = tl.maximum(amax, tl.max(xi.to(tl.int32) & 0x7FFF, 1))
            else:  # fp32 bit patterns (read, or widened above)
                xf = x32.to(tl.float32, bitcast=True)
                amax = tl.maximum(amax, tl.max(x32 & 0x7FFFFFFF, 1))
            sq_acc += tl.dot(xf * xf, ones, input_precision="ieee")  # a slab's sum, then the slabs'
            p = tl.load(p_ptr + cols[:, None] * SK + sk_cols[None, :], mask=col_ok[:, None], other=0.0)
            sketch = tl.dot(xf, p, sketch, input_precision="ieee")
        digest = dig_lo + (dig_hi.to(tl.int64) << 32)
        ladder = lad_lo + (lad_hi.to(tl.int64) << 32)
        sq = tl.sum(tl.where(sk_cols[None, :] == 0, sq_acc, 0.0), 1)  # column 0 (plus zeros: exact)
        return digest, ladder, sketch, sq, amax

    @triton.jit
    def _finish(sq, amax, KIND: tl.constexpr):
        """(L2, max-abs) from a row's sum of squares and its largest |x| as a bit pattern."""
        if KIND == 0:
            maxabs = (amax << 16).to(tl.float32, bitcast=True)
        elif KIND == 1:
            maxabs = amax.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            maxabs = amax.to(tl.float32, bitcast=True)
        return tl.sqrt_rn(sq), maxabs

    @triton.jit
    def _store_tile(
        int_row, flt_row, row_ok, digest, ladder, sketch, l2, maxabs, R: tl.constexpr, SK: tl.constexpr
    ):
        """Write :func:`_fingerprint_tile`'s fields at each row's int64 and float32 output row."""
        r_idx = tl.arange(0, R)
        sk_cols = tl.arange(0, SK)
        tl.store(int_row, digest, mask=row_ok)
        tl.store(int_row[:, None] + 1 + r_idx[None, :], ladder, mask=row_ok[:, None])
        tl.store(flt_row[:, None] + sk_cols[None, :], sketch, mask=row_ok[:, None])
        tl.store(flt_row + SK, l2, mask=row_ok)
        tl.store(flt_row + SK + 1, maxabs, mask=row_ok)

    @triton.jit
    def _row_sums(
        base, row_ok, w_ptr, p_ptr, m_ptr, hidden, part_i, part_f, n_rows, part_rows,
        R: tl.constexpr, KIND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, SK: tl.constexpr,
        CHUNK: tl.constexpr,
    ):  # fmt: skip
        """The whole rows' sums (``CHUNK`` 0), or (``CHUNK`` > 0) the sums of column chunk
        ``program_id(2)`` written to the partials at row ``part_rows`` of the chunk's ``n_rows``
        (:func:`_store_partial`); returns the whole rows' (digest, ladder, sketch, L2, max-abs),
        meaningless when chunked."""
        if CHUNK == 0:
            digest, ladder, sketch, sq, amax = _fingerprint_tile(
                base, row_ok, w_ptr, p_ptr, m_ptr, hidden, R, KIND, BLOCK_R, BLOCK_H, SK
            )
        else:
            start = tl.program_id(2) * CHUNK
            span = tl.minimum(hidden - start, CHUNK)
            digest, ladder, sketch, sq, amax = _fingerprint_tile(
                base + start, row_ok, w_ptr + start, p_ptr + start * SK, m_ptr, span,
                R, KIND, BLOCK_R, BLOCK_H, SK,
            )  # fmt: skip
            at = tl.program_id(2).to(tl.int64) * n_rows + part_rows.to(tl.int64)
            _store_partial(part_i, part_f, at, row_ok, digest, ladder, sketch, sq, amax, R, SK)
        l2, maxabs = _finish(sq, amax, KIND)
        return digest, ladder, sketch, l2, maxabs

    @triton.jit
    def _store_partial(
        part_i, part_f, at, row_ok, digest, ladder, sketch, sq, amax, R: tl.constexpr, SK: tl.constexpr
    ):
        """A column chunk's sums at partial row ``at``: int64 (digest, R rungs, largest |x| bits)
        and float32 (SK sketch values, sum of squares)."""
        r_idx = tl.arange(0, R)
        sk_cols = tl.arange(0, SK)
        int_row = part_i + at * (R + 2)
        flt_row = part_f + at * (SK + 1)
        tl.store(int_row, digest, mask=row_ok)
        tl.store(int_row[:, None] + 1 + r_idx[None, :], ladder, mask=row_ok[:, None])
        tl.store(int_row + 1 + R, amax.to(tl.int64), mask=row_ok)
        tl.store(flt_row[:, None] + sk_cols[None, :], sketch, mask=row_ok[:, None])
        tl.store(flt_row + SK, sq, mask=row_ok)

    @jit(do_not_specialize=["n_rows"])
    def _fingerprint_kernel(
        x_ptr, w_ptr, p_ptr, m_ptr, int_ptr, flt_ptr, part_i, part_f, n_rows, hidden, stride_x, stride_i, stride_f,
        R: tl.constexpr, KIND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, SK: tl.constexpr,
        CHUNK: tl.constexpr = 0,
    ):  # fmt: skip
        """KIND 0: bf16 (int16 view), 1: fp16 (int16 view), 2: fp32 (int32 view). Output rows:
        int64 (digest, R rungs) every ``stride_i``; float32 (16 sketch values, L2, max-abs) every
        ``stride_f`` (a caller's preallocated buffers may be wider than the fields). ``CHUNK`` > 0:
        program (i, 0, c) writes column chunk c's sums to the partials, which
        :func:`_combine_kernel` adds into the rows."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        base = x_ptr + rows.to(tl.int64) * stride_x
        digest, ladder, sketch, l2, maxabs = _row_sums(
            base, row_ok, w_ptr, p_ptr, m_ptr, hidden, part_i, part_f, n_rows, rows,
            R, KIND, BLOCK_R, BLOCK_H, SK, CHUNK,
        )  # fmt: skip
        if CHUNK == 0:
            int_row = int_ptr + rows.to(tl.int64) * stride_i
            flt_row = flt_ptr + rows.to(tl.int64) * stride_f
            _store_tile(int_row, flt_row, row_ok, digest, ladder, sketch, l2, maxabs, R, SK)

    @jit(do_not_specialize=["n_rows"])
    def _fingerprint_regions_kernel(
        table_ptr, w_ptr, p_ptr, m_ptr, int_ptr, flt_ptr, part_i, part_f, n_rows, hidden,
        slot_i, stride_i, slot_f, stride_f,
        R: tl.constexpr, KIND: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, SK: tl.constexpr,
        ALIGNED: tl.constexpr = False, CHUNK: tl.constexpr = 0,
    ):  # fmt: skip
        """Many regions of one dtype and width in one launch: program (i, g) takes row block i of
        region g, whose table row (int64) is (data address, row stride in elements, output slot);
        slot ``s``'s output rows start at ``int_ptr + s * slot_i`` and ``flt_ptr + s * slot_f``.
        Each row block through :func:`_fingerprint_tile`: the bits of :func:`_fingerprint_kernel`
        (chunked alike: region g's partials are chunks ``g * chunks ...``)."""
        g = tl.program_id(1)
        addr = tl.load(table_ptr + 3 * g)
        stride_x = tl.load(table_ptr + 3 * g + 1)
        slot = tl.load(table_ptr + 3 * g + 2)
        if KIND == 2:
            x_ptr = addr.to(tl.pointer_type(tl.int32))
        else:
            x_ptr = addr.to(tl.pointer_type(tl.int16))
        if ALIGNED:  # every address 16-byte aligned, every row stride a multiple of 16 bytes: vector loads
            x_ptr = tl.multiple_of(x_ptr, 16)
            stride_x = tl.multiple_of(stride_x, 4 if KIND == 2 else 8)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        base = x_ptr + rows.to(tl.int64) * stride_x
        part_rows = (g * tl.num_programs(2)).to(tl.int64) * n_rows + rows  # region g's chunk 0 first
        digest, ladder, sketch, l2, maxabs = _row_sums(
            base, row_ok, w_ptr, p_ptr, m_ptr, hidden, part_i, part_f, n_rows, part_rows,
            R, KIND, BLOCK_R, BLOCK_H, SK, CHUNK,
        )  # fmt: skip
        if CHUNK == 0:
            int_row = int_ptr + slot * slot_i + rows.to(tl.int64) * stride_i
            flt_row = flt_ptr + slot * slot_f + rows.to(tl.int64) * stride_f
            _store_tile(int_row, flt_row, row_ok, digest, ladder, sketch, l2, maxabs, R, SK)

    @jit(do_not_specialize=["n_rows"])
    def _combine_kernel(
        table_ptr, part_i, part_f, int_ptr, flt_ptr, n_rows, chunks, slot_i, stride_i, slot_f, stride_f,
        R: tl.constexpr, KIND: tl.constexpr, BLOCK_R: tl.constexpr, SK: tl.constexpr, REGIONS: tl.constexpr,
    ):  # fmt: skip
        """Rows ``[program_id(0) * BLOCK_R, +BLOCK_R)`` of region ``program_id(1)``: its chunks'
        sums added in ascending chunk order (integers wrap; the float sums start from chunk 0's, so
        a single chunk keeps its bits), finished and stored as :func:`_store_tile` does. With
        ``REGIONS`` the output slot is the region's table row's, else 0."""
        g = tl.program_id(1)
        if REGIONS:
            slot = tl.load(table_ptr + 3 * g + 2)
        else:
            slot = 0
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        r_idx = tl.arange(0, R)
        sk_cols = tl.arange(0, SK)
        at = (g * chunks).to(tl.int64) * n_rows + rows.to(tl.int64)
        int_row = part_i + at * (R + 2)
        flt_row = part_f + at * (SK + 1)
        digest = tl.load(int_row, mask=row_ok, other=0)
        ladder = tl.load(int_row[:, None] + 1 + r_idx[None, :], mask=row_ok[:, None], other=0)
        amax = tl.load(int_row + 1 + R, mask=row_ok, other=0)
        sketch = tl.load(flt_row[:, None] + sk_cols[None, :], mask=row_ok[:, None], other=0.0)
        sq = tl.load(flt_row + SK, mask=row_ok, other=0.0)
        for _c in range(1, chunks):
            int_row += n_rows * (R + 2)
            flt_row += n_rows * (SK + 1)
            digest += tl.load(int_row, mask=row_ok, other=0)
            ladder += tl.load(int_row[:, None] + 1 + r_idx[None, :], mask=row_ok[:, None], other=0)
            amax = tl.maximum(amax, tl.load(int_row + 1 + R, mask=row_ok, other=0))
            sketch += tl.load(flt_row[:, None] + sk_cols[None, :], mask=row_ok[:, None], other=0.0)
            sq += tl.load(flt_row + SK, mask=row_ok, other=0.0)
        l2, maxabs = _finish(sq, amax.to(tl.int32), KIND)
        out_i = int_ptr + slot * slot_i + rows.to(tl.int64) * stride_i
        out_f = flt_ptr + slot * slot_f + rows.to(tl.int64) * stride_f
        _store_tile(out_i, out_f, row_ok, digest, ladder, sketch, l2, maxabs, R, SK)

    _LAUNCH = CachedLauncher(_fingerprint_kernel)
    _LAUNCH_REGIONS = CachedLauncher(_fingerprint_regions_kernel)
    _LAUNCH_COMBINE = CachedLauncher(_combine_kernel)


def fingerprint_reference(
    x: torch.Tensor, weights: torch.Tensor, sketch: torch.Tensor, masks: torch.Tensor
) -> Fingerprints:
    """The fields in plain torch (the definition; the kernel's digest, ladder and max-abs equal
    it bitwise, its sketch and L2 to fp32 rounding)."""
    rows = x.detach().reshape(-1, x.shape[-1])
    wide = rows.contiguous().view(_INT_VIEW[x.dtype]).to(torch.int64)
    digest = (wide * weights).sum(-1)
    ladder = ((wide.unsqueeze(1) & masks.reshape(1, -1, 1)) * weights).sum(-1)
    values = rows.float()
    sk = (values.double() @ sketch.double()).float()
    return Fingerprints(digest, ladder, sk, torch.linalg.vector_norm(values, dim=-1), values.abs().amax(-1))


@lru_cache(maxsize=256)
def _pow2_at_least(r: int) -> int:
    return 1 << max(r - 1, 0).bit_length()


def fingerprint_rows(
    x: torch.Tensor,
    weights: torch.Tensor,
    sketch: torch.Tensor,
    masks: torch.Tensor,
    impl: str | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    as_float32: bool = False,
) -> Fingerprints:
    """Fingerprint every row of ``x`` ([..., hidden], bf16/fp16/fp32; rows = leading dims
    flattened) in one pass on x's device. ``as_float32``: the fields of ``x.float()`` (``masks``
    then fp32's), each element widened as it is read, so no fp32 copy is made.

    ``weights``: int64 [hidden], the odd digest weights (uint64 bit patterns); ``sketch``: float32
    [hidden, 16], the projection; ``masks``: int64 [R], one bit mask per ladder rung (``-(1 << (m -
    k))`` keeps k of m mantissa bits and the sign extension). All on x's device. ``impl`` forces
    "triton" or "torch" (default: the kernel where it runs).

    ``out``: ``(ints, floats)`` to write into instead of fresh tensors (a captured graph's or a
    compiled step's preallocated buffers): int64 ``[n, >= 1 + R']`` (digest, then the rungs; ``R'``
    is R rounded up to a power of two for the kernel, the extra rungs keeping every bit) and
    float32 ``[n, >= 18]`` (sketch, L2, max-abs), each with unit column stride. The returned
    fields are views of them."""
    if not supported(x):
        raise TypeError(f"x: dtype {x.dtype} is not fused; expected one of {sorted(map(str, _INT_VIEW))}")
    hidden = x.shape[-1]
    if weights.shape != (hidden,) or weights.dtype != torch.int64:
        raise ValueError(f"weights: expected int64 [{hidden}], got {weights.dtype} {list(weights.shape)}")
    if sketch.shape != (hidden, SKETCH_DIM) or sketch.dtype != torch.float32:
        raise ValueError(
            f"sketch: expected float32 [{hidden}, {SKETCH_DIM}], got {sketch.dtype} {list(sketch.shape)}"
        )
    if masks.dim() != 1 or masks.dtype != torch.int64:
        raise ValueError(f"masks: expected int64 [R], got {masks.dtype} {list(masks.shape)}")
    r = masks.shape[0]
    r_pad = _pow2_at_least(max(r, 1))
    if out is not None:
        _check_out(out, x, r_pad)
    if resolve(impl, x) == "torch":
        got = fingerprint_reference(x.float() if as_float32 else x, weights, sketch, masks)
        if out is None:
            return got
        fields = _fields(*out, r)
        for dst, src in zip(fields, got, strict=True):
            dst.copy_(src)
        return fields
    rows = x.detach().reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    n, dev = rows.shape[0], x.device
    if out is None:
        # Two allocations, viewed as the five fields (five allocations cost more host time than a
        # small region's whole pass): int64 [n, 1 + R] and float32 [n, 18].
        ints = torch.empty(n, 1 + r_pad, dtype=torch.int64, device=dev)
        floats = torch.empty(n, SKETCH_DIM + 2, dtype=torch.float32, device=dev)
    else:
        ints, floats = out
    fields = _fields(ints, floats, r)
    if n:
        masks = _padded(masks, r_pad)
        xi = rows.view(_INT_VIEW[x.dtype])
        kind = (_KIND_AS_FP32 if as_float32 else _KIND)[x.dtype]
        proj = sketch.contiguous()
        si, sf = ints.stride(0), floats.stride(0)
        chunks = column_chunks(hidden)
        part_i, part_f = _partials(1, chunks, n, r_pad, dev) if chunks else (ints, floats)
        args = (xi, weights, proj, masks, ints, floats, part_i, part_f, n, hidden, xi.stride(0), si, sf)
        chunk = CHUNK_H if chunks else 0
        cx = dict(R=r_pad, KIND=kind, BLOCK_R=BLOCK_R, BLOCK_H=BLOCK_H, SK=SKETCH_DIM, CHUNK=chunk)
        key = (
            kind,
            r_pad,
            hidden,
            xi.stride(0),
            si,
            sf,
            aligned(xi, weights, proj, masks, ints, floats, part_i, part_f),
            dev,
        )
        _LAUNCH(key, (cdiv(n, BLOCK_R), 1, max(chunks, 1)), args, cx, num_warps=WARPS)
        if chunks:
            _combine(ints, ints, floats, part_i, part_f, n, chunks, 1, (0, si, 0, sf), r_pad, kind, False)
    return fields


def _partials(
    count: int, chunks: int, n_rows: int, r_pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The column chunks' sums of ``count`` regions: int64 ``[count * chunks * n_rows, R' + 2]``
    (digest, rungs, largest |x| bits) and float32 ``[..., 17]`` (sketch, sum of squares)."""
    rows = count * chunks * n_rows
    return (
        torch.empty(rows, r_pad + 2, dtype=torch.int64, device=device),
        torch.empty(rows, SKETCH_DIM + 1, dtype=torch.float32, device=device),
    )


def _combine(
    table: torch.Tensor,
    ints: torch.Tensor,
    floats: torch.Tensor,
    part_i: torch.Tensor,
    part_f: torch.Tensor,
    n_rows: int,
    chunks: int,
    count: int,
    strides: tuple[int, int, int, int],
    r_pad: int,
    kind: int,
    regions: bool,
) -> None:
    """Add each region's column chunks into its output rows (:func:`_combine_kernel`)."""
    args = (table, part_i, part_f, ints, floats, n_rows, chunks, *strides)
    cx = dict(R=r_pad, KIND=kind, BLOCK_R=BLOCK_R, SK=SKETCH_DIM, REGIONS=regions)
    key = (kind, r_pad, chunks, strides, regions, aligned(table, part_i, part_f, ints, floats), ints.device)
    _LAUNCH_COMBINE(key, (cdiv(n_rows, BLOCK_R), count, 1), args, cx, num_warps=WARPS)


def _padded(masks: torch.Tensor, r_pad: int) -> torch.Tensor:
    """``masks`` with ``r_pad - R`` all-ones rungs appended (``tl.arange`` needs a power of two:
    the extra rungs keep every bit and are never read), contiguous."""
    r = masks.shape[0]
    if r_pad != r:
        masks = torch.cat([masks, masks.new_full((r_pad - r,), -1)])
    return masks.contiguous()


#: Table columns of :func:`fingerprint_regions`: data address, row stride (elements), output slot.
TABLE_WIDTH = 3


def fingerprint_regions(
    table: torch.Tensor,
    count: int,
    n_rows: int,
    hidden: int,
    dtype: torch.dtype,
    weights: torch.Tensor,
    sketch: torch.Tensor,
    masks: torch.Tensor,
    ints: torch.Tensor,
    floats: torch.Tensor,
    aligned_rows: bool = False,
) -> None:
    """Fingerprint ``count`` regions in one launch: each ``n_rows`` rows of ``hidden`` elements of
    ``dtype`` with unit column stride, listed in ``table`` (int64 ``[>= count, 3]`` on the
    device, contiguous: each region's data address, row stride in elements and output slot); region
    rows go to ``ints[slot]`` / ``floats[slot]`` (``[slots, n_rows, >= 1 + R']`` int64 and
    ``[slots, n_rows, >= 18]`` float32, unit column stride) with the bits of
    :func:`fingerprint_rows` on each region alone (both kernels share :func:`_fingerprint_tile`).

    The table is read when the kernel runs, not at the call: a launch captured into a CUDA graph
    may be given a table whose rows are written after the capture (the addresses are the graph's).
    The caller keeps every listed tensor alive until the kernel has run. ``weights``/``sketch``/
    ``masks`` as for :func:`fingerprint_rows` (of ``hidden``), on the table's device. ``aligned_rows``:
    every listed address is a multiple of 16 bytes and every row stride of 16 bytes (the kernel
    then loads 16 bytes at a time; the caller checks, as :func:`rows_aligned` does)."""
    if dtype not in _INT_VIEW:
        raise TypeError(f"dtype: {dtype} is not fused; expected one of {sorted(map(str, _INT_VIEW))}")
    if (
        table.dtype != torch.int64
        or table.dim() != 2
        or table.shape[1] != TABLE_WIDTH
        or table.shape[0] < count
    ):
        raise ValueError(
            f"table: expected int64 [>= {count}, {TABLE_WIDTH}], got {table.dtype} {list(table.shape)}"
        )
    if not table.is_contiguous():
        raise ValueError("table: must be contiguous")
    r_pad = _pow2_at_least(max(masks.shape[0], 1))
    _check_row_buffers(
        (("ints", ints), ("floats", floats)), r_pad, n_rows, table.device, "the table", slots=True
    )
    if count == 0 or n_rows == 0:
        return
    resolve("triton", table)  # raises where the kernel cannot run
    masks = _padded(masks, r_pad)
    proj = sketch.contiguous()
    kind = _KIND[dtype]
    strides = (ints.stride(0), ints.stride(1), floats.stride(0), floats.stride(1))
    chunks = column_chunks(hidden)
    part_i, part_f = _partials(count, chunks, n_rows, r_pad, table.device) if chunks else (ints, floats)
    args = (table, weights, proj, masks, ints, floats, part_i, part_f, n_rows, hidden, *strides)
    chunk = CHUNK_H if chunks else 0
    cx = dict(
        R=r_pad, KIND=kind, BLOCK_R=BLOCK_R, BLOCK_H=BLOCK_H, SK=SKETCH_DIM, ALIGNED=aligned_rows, CHUNK=chunk
    )
    tensors = aligned(table, weights, proj, masks, ints, floats, part_i, part_f)
    key = (kind, r_pad, hidden, strides, tensors, table.device, aligned_rows)
    _LAUNCH_REGIONS(key, (cdiv(n_rows, BLOCK_R), count, max(chunks, 1)), args, cx, num_warps=WARPS)
    if chunks:
        _combine(table, ints, floats, part_i, part_f, n_rows, chunks, count, strides, r_pad, kind, True)


def rows_aligned(addresses: Sequence[int], row_strides: Sequence[int], dtype: torch.dtype) -> bool:
    """Whether rows at ``addresses`` (bytes) with ``row_strides`` (elements of ``dtype``) all start
    on 16-byte boundaries: what :func:`fingerprint_regions`'s ``aligned_rows`` promises."""
    size = dtype.itemsize
    return all(a % 16 == 0 for a in addresses) and all(s * size % 16 == 0 for s in row_strides)


def _fields(ints: torch.Tensor, floats: torch.Tensor, r: int) -> Fingerprints:
    """The five fields as views of the two row buffers."""
    return Fingerprints(
        ints[:, 0],
        ints[:, 1 : 1 + r],
        floats[:, :SKETCH_DIM],
        floats[:, SKETCH_DIM],
        floats[:, SKETCH_DIM + 1],
    )


def _check_out(out: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, r_pad: int) -> None:
    ints, floats = out
    n = x.numel() // max(x.shape[-1], 1) if x.dim() else 1
    _check_row_buffers((("out[0] (ints)", ints), ("out[1] (floats)", floats)), r_pad, n, x.device, "the rows")


def _check_row_buffers(
    buffers: tuple[tuple[str, torch.Tensor], tuple[str, torch.Tensor]],
    r_pad: int,
    n_rows: int,
    device: torch.device,
    beside: str,
    slots: bool = False,
) -> None:
    """The (ints, floats) row buffers a fingerprint kernel writes: int64 and float32 of ``n_rows``
    rows (after a leading slot dimension with ``slots``), wide enough, unit column stride, on
    ``device`` (where ``beside``, the inputs, are)."""
    lead = "slots, " if slots else ""
    for (name, t), dtype, width in zip(
        buffers, (torch.int64, torch.float32), (1 + r_pad, SKETCH_DIM + 2), strict=True
    ):
        shaped = t.dim() == 2 + slots and t.shape[-2] == n_rows and t.shape[-1] >= width
        if t.dtype != dtype or not shaped or t.stride(-1) != 1:
            raise ValueError(
                f"{name}: expected {dtype} [{lead}{n_rows}, >= {width}] with unit column stride, "
                f"got {t.dtype} {list(t.shape)} strides {list(t.stride())}"
            )
        if t.device != device:
            raise ValueError(f"{name}: on {t.device}, {beside} on {device}")
