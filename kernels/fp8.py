"""Batch-invariant W8A8 block-FP8 linear: ``y = dq(x) @ dq(W).T (+ bias)`` on E4M3 tensor cores.

Operands (:mod:`isoaudit.kernels.fp8_quant`): E4M3 weights in 128×128 blocks with fp32 scales, made
from the bf16 master; E4M3 activations per token in groups of 128 with fp32 scales. The product
(what :func:`w8a8_reference` writes in torch):

* K is walked in ascending 128-wide blocks (one activation group, one weight block column);
* each block's product is an FP8 MMA accumulated from zero over that block alone, then promoted:
  multiplied in fp32 by ``a_scale[m, kb] * w_scale[n // 128, kb]`` and added to an fp32 master
  accumulator (DeepGEMM's promotion every 128 K; Hopper's FP8 MMA does not accumulate in full fp32,
  so a whole-K MMA chain would lose bits a fixed 128-K chain does not);
* with the fixed split-K of :func:`fp8_config` (a function of the weight shape), the master sum
  restarts from zero at every span of ``k_split`` and the span sums are added in ascending order,
  whether one program sums the spans in turn (large M) or the spans run as programs and a tile's
  last one adds them (small M, :func:`plan`): the same adds either way;
* bias in fp32, one rounding to the output dtype.

The E4M3 activations are the quantizer kernel's output, or, where a call asks for it
(``fuse_quant=True``), the same values computed inside the GEMM as each 128-K block of the
unquantized activation is read (``FUSED_QUANT``: one launch, the quantizer's own Triton code,
``fp8_quant._quantize_rows``), so the choice changes no bit. The fused kernel is an opt-in
(:data:`FUSE_MAX_M` is 0): it saves a launch's host time, and a call of fewer rows than its tile
quantizes only :func:`quant_rows` rows, but its device time against the two launches decides
where it becomes the default (docs/kernels.md).

The split span depends on (N, K) only; the tile (BLOCK_M, BLOCK_N, warps, stages, program order,
lagged promotion: :class:`Fp8Tile`) follows M through one table (:data:`TILE_TABLE`,
:func:`pick_tile`), since it changes where each element is computed, never its adds: every
element is the same K-ordered chain of block MMAs (each from zero over its 128 K) and fp32
promotions whatever tile holds it (proven on the GPU for every tile of :data:`TILE_CANDIDATES`).
M is not a specialised integer: prefill, decode and the trainer's recompute give a row the same
bits whatever its batch-mates.

Backward (:func:`fp8_linear`): straight-through in bf16 to the master weights — the quantizers are
treated as the identity, ``dx = g @ W``, ``dW = g.T @ x`` in the master dtype.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache, partial
from typing import Any, Generic, Protocol, TypeVar

import torch

from ._triton import HAVE_TRITON, CachedLauncher, as_rows, cdiv, jit, next_power_of_2, resolve, tl, triton
from .fp8_quant import FP8, GROUP, quantize_act, quantize_act_reference, quantize_per_tensor, quantize_weight
from .gemm import _device_traits

if HAVE_TRITON:
    from .fp8_quant import _quantize_rows  # the activation arithmetic, shared with the quantizer

    @triton.jit
    def _fp8_block(
        a_rows, b_rows, sa_rows, sb_rows, sb_tile, a_ok, m_ok, n_ok, offs_k, K, kb,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_K: tl.constexpr,
        FUSED_QUANT: tl.constexpr,
        A_FP8: tl.constexpr,
        QUANT_M: tl.constexpr,
    ):  # fmt: skip
        """Block ``kb``'s MMA from zero and its promotion factors ``sa[m] * sb[n // 128]`` (fp32).
        A tile at most 128 wide lies in one weight block column: one ``sb`` for the tile, the
        factors one column (the same products, BLOCK_N times fewer multiplies). FUSED_QUANT:
        ``a_rows`` are the unquantized activation's rows, and the block (one activation group per
        row) is quantized here by the quantizer's own arithmetic (``_quantize_rows``: E4M3 if
        A_FP8, else the fp32 values before the cast), its scales the ``sa`` (``sa_rows`` unread).
        QUANT_M < BLOCK_M (fused, a call of fewer rows than the tile): ``a_rows`` / ``a_ok`` are
        the tile's first QUANT_M rows, the only ones quantized, and the MMA's BLOCK_M-row operand
        repeats them (row r holds row r % QUANT_M): rows r < M are their own, the rest are
        never stored, and an MMA row's sums read that row alone."""
        tl.static_assert(FUSED_QUANT or QUANT_M == BLOCK_M)
        k0 = kb * BLOCK_K
        if EVEN_K:  # K a multiple of 128: no K mask (the same values)
            x = tl.load(a_rows + (k0 + offs_k)[None, :], mask=a_ok[:, None], other=0.0)
            w = tl.load(b_rows + (k0 + offs_k)[None, :], mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + offs_k) < K
            x = tl.load(a_rows + (k0 + offs_k)[None, :], mask=a_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(b_rows + (k0 + offs_k)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if FUSED_QUANT:  # masked K and rows load zeros: amax unchanged, q = 0
            x, sa = _quantize_rows(x.to(tl.float32), A_FP8)
            if QUANT_M < BLOCK_M:
                # A gather, not broadcast + reshape: with the reshape Triton 3.6 computes the
                # quantizer in the MMA operand's layout, each thread dividing 32 to 64 elements
                # where the gather leaves it about QUANT_M (``hopper_compile.py --stats``).
                rep = tl.arange(0, BLOCK_M) % QUANT_M
                x = tl.gather(x, tl.broadcast_to(rep[:, None], (BLOCK_M, BLOCK_K)), 0)
                sa = tl.gather(sa, rep, 0)
        else:
            sa = tl.load(sa_rows + kb, mask=m_ok, other=0.0)
        part = tl.dot(x, tl.trans(w), out_dtype=tl.float32)
        # One return: Triton's code generator refuses returns of different shapes in one function,
        # even where a constexpr decides which one runs.
        if BLOCK_N <= BLOCK_K:
            scale = (sa * tl.load(sb_tile + kb))[:, None]
        else:
            sb = tl.load(sb_rows + kb, mask=n_ok, other=0.0)
            scale = sa[:, None] * sb[None, :]
        return part, scale

    @triton.jit
    def _fp8_span(
        a, a_s, b, b_s, M, N, K, stride_am, stride_asm, stride_bn, stride_bsn, pid_m, pid_n, kb_lo, kb_hi,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPAN_BLOCKS: tl.constexpr,
        LAG: tl.constexpr,
        EVEN_K: tl.constexpr,
        FUSED_QUANT: tl.constexpr,
        A_FP8: tl.constexpr,
        QUANT_M: tl.constexpr,
    ):  # fmt: skip
        """The fp32 sum over K blocks [kb_lo, kb_hi) of one tile (kb_lo < kb_hi): each block's MMA
        from zero, scaled, added in ascending order. SPAN_BLOCKS > 0: the running sum restarts at
        every span of that many blocks and the span sums are added in order to a total (0 + p0 +
        p1 + ...). LAG: block kb's MMA is issued before block kb-1's promotion (the MMA can run
        while the previous block is scaled and added); the same adds in the same order. QUANT_M:
        the activation rows read (BLOCK_M, or fewer: see ``_fp8_block``)."""
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_a = pid_m * BLOCK_M + tl.arange(0, QUANT_M)
        m_ok = offs_m < M
        a_ok = offs_a < M
        n_ok = offs_n < N
        a_rows = a + offs_a[:, None].to(tl.int64) * stride_am
        b_rows = b + offs_n[:, None].to(tl.int64) * stride_bn
        sa_rows = a_s + offs_m.to(tl.int64) * stride_asm
        sb_rows = b_s + (offs_n // BLOCK_K).to(tl.int64) * stride_bsn
        sb_tile = b_s + ((pid_n * BLOCK_N) // BLOCK_K).to(tl.int64) * stride_bsn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SPAN_BLOCKS > 0:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if LAG:
            part, scale = _fp8_block(a_rows, b_rows, sa_rows, sb_rows, sb_tile, a_ok, m_ok, n_ok, offs_k, K, kb_lo,
                              BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FUSED_QUANT, A_FP8, QUANT_M)  # fmt: skip
            for kb in range(kb_lo + 1, kb_hi):
                nxt, nxt_scale = _fp8_block(a_rows, b_rows, sa_rows, sb_rows, sb_tile, a_ok, m_ok, n_ok, offs_k, K, kb,
                                  BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FUSED_QUANT, A_FP8, QUANT_M)  # fmt: skip
                acc = acc + part * scale  # block kb - 1
                if SPAN_BLOCKS > 0:
                    if kb % SPAN_BLOCKS == 0:
                        total = total + acc
                        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                part = nxt
                scale = nxt_scale
            acc = acc + part * scale  # block kb_hi - 1 ends the last span
            if SPAN_BLOCKS > 0:
                total = total + acc
        else:
            for kb in range(kb_lo, kb_hi):
                part, scale = _fp8_block(a_rows, b_rows, sa_rows, sb_rows, sb_tile, a_ok, m_ok, n_ok, offs_k, K, kb,
                                  BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FUSED_QUANT, A_FP8, QUANT_M)  # fmt: skip
                acc = acc + part * scale
                if SPAN_BLOCKS > 0:
                    if ((kb + 1) % SPAN_BLOCKS == 0) | (kb + 1 >= kb_hi):
                        total = total + acc
                        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SPAN_BLOCKS > 0:
            return total
        return acc

    @triton.jit
    def _fp8_store(c, acc, bias_ptr, M, N, stride_cm, pid_m, pid_n, HAS_BIAS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(
            c + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :],
            acc.to(c.dtype.element_ty),
            mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
        )

    @jit(do_not_specialize=["M"])
    def _w8a8_kernel(
        a, a_s, b, b_s, c, bias_ptr, M, N, K, stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
        partials, counters,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        SPAN_BLOCKS: tl.constexpr,
        SPLIT_GRID: tl.constexpr,
        LAG: tl.constexpr,
        EVEN_K: tl.constexpr,
        FUSED_QUANT: tl.constexpr,
        A_FP8: tl.constexpr,
        QUANT_M: tl.constexpr,
    ):  # fmt: skip
        # FUSED_QUANT: ``a`` is the unquantized activation, quantized block by block as it is read
        # (the quantizer's bits; ``a_s`` unread); QUANT_M < BLOCK_M: only the tile's first QUANT_M
        # rows are read and quantized (M <= QUANT_M).
        # Program (tile, span): tiles in grouped order (which program runs a tile, not its sums).
        tile = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_n
        first_m = (tile // group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + ((tile % group) % size_m)
        pid_n = (tile % group) // size_m
        kbs = tl.cdiv(K, BLOCK_K)
        if not SPLIT_GRID:
            acc = _fp8_span(
                a, a_s, b, b_s, M, N, K, stride_am, stride_asm, stride_bn, stride_bsn, pid_m, pid_n, 0, kbs,
                BLOCK_M, BLOCK_N, BLOCK_K, SPAN_BLOCKS, LAG, EVEN_K, FUSED_QUANT, A_FP8, QUANT_M,
            )  # fmt: skip
            _fp8_store(c, acc, bias_ptr, M, N, stride_cm, pid_m, pid_n, HAS_BIAS, BLOCK_M, BLOCK_N)
        else:
            # Span s of the tile is program (tile, s); its fp32 sum goes to ``partials``; the tile's
            # last program to finish (an atomic count) adds every span in ascending order.
            span = tl.program_id(1)
            lo = span * SPAN_BLOCKS
            acc = _fp8_span(
                a, a_s, b, b_s, M, N, K, stride_am, stride_asm, stride_bn, stride_bsn, pid_m, pid_n,
                lo, tl.minimum(lo + SPAN_BLOCKS, kbs), BLOCK_M, BLOCK_N, BLOCK_K, 0, LAG, EVEN_K,
                FUSED_QUANT, A_FP8, QUANT_M,
            )  # fmt: skip
            spans = tl.cdiv(kbs, SPAN_BLOCKS)
            tiles = num_m * num_n
            slab = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            tl.store(partials + (span * tiles + tile).to(tl.int64) * (BLOCK_M * BLOCK_N) + slab, acc)
            tl.debug_barrier()
            done = tl.atomic_add(counters + tile, 1, sem="acq_rel", scope="gpu")
            if done == spans - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s2 in range(0, spans):
                    total = total + tl.load(
                        partials + (s2 * tiles + tile).to(tl.int64) * (BLOCK_M * BLOCK_N) + slab,
                        cache_modifier=".cg",
                    )
                tl.atomic_xchg(counters + tile, 0, sem="relaxed", scope="gpu")
                _fp8_store(c, total, bias_ptr, M, N, stride_cm, pid_m, pid_n, HAS_BIAS, BLOCK_M, BLOCK_N)

    _LAUNCH = CachedLauncher(_w8a8_kernel)


@dataclass(frozen=True)
class Fp8Tile:
    """How one call's output is laid on the GPU: the output tile, warps, stages, the grouped-M
    program order and the lagged promotion (``lag``: block kb's MMA issued before block kb-1 is
    promoted). None of it changes an element's arithmetic (the K order, the 128-K blocks and the
    split are the weight's), so the tile may follow M; ``tests/kernels/test_fp8_tiles.py`` proves
    on the GPU that every tile of :data:`TILE_CANDIDATES` gives the same bits."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    lag: bool = False

    def with_split(self, k_split: int) -> Fp8Config:
        """This tile with a weight's fixed split-K: a full launch config."""
        return Fp8Config(
            self.block_m,
            self.block_n,
            self.num_warps,
            self.num_stages,
            k_split,
            GROUP,
            self.group_m,
            self.lag,
        )

    @property
    def source(self) -> str:
        """The tile as Python source, for a :data:`TILE_TABLE` literal."""
        extra = (f", group_m={self.group_m}" if self.group_m != 8 else "") + (
            ", lag=True" if self.lag else ""
        )
        return f"Fp8Tile({self.block_m}, {self.block_n}, {self.num_warps}, {self.num_stages}{extra})"

    @property
    def tag(self) -> str:
        """Short name, e.g. ``128x128w8s4g8L`` (``L``: lagged promotion)."""
        return f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}g{self.group_m}{'L' if self.lag else ''}"


@dataclass(frozen=True)
class Fp8Config:
    """A full launch config: a tile and the weight's ``k_split`` (K elements per span of the fixed
    split-K, a multiple of 128; 0: one span). The split sets the bits; the tile does not."""

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 4
    k_split: int = 0
    block_k: int = GROUP  # the promotion interval: one activation group, one weight block column
    group_m: int = 8
    lag: bool = False

    @property
    def tile(self) -> Fp8Tile:
        return Fp8Tile(self.block_m, self.block_n, self.num_warps, self.num_stages, self.group_m, self.lag)


#: A weight of fewer than SPLIT_MAX_TILES column tiles (of SPLIT_TILE_N) and at least
#: SPLIT_MIN_BLOCKS 128-K blocks gets a fixed split-K, so a decode call still fills the device:
#: spans = min(SPLIT_MAX_SPANS, ceil(SPLIT_TARGET / tiles), blocks // 4). A function of (N, K),
#: never of M or of the tile a call runs: the bits of every row are the weight's. (Fitted to a
#: sweep on the H100: a split of a short K cost more than it gave.)
SPLIT_TARGET = 132
SPLIT_MAX_TILES = 96
SPLIT_MIN_BLOCKS = 16
SPLIT_MAX_SPANS = 8
SPLIT_TILE_N = 64
#: The split grid (spans as programs) serves calls of at most this many rows; larger ones sum the
#: spans in turn in one program (the same adds).
SPLIT_GRID_MAX_M = 128

#: Every tile the policy may pick (the GPU test proves they all give the same bits; the sweep
#: ``bench/kernels.py --only fp8_tune`` times them). Block M >= 64: Hopper's warpgroup MMA.
TILE_CANDIDATES: tuple[Fp8Tile, ...] = (
    Fp8Tile(64, 64, 4, 4),
    Fp8Tile(64, 128, 4, 4),
    Fp8Tile(64, 128, 4, 3),
    Fp8Tile(128, 64, 8, 4),
    Fp8Tile(128, 128, 8, 3),
    Fp8Tile(128, 128, 8, 4),
    Fp8Tile(128, 256, 8, 3),
    Fp8Tile(64, 128, 4, 4, lag=True),
    Fp8Tile(128, 128, 8, 4, lag=True),
)

#: The tile policy, one data structure: ``(max_m, tiles)`` rows in ascending ``max_m`` (the last
#: row's ``max_m`` is 0: every larger M). A call of M rows takes the first row with ``M <= max_m``;
#: within it the first tile whose grid fills the device (programs >= SMs, the split grid's spans
#: counted), else the row's last tile. Hopper defaults: 64x64 at decode sizes (the fastest single
#: tile there in the H100 sweep), wider and 8-warp tiles as M grows. ``fp8_tune`` prints a
#: measured replacement; :func:`set_tile_table` installs one at run time.
TILE_TABLE: tuple[tuple[int, tuple[Fp8Tile, ...]], ...] = (
    (64, (Fp8Tile(64, 64, 4, 4),)),
    (256, (Fp8Tile(64, 128, 4, 4), Fp8Tile(64, 64, 4, 4))),
    (0, (Fp8Tile(128, 128, 8, 4), Fp8Tile(64, 128, 4, 4), Fp8Tile(64, 64, 4, 4))),
)


def set_tile_table(
    table: tuple[tuple[int, tuple[Fp8Tile, ...]], ...],
) -> tuple[tuple[int, tuple[Fp8Tile, ...]], ...]:
    """Install a tile policy (the layout of :data:`TILE_TABLE`); returns the previous one. Every
    tile must be one of :data:`TILE_CANDIDATES` (the tiles whose bits the GPU test proves equal)."""
    global TILE_TABLE
    if not table or table[-1][0] != 0:
        raise ValueError("tile table: the last row's max_m must be 0 (every larger M)")
    bounds = [row[0] for row in table[:-1]]
    if any(b <= 0 for b in bounds) or bounds != sorted(set(bounds)):
        raise ValueError(f"tile table: max_m must ascend and be positive, got {bounds}")
    for max_m, tiles in table:
        if not tiles:
            raise ValueError(f"tile table: the row max_m={max_m} has no tile")
        for t in tiles:
            if t not in TILE_CANDIDATES:
                raise ValueError(f"tile table: {t} (row max_m={max_m}) is not in TILE_CANDIDATES")
    prev, TILE_TABLE = TILE_TABLE, tuple((m, tuple(ts)) for m, ts in table)
    plan.cache_clear()
    return prev


def split_enabled() -> bool:
    """Fixed split-K on unless ``ISOAUDIT_FP8_SPLIT_K=0`` (read when a weight shape is first planned;
    it sets the bits: trainer and rollout must agree)."""
    return os.environ.get("ISOAUDIT_FP8_SPLIT_K", "1") == "1"


@cache
def weight_split(n: int, k: int) -> int:
    """The fixed split-K of an (n, k) weight: K elements per span (0: one span). Sets the bits."""
    tiles = cdiv(n, SPLIT_TILE_N)
    kbs = cdiv(k, GROUP)
    if split_enabled() and tiles < SPLIT_MAX_TILES and kbs >= SPLIT_MIN_BLOCKS:
        spans = min(SPLIT_MAX_SPANS, cdiv(SPLIT_TARGET, tiles), kbs // 4)
        if spans > 1:
            return cdiv(kbs, spans) * GROUP
    return 0


def fp8_config(n: int, k: int, capability: tuple[int, int] | None = None) -> Fp8Config:
    """The (n, k) weight's split-K with the policy's decode tile (the first tile of
    :data:`TILE_TABLE`'s first row). Larger calls take other tiles (:func:`pick_tile`), never
    other bits."""
    return TILE_TABLE[0][1][0].with_split(weight_split(n, k))


def pick_tile(m: int, n: int, k: int, sms: int, table: tuple | None = None) -> Fp8Tile:
    """The tile of an (m, n, k) call under ``table`` (default :data:`TILE_TABLE`): the M row, then
    its first tile whose programs fill ``sms`` multiprocessors, else the row's last tile."""
    table = table or TILE_TABLE
    row = next((tiles for max_m, tiles in table if max_m == 0 or m <= max_m), table[-1][1])
    split = weight_split(n, k)
    spans = cdiv(cdiv(k, GROUP), split // GROUP) if split and m <= SPLIT_GRID_MAX_M else 1
    for t in row:
        if cdiv(m, t.block_m) * cdiv(n, t.block_n) * spans >= sms:
            return t
    return row[-1]


class _Plan(tuple):
    """(grid, constexprs, options, split scratch sizes or None); hashed by identity (launch key)."""

    __slots__ = ()
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __new__(cls, *fields: Any) -> _Plan:
        return super().__new__(cls, fields)


#: Calls of at most this many rows (and at least one) quantize their activations inside the GEMM
#: by default (``FUSED_QUANT``: one launch, no E4M3 copy of the activations in memory); larger calls
#: run the quantizer kernel once and the GEMM on its output. 0: no call fuses unless it passes
#: ``fuse_quant=True``, until the fused kernel's device time is measured at or below the two
#: launches' (docs/kernels.md has the figures). Either way every element's operands are the
#: quantizer's bits, so the choice changes no bit of the result.
FUSE_MAX_M = 0


def quant_rows(m: int, block_m: int) -> int:
    """The activation rows a fused program reads and quantizes per 128-K block: its tile's
    ``block_m``, or for a call of fewer rows than that the least power of two >= M, at least 2
    (the MMA's operand repeats them). Decode calls quantize 2 to 32 rows instead of 64
    masked-mostly ones; each row's quantization and MMA sums are its own, so this changes no bit.
    (One row of bf16 is 2 bytes a thread, too little for ``cp.async``: Triton then loads it
    in the K loop, unpipelined; two rows are copied ahead like the weight.)"""
    return block_m if m >= block_m else min(block_m, next_power_of_2(max(m, 2)))


@lru_cache(maxsize=8192)
def plan(
    m: int,
    n: int,
    k: int,
    has_bias: bool,
    device: torch.device,
    config: Fp8Config | None,
    fused: bool = False,
) -> _Plan:
    """The launch of one (m, n, k) call: ``config`` if given, else the weight's split with the
    policy's tile for M (:func:`pick_tile`); the split spans as programs for at most
    :data:`SPLIT_GRID_MAX_M` rows, else summed in turn (the same adds, the same bits). ``fused``:
    the activation arrives unquantized and each block is quantized as it is read (E4M3 on CUDA;
    under the interpreter the fp32 values before the cast, as :func:`quantize_act` gives there),
    :func:`quant_rows` of the tile's rows (QUANT_M)."""
    cfg = config or pick_tile(m, n, k, _device_traits(device)[1]).with_split(weight_split(n, k))
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    span_blocks = cfg.k_split // GROUP if cfg.k_split else 0
    spans = cdiv(cdiv(k, GROUP), span_blocks) if span_blocks else 1
    split_grid = spans > 1 and m <= SPLIT_GRID_MAX_M
    constexprs = dict(
        HAS_BIAS=has_bias,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=GROUP,
        GROUP_M=cfg.group_m,
        SPAN_BLOCKS=span_blocks if spans > 1 else 0,
        SPLIT_GRID=split_grid,
        LAG=cfg.lag and k > 0,
        EVEN_K=k % GROUP == 0,
        FUSED_QUANT=fused,
        A_FP8=fused and device.type == "cuda",
        QUANT_M=quant_rows(m, cfg.block_m) if fused else cfg.block_m,
    )
    scratch = (spans * tiles * cfg.block_m * cfg.block_n, tiles) if split_grid else None
    grid = (tiles, spans if split_grid else 1, 1)
    return _Plan(grid, constexprs, dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages), scratch)


def w8a8_reference(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    k_split: int | None = None,
) -> torch.Tensor:
    """The kernel's arithmetic in torch: per 128-K block the E4M3 products summed exactly (in
    fp64, which holds any sum of 128 E4M3 products exactly: 8-bit products, multiples of 2^-18
    below 2^25) then rounded once to fp32 — so the CPU result does not depend on the BLAS's order
    or on the batch; the kernel's MMA sums the block in the tensor core's own order and width, so
    the two agree to that rounding —, promoted with the two scales in fp32, added in ascending K
    (restarting at every ``k_split`` span, the span sums then added in order), bias, one rounding.
    ``k_split=None``: the weight shape's :func:`fp8_config` span."""
    m, k = xq.shape
    n = wq.shape[0]
    if k_split is None:
        k_split = weight_split(n, k)
    xf, wf = xq.double(), wq.double()
    ws_cols = ws.repeat_interleave(GROUP, dim=0)[:n]  # (N, KB)
    total = torch.zeros(m, n, dtype=torch.float32, device=xq.device)
    span = k_split or max(k, 1)
    for s0 in range(0, k, span):
        acc = torch.zeros_like(total)
        for k0 in range(s0, min(s0 + span, k), GROUP):
            kb = k0 // GROUP
            part = (xf[:, k0 : k0 + GROUP] @ wf[:, k0 : k0 + GROUP].T).float()
            acc = acc + part * (xs[:, kb, None] * ws_cols[None, :, kb])
        total = total + acc
    if bias is not None:
        total = total + bias.float()
    return total.to(out_dtype)


_SPLIT: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_scratch(sizes: tuple[int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 span sums, int32 counters) of a split-grid launch: one pair per (device, stream) for
    eager launches (each tile's last program zeroes its counter), a fresh pair under graph capture."""
    n_partial, n_tiles = sizes
    if device.type != "cuda" or torch._C._cuda_isCurrentStreamCapturing():
        return torch.empty(n_partial, dtype=torch.float32, device=device), torch.zeros(
            n_tiles, dtype=torch.int32, device=device
        )
    dev = torch._C._cuda_getDevice()
    key = (dev, torch._C._cuda_getCurrentRawStream(dev))
    hit = _SPLIT.get(key)
    if hit is None or hit[0].numel() < n_partial or hit[1].numel() < n_tiles:
        hit = _SPLIT[key] = (
            torch.empty(max(n_partial, 1 << 16), dtype=torch.float32, device=device),
            torch.zeros(max(n_tiles, 1 << 12), dtype=torch.int32, device=device),
        )
    return hit


def w8a8_gemm(
    xq: torch.Tensor,
    xs: torch.Tensor | None,
    wq: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    impl: str | None = None,
    config: Fp8Config | None = None,
    *,
    fused_quant: bool = False,
) -> torch.Tensor:
    """``dq(xq) @ dq(wq).T + bias`` for quantized (M, K) activations and an (N, K) weight: the
    Triton kernel on CUDA (or the interpreter), :func:`w8a8_reference` elsewhere. Under the
    interpreter the operands may be fp32 holding E4M3 values (the interpreter's own fp8 handling is
    no reference).

    ``fused_quant=True``: ``xq`` is the unquantized (M, K) activation (bf16, fp16 or fp32) and
    ``xs`` is not read (None will do); the kernel quantizes each 128-K block of each row as it
    reads it, with :func:`quantize_act`'s arithmetic, so the result is that of ``quantize_act``
    followed by this GEMM, bit for bit, in one launch. On CUDA the weight must be E4M3; under the
    interpreter the activation's values are the fp32 ones before the E4M3 cast (as
    ``quantize_act(impl="triton")`` returns them on the CPU)."""
    if resolve(impl, xq) == "torch":
        if fused_quant:
            xq, xs = quantize_act_reference(xq)
        if xs is None:
            raise ValueError("w8a8_gemm: xs is needed unless fused_quant=True")
        return w8a8_reference(xq, xs, wq, ws, bias, out_dtype, config.k_split if config else None)
    if fused_quant:
        if xq.is_cuda and wq.dtype != FP8:
            raise ValueError(f"w8a8_gemm(fused_quant=True): the weight must be E4M3 on CUDA, not {wq.dtype}")
        xs = xq
    elif xs is None:
        raise ValueError("w8a8_gemm: xs is needed unless fused_quant=True")
    if xq.stride(1) != 1 or wq.stride(1) != 1 or xs.stride(1) != 1 or ws.stride(1) != 1:
        raise ValueError("w8a8_gemm: operands and scales need unit inner strides")
    return _launch(xq, xs, wq, ws, bias, out_dtype, config, fused_quant)


def _launch(
    a: torch.Tensor,
    a_s: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: Fp8Config | None,
    fused: bool,
) -> torch.Tensor:
    """One GEMM launch on operands with unit inner strides (the callers' to ensure): a cached
    launch when the key is known, else Triton's (which fills the cache). ``fused``: ``a`` is the
    unquantized activation and ``a_s`` is ``a`` (not read). Each pointer and stride is read once."""
    m, k = a.shape
    n = wq.shape[0]
    dev = a.device
    out = torch.empty((m, n), dtype=out_dtype, device=dev)
    if m == 0:
        return out
    p = plan(m, n, k, bias is not None, dev, config, fused)
    grid, constexprs, options, scratch = p
    po = out.data_ptr()
    if scratch:
        partials, counters = _split_scratch(scratch, dev)
        pp, pc = partials.data_ptr(), counters.data_ptr()
    else:
        partials, counters, pp, pc = out, out, po, po
    pa, pas, pw, pws = a.data_ptr(), a_s.data_ptr(), wq.data_ptr(), ws.data_ptr()
    if bias is not None:
        bias_arg, pb, bias_dtype = bias, bias.data_ptr(), bias.dtype
    else:
        bias_arg, pb, bias_dtype = out, po, None
    sa, sas, sw, sws = a.stride(0), 0 if fused else a_s.stride(0), wq.stride(0), ws.stride(0)
    # What Triton specialises the runtime arguments on: the plan fixes n, k and the constexprs; the
    # strides, the dtypes (the bias's is loaded and widened in the kernel) and the pointers' 16-byte
    # alignment complete it (m is not specialised).
    align = (
        (pa % 16 == 0)
        | (pas % 16 == 0) << 1
        | (pw % 16 == 0) << 2
        | (pws % 16 == 0) << 3
        | (po % 16 == 0) << 4
        | (pb % 16 == 0) << 5
    )
    key = (p, sa, sas, sw, sws, a.dtype, wq.dtype, out_dtype, bias_dtype, align)
    sizes = (m, n, k, sa, sas, sw, sws, n)
    if a.is_cuda and _LAUNCH.launch_cached(key, grid, (pa, pas, pw, pws, po, pb, *sizes, pp, pc)):
        return out
    _LAUNCH(key, grid, (a, a_s, wq, ws, out, bias_arg, *sizes, partials, counters), constexprs, **options)
    return out


class Fp8Weight:
    """The E4M3 deploy copy of one master weight: ``(q, scales)``, re-made in place from the master
    whenever its data changes (an optimizer step or a weight sync bumps the tensor's version), so a
    CUDA graph captured over ``q``/``scales`` sees the new weights at its next replay."""

    __slots__ = ("q", "scale", "version", "ptr")

    def __init__(self, master: torch.Tensor) -> None:
        self.q, self.scale = quantize_weight(master.detach())
        self.version, self.ptr = master._version, master.data_ptr()

    def refresh(self, master: torch.Tensor) -> None:
        if master._version != self.version or master.data_ptr() != self.ptr:
            q, s = quantize_weight(master.detach())
            self.q.copy_(q)
            self.scale.copy_(s)
            self.version, self.ptr = master._version, master.data_ptr()


class _Refreshable(Protocol):
    """A copy made from a master tensor that knows the master's version and storage it was made
    from (:class:`Fp8Weight`, :class:`isoaudit.kernels.fp8_grouped.Fp8Experts`)."""

    version: int
    ptr: int

    def refresh(self, master: torch.Tensor) -> None: ...


E = TypeVar("E", bound=_Refreshable)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch._C._cuda_isCurrentStreamCapturing()


class MasterCache(Generic[E]):
    """Copies made from master tensors (``make(master)``), found by the master's identity: a lookup
    is one dict get, one weak-reference call and the master's version and data pointer compared
    (a ``WeakIdKeyDictionary`` get builds a reference object per call). A copy is re-made in place
    (``refresh``) when its master's data changed (an optimizer step or a weight sync bumps the
    version), never under CUDA-graph capture, where the graph reuses its buffers. An entry leaves
    when its master dies; ``is`` guards a reused id."""

    def __init__(self, make: Callable[[torch.Tensor], E]) -> None:
        self._make = make
        self._by_id: dict[int, tuple[weakref.ref, E]] = {}

    def __contains__(self, key: int) -> bool:
        """Is there an entry for the master whose ``id`` is ``key``?"""
        return key in self._by_id

    def get(self, master: torch.Tensor) -> E:
        """The copy of ``master``: made on first use, refreshed if the master changed."""
        key = id(master)
        hit = self._by_id.get(key)
        if hit is not None and hit[0]() is master:
            entry = hit[1]
            if (master._version != entry.version or master.data_ptr() != entry.ptr) and not _capturing(
                master
            ):
                entry.refresh(master)
            return entry
        entry = self._make(master)
        self._by_id[key] = (weakref.ref(master, partial(self._forget, key=key)), entry)
        return entry

    def refresh_all(self) -> int:
        """Re-make every copy whose master changed (a weight sync before replaying decode graphs);
        returns how many were re-made."""
        n = 0
        for ref, entry in list(self._by_id.values()):
            master = ref()
            if master is not None and (master._version != entry.version or master.data_ptr() != entry.ptr):
                entry.refresh(master)
                n += 1
        return n

    def _forget(self, ref: weakref.ref, key: int) -> None:
        hit = self._by_id.get(key)
        if hit is not None and hit[0] is ref:
            del self._by_id[key]


_WEIGHTS: MasterCache[Fp8Weight] = MasterCache(Fp8Weight)


def fp8_weight(master: torch.Tensor) -> Fp8Weight:
    """The cached E4M3 copy of ``master`` (quantized on first use, re-made when the master's
    version or storage changed; never under CUDA-graph capture, where the graph reuses the
    buffers). A call on an unchanged master reads its version and data pointer, nothing else."""
    return _WEIGHTS.get(master)


def refresh_fp8_weights() -> int:
    """Re-quantize every cached weight whose master changed (a weight sync before replaying decode
    graphs); returns how many were re-made."""
    return _WEIGHTS.refresh_all()


#: How activations are scaled: "group" (per token, per 128 of K: the invariant quantizer) or
#: "tensor" (one dynamic scale for the whole batch, amax / 448). "tensor" exists only so the tests
#: and the bench can show what it breaks: a row's bits then depend on its batch-mates.
_ACT_SCALING = "group"


def set_act_scaling(kind: str) -> str:
    """Set :data:`_ACT_SCALING` (``"group"`` or ``"tensor"``); returns the previous value."""
    global _ACT_SCALING
    if kind not in ("group", "tensor"):
        raise ValueError(f"act scaling: 'group' or 'tensor', not {kind!r}")
    prev, _ACT_SCALING = _ACT_SCALING, kind
    return prev


def _per_tensor_operands(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor dynamic activation scaling in the kernel's operand layout (the one scale in
    every group's slot)."""
    a = x.reshape(-1, x.shape[-1])
    q, s = quantize_per_tensor(a)
    return q, s.reshape(1, 1).expand(a.shape[0], cdiv(a.shape[1], GROUP)).contiguous()


def _forward(
    x: torch.Tensor,
    entry: Fp8Weight,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    impl: str | None,
    fuse_quant: bool | None = None,
) -> torch.Tensor:
    """Quantize ``x`` per token group and multiply. On CUDA: the quantizer kernel then the GEMM;
    ``fuse_quant=True`` (or a call of at most :data:`FUSE_MAX_M` rows, none by default) one launch
    of the GEMM quantizing as it reads (the same bits). On the CPU the torch references (``impl="triton"``: the GEMM
    under the interpreter on the reference quantizer's E4M3 values, fp32 operands)."""
    if x.is_cuda and impl != "torch" and _ACT_SCALING == "group":
        k = x.shape[-1]
        a = as_rows(x, k)
        if a.stride(1) != 1:
            a = a.contiguous()
        m = a.shape[0]
        if fuse_quant if fuse_quant is not None else 0 < m <= FUSE_MAX_M:
            # the weight's copy is made contiguous by Fp8Weight: no stride checks on it
            y = _launch(a, a, entry.q, entry.scale, bias, out_dtype, None, True)
        else:
            xq, xs = quantize_act(a)
            y = _launch(xq, xs, entry.q, entry.scale, bias, out_dtype, None, False)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[1])
    n = entry.q.shape[0]
    if _ACT_SCALING == "tensor":
        xq, xs = _per_tensor_operands(x)
        if x.is_cuda and impl != "torch":
            y = w8a8_gemm(xq, xs, entry.q, entry.scale, bias, out_dtype)
        else:
            y = w8a8_reference(xq, xs, entry.q, entry.scale, bias, out_dtype)
    else:
        xq, xs = quantize_act_reference(x)
        if impl == "triton":
            y = w8a8_gemm(xq.float(), xs, entry.q.float(), entry.scale, bias, out_dtype, impl="triton")
        else:
            y = w8a8_reference(xq, xs, entry.q, entry.scale, bias, out_dtype)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], n)


class _Fp8Linear(torch.autograd.Function):
    """Forward in W8A8; backward straight-through in the master dtype (bf16)."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype, impl, fuse_quant):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _forward(x, fp8_weight(weight), bias, out_dtype or x.dtype, impl, fuse_quant)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1]).to(weight.dtype)
        gx = (g2 @ weight).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (g2.T @ x.reshape(-1, x.shape[-1]).to(weight.dtype)).to(weight.dtype)
        gb = g2.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    impl: str | None = None,
    *,
    fuse_quant: bool | None = None,
) -> torch.Tensor:
    """``F.linear`` in invariant W8A8 (activations per token group, the master's 128×128 E4M3
    blocks), differentiable straight-through to ``weight`` and ``x`` in their own dtype. CUDA runs
    the Triton kernels: the quantizer kernel then the GEMM, or with ``fuse_quant=True`` one launch
    that quantizes the activation inside the GEMM (the same bits; fewer host microseconds, more
    device time: see :data:`FUSE_MAX_M`, 0, so ``fuse_quant=None`` does not fuse). The CPU runs
    the torch references (batch-invariant too: exact block sums), or with ``impl="triton"`` the
    GEMM under the interpreter."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _Fp8Linear.apply(x, weight, bias, out_dtype, impl, fuse_quant)
    return _forward(x, fp8_weight(weight), bias, out_dtype or x.dtype, impl, fuse_quant)


__all__ = [
    "FP8",
    "FUSE_MAX_M",
    "TILE_CANDIDATES",
    "TILE_TABLE",
    "Fp8Config",
    "Fp8Tile",
    "Fp8Weight",
    "fp8_config",
    "fp8_linear",
    "fp8_weight",
    "pick_tile",
    "plan",
    "refresh_fp8_weights",
    "set_act_scaling",
    "set_tile_table",
    "w8a8_gemm",
    "w8a8_reference",
]
