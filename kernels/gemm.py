"""Batch-invariant GEMM: ``y = x @ w.T (+ bias)`` whose every row is independent of the batch.

Why it is invariant: the tile shape (BLOCK_M, BLOCK_N, BLOCK_K), warps, pipeline depth and the
load path (TMA descriptors or pointers) are a function of the weight shape, dtype and device
capability only, never of M; by default there is no split-K and no atomics; each output element
is accumulated in fp32 over K in ascending BLOCK_K steps. (With the fixed split-K of narrow weights,
:func:`split_span`, K is cut into spans set by the weight shape and the span sums are added in one
order, whether one program sums them in turn or, at small M, the spans run as programs and a
tile's last one, found by an atomic count, adds them.) So a row's bits do not depend on how many
other rows are in the batch or where it sits (M and the program count are also excluded from
Triton's integer specialisation, so M=1 compiles to the same code as M=2048).

On Hopper (capability >= 9.0) bf16/fp16 weights take a persistent kernel: one program per SM
walks the output tiles in a fixed grouped order, loading through TMA descriptors the kernel builds.
The grid size depends on M, but that only changes which program computes a tile, not the tile's
sums. On the H200 (9.0) only, a small-M call narrows its tile to fill the SMs: BLOCK_K, the K order
and the instruction stay fixed, which measured bit-identical (see :func:`launch_config`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from functools import cache, lru_cache

import torch

from ._triton import (
    HAVE_TRITON,
    CachedLauncher,
    aligned,
    as_rows,
    cdiv,
    dot_precision,
    host_descriptors,
    interpreting,
    jit,
    resolve,
    scratch_allocator,
    tl,
    tma_map,
    tma_ready,
    triton,
)

if HAVE_TRITON:
    from triton.runtime import _allocation
    from triton.tools.tensor_descriptor import TensorDescriptor


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and load path for one weight shape; fixed for every M."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    tma: bool = False  # TMA descriptor loads + persistent grid (Hopper, 16-byte aligned rows)
    split_epilogue: bool = False  # store the tile as two halves (less shared memory, more stages)
    warp_specialize: bool = False  # TMA producer warps (works on Hopper in Triton 3.6; no gain measured)
    # TMA descriptors built by the kernel (False: host-built, encoded once per buffer and passed as
    # kernel parameters, :func:`_launch_host_descriptors`; what a call under CUDA-graph capture takes).
    device_descriptors: bool = True
    # Small M on Hopper: narrower tiles (same BLOCK_K and instruction family) when the full tile
    # would leave most SMs idle; see :func:`launch_config`.
    shrink_small_m: bool = False
    # Fixed split-K: K cut into spans of ``k_split`` elements (a multiple of every BLOCK_K a call
    # may take), each summed from zero in ascending BLOCK_K steps, the span sums then added in
    # ascending order in fp32. 0: one span. A function of the weight shape, never of M (see
    # :func:`split_span`).
    k_split: int = 0


#: Fixed split-K for narrow weights (N <= SPLIT_MAX_N) on the H200: at decode sizes their few
#: column tiles leave most SMs idle while one program walks all of K (cuBLAS splits K there). K is
#: cut into SPLIT_SPANS spans of a multiple of SPLIT_ALIGN elements (every BLOCK_K a call may take
#: divides it), for every M: the large-M call sums the spans in turn in one program, the small-M
#: call runs them as programs and adds them in the same order, so the bits are M's alone.
SPLIT_MAX_N = 1024
SPLIT_MIN_K = 2048
SPLIT_SPANS = 4
SPLIT_ALIGN = 128
#: The split grid (spans as programs) serves calls of at most ``K / (SPLIT_GRID_ROWS * spans)``
#: rows: its fp32 span sums, written and read back, then stay under half the weight's bytes. Above
#: POINTER_MAX_M rows it also has to fit one round of programs: on the H200 (graph replay) the
#: 64x64x128 TMA tile on the split grid took 10.4-10.5 us at M = 96 / 128 on 896 x 4864 (1.16x-1.20x
#: cuBLAS) against 12.3-12.4 us (1.39x-1.46x) summing the spans in turn, but 14.5 us against 12.3
#: at M=192, where its 168 programs take two rounds.
SPLIT_GRID_ROWS = 8


def split_k_enabled() -> bool:
    """Whether narrow weights take the fixed split-K: on unless ``ISOAUDIT_GEMM_SPLIT_K=0`` (read
    when a weight shape is first planned). Measured on the H200 with the 128x256 tile: decode GEMMs
    on these weights 1.3-1.5x faster, M=16384 5-8% slower, the 0.5B trainer step 1.06x native with
    it and 1.21x without (one call). It sets the bits: trainer and rollout must agree on it."""
    return os.environ.get("ISOAUDIT_GEMM_SPLIT_K", "1") == "1"


def split_span(n: int, k: int) -> int:
    """K elements per span of the fixed split-K for an (n, k) weight; 0: no split."""
    if n > SPLIT_MAX_N or k < SPLIT_MIN_K or not split_k_enabled():
        return 0
    return cdiv(cdiv(k, SPLIT_SPANS), SPLIT_ALIGN) * SPLIT_ALIGN


@cache
def gemm_config(n: int, k: int, dtype: torch.dtype, capability: tuple[int, int] | None = None) -> GemmConfig:
    """The tile configuration for a weight of shape (n, k) on a device of ``capability`` (None: no
    GPU, e.g. the interpreter): depends on (n, k, dtype, capability), never on M (but see
    :func:`launch_config` for the measured-safe narrowing at small M on Hopper)."""
    if dtype == torch.float32:
        return GemmConfig(64, 64, 32, 4, 2)
    if n >= 256 and k >= 64:
        if capability is not None and capability >= (9, 0) and n % 8 == 0 and k % 8 == 0:
            span = split_span(n, k) if capability == (9, 0) else 0
            if span:  # the 128x256 tile: its running total, touched once a span, may live in local memory
                return GemmConfig(
                    128,
                    256,
                    64,
                    8,
                    3,
                    tma=True,
                    shrink_small_m=True,
                    k_split=span,
                )
            # Best of 14 on an H200 (bench_tune): 1.03x cuBLAS at M=2048 and 8192. Warp specialisation
            # and 4 stages measured no better; 3 stages leave room for a 4-byte output tile.
            return GemmConfig(
                128,
                256,
                64,
                8,
                3,
                tma=True,
                shrink_small_m=capability == (9, 0),
            )
        return GemmConfig(256, 128, 64, 8, 3)
    return GemmConfig(64, 64, 64, 4, 3)


#: Narrow tiles a small-M call may take on the H200, widest first: (BLOCK_N, BLOCK_K, stages,
#: TMA). Launch shape only: measured on the H200, each gives the full tile's bits (BLOCK_K 128 is
#: two of the full tile's 64-wide steps back to back: the same k16 MMA chain on one accumulator;
#: pointer loads fill the same shared-memory operands a TMA copy does). The narrow ones load by
#: pointers: at decode sizes the kernel-built TMA descriptor and its fence cost more than they save
#: (a sweep of 26 tiles on the H200: 64x16 and 64x32 pointer tiles 1.0-1.15x cuBLAS at M = 64 where
#: the same tiles by TMA took 1.25-1.55x).
NARROW_TILES: tuple[tuple[int, int, int, bool], ...] = (
    (256, 64, 4, True),
    (128, 128, 4, True),
    (64, 128, 5, False),
    (32, 128, 5, False),
    (16, 128, 5, False),
)

#: At most this many rows take one 16-row tile (``mma.sync``) instead of a 64-row one (``wgmma``):
#: on the H200 both give every row the same bits for the same K order (``tests/kernels/
#: test_dot_rows.py``, ``test_small_m_shapes_gpu``), and the 16-row tile does a quarter of the MMA
#: work and holds a quarter of the registers, so twice the programs fit an SM (same sweep: 1.06-1.11x
#: cuBLAS at M <= 16 on the K = 2048-14336 weights where the 64-row tiles took 1.24-1.35x).
ROW16_MAX_M = 16
ROW16_TILE = (16, 16, 128, 2, 5)  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), pointer loads

#: Pointer loads serve calls of at most this many rows (one 64-row tile). Above it every 64-row
#: narrow tile loads by TMA and none narrower than 64 columns is taken: on the H200 (graph replay,
#: host-built descriptors) the 64x64x128 tile took 12.4 / 13.2 us by TMA against 17.9 / 18.0 us
#: by pointers at M = 256 / 512 on an 896 x 4864 weight, 1.20x / 1.21x cuBLAS where the pointer
#: tiles the rule then took (64x32, 64x64) measured 1.28x / 1.64x.
POINTER_MAX_M = 64
#: A 128-row tile (BLOCK_N, BLOCK_K, warps, stages; TMA) that an under-filled call of at least
#: ROW128_MIN_M rows (a narrow weight's prefill) takes first where it fills half the SMs: the area
#: of 64x256 with eight warps on it. Same H200 sweep, at M = 2048: 31.6 against 46.9 us on
#: 896 x 4864 (1.20x against 1.91x cuBLAS), 27.0 against 27.4 us on 1024 x 4096, 8.5 against
#: 9.5 us on 896 x 896; at M = 256 it was no faster than 64x256 (8.6 against 8.3 us on 4864 x 896).
ROW128_TILE = (128, 64, 8, 4)
ROW128_MIN_M = 1024


@cache
def _narrowed(cfg: GemmConfig, tile: tuple[int, int, int, bool], few_rows: bool) -> GemmConfig:
    block_n, block_k, stages, tma = tile
    if not tma and few_rows:
        bm, bn, bk, warps, st = ROW16_TILE
        return replace(cfg, block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=st, tma=False)
    return replace(cfg, block_m=64, block_n=block_n, block_k=block_k, num_warps=4, num_stages=stages, tma=tma)


@cache
def _row128(cfg: GemmConfig) -> GemmConfig:
    block_n, block_k, warps, stages = ROW128_TILE
    return replace(
        cfg, block_m=128, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages, tma=True
    )


#: The 64-row tiles a call of more than POINTER_MAX_M rows may take: TMA, at least 64 columns.
_TMA_NARROW_TILES = tuple((bn, bk, st, True) for bn, bk, st, _ in NARROW_TILES if bn >= 64)


#: Device time per output element of the wide TMA tiles of :data:`NARROW_TILES` (by BLOCK_N),
#: relative to the full tile's (1.0), for one round of programs over the SMs: a 64-row tile does
#: less per instruction. Fitted to a sweep on the H200 (``bench_tune_small``, the 0.5B-8B
#: projections at M = 128-512).
TILE_COST = {256: 1.08, 128: 1.14}
#: The wide tiles are compared only where the full tile's programs fill the SMs at most this many
#: times over (the sweep's range); a larger call keeps the full tile, whose waves then fill the
#: device.
SHRINK_MAX_ROUNDS = 2


def launch_config(cfg: GemmConfig, m: int, n: int, sms: int, k: int = 0) -> GemmConfig:
    """The tile one call runs (``k``: the K of a call whose split-K spans run as programs and so
    count toward filling the SMs; 0 where they do not). Normally ``cfg`` for every M; with
    ``cfg.shrink_small_m`` (Hopper):

    * a call whose full tiles would fill fewer than half the SMs runs the widest 64-row tile of
      :data:`NARROW_TILES` that fills half of them (the narrowest when none does), and at most
      :data:`ROW16_MAX_M` rows run :data:`ROW16_TILE` in place of a pointer-loaded one: at decode
      sizes a program's time is its K loop's latency, so filling the SMs is what counts. Above
      :data:`POINTER_MAX_M` rows the rule runs over the 64-row tiles of at least 64 columns, all
      loaded by TMA, and from :data:`ROW128_MIN_M` rows over :data:`ROW128_TILE` first;
    * a call whose full tiles fill the SMs at most :data:`SHRINK_MAX_ROUNDS` times runs the full
      tile or a wide TMA tile of :data:`NARROW_TILES`, whichever leaves its busiest SM the least
      work: rounds of programs (``ceil(programs / sms)``) times the tile's area times its
      :data:`TILE_COST`, the wider on a tie. A last round that leaves SMs idle wastes them: 112
      full tiles of a 14336-wide weight at M=256 fill 85% of 132 SMs in one round (kept); 96 of
      a 12288-wide one fill 73%, where 384 64x128 tiles fill 97% in three (taken).

    Chosen from sweeps over the 0.5B-8B decode projections at M = 1 to 512 (``bench_tune_small``).

    Why that keeps the bits: the K order and the MMA's k16 steps on one fp32 accumulator are
    unchanged; only how many rows and columns one program covers, how many k16 steps one loop
    iteration issues, and how the operands reach shared memory change. Measured on an H200:
    128x256, 64x256, 128x128, 64x128, 64x64, 64x32, 64x16, 32x64, 16x128, 16x64, 16x32 and 16x16
    tiles at BLOCK_K 64, 128 and 256, by TMA and by pointers, give identical bits for the 0.5B-8B
    projections; ``test_batch_invariant_gpu`` and ``test_small_m_shapes_gpu`` cross every switch."""
    if not cfg.shrink_small_m:
        return cfg
    spans = cdiv(k, cfg.k_split) if cfg.k_split and k else 1  # split-grid programs count toward the fill

    def programs(block_m: int, block_n: int) -> int:
        return cdiv(m, block_m) * cdiv(n, block_n) * spans

    full = programs(cfg.block_m, cfg.block_n)
    if full >= sms // 2:
        if cdiv(full, sms) > SHRINK_MAX_ROUNDS:
            return cfg
        best, best_cost = None, float(cdiv(full, sms) * cfg.block_m * cfg.block_n)
        for tile in NARROW_TILES:  # widest first: a tie keeps the wider
            if tile[3]:
                cost = cdiv(programs(64, tile[0]), sms) * 64 * tile[0] * TILE_COST.get(tile[0], 1.0)
                if cost < best_cost:
                    best, best_cost = tile, cost
        return cfg if best is None else _narrowed(cfg, best, m <= ROW16_MAX_M)
    if m >= ROW128_MIN_M and programs(128, ROW128_TILE[0]) >= sms // 2:
        return _row128(cfg)
    tiles = _TMA_NARROW_TILES if m > POINTER_MAX_M else NARROW_TILES
    for tile in tiles:
        if programs(64, tile[0]) >= sms // 2:
            return _narrowed(cfg, tile, m <= ROW16_MAX_M)
    return _narrowed(cfg, tiles[-1], m <= ROW16_MAX_M)


if HAVE_TRITON:

    @triton.jit
    def _span_sum(
        a, b, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, pid_m, pid_n, k_lo, k_hi,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        TMA: tl.constexpr,
        A_PTR: tl.constexpr,
        SPAN: tl.constexpr = 0,
    ):  # fmt: skip
        """One tile's fp32 sum over K in [k_lo, k_hi), from zero, in ascending BLOCK_K steps.
        SPAN > 0 (one loop for a whole split K): the sum restarts from zero at every SPAN
        boundary and each span's sum is added, in order, to a running total (0 + p0 + p1 + ...),
        which is returned."""
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SPAN > 0:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if TMA:
                if A_PTR:
                    x = tl.load(
                        a + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                        mask=(offs_m[:, None] < M) & ((k0 + offs_k) < K)[None, :],
                        other=0.0,
                    )
                else:
                    x = a.load([pid_m * BLOCK_M, k0])
                w = b.load([pid_n * BLOCK_N, k0])
                acc = tl.dot(x, w.T, acc, input_precision=PRECISION)
            else:
                k_ok = (k0 + offs_k) < K
                x = tl.load(
                    a + offs_m[:, None] * stride_am + (k0 + offs_k)[None, :] * stride_ak,
                    mask=(offs_m[:, None] < M) & k_ok[None, :],
                    other=0.0,
                )
                w = tl.load(
                    b + (k0 + offs_k)[:, None] * stride_bk + offs_n[None, :] * stride_bn,
                    mask=k_ok[:, None] & (offs_n[None, :] < N),
                    other=0.0,
                )
                acc = tl.dot(x, w, acc, input_precision=PRECISION)
            if SPAN > 0:
                if ((k0 + BLOCK_K) % SPAN == 0) | (k0 + BLOCK_K >= k_hi):
                    total = total + acc
                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SPAN > 0:
            return total
        return acc

    @triton.jit
    def _store_tile(
        c, acc, bias_ptr, M, N, stride_cm, stride_cn, pid_m, pid_n,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        TMA: tl.constexpr,
        A_PTR: tl.constexpr,
        SPLIT_EPILOGUE: tl.constexpr,
    ):  # fmt: skip
        """Bias in fp32, one rounding, the store (TMA descriptor or masked pointers)."""
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
        if TMA and not A_PTR:
            if SPLIT_EPILOGUE:
                lo, hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
                c.store([pid_m * BLOCK_M, pid_n * BLOCK_N], lo.to(c.dtype))
                c.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], hi.to(c.dtype))
            else:
                c.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(c.dtype))
        else:
            tl.store(
                c + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn,
                acc.to(c.dtype.element_ty),
                mask=(offs_m[:, None] < M) & (offs_n[None, :] < N),
            )

    @jit(do_not_specialize=["M", "num_programs"])
    def _gemm_kernel(
        a,
        b,
        c,
        bias_ptr,
        M,
        N,
        K,
        stride_am,
        stride_ak,
        stride_bn,
        stride_bk,
        stride_cm,
        stride_cn,
        num_programs,
        partials,
        counters,
        HAS_BIAS: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        TMA: tl.constexpr,
        SPLIT_EPILOGUE: tl.constexpr,
        WARP_SPECIALIZE: tl.constexpr,
        DEVICE_DESC: tl.constexpr,
        A_PTR: tl.constexpr,
        K_SPLIT: tl.constexpr,
        SPLIT_GRID: tl.constexpr,
    ):
        # With TMA, a/b/c are tensor descriptors (out-of-bounds reads are zeros, writes dropped),
        # passed in or (DEVICE_DESC) built here from pointers; otherwise they are pointers with
        # explicit masks. A_PTR (TMA, fewer rows than one tile): a and c stay pointers, since a
        # descriptor box mostly past M measured twice as slow; the weight still streams by TMA.
        # Same tile walk, K order and instruction either way.
        # K_SPLIT > 0: K in spans of K_SPLIT, each summed from zero, the span sums added in order.
        # SPLIT_GRID (few tiles): span s is program (tile, s) on axis 1; it writes its fp32 sum to
        # ``partials`` and the tile's last program to finish (an atomic count per tile) adds all
        # spans in ascending order, whichever program ran them: the same adds as one program
        # summing the spans in turn (SPLIT_GRID False), so M never changes a bit.
        if TMA:
            if DEVICE_DESC:
                C_BLOCK_N: tl.constexpr = BLOCK_N // 2 if SPLIT_EPILOGUE else BLOCK_N
                if not A_PTR:
                    a = tl.make_tensor_descriptor(a, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
                    c = tl.make_tensor_descriptor(c, [M, N], [stride_cm, 1], [BLOCK_M, C_BLOCK_N])
                b = tl.make_tensor_descriptor(b, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        group = GROUP_M * num_n
        for tile in tl.range(
            tl.program_id(0),
            num_m * num_n,
            num_programs,
            # unflattened with a split: the split grid's body (an atomic, a branch, a loop) fails
            # Triton 3.6's nested-loop fusion, and the spans' loop measured faster unflattened
            flatten=TMA and K_SPLIT == 0,
            warp_specialize=WARP_SPECIALIZE,
        ):
            # Grouped order for L2 reuse; it changes which program runs a tile, not its sums.
            first_m = (tile // group) * GROUP_M
            size_m = tl.minimum(num_m - first_m, GROUP_M)
            pid_m = first_m + ((tile % group) % size_m)
            pid_n = (tile % group) // size_m
            if not SPLIT_GRID:
                # The whole K in one loop; with K_SPLIT it restarts its sum at every span
                # boundary and adds the span sums in order (0 + p0 + p1 + ...: the grid's adds).
                # (A loop over (tile, span) pairs, and the tile walk flattened into this one,
                # measured slower on the H200; flattened, ptxas serializes the wgmma chain.)
                acc = _span_sum(
                    a, b, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, pid_m, pid_n, 0, K,
                    PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, TMA, A_PTR, K_SPLIT,
                )  # fmt: skip
                _store_tile(
                    c, acc, bias_ptr, M, N, stride_cm, stride_cn, pid_m, pid_n,
                    HAS_BIAS, BLOCK_M, BLOCK_N, TMA, A_PTR, SPLIT_EPILOGUE,
                )  # fmt: skip
            else:
                # The split grid: fp32 span sums, one BLOCK_M x BLOCK_N slab per (span, tile);
                # counters[tile] counts the spans stored; the last adds them in span order
                # (0 + p0 + p1 + ...) and sets the count back to zero.
                span = tl.program_id(1)
                acc = _span_sum(
                    a, b, M, N, K, stride_am, stride_ak, stride_bn, stride_bk, pid_m, pid_n,
                    span * K_SPLIT, tl.minimum(span * K_SPLIT + K_SPLIT, K),
                    PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, TMA, A_PTR,
                )  # fmt: skip
                spans = tl.cdiv(K, K_SPLIT)
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
                    _store_tile(
                        c, total, bias_ptr, M, N, stride_cm, stride_cn, pid_m, pid_n,
                        HAS_BIAS, BLOCK_M, BLOCK_N, TMA, A_PTR, SPLIT_EPILOGUE,
                    )  # fmt: skip

    _LAUNCH = CachedLauncher(_gemm_kernel)


def gemm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_k: int | None = None,
    k_split: int = 0,
) -> torch.Tensor:
    """The arithmetic the kernel defines: fp32 products, fp32 partial sums per BLOCK_K slab, the
    slabs added in ascending k (within each ``k_split`` span, from zero, the span sums then added
    in ascending order), bias added in fp32, one rounding to ``out_dtype`` at the end.
    (Inside one slab the hardware's dot order applies, so kernel and reference agree to rounding.)"""
    n, k = weight.shape
    bk = block_k or gemm_config(n, k, weight.dtype).block_k
    xf = x.reshape(math.prod(x.shape[:-1]), k).float()  # not (-1, k): K may be 0 (an empty leaf)
    wf = weight.float()
    acc = torch.zeros(xf.shape[0], n, dtype=torch.float32, device=x.device)
    span = k_split or max(k, 1)
    for s0 in range(0, k, span):
        part = torch.zeros_like(acc)
        for k0 in range(s0, min(s0 + span, k), bk):
            hi = min(k0 + bk, s0 + span)
            part = part + xf[:, k0:hi] @ wf[:, k0:hi].T
        acc = acc + part
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype or x.dtype).reshape(*x.shape[:-1], n)


@cache
def _device_traits(device: torch.device) -> tuple[tuple[int, int] | None, int]:
    """(capability, persistent program count) of a device; the interpreter gets (None, 2) so its
    tests still see programs that walk more than one tile."""
    if device.type != "cuda":
        return None, 2
    return torch.cuda.get_device_capability(device), torch.cuda.get_device_properties(
        device
    ).multi_processor_count


def _tma_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if TMA can read it (unit inner stride, 16-byte aligned base and rows), else a
    contiguous copy: the same values, so the same kernel and the same bits."""
    if tma_ready(t.data_ptr(), t.stride(), t.element_size()):
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


# Global scratch Triton asks for at launch (the kernel-built TMA descriptors live there): one
# buffer per (device, stream) for eager launches, a fresh one under CUDA graph capture. The rule
# lives in ``_triton`` because the cached launcher applies it itself (see ``_global_scratch``).
_scratch = scratch_allocator


_SPLIT: dict[tuple[int, int | None], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_scratch(sizes: tuple[int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 span sums, int32 per-tile counters) for a split-grid launch. The counters start at
    zero and each tile's last program sets its count back to zero, so eager launches on one stream
    (which run in order) share one pair per (device, stream); a launch being captured into a CUDA
    graph gets its own pair (the zeroing is part of the graph)."""
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


def _ensure_allocator() -> None:
    """Give Triton a scratch allocator unless the process (e.g. the engine) already set one. The
    setting is a context variable, so each thread that launches checks for itself."""
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_scratch)


def _descriptor(t: torch.Tensor, block: list[int]):
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


_host_tma = host_descriptors()


@lru_cache(maxsize=8192)
def _plan(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
    has_bias: bool,
    device: torch.device,
    config: GemmConfig | None,
    captured: bool = False,
) -> _GemmPlan:
    """Everything about one call that its shapes fix: the tile, the program count, the constexprs
    and launch options (computed once per shape, not per call). ``captured``: the call is being
    captured into a CUDA graph, where a TMA tile takes host-built descriptors (see :func:`gemm`)."""
    capability, sms = _device_traits(device)
    base = config or gemm_config(n, k, dtype, capability)
    if captured and base.tma and base.device_descriptors:
        base = replace(base, device_descriptors=False)
    spans = cdiv(k, base.k_split) if base.k_split else 1
    # Split-K spans run as programs (the split grid) where the fp32 span sums they write and
    # read back stay small (:data:`SPLIT_GRID_ROWS`) and the tiles alone would not fill the
    # device (above POINTER_MAX_M rows: where the spans' programs fit one round); else each
    # program sums its tiles' spans in turn. The same adds either way (see the kernel), so this
    # is a launch choice, not an arithmetic one.
    grid_ok = spans > 1 and SPLIT_GRID_ROWS * spans * m <= k
    cfg = launch_config(base, m, n, sms, k if grid_ok else 0)
    tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
    split_grid = grid_ok and tiles < sms and (m <= POINTER_MAX_M or tiles * spans <= sms)
    programs = tiles if split_grid or not cfg.tma else min(tiles, sms)
    grid = (programs, spans if split_grid else 1, 1)
    # (fp32 span sums, per-tile counters) the split-grid launch needs, in elements
    scratch = (spans * tiles * cfg.block_m * cfg.block_n, tiles) if split_grid else None
    # A 4-byte output tile is twice the shared memory: store it in halves (the store order does
    # not touch the sums, and the output dtype is fixed by the call site, never by M).
    split = cfg.tma and (cfg.split_epilogue or out_dtype.itemsize > 2)
    constexprs = dict(
        HAS_BIAS=has_bias,
        PRECISION=dot_precision(dtype),
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=8,
        TMA=cfg.tma,
        SPLIT_EPILOGUE=split,
        WARP_SPECIALIZE=cfg.warp_specialize,
        DEVICE_DESC=cfg.device_descriptors,
        # Pointer loads and stores for A and C below one 64-row tile with a 2-byte output: the
        # pointer store stages the tile in shared memory, which a 4-byte or 128-row tile overflows
        # (the interpreter has no such limit: there it serves every partial tile, as a structure test).
        A_PTR=cfg.tma and m < cfg.block_m and (interpreting() or (cfg.block_m == 64 and not split)),
        K_SPLIT=cfg.k_split if spans > 1 else 0,
        SPLIT_GRID=split_grid,
    )
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _GemmPlan(cfg, grid, constexprs, options, scratch)


class _GemmPlan(tuple):
    """(config, grid, constexprs, options, split scratch sizes or None), hashed by identity: the launch key holds the plan
    itself (one object per shape, kept alive by the key), so hashing it costs nothing per call."""

    __slots__ = ()
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __new__(cls, *fields):
        return super().__new__(cls, fields)


def gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    impl: str | None = None,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """Batch-invariant ``x @ weight.T + bias`` for x of shape (..., K) and weight (N, K).
    ``config`` overrides the tile choice (for tuning; both sides must use the same one)."""
    if resolve(impl, x) == "torch":
        return gemm_reference(x, weight, bias, out_dtype)
    n, k = weight.shape
    if x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    a = as_rows(x, k)
    m = a.shape[0]
    odt = out_dtype or x.dtype
    dev = x.device
    out = torch.empty(m, n, dtype=odt, device=dev)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    # Under CUDA-graph capture a TMA tile takes host-built descriptors, whether the tile is the
    # weight's own or an explicit ``config`` (the tree's slot pairs): their host cost (5-11 us a
    # call on the H200 host) is paid once, and each replay saves the ~2 us a program spends
    # building its own before the first load; eager calls keep the kernel-built ones. The same
    # loads either way, so the same bits (``test_host_descriptor_launch_gpu``).
    captured = weight.is_cuda and _host_tma and torch._C._cuda_isCurrentStreamCapturing()
    plan = _plan(m, n, k, weight.dtype, odt, bias is not None, dev, config, captured)
    cfg = plan[0]
    if weight.is_cuda and (bias is None or bias.is_cuda):
        if cfg.device_descriptors or not cfg.tma:
            _launch_direct(a, weight, bias, out, plan, dev, m, n, k)
        else:
            _launch_host_descriptors(a, weight, bias, out, plan, dev, m, n, k)
    else:
        _launch_other(a, weight, bias, out, plan, dev, m, n, k)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], n)


def _launch_direct(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    plan: _GemmPlan,
    dev: torch.device,
    m: int,
    n: int,
    k: int,
) -> None:
    """The launch on CUDA with kernel-built descriptors or pointer loads (every config but
    host-built descriptors), the host work cut to what the launch needs: each pointer and stride
    read once, and a cache hit handed raw pointers (the caller checked every tensor is a CUDA one:
    an int skips the launcher's check). The arguments, key, constexprs and options are those of
    ``_launch_other``'s cached branch."""
    cfg, grid, constexprs, options, scratch = plan
    itemsize = weight.dtype.itemsize  # a has weight's dtype (gemm casts x)
    w, pw, sw = weight, weight.data_ptr(), weight.stride()
    pa, sa = a.data_ptr(), a.stride()
    if cfg.tma:
        if not tma_ready(pw, sw, itemsize):
            w = _tma_operand(weight)
            pw, sw = w.data_ptr(), w.stride()
        if not constexprs["A_PTR"] and not tma_ready(pa, sa, itemsize):
            a = _tma_operand(a)
            pa, sa = a.data_ptr(), a.stride()
        _ensure_allocator()
    bias_arg, pb = (bias, bias.data_ptr()) if bias is not None else (w, pw)
    po = out.data_ptr()
    if scratch:
        partials, counters = _split_scratch(scratch, dev)
        pp, pc = partials.data_ptr(), counters.data_ptr()
    else:
        partials, counters, pp, pc = out, out, po, po
    so = (max(n, 1), 1)  # out.stride(): torch.empty(m, n) is row-major (a stride is never 0)
    # What Triton specialises the runtime arguments on: the plan fixes n, k, the dtypes and the
    # output; the strides of a and w and the pointers' alignment (``aligned(a, w, bias_arg)``'s
    # bits) complete it (m and the program count are not specialised).
    key = (plan, *sa, *sw, (pa % 16 == 0) | (pw % 16 == 0) << 1 | (pb % 16 == 0) << 2)
    programs = grid[0]
    ptrs = (pa, pw, po, pb, m, n, k, *sa, *sw, *so, programs, pp, pc)
    if not _LAUNCH.launch_cached(key, grid, ptrs):
        args = (a, w, out, bias_arg, m, n, k, *sa, *sw, *so, programs, partials, counters)
        _LAUNCH(key, grid, args, constexprs, **options)


def _launch_host_descriptors(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    plan: _GemmPlan,
    dev: torch.device,
    m: int,
    n: int,
    k: int,
) -> None:
    """The launch with host-built TMA descriptors, cached: each descriptor is encoded once per
    operand buffer (:func:`tma_map`) and handed to the compiled launcher as Triton's own launch
    expands it, ``(descriptor, rows, cols, row stride, 1)``. A kernel-built descriptor costs its
    program ~2 us before the first load (measured on the H200: a 64x256 tile at M=256 on a
    4864 x 896 weight 10.6 us with kernel-built descriptors, 8.3 us with host-built ones); a
    host-built one is a kernel parameter. The first call of a key goes through Triton."""
    cfg, grid, constexprs, options, scratch = plan
    itemsize = weight.dtype.itemsize
    w = weight if tma_ready(weight.data_ptr(), weight.stride(), itemsize) else _tma_operand(weight)
    a_ptr = constexprs["A_PTR"]
    if not a_ptr and not tma_ready(a.data_ptr(), a.stride(), itemsize):
        a = _tma_operand(a)
    pa, sa, pw, sw, po = a.data_ptr(), a.stride(), w.data_ptr(), w.stride(), out.data_ptr()
    pb = bias.data_ptr() if bias is not None else pw
    key = (plan, *sa, *sw, (pa % 16 == 0) | (pw % 16 == 0) << 1 | (pb % 16 == 0) << 2)
    entry = _LAUNCH.entry(key)
    if entry is None or entry.tma_meta is None:
        _launch_other(a, w, bias, out, plan, dev, m, n, k, key)
        return
    metas = entry.tma_meta
    wd = (tma_map(pw, n, k, sw[0], metas[0 if a_ptr else 1]), n, k, sw[0], 1)
    if a_ptr:
        head = (pa, *wd, po)
    else:
        ad = (tma_map(pa, m, k, sa[0], metas[0]), m, k, sa[0], 1)
        head = (*ad, *wd, tma_map(po, m, n, n, metas[2]), m, n, n, 1)
    if scratch:
        partials, counters = _split_scratch(scratch, dev)
        pp, pc = partials.data_ptr(), counters.data_ptr()
    else:
        pp = pc = po
    entry(grid, (*head, pb, m, n, k, *sa, *sw, n, 1, grid[0], pp, pc))


def _launch_other(
    a: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    plan: _GemmPlan,
    dev: torch.device,
    m: int,
    n: int,
    k: int,
    key: tuple | None = None,
) -> None:
    """Every other launch: the interpreter's structure tests, a tensor off CUDA (Triton's launch
    then raises its own error), and the first call of a host-descriptor key (``key``: it caches
    the compiled kernel for :func:`_launch_host_descriptors`)."""
    cfg, grid, constexprs, options, scratch = plan
    programs = grid[0]
    if cfg.tma:
        w = _tma_operand(weight)
        if not constexprs["A_PTR"]:
            a = _tma_operand(a)
        if cfg.device_descriptors:
            _ensure_allocator()
            a_arg, b_arg, c_arg = a, w, out
        else:
            b_arg = _descriptor(w, [cfg.block_n, cfg.block_k])
            if constexprs["A_PTR"]:
                a_arg, c_arg = a, out
            else:
                a_arg = _descriptor(a, [cfg.block_m, cfg.block_k])
                c_arg = _descriptor(
                    out, [cfg.block_m, cfg.block_n // (2 if constexprs["SPLIT_EPILOGUE"] else 1)]
                )
    else:
        w = weight
        a_arg, b_arg, c_arg = a, w, out
    bias_arg = bias if bias is not None else w
    partials, counters = _split_scratch(scratch, dev) if scratch else (out, out)
    args = (
        a_arg, b_arg, c_arg, bias_arg, m, n, k, *a.stride(), *w.stride(), *out.stride(), programs,
        partials, counters,
    )  # fmt: skip
    if cfg.tma and not cfg.device_descriptors:  # host descriptors: Triton binds them itself
        if key is None:
            _gemm_kernel[grid](*args, **constexprs, **options)
        else:
            _LAUNCH(key, grid, args, constexprs, **options)
    else:
        # What Triton specialises the runtime arguments on: the plan fixes n, k, the dtypes and
        # the output; the strides of a and w (args[7:11]) and the pointers' alignment complete it
        # (m and the program count are not specialised).
        key = (plan, *args[7:11], aligned(a, w, bias_arg))
        _LAUNCH(key, grid, args, constexprs, **options)


class _Linear(torch.autograd.Function):
    """Forward through the invariant GEMM; backward through torch (the gradient's bits are not the
    contract, the forward's are)."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_dtype):  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return gemm(x, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = (g2.to(weight.dtype) @ weight).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (g2.T.to(weight.dtype) @ x.reshape(-1, x.shape[-1]).to(weight.dtype)).to(weight.dtype)
        gb = g2.sum(0).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Autograd-aware batch-invariant linear layer (``F.linear`` semantics)."""
    return _Linear.apply(x, weight, bias, out_dtype)
