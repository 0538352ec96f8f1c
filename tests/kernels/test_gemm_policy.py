"""The GEMM's tile policy on the CPU: the tile, grid and load paths a call's shapes decide (the
bits across each switch are checked on the GPU, in ``test_gemm.py``)."""

from __future__ import annotations

import pytest
import torch
from isoaudit.kernels.gemm_policy import (
    SPLIT_GRID_ROWS,
    GemmConfig,
    gemm_config,
    launch_config,
    plan_tiles,
)

H200 = ((9, 0), 132)  # (capability, SMs)


def _plan(n: int, k: int, m: int, out_itemsize: int = 2, interpreter: bool = False):
    capability, sms = H200
    return plan_tiles(gemm_config(n, k, torch.bfloat16, capability), m, n, k, sms, out_itemsize, interpreter)


def _tile(plan) -> tuple[int, int, int, int, int, bool]:
    c = plan.config
    return (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.tma)


def test_launch_config_narrows_only_underfilled_hopper_calls() -> None:
    """The tile choice itself (the bits across the switch are checked on the GPU): the tile whose
    busiest SM has the least work where the full tiles fill the SMs at most twice, the full tile
    beyond, and never without the flag."""
    hopper = gemm_config(4096, 4096, torch.bfloat16, (9, 0))
    assert hopper.shrink_small_m and not gemm_config(4096, 4096, torch.bfloat16, (10, 0)).shrink_small_m
    assert launch_config(hopper, 2048, 4096, 132) is hopper
    assert launch_config(hopper, 256, 14336, 132) is hopper  # 112 full tiles: one round, 85% full
    # 96 full tiles fill 73% of the SMs in one round; 384 64x128 tiles fill 97% in three
    assert (launch_config(hopper, 256, 12288, 132).block_n, launch_config(hopper, 256, 12288, 132).tma) == (
        128,
        True,
    )
    assert launch_config(hopper, 4096, 12288, 132) is hopper  # many rounds: the full tile
    decode = launch_config(hopper, 64, 4096, 132)  # 128 tiles of 64x32, loaded by pointers
    assert (decode.block_m, decode.block_n, decode.block_k, decode.tma) == (64, 32, 128, False)
    small = launch_config(hopper, 1, 4096, 132)  # at most 16 rows: the 16-row tile in its place
    assert (small.block_m, small.block_n, small.block_k, small.num_warps, small.tma) == (
        16,
        16,
        128,
        2,
        False,
    )
    assert (
        launch_config(hopper, 16, 4096, 132).block_m == 16
        and launch_config(hopper, 17, 4096, 132).block_m == 64
    )
    assert launch_config(hopper, 64, 896, 132).block_n == 16  # none fills half: the narrowest
    # hopper is the 4096x4096 config: launch_config(hopper, 1, 14336, ...) is a tile-choice probe only
    wide = launch_config(hopper, 1, 14336, 132)  # a TMA tile fills half: 64 rows even for one
    assert (wide.block_m, wide.block_n, wide.block_k, wide.tma) == (64, 128, 128, True)
    mid = launch_config(hopper, 512, 4096, 132)  # 64 full tiles; 128 of 64x256
    assert (mid.block_m, mid.block_n, mid.block_k) == (64, 256, hopper.block_k)
    # above 64 rows no pointer tile: the narrowest is 64x64 by TMA (128 of them here)
    above = launch_config(hopper, 65, 4096, 132)
    assert (above.block_m, above.block_n, above.block_k, above.tma) == (64, 64, 128, True)
    plain = GemmConfig(32, 32, 16, 4, 2, tma=True)
    assert launch_config(plain, 1, 4096, 132) is plain


def test_split_span_is_fixed_per_weight_shape(split_k) -> None:
    """The split is a function of (N, K) alone: narrow weights get four spans of a multiple of
    128 on the H200, wide ones none, and the narrowing at small M counts the spans' programs."""
    from isoaudit.kernels.gemm_policy import split_span

    assert split_span(896, 4864) == 1280 and split_span(1024, 4096) == 1024
    assert split_span(4096, 4096) == 0 and split_span(896, 896) == 0  # K = 896: measured slower split
    narrow = gemm_config(896, 4864, torch.bfloat16, (9, 0))
    assert (narrow.block_m, narrow.block_n, narrow.k_split) == (128, 256, 1280)
    assert gemm_config(896, 4864, torch.bfloat16, (10, 0)).k_split == 0
    assert launch_config(narrow, 4096, 896, 132, 4864) is narrow
    assert launch_config(narrow, 64, 896, 132, 4864).block_n == 32  # 28 tiles x 4 spans >= 66
    assert launch_config(narrow, 1, 896, 132, 4864).block_m == 16  # at most 16 rows: the 16-row tile
    at256 = launch_config(narrow, 256, 896, 132)  # none fills half: the narrowest TMA tile
    assert (at256.block_m, at256.block_n, at256.tma, at256.k_split) == (64, 64, True, 1280)
    prefill = launch_config(narrow, 2048, 896, 132)  # 64 full tiles; 112 of 128x128 on 8 warps
    assert (prefill.block_m, prefill.block_n, prefill.num_warps, prefill.tma) == (128, 128, 8, True)


def test_weight_tiles_per_device() -> None:
    """The weight's own tile: fp32 and small weights one tile everywhere; bf16 on Hopper the
    128x256 TMA tile (narrowing at small M on the H200 only), elsewhere 256x128 by pointers."""
    assert gemm_config(4096, 4096, torch.float32, (9, 0)) == GemmConfig(64, 64, 32, 4, 2)
    assert gemm_config(128, 4096, torch.bfloat16, (9, 0)) == GemmConfig(64, 64, 64, 4, 3)
    assert gemm_config(4096, 4096, torch.bfloat16, None) == GemmConfig(256, 128, 64, 8, 3)
    assert gemm_config(4096, 4096, torch.bfloat16, (8, 0)) == GemmConfig(256, 128, 64, 8, 3)
    assert gemm_config(4100, 4096, torch.bfloat16, (9, 0)) == GemmConfig(256, 128, 64, 8, 3)  # N % 8
    assert gemm_config(4096, 4096, torch.bfloat16, (9, 0)) == GemmConfig(
        128, 256, 64, 8, 3, tma=True, shrink_small_m=True
    )
    assert gemm_config(4096, 4096, torch.bfloat16, (10, 0)) == GemmConfig(128, 256, 64, 8, 3, tma=True)


@pytest.mark.parametrize(
    ("n", "k", "m", "tile", "grid"),
    [
        # decode: the 16-row tile up to 16 rows, 64-row pointer tiles up to 64, TMA tiles above
        (4096, 4096, 1, (16, 16, 128, 2, 5, False), (256, 1, 1)),
        (4096, 4096, 16, (16, 16, 128, 2, 5, False), (256, 1, 1)),
        (4096, 4096, 17, (64, 32, 128, 4, 5, False), (128, 1, 1)),
        (4096, 4096, 64, (64, 32, 128, 4, 5, False), (128, 1, 1)),
        (4096, 4096, 65, (64, 64, 128, 4, 5, True), (128, 1, 1)),
        (4096, 4096, 192, (64, 128, 128, 4, 4, True), (96, 1, 1)),
        (14336, 4096, 1, (64, 128, 128, 4, 4, True), (112, 1, 1)),
        (14336, 4096, 65, (64, 256, 64, 4, 4, True), (112, 1, 1)),
        (14336, 4096, 256, (128, 256, 64, 8, 3, True), (112, 1, 1)),
        (896, 896, 17, (64, 16, 128, 4, 5, False), (56, 1, 1)),
        # prefill: the 128-row tile for an under-filled narrow weight, else the full tile on a
        # persistent grid of one program per SM
        (896, 896, 2048, (128, 128, 64, 8, 4, True), (112, 1, 1)),
        (896, 896, 16384, (128, 256, 64, 8, 3, True), (132, 1, 1)),
        (4096, 4096, 2048, (128, 256, 64, 8, 3, True), (132, 1, 1)),
        (14336, 4096, 16384, (128, 256, 64, 8, 3, True), (132, 1, 1)),
    ],
)
def test_tiles_at_decode_and_prefill(n: int, k: int, m: int, tile: tuple, grid: tuple) -> None:
    plan = _plan(n, k, m)
    assert (_tile(plan), plan.grid, plan.scratch, plan.split_grid, plan.k_split) == (
        tile,
        grid,
        None,
        False,
        0,
    )


def test_split_grid_bound(split_k) -> None:
    """A split-K weight (896 x 4864: four spans of 1280) runs its spans as programs up to
    K / (SPLIT_GRID_ROWS * spans) rows, with fp32 span sums and a counter per tile; above, each
    program sums its spans in turn. The span (the arithmetic) is the same either way."""
    n, k = 896, 4864
    bound = k // (SPLIT_GRID_ROWS * 4)
    assert bound == 152
    expected = {
        1: ((16, 16, 128, 2, 5, False), (56, 4, 1), (4 * 56 * 16 * 16, 56)),
        16: ((16, 16, 128, 2, 5, False), (56, 4, 1), (4 * 56 * 16 * 16, 56)),
        17: ((64, 32, 128, 4, 5, False), (28, 4, 1), (4 * 28 * 64 * 32, 28)),
        65: ((64, 64, 128, 4, 5, True), (28, 4, 1), (4 * 28 * 64 * 64, 28)),
        bound: ((64, 128, 128, 4, 4, True), (21, 4, 1), (4 * 21 * 64 * 128, 21)),
        bound + 1: ((64, 64, 128, 4, 5, True), (42, 1, 1), None),
        256: ((64, 64, 128, 4, 5, True), (56, 1, 1), None),
        2048: ((128, 128, 64, 8, 4, True), (112, 1, 1), None),
        16384: ((128, 256, 64, 8, 3, True), (132, 1, 1), None),
    }
    for m, (tile, grid, scratch) in expected.items():
        plan = _plan(n, k, m)
        assert (_tile(plan), plan.grid, plan.scratch) == (tile, grid, scratch), m
        assert plan.split_grid == (scratch is not None) and plan.k_split == 1280, m


def test_output_and_pointer_paths() -> None:
    """A 4-byte output stores its TMA tile in halves; A and C go by pointers below one 64-row TMA
    tile with a 2-byte output (the interpreter: below any TMA tile)."""
    bf16_out = _plan(14336, 4096, 1)
    assert bf16_out.a_pointers and not bf16_out.split_epilogue
    fp32_out = _plan(14336, 4096, 1, out_itemsize=4)
    assert not fp32_out.a_pointers and fp32_out.split_epilogue
    full_tile = _plan(14336, 4096, 100)  # 64x256 TMA tile, 100 rows: no partial tile below one
    assert not full_tile.a_pointers
    pointer_tile = _plan(4096, 4096, 1)  # the 16-row pointer tile: no TMA at all
    assert not pointer_tile.a_pointers and not pointer_tile.split_epilogue
    cfg = GemmConfig(128, 256, 64, 8, 3, tma=True)
    assert not plan_tiles(cfg, 100, 4096, 4096, 132, 2, False).a_pointers  # a 128-row tile
    assert plan_tiles(cfg, 100, 4096, 4096, 132, 2, True).a_pointers


def test_persistent_grid_only_with_tma() -> None:
    """A TMA tile runs at most one program per SM (each walks tiles); a pointer tile one program
    per tile."""
    tma = GemmConfig(64, 64, 32, 4, 2, tma=True)
    ptr = GemmConfig(64, 64, 32, 4, 2)
    assert plan_tiles(tma, 4096, 4096, 4096, 132, 2, False).grid == (132, 1, 1)
    assert plan_tiles(ptr, 4096, 4096, 4096, 132, 2, False).grid == (64 * 64, 1, 1)
