"""The exact FP8 (E4M3) quantizers both sides of an FP8 run share.

Weights: 128×128 blocks of the bf16 (or fp32) master, one fp32 scale per block. Activations: per
token, in groups of 128 along K, one fp32 scale per (token, group): a token's scale depends on that
token alone, never on its batch-mates (a per-tensor dynamic scale does: :func:`quantize_per_tensor`,
kept for the test that shows it).

The arithmetic, the same on every device (the torch reference here on the CPU or CUDA, the Triton
kernel on CUDA or under the interpreter):

* ``amax`` = max |v| over the group or block, in fp32 (exact: a max rounds nothing);
* ``scale`` = max(amax, 2^-40) / 448, one IEEE fp32 division (round to nearest even); the floor
  keeps an all-zero group finite;
* ``q`` = e4m3(clamp(v / scale, -448, 448)): one IEEE fp32 division, then the fp32 value rounded
  to E4M3 to nearest, ties to even (subnormals included), saturating at ±448 (E4M3's largest
  finite value; E4M3 "fn" has no infinity, and the clamp makes every finite input finite).

Dequantized, ``q * scale`` (fp32) is what the FP8 GEMM multiplies. In Triton the divisions are
``div_rn`` (Triton's plain ``/`` on fp32 is an approximate division on CUDA) and the cast is
``fp_downcast_rounding="rtne"``; ``test_fp8_quant.py`` checks the kernel's bits against this
module's torch reference. The activation arithmetic is written once in Triton (``_quantize_rows``):
the quantizer kernel calls it, and so does the W8A8 GEMM where it quantizes the activation as it
reads it (:mod:`isoaudit.kernels.fp8`).
"""

from __future__ import annotations

from functools import cache

import torch

from ._triton import HAVE_TRITON, CachedLauncher, cdiv, interpreting, jit, tl, triton

#: The E4M3 element type both sides store (torch's ``float8_e4m3fn``; Triton's ``float8e4nv``).
FP8 = torch.float8_e4m3fn
#: E4M3's largest finite magnitude.
E4M3_MAX = 448.0
#: Group width of an activation scale (along K) and block edge of a weight scale.
GROUP = 128
#: The floor under ``amax`` (a power of two, so exact in every format): an all-zero group gets a
#: finite scale and quantizes to zeros.
AMAX_FLOOR = 2.0**-40


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    # The divisor a tensor, not a Python number: torch on CUDA divides by a host scalar as a
    # multiplication by its reciprocal (not an IEEE division), the likely reason the H100 run of
    # this reference on CUDA missed the CPU's bits for bf16 weight blocks.
    return torch.clamp(amax.float(), min=AMAX_FLOOR) / torch.full((), E4M3_MAX, device=amax.device)


def _to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3, round to nearest even, saturating at ±448 (torch's cast rounds to nearest
    even; out-of-range values would become NaN, hence the clamp first)."""
    return torch.clamp(v, -E4M3_MAX, E4M3_MAX).to(FP8)


def quantize_act_reference(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group quantization of ``x`` (..., K) flattened to rows: (q (M, K) E4M3,
    scales (M, ceil(K / group)) fp32). The last group of a K that ``group`` does not divide covers
    what is left of the row."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).float()
    m = rows.shape[0]
    g = cdiv(k, group)
    pad = g * group - k
    padded = torch.nn.functional.pad(rows, (0, pad)) if pad else rows  # zeros: amax unchanged
    blocks = padded.reshape(m, g, group)
    scale = _scale_of(blocks.abs().amax(dim=-1))  # (M, G)
    q = _to_e4m3(blocks / scale[:, :, None]).reshape(m, g * group)[:, :k]
    return q.contiguous(), scale


def quantize_weight_reference(w: torch.Tensor, block: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """128×128 block quantization of a weight (N, K): (q (N, K) E4M3, scales (ceil(N / 128),
    ceil(K / 128)) fp32); edge blocks cover what is left of the matrix."""
    n, k = w.shape
    gn, gk = cdiv(n, block), cdiv(k, block)
    wf = torch.nn.functional.pad(w.float(), (0, gk * block - k, 0, gn * block - n))
    blocks = wf.reshape(gn, block, gk, block)
    scale = _scale_of(blocks.abs().amax(dim=(1, 3)))  # (GN, GK)
    q = _to_e4m3(blocks / scale[:, None, :, None]).reshape(gn * block, gk * block)[:n, :k]
    return q.contiguous(), scale


def quantize_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic quantization (one scale = amax of the whole batch / 448): what a stock
    FP8 path often does for activations, and what makes a row's bits depend on its batch-mates.
    Not used by the invariant path; kept so a test can show the dependence."""
    scale = _scale_of(x.abs().amax())
    return _to_e4m3(x.float() / scale), scale


def dequantize_act(q: torch.Tensor, scale: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """fp32 ``q * scale`` of an activation quantized per token group."""
    k = q.shape[-1]
    s = scale.repeat_interleave(group, dim=-1)[..., :k]
    return q.float() * s


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, block: int = GROUP) -> torch.Tensor:
    """fp32 ``q * scale`` of a block-quantized weight."""
    n, k = q.shape
    s = scale.repeat_interleave(block, dim=0)[:n].repeat_interleave(block, dim=1)[:, :k]
    return q.float() * s


if HAVE_TRITON:

    @triton.jit
    def _quantize_rows(v, OUT_FP8: tl.constexpr):
        """One 128-wide group of each row of ``v`` ([rows, GROUP] fp32, zeros where masked: a zero
        does not change amax) quantized: ``(q, scale)``, q E4M3 (``OUT_FP8``) or the fp32 values
        before the cast (the interpreter, whose fp8 cast is not the hardware's), scale [rows] fp32.
        The one statement of the activation arithmetic in Triton: the quantizer kernel and the
        GEMM's fused quantization (:mod:`isoaudit.kernels.fp8`) both call it.

        A zero (a masked row or column, or a zero of the data) is not divided: it is its own
        quotient, since IEEE division gives ±0 / s = ±0 for every s > 0, +inf included, and the
        scale here is >= 2^-40 / 448 or NaN (where ``maximum`` propagates a NaN amax; a NaN scale
        divides every element, zeros too, as before), so the bits are ``div_rn``'s for every
        input. A zero divides 1 by the scale instead, because of what zeros cost on sm_90:
        ``div_rn`` is MUFU.RCP, FCHK and five FFMA per element, plus a slow subroutine (a CALL)
        where FCHK objects, and a zero row's elements (dividend 0, divisor the floor scale) take
        it: on the H100 the fused GEMM's device time grew in step with its tile's zero rows, and
        FCHK is the only branch in its SASS that depends on the data. (Replacing the divisor by 1
        as well would not depend on which of the two operands FCHK objects to, but the 64-row
        fused tile then needs more than 255 registers and spills.)"""
        amax = tl.max(tl.abs(v), axis=1)
        scale = tl.math.div_rn(tl.maximum(amax, 2.0**-40), 448.0)
        nz = (v != 0.0) | (scale != scale)[:, None]
        y = tl.where(nz, tl.math.div_rn(tl.where(nz, v, 1.0), scale[:, None]), v)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if OUT_FP8:
            y = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        return y, scale

    @jit(do_not_specialize=["M"])
    def _act_quant_kernel(
        x,
        q,
        s,
        M,
        K,
        stride_xm,
        stride_qm,
        stride_sm,
        GROUP_K: tl.constexpr,
        ROWS: tl.constexpr,
        OUT_FP8: tl.constexpr,
    ):
        # Program (i, j): rows [i*ROWS, i*ROWS + ROWS), group j. Each row's group is reduced on its
        # own, so a row's bits do not depend on which other rows share the program.
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * GROUP_K + tl.arange(0, GROUP_K)
        ok = (rows < M)[:, None] & (cols < K)[None, :]
        v = tl.load(x + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=ok, other=0.0).to(
            tl.float32
        )
        y, scale = _quantize_rows(v, OUT_FP8)
        tl.store(q + rows[:, None].to(tl.int64) * stride_qm + cols[None, :], y, mask=ok)
        tl.store(s + rows.to(tl.int64) * stride_sm + tl.program_id(1), scale, mask=rows < M)

    _ACT_LAUNCH = CachedLauncher(_act_quant_kernel)

    @jit()
    def _weight_quant_kernel(w, q, s, N, K, stride_wn, stride_sn, BLOCK: tl.constexpr, OUT_FP8: tl.constexpr):
        # Program (i, j): the weight block [i*BLOCK, +BLOCK) x [j*BLOCK, +BLOCK), one scale.
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = (rows < N)[:, None] & (cols < K)[None, :]
        v = tl.load(w + rows[:, None].to(tl.int64) * stride_wn + cols[None, :], mask=ok, other=0.0).to(
            tl.float32
        )
        amax = tl.max(tl.max(tl.abs(v), axis=1), axis=0)
        scale = tl.math.div_rn(tl.maximum(amax, 2.0**-40), 448.0)
        y = tl.math.div_rn(v, scale)
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        if OUT_FP8:
            y = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        tl.store(q + rows[:, None].to(tl.int64) * K + cols[None, :], y, mask=ok)
        tl.store(s + tl.program_id(0) * stride_sn + tl.program_id(1), scale)


@cache
def _rows_per_program(k: int) -> int:
    return 4 if k >= 2048 else 1


def quantize_act(
    x: torch.Tensor, impl: str | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group quantization (:func:`quantize_act_reference`'s bits): the Triton kernel on
    CUDA (one launch), the torch reference on the CPU. ``impl="triton"`` on the CPU runs the
    kernel under the interpreter with an fp32 ``q`` (the interpreter's fp8 cast does not round to
    nearest even): the structure, the scales and the pre-cast values, not the cast."""
    from ._triton import resolve

    if (impl is None and not x.is_cuda) or resolve(impl, x) == "torch":
        return quantize_act_reference(x)
    k = x.shape[-1]
    a = x.reshape(-1, k)
    if a.stride(-1) != 1:
        a = a.contiguous()
    m = a.shape[0]
    g = cdiv(k, GROUP)
    fp8 = not interpreting()
    if out is None:
        q = torch.empty(m, k, dtype=FP8 if fp8 else torch.float32, device=x.device)
        s = torch.empty(m, g, dtype=torch.float32, device=x.device)
    else:
        q, s = out
    if m == 0:
        return q, s
    rows = _rows_per_program(k)
    grid = (cdiv(m, rows), g, 1)
    sa = a.stride(0)
    key = (a.dtype, k, sa, a.data_ptr() % 16 == 0, q.data_ptr() % 16 == 0, s.data_ptr() % 16 == 0, fp8)
    args = (a, q, s, m, k, sa, k, g)
    if a.is_cuda and _ACT_LAUNCH.launch_cached(
        key, grid, (a.data_ptr(), q.data_ptr(), s.data_ptr(), *args[3:])
    ):
        return q, s
    _ACT_LAUNCH(key, grid, args, dict(GROUP_K=GROUP, ROWS=rows, OUT_FP8=fp8), num_warps=4 if rows > 1 else 1)
    return q, s


def quantize_weight(w: torch.Tensor, impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """128×128 block quantization of a master weight (:func:`quantize_weight_reference`'s bits):
    one Triton launch on CUDA, the torch reference on the CPU (``impl="triton"`` there: the
    interpreter, fp32 ``q`` as in :func:`quantize_act`). Run once per weight update. (Measured on
    the H100: torch's own ops on CUDA do not give the CPU's bits for every bf16 block; this
    kernel's ``div_rn`` and round-to-nearest-even cast do.)"""
    from ._triton import resolve

    if (impl is None and not w.is_cuda) or resolve(impl, w) == "torch":
        return quantize_weight_reference(w)
    n, k = w.shape
    if w.stride(-1) != 1:
        w = w.contiguous()
    gn, gk = cdiv(n, GROUP), cdiv(k, GROUP)
    fp8 = not interpreting()
    q = torch.empty(n, k, dtype=FP8 if fp8 else torch.float32, device=w.device)
    s = torch.empty(gn, gk, dtype=torch.float32, device=w.device)
    if n and k:
        _weight_quant_kernel[(gn, gk)](w, q, s, n, k, w.stride(0), gk, BLOCK=GROUP, OUT_FP8=fp8, num_warps=8)
    return q, s


__all__ = [
    "AMAX_FLOOR",
    "E4M3_MAX",
    "FP8",
    "GROUP",
    "dequantize_act",
    "dequantize_weight",
    "quantize_act",
    "quantize_act_reference",
    "quantize_per_tensor",
    "quantize_weight",
    "quantize_weight_reference",
]
