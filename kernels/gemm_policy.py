"""The batch-invariant GEMM's tile policy: which tile, load path, split-K and grid a call takes.

Plain Python over shapes and device traits (capability, SM count): no Triton, no device work, so
every decision is testable on the CPU. :mod:`isoaudit.kernels.gemm` turns a :class:`TilePlan`
into the kernel's constexprs and launches it.

The invariance rule every choice here keeps: the weight's tile (BLOCK_K, the K order, the MMA
instruction family and its fp32 accumulator) is a function of (N, K, dtype, capability), never of
M. What may vary with M is only the launch shape — how many rows and columns one program covers,
how many k16 steps one loop iteration issues, how operands reach shared memory, and whether the
fixed split-K spans run in one program or as programs of their own — none of which touches a
sum. The GPU tests (``test_batch_invariant_gpu``, ``test_small_m_shapes_gpu``) cross every switch
this module makes; measured figures behind each rule are in ``docs/kernels.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

import torch


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    warp_specialize: bool = False  # TMA producer warps (works on Hopper; no gain measured)
    # TMA descriptors built by the kernel (False: host-built, encoded once per buffer and passed as
    # kernel parameters; what a call under CUDA-graph capture takes).
    device_descriptors: bool = True
    # Small M on Hopper: narrower tiles (same BLOCK_K and instruction family) when the full tile
    # would leave most SMs idle; see :func:`launch_config`.
    shrink_small_m: bool = False
    # Fixed split-K: K cut into spans of ``k_split`` elements (a multiple of every BLOCK_K a call
    # may take), each summed from zero in ascending BLOCK_K steps, the span sums then added in
    # ascending order in fp32. 0: one span. A function of the weight shape, never of M (see
    # :func:`split_span`).
    k_split: int = 0


#: The default fixed split-K's parameters (see :class:`SplitPolicy`): for narrow weights
#: (N <= SPLIT_MAX_N, K >= SPLIT_MIN_K) on the H200, whose few column tiles leave most SMs idle at
#: decode sizes while one program walks all of K. K is cut into SPLIT_SPANS spans of a multiple of
#: SPLIT_ALIGN elements (every BLOCK_K a call may take divides it), for every M: the large-M call
#: sums the spans in turn in one program, the small-M call runs them as programs and adds them in
#: the same order, so the bits are the weight's alone.
SPLIT_MAX_N = 1024
SPLIT_MIN_K = 2048
SPLIT_SPANS = 4
SPLIT_ALIGN = 128
#: The split grid (spans as programs) serves calls of at most ``K / (SPLIT_GRID_ROWS * spans)``
#: rows, so its fp32 span sums, written and read back, stay under half the weight's bytes. Above
#: :data:`POINTER_MAX_M` rows it also has to fit one round of programs: a second round costs more
#: than summing the spans in turn.
SPLIT_GRID_ROWS = 8

#: The process environment variable that may override the split policy when the kernels are
#: imported (``0``: :data:`NO_SPLIT`; ``1`` or unset: :data:`DEFAULT_SPLIT`). What it chose is the
#: active policy, which both sides' manifests state (:attr:`SplitPolicy.label`).
SPLIT_ENV = "ISOAUDIT_GEMM_SPLIT_K"


@dataclass(frozen=True)
class SplitPolicy:
    """Which weights take the fixed split-K, and its span: a function of the weight shape (N, K)
    and the device capability, never of M or the batch. The split fixes the order of the sum over K
    (each span summed from zero in ascending BLOCK_K steps, the span sums added in ascending order),
    so it is part of the bits: trainer and rollout must run one policy, and each side's manifest
    states it (``runtime.gemm_split``, the :attr:`label`), which the contract handshake compares."""

    max_n: int = SPLIT_MAX_N  # weights of at most this many output columns ...
    min_k: int = SPLIT_MIN_K  # ... and at least this many input columns take the split
    spans: int = SPLIT_SPANS  # K is cut into this many spans ...
    align: int = SPLIT_ALIGN  # ... each a multiple of this many elements (the last may be short)
    capability: tuple[int, int] | None = (9, 0)  # the device it applies on; None: no split anywhere

    @property
    def enabled(self) -> bool:
        return self.capability is not None

    def span(self, n: int, k: int) -> int:
        """K elements per span for an (n, k) weight on the policy's device; 0: no split."""
        if not self.enabled or n > self.max_n or k < self.min_k:
            return 0
        return _cdiv(_cdiv(k, self.spans), self.align) * self.align

    def span_on(self, n: int, k: int, capability: tuple[int, int] | None) -> int:
        """:meth:`span` on a device of ``capability`` (0 on any other device)."""
        return self.span(n, k) if capability is not None and capability == self.capability else 0

    @property
    def label(self) -> str:
        """The policy as the manifests and the contract state it: ``off``, or its rule."""
        if self.capability is None:
            return "off"
        major, minor = self.capability
        return f"N<={self.max_n},K>={self.min_k},spans={self.spans},align={self.align},sm_{major}{minor}"


DEFAULT_SPLIT = SplitPolicy()
NO_SPLIT = SplitPolicy(capability=None)


def split_policy_from_env(value: str | None) -> SplitPolicy:
    """The policy :data:`SPLIT_ENV`'s ``value`` asks for (None: unset)."""
    if value in (None, "", "1"):
        return DEFAULT_SPLIT
    if value == "0":
        return NO_SPLIT
    raise ValueError(f"{SPLIT_ENV}={value!r}: expected 1 (the default split policy) or 0 (no split)")


_active_split = split_policy_from_env(os.environ.get(SPLIT_ENV))
_on_split_change: list[Callable[[], None]] = []


def split_policy() -> SplitPolicy:
    """The split policy this process's GEMMs run (fixed when the kernels are imported, changed only
    by :func:`set_split_policy`, so what a manifest states is what ran)."""
    return _active_split


def set_split_policy(policy: SplitPolicy) -> SplitPolicy:
    """Run ``policy`` from now on (every plan made under the old one is dropped); returns the
    previous policy. Both sides must run the same one: their manifests state it."""
    global _active_split
    previous, _active_split = _active_split, policy
    _config.cache_clear()
    for clear in _on_split_change:
        clear()
    return previous


def on_split_change(clear: Callable[[], None]) -> None:
    """Register a cache of plans made under the active policy, dropped when it changes."""
    _on_split_change.append(clear)


def split_k_enabled() -> bool:
    """Whether the active policy splits any weight."""
    return _active_split.enabled


def split_span(n: int, k: int) -> int:
    """K elements per span of the active policy's fixed split-K for an (n, k) weight on its
    device; 0: no split."""
    return _active_split.span(n, k)


def gemm_config(n: int, k: int, dtype: torch.dtype, capability: tuple[int, int] | None = None) -> GemmConfig:
    """The tile configuration for a weight of shape (n, k) on a device of ``capability`` (None: no
    GPU, e.g. the interpreter) under the active split policy: depends on (n, k, dtype, capability),
    never on M (but see :func:`launch_config` for the launch-shape narrowing at small M on Hopper)."""
    return _config(n, k, dtype, capability, _active_split)


@cache
def _config(
    n: int, k: int, dtype: torch.dtype, capability: tuple[int, int] | None, split: SplitPolicy
) -> GemmConfig:
    """:func:`gemm_config` under the split policy ``split``."""
    if dtype == torch.float32:
        return GemmConfig(64, 64, 32, 4, 2)
    if n >= 256 and k >= 64:
        if capability is not None and capability >= (9, 0) and n % 8 == 0 and k % 8 == 0:
            span = split.span_on(n, k, capability)
            if span:  # the 128x256 tile: its running total, touched once a span, may live in local memory
                return GemmConfig(128, 256, 64, 8, 3, tma=True, shrink_small_m=True, k_split=span)
            # The best tile of a tuning sweep on the H200; warp specialisation and 4 stages were
            # no better, and 3 stages leave room for a 4-byte output tile.
            return GemmConfig(128, 256, 64, 8, 3, tma=True, shrink_small_m=capability == (9, 0))
        return GemmConfig(256, 128, 64, 8, 3)
    return GemmConfig(64, 64, 64, 4, 3)


#: Narrow tiles a small-M call may take on the H200, widest first: (BLOCK_N, BLOCK_K, stages,
#: TMA). Launch shape only: each gives the full tile's bits (BLOCK_K 128 is two of the full tile's
#: 64-wide steps back to back: the same k16 MMA chain on one accumulator; pointer loads fill the
#: same shared-memory operands a TMA copy does). The narrow ones load by pointers: at decode sizes
#: a kernel-built TMA descriptor and its fence cost more than they save.
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
#: work and holds a quarter of the registers, so twice the programs fit an SM.
ROW16_MAX_M = 16
ROW16_TILE = (16, 16, 128, 2, 5)  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), pointer loads

#: Pointer loads serve calls of at most this many rows (one 64-row tile). Above it every 64-row
#: narrow tile loads by TMA and none narrower than 64 columns is taken: there TMA (host-built
#: descriptors under graph capture) outruns pointer loads.
POINTER_MAX_M = 64
#: A 128-row tile (BLOCK_N, BLOCK_K, warps, stages; TMA) that an under-filled call of at least
#: ROW128_MIN_M rows (a narrow weight's prefill) takes first where it fills half the SMs: the area
#: of 64x256 with eight warps on it. At a few hundred rows it is no faster than 64x256.
ROW128_TILE = (128, 64, 8, 4)
ROW128_MIN_M = 1024


@cache
def _narrowed(cfg: GemmConfig, tile: tuple[int, int, int, bool], few_rows: bool) -> GemmConfig:
    """``cfg`` launched as a 64-row tile of :data:`NARROW_TILES` (or, for a pointer tile at most
    :data:`ROW16_MAX_M` rows, as :data:`ROW16_TILE`)."""
    block_n, block_k, stages, tma = tile
    if not tma and few_rows:
        bm, bn, bk, warps, st = ROW16_TILE
        return replace(cfg, block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=st, tma=False)
    return replace(cfg, block_m=64, block_n=block_n, block_k=block_k, num_warps=4, num_stages=stages, tma=tma)


@cache
def _row128(cfg: GemmConfig) -> GemmConfig:
    """``cfg`` launched as :data:`ROW128_TILE`."""
    block_n, block_k, warps, stages = ROW128_TILE
    return replace(
        cfg, block_m=128, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages, tma=True
    )


#: The 64-row tiles a call of more than POINTER_MAX_M rows may take: TMA, at least 64 columns.
_TMA_NARROW_TILES = tuple((bn, bk, st, True) for bn, bk, st, _ in NARROW_TILES if bn >= 64)


#: Device time per output element of the wide TMA tiles of :data:`NARROW_TILES` (by BLOCK_N),
#: relative to the full tile's (1.0), for one round of programs over the SMs: a 64-row tile does
#: less per instruction. Fitted to a tuning sweep over the 0.5B-8B projections at M = 128-512.
TILE_COST = {256: 1.08, 128: 1.14}
#: The wide tiles are compared only where the full tile's programs fill the SMs at most this many
#: times over (the fitted range); a larger call keeps the full tile, whose waves then fill the
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

    Why that keeps the bits: the K order and the MMA's k16 steps on one fp32 accumulator are
    unchanged; only how many rows and columns one program covers, how many k16 steps one loop
    iteration issues, and how the operands reach shared memory change. Every tile this can return
    gives the full tile's bits on the H200; ``test_batch_invariant_gpu`` and
    ``test_small_m_shapes_gpu`` cross every switch."""
    if not cfg.shrink_small_m:
        return cfg
    spans = _cdiv(k, cfg.k_split) if cfg.k_split and k else 1  # split-grid programs count toward the fill

    def programs(block_m: int, block_n: int) -> int:
        return _cdiv(m, block_m) * _cdiv(n, block_n) * spans

    full = programs(cfg.block_m, cfg.block_n)
    if full >= sms // 2:
        if _cdiv(full, sms) > SHRINK_MAX_ROUNDS:
            return cfg
        best, best_cost = None, float(_cdiv(full, sms) * cfg.block_m * cfg.block_n)
        for tile in NARROW_TILES:  # widest first: a tie keeps the wider
            if tile[3]:
                cost = _cdiv(programs(64, tile[0]), sms) * 64 * tile[0] * TILE_COST.get(tile[0], 1.0)
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


@dataclass(frozen=True)
class TilePlan:
    """What one call's shapes decide, before it becomes kernel arguments."""

    config: GemmConfig  # the launched tile (:func:`launch_config` of the weight's)
    grid: tuple[int, int, int]  # (programs, split-K spans as programs or 1, 1)
    #: (fp32 span-sum elements, per-tile counters) the split grid needs; None without it.
    scratch: tuple[int, int] | None
    split_epilogue: bool  # store the output tile in two halves
    a_pointers: bool  # A and C by pointers while the weight streams by TMA
    k_split: int  # the split-K span the kernel sums in (0: one span)
    split_grid: bool  # the spans run as programs; the tile's last one adds them


def plan_tiles(
    base: GemmConfig, m: int, n: int, k: int, sms: int, out_itemsize: int, interpreter: bool
) -> TilePlan:
    """The tile, grid and load paths of an (m, k) x (n, k)^T call on a device of ``sms``
    persistent programs, for the weight's configuration ``base`` and an output of
    ``out_itemsize`` bytes (``interpreter``: Triton's CPU interpreter, which has no shared-memory
    limit).

    Split-K spans run as programs (the split grid) where the fp32 span sums they write and read
    back stay small (:data:`SPLIT_GRID_ROWS`) and the tiles alone would not fill the device (above
    :data:`POINTER_MAX_M` rows: where the spans' programs fit one round); else each program sums
    its tiles' spans in turn. The same adds either way, so this is a launch choice, not an
    arithmetic one."""
    spans = _cdiv(k, base.k_split) if base.k_split else 1
    grid_ok = spans > 1 and SPLIT_GRID_ROWS * spans * m <= k
    cfg = launch_config(base, m, n, sms, k if grid_ok else 0)
    tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
    split_grid = grid_ok and tiles < sms and (m <= POINTER_MAX_M or tiles * spans <= sms)
    programs = tiles if split_grid or not cfg.tma else min(tiles, sms)
    scratch = (spans * tiles * cfg.block_m * cfg.block_n, tiles) if split_grid else None
    # A 4-byte output tile is twice the shared memory: store it in halves (the store order does
    # not touch the sums, and the output dtype is fixed by the call site, never by M).
    split = cfg.tma and (cfg.split_epilogue or out_itemsize > 2)
    # Pointer loads and stores for A and C below one 64-row tile with a 2-byte output: the
    # pointer store stages the tile in shared memory, which a 4-byte or 128-row tile overflows
    # (the interpreter has no such limit: there it serves every partial tile, as a structure test).
    a_pointers = cfg.tma and m < cfg.block_m and (interpreter or (cfg.block_m == 64 and not split))
    return TilePlan(
        config=cfg,
        grid=(programs, spans if split_grid else 1, 1),
        scratch=scratch,
        split_epilogue=split,
        a_pointers=a_pointers,
        k_split=cfg.k_split if spans > 1 else 0,
        split_grid=split_grid,
    )
