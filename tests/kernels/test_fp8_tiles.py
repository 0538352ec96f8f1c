"""The W8A8 GEMM's tile follows M without changing a bit: the dispatcher's choice per M (CPU), the
kernel's adds under every candidate tile (the interpreter, on operands whose block sums are exact),
and on the GPU every tile the policy can pick giving the same bits at every M as every other tile
and as the 4096-row result."""

from __future__ import annotations

import os

import pytest
import torch
from isoaudit.kernels import fp8 as F8
from isoaudit.kernels.fp8_quant import quantize_act, quantize_weight

from .conftest import bits_equal, gpu, needs_triton

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
T = F8.Fp8Tile


@pytest.fixture
def table():
    """Restore the shipped tile table after a test that installs another."""
    saved = F8.TILE_TABLE
    yield
    F8.set_tile_table(saved)


def test_table_draws_from_the_proven_candidates() -> None:
    """The shipped table is well formed (ascending rows, a last catch-all row) and every tile in it is
    one the GPU test proves; block M is at least 64 (Hopper's warpgroup MMA)."""
    assert F8.TILE_TABLE[-1][0] == 0
    bounds = [m for m, _ in F8.TILE_TABLE[:-1]]
    assert bounds == sorted(bounds) and all(b > 0 for b in bounds)
    for _, tiles in F8.TILE_TABLE:
        assert tiles and all(t in F8.TILE_CANDIDATES for t in tiles)
    assert all(t.block_m >= 64 and t.block_n >= 64 for t in F8.TILE_CANDIDATES)
    assert len(set(F8.TILE_CANDIDATES)) == len(F8.TILE_CANDIDATES)


def test_pick_tile_by_m_row_and_device_fill(table) -> None:
    """A call takes the first row with M <= max_m, then the row's first tile whose programs fill the
    device, else the row's last tile."""
    big, mid, small = T(128, 128, 8, 4), T(64, 128, 4, 4), T(64, 64, 4, 4)
    F8.set_tile_table(((64, (small,)), (256, (mid, small)), (0, (big, mid, small))))
    for m in (1, 7, 64):
        assert F8.pick_tile(m, 4096, 4096, 132) == small
    assert F8.pick_tile(65, 28672, 4096, 132) == mid  # 2 x 224 programs
    assert F8.pick_tile(256, 896, 896, 132) == small  # 64x128: 4 x 7 = 28 programs, too few
    assert F8.pick_tile(2048, 4096, 4096, 132) == big  # 16 x 32 = 512
    assert F8.pick_tile(2048, 896, 896, 132) == mid  # 128x128: 16 x 7 = 112 < 132
    assert F8.pick_tile(257, 896, 896, 132) == small  # nothing fills: the row's last
    assert F8.pick_tile(2048, 896, 896, 100) == big  # a smaller device is filled sooner


def test_split_grid_spans_count_as_programs(table) -> None:
    """At most SPLIT_GRID_MAX_M rows the split spans run as programs, so they count toward the fill."""
    mid, small = T(64, 128, 4, 4), T(64, 64, 4, 4)
    F8.set_tile_table(((0, (mid, small)),))
    n, k = 896, 4864  # 8 spans of 640
    assert F8.weight_split(n, k) == 640
    assert F8.pick_tile(128, n, k, 132) == small  # 64x128: 2 x 7 x 8 = 112 < 132; 64x64: 224
    assert F8.pick_tile(128, n, k, 100) == mid  # 112 >= 100
    assert F8.pick_tile(129, n, k, 20) == mid  # spans summed in one program: 3 x 7 = 21 programs
    assert F8.pick_tile(129, n, k, 22) == small


def test_plan_follows_the_table_and_keeps_the_split(table) -> None:
    """The launch's tile changes with M; its split (the bits) does not; a new table clears the plans."""
    cpu = torch.device("cpu")
    sms = 2  # what the CPU's device traits report: any tile fills it, so every row's first tile
    for n, k in ((896, 896), (896, 4864), (4096, 4096), (4096, 14336)):
        spans = set()
        for m in (1, 7, 64, 65, 256, 257, 2048, 4096):
            p = F8.plan(m, n, k, False, cpu, None)
            want = F8.pick_tile(m, n, k, sms)
            assert (p[1]["BLOCK_M"], p[1]["BLOCK_N"], p[1]["GROUP_M"], p[1]["LAG"]) == (
                want.block_m,
                want.block_n,
                want.group_m,
                want.lag,
            )
            assert p[2] == dict(num_warps=want.num_warps, num_stages=want.num_stages)
            spans.add(p[1]["SPAN_BLOCKS"])
        assert len(spans) == 1, (n, k, spans)
        assert F8.fp8_config(n, k).k_split == F8.weight_split(n, k)
    lag = T(64, 128, 4, 4, lag=True)
    F8.set_tile_table(((0, (lag,)),))
    p = F8.plan(4096, 4096, 4096, False, cpu, None)
    assert (p[1]["BLOCK_N"], p[1]["LAG"]) == (128, True)


def test_set_tile_table_refuses_unproven_or_malformed(table) -> None:
    ok = T(64, 64, 4, 4)
    with pytest.raises(ValueError, match="not in TILE_CANDIDATES"):
        F8.set_tile_table(((0, (T(32, 32, 4, 2),)),))
    with pytest.raises(ValueError, match="last row's max_m"):
        F8.set_tile_table(((64, (ok,)),))
    with pytest.raises(ValueError, match="max_m must ascend"):
        F8.set_tile_table(((256, (ok,)), (64, (ok,)), (0, (ok,))))
    with pytest.raises(ValueError, match="max_m=64 has no tile"):
        F8.set_tile_table(((64, ()), (0, (ok,))))
    assert F8.set_tile_table(((0, (ok,)),))[-1][0] == 0


def _exact_operands(m: int, n: int, k: int, seed: int = 0):
    """Integer E4M3 values in [-16, 16] (as fp32, the interpreter's stand-in) with random fp32
    scales: a 128-K block's products sum exactly in fp32 in any order, so the interpreter's matmul
    (whose order follows its operand shapes) is out of the picture and only the kernel's own adds —
    the promotions, the spans, their order — decide the bits."""
    g = torch.Generator().manual_seed(seed)
    kb = -(-k // 128)
    xq = torch.randint(-16, 17, (m, k), generator=g).float()
    wq = torch.randint(-16, 17, (n, k), generator=g).float()
    xs = torch.rand(m, kb, generator=g) * 2.0**-6 + 2.0**-9
    ws = torch.rand(-(-n // 128), kb, generator=g) * 2.0**-6 + 2.0**-9
    return xq, xs, wq, ws


@needs_triton
def test_every_candidate_tile_same_adds_interpreter() -> None:
    """Under the interpreter every candidate tile gives each row the reference's bits at M = 1 and
    300: a ragged K (6 blocks, the last of 40) with a split of 256 (as split programs at M = 1, as
    spans summed in turn at M = 300), and an even K (no K mask) without a split."""
    if not INTERP:
        pytest.skip("interpreter structure test (CPU only)")
    n = 200  # ragged against every block width
    for k, k_split in ((680, 256), (512, 0)):
        xq, xs, wq, ws = _exact_operands(300, n, k)
        bias = torch.randn(n)
        ref = F8.w8a8_reference(xq, xs, wq, ws, bias, torch.float32, k_split=k_split)
        for tile in F8.TILE_CANDIDATES:
            cfg = tile.with_split(k_split)
            for m in (1, 300):
                y = F8.w8a8_gemm(xq[:m], xs[:m], wq, ws, bias, torch.float32, impl="triton", config=cfg)
                assert bits_equal(y, ref[:m]), (tile.tag, k, k_split, m)


# ---------------------------------------------------------------------------------------- CUDA

#: Qwen2.5-0.5B (q+k+v, down: split-K) and Llama-3-8B (q/o, down: split-K) projections.
GPU_SHAPES = [(1152, 896), (896, 4864), (4096, 4096), (4096, 14336)]
GPU_MS = (1, 7, 64, 256, 2048, 4096)


@gpu
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_every_candidate_tile_same_bits_gpu(n: int, k: int) -> None:
    """Every tile the policy can pick, at every M, gives each row the bits of the first candidate's
    4096-row result (fp32 output with a bias: no bf16 rounding to hide a difference); and the
    shipped policy's own dispatch (whatever tile it picks per M) gives them too."""
    g = torch.Generator().manual_seed(n + k)
    x = (torch.randn(4096, k, generator=g) * torch.rand(4096, 1, generator=g) * 4).bfloat16().cuda()
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16().cuda()
    b = torch.randn(n, generator=g).cuda()
    xq, xs = quantize_act(x)
    wq, ws = quantize_weight(w)
    split = F8.weight_split(n, k)
    want = F8.w8a8_gemm(xq, xs, wq, ws, b, torch.float32, config=F8.TILE_CANDIDATES[0].with_split(split))
    differ = []
    for tile in F8.TILE_CANDIDATES:
        cfg = tile.with_split(split)
        for m in GPU_MS:
            y = F8.w8a8_gemm(xq[:m], xs[:m], wq, ws, b, torch.float32, config=cfg)
            if not bits_equal(y, want[:m]):
                differ.append(f"{tile.tag} M={m}")
    for m in GPU_MS:
        if not bits_equal(F8.w8a8_gemm(xq[:m], xs[:m], wq, ws, b, torch.float32), want[:m]):
            differ.append(f"policy M={m}")
    assert not differ, f"N={n} K={k}: bits differ from the 4096-row result: {differ}"
