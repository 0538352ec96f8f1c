"""Batch-invariant GEMM: f(A[:m]) == f(A)[:m] bitwise, and under row permutations."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.nn.functional as F
from isoaudit.kernels.gemm import gemm, gemm_reference, linear
from isoaudit.kernels.gemm_policy import GemmConfig, gemm_config

from .conftest import bits_equal, gpu, needs_triton

pytestmark = needs_triton


def _check_invariance(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, ms: list[int]) -> None:
    full = gemm(a, w, bias, impl="triton")
    for m in ms:
        assert bits_equal(gemm(a[:m], w, bias, impl="triton"), full[:m]), f"m={m}"
    perm = torch.randperm(a.shape[0], device=a.device)
    assert bits_equal(gemm(a[perm], w, bias, impl="triton"), full[perm])


def test_matches_reference(dev: str) -> None:
    a, w, b = torch.randn(37, 80, device=dev), torch.randn(72, 80, device=dev), torch.randn(72, device=dev)
    torch.testing.assert_close(gemm(a, w, b, impl="triton"), gemm_reference(a, w, b), rtol=1e-5, atol=1e-5)


def test_batch_invariant_fp32(dev: str) -> None:
    torch.manual_seed(0)
    a, w = torch.randn(130, 96, device=dev), torch.randn(70, 96, device=dev)
    _check_invariance(a, w, torch.randn(70, device=dev), [1, 3, 16, 63, 64, 65, 129])


def test_tma_path_fp32(dev: str) -> None:
    """The Hopper path (descriptor loads, host- or kernel-built descriptors, persistent tile walk,
    split epilogue) as a structure test:
    fp32 under the interpreter, where the program count (2) makes programs walk several tiles.
    K = 88 is not a multiple of BLOCK_K, so the last slab reads TMA's zero padding."""
    torch.manual_seed(0)
    a, w, b = torch.randn(150, 88, device=dev), torch.randn(72, 88, device=dev), torch.randn(72, device=dev)
    for split, device_desc in ((False, False), (True, False), (False, True), (True, True)):
        cfg = GemmConfig(32, 32, 16, 4, 2, tma=True, split_epilogue=split, device_descriptors=device_desc)
        full = gemm(a, w, b, impl="triton", config=cfg)
        torch.testing.assert_close(full, gemm_reference(a, w, b, block_k=16), rtol=1e-5, atol=1e-5)
        for m in (1, 3, 33, 149):
            assert bits_equal(gemm(a[:m], w, b, impl="triton", config=cfg), full[:m]), f"m={m}"
    strided = torch.randn(150, 100, device=dev)[:, 5:93]  # rows not 16-byte aligned: copied first
    assert bits_equal(
        gemm(strided, w, b, impl="triton", config=cfg), gemm(strided.contiguous(), w, b, config=cfg)
    )


def test_decode_tiles_fp32(dev: str) -> None:
    """The decode-size tiles ``launch_config`` picks on the H200 (the 16-row tile, a pointer-loaded
    64-row one, with and without a fixed split-K run as programs) as a structure test: fp32 under
    the interpreter, K = 300 not a multiple of BLOCK_K, each tile's rows the same at every M."""
    from isoaudit.kernels.gemm_policy import ROW16_TILE

    torch.manual_seed(0)
    a, w, b = torch.randn(70, 300, device=dev), torch.randn(40, 300, device=dev), torch.randn(40, device=dev)
    bm, bn, bk, warps, stages = ROW16_TILE
    for cfg in (
        GemmConfig(bm, bn, bk, warps, stages),
        GemmConfig(bm, bn, bk, warps, stages, k_split=128),
        GemmConfig(64, 32, 128, 4, 5),
        GemmConfig(64, 32, 128, 4, 5, k_split=256),
    ):
        full = gemm(a, w, b, impl="triton", config=cfg)
        torch.testing.assert_close(full, gemm_reference(a, w, b), rtol=1e-4, atol=1e-4)
        for m in (1, 2, 15, 16, 17, 64, 65):
            assert bits_equal(gemm(a[:m], w, b, impl="triton", config=cfg), full[:m]), (cfg, m)


def test_linear_autograd(dev: str) -> None:
    x = torch.randn(5, 3, 32, device=dev, requires_grad=True)
    w = torch.randn(48, 32, device=dev, requires_grad=True)
    y = linear(x, w)
    y.square().sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.linear(x2, w2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-4)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nk", [(4096, 4096), (1024, 3000)])
def test_batch_invariant_gpu(dtype: torch.dtype, nk: tuple[int, int]) -> None:
    torch.manual_seed(0)
    n, k = nk
    a = torch.randn(2048, k, device="cuda").to(dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)
    _check_invariance(a, w, torch.randn(n, device="cuda").to(dtype), [1, 3, 16, 255, 256, 257, 512, 2048])
    ref = F.linear(a.float(), w.float())
    got = gemm(a, w).float()
    assert ((got - ref).norm() / ref.norm()).item() < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@gpu
def test_batch_invariant_gpu_fp32_out() -> None:
    """bf16 operands, fp32 output (the lm_head path): the epilogue stores the tile in halves."""
    torch.manual_seed(0)
    a = torch.randn(2048, 4096, device="cuda").bfloat16()
    w = (torch.randn(4096, 4096, device="cuda") / 64).bfloat16()
    full = gemm(a, w, out_dtype=torch.float32)
    for m in (1, 3, 255, 257):
        assert bits_equal(gemm(a[:m], w, out_dtype=torch.float32), full[:m]), f"m={m}"
    ref = F.linear(a.float(), w.float())
    assert ((full - ref).norm() / ref.norm()).item() < 5e-5


@gpu
def test_kernel_built_descriptors_same_bits_gpu() -> None:
    """Descriptors built by the kernel (the default: a cheaper launch) load the same tiles as
    host-built ones: the same bits, for bf16 and fp32 (split epilogue) outputs."""
    torch.manual_seed(0)
    a = torch.randn(300, 4096, device="cuda").bfloat16()
    w = (torch.randn(4096, 4096, device="cuda") / 64).bfloat16()
    cfg = gemm_config(4096, 4096, torch.bfloat16, torch.cuda.get_device_capability())
    if not cfg.tma:
        pytest.skip("no TMA on this GPU")
    device = dataclasses.replace(cfg, device_descriptors=True)
    host = dataclasses.replace(cfg, device_descriptors=False)
    for out_dtype in (torch.bfloat16, torch.float32):
        assert bits_equal(
            gemm(a, w, out_dtype=out_dtype, config=device), gemm(a, w, out_dtype=out_dtype, config=host)
        )


@pytest.mark.parametrize("tma", [False, True])
def test_split_k_fp32(dev: str, tma: bool) -> None:
    """Fixed split-K as a structure test (fp32, interpreter: 2 programs): K = 88 in spans of 32
    (32, 32, 24; the last slab of each span partial). N = 32 and M <= 32 is one tile, fewer than
    the programs: the spans run as programs and the last adds them (the split grid); more rows
    sum the spans in turn in one program. Every M gives the same bits, calls repeat bitwise
    (each tile's count is back at zero), and the sums are the reference's span arithmetic."""
    torch.manual_seed(0)
    a = torch.randn(150, 88, device=dev)
    for n in (32, 72):
        w, b = torch.randn(n, 88, device=dev), torch.randn(n, device=dev)
        cfg = GemmConfig(32, 32, 16, 4, 2, tma=tma, k_split=32)
        full = gemm(a, w, b, impl="triton", config=cfg)
        torch.testing.assert_close(
            full, gemm_reference(a, w, b, block_k=16, k_split=32), rtol=1e-5, atol=1e-5
        )
        for m in (1, 3, 32, 33, 149):
            first = gemm(a[:m], w, b, impl="triton", config=cfg)
            assert bits_equal(first, full[:m]), f"n={n} m={m}"
            assert bits_equal(gemm(a[:m], w, b, impl="triton", config=cfg), first), f"n={n} m={m} repeat"
    unsplit = gemm(a, w, b, impl="triton", config=GemmConfig(32, 32, 16, 4, 2, tma=tma))
    assert not bits_equal(full, unsplit)  # the split is real: other adds, other roundings


def _tile_switches(n: int, k: int, top: int = 2048) -> list[int]:
    """Every M <= top where the launched tile, or whether the split-K spans run as programs,
    differs from M - 1's, with M - 1 (both sides of each switch), as ``gemm``'s plan decides it."""
    from isoaudit.kernels.gemm import _plan

    def tile(m: int) -> tuple[GemmConfig, int]:
        _plan.cache_clear()
        plan = _plan(m, n, k, torch.bfloat16, torch.bfloat16, True, torch.device("cuda"), None)
        return plan[0], plan[1][1]

    out, prev = [1], tile(1)
    for m in range(2, top + 1):
        cur = tile(m)
        if cur != prev:
            out += [m - 1, m]
        prev = cur
    return sorted(set(out))


def test_tile_switches_are_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch finder the GPU test relies on sees the switches of the H200's rule."""
    gemm_mod = sys.modules["isoaudit.kernels.gemm"]  # (the package exports the function gemm)
    monkeypatch.setattr(gemm_mod, "_device_traits", lambda device: ((9, 0), 132))
    ms = _tile_switches(12288, 4096, top=600)
    assert {64, 65, 128, 129, 256, 257} <= set(ms), ms  # 64x128 (one 64-row tile), 64x256, 64x128, ...
    gemm_mod._plan.cache_clear()


@gpu
@pytest.mark.parametrize(
    "nk",
    [
        (896, 896),
        (4864, 896),
        (896, 4864),
        (1024, 4096),
        (14336, 4096),
        (4096, 14336),
        (12288, 4096),
        (4096, 2048),
    ],
)
def test_small_m_shapes_gpu(nk: tuple[int, int]) -> None:
    """The 0.5B-8B decode projections at every M that picks another tile (both sides of each
    switch, up to 2048 rows), against the rows of a 2048-row batch; with a bias, and through the
    cached launch and Triton's."""
    _small_m_check(*nk)


@gpu
@pytest.mark.parametrize("nk", [(896, 4864), (1024, 4096)])
def test_split_k_small_m_gpu(split_k, nk: tuple[int, int]) -> None:
    """The same with the fixed split-K: the split grid at small M, the in-program spans above."""
    from isoaudit.kernels.gemm_policy import gemm_config

    assert gemm_config(*nk, torch.bfloat16, torch.cuda.get_device_capability()).k_split or pytest.skip(
        "no split-K"
    )
    _small_m_check(*nk)


def _small_m_check(n: int, k: int) -> None:
    from isoaudit.kernels import _triton

    torch.manual_seed(0)
    a = torch.randn(2048, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
    bias = torch.randn(n, device="cuda").bfloat16()
    switches = _tile_switches(n, k)
    _check_invariance(a, w, bias, sorted({1, 2, 8, 16, 17, 64, 65, 128, 200, 256, 257, 512, 1000, *switches}))
    full = gemm(a, w, bias)
    try:
        _triton.CachedLauncher.enabled = False
        for m in (1, 64, 256):
            assert bits_equal(gemm(a[:m], w, bias), full[:m]), m
    finally:
        _triton.CachedLauncher.enabled = True


@gpu
def test_cached_launch_respects_alignment_gpu() -> None:
    """A cached launch keyed on alignment: a 2-byte-offset view of A (not 16-byte aligned; TMA
    copies it) and an fp32 pointer-path call on an odd view give the Triton launch's results."""
    from isoaudit.kernels import _triton

    torch.manual_seed(0)
    base = torch.randn(300, 4104, device="cuda").bfloat16()
    w = (torch.randn(4096, 4096, device="cuda") / 64).bfloat16()
    for view in (base[:, :4096], base[:, 1:4097], base[:, 8:4104]):
        want = gemm(view.contiguous(), w)
        assert bits_equal(gemm(view, w), want)
        assert bits_equal(gemm(view, w), want)  # the second call hits the cache
    a32 = torch.randn(64, 1001, device="cuda")
    w32 = torch.randn(200, 1000, device="cuda")
    for view in (a32[:, :1000], a32[:, 1:]):
        _triton.CachedLauncher.enabled = False
        want = gemm(view, w32)
        _triton.CachedLauncher.enabled = True
        assert bits_equal(gemm(view, w32), want) and bits_equal(gemm(view, w32), want)


@gpu
def test_split_k_graph_replay_gpu(split_k) -> None:
    """The split grid inside a CUDA graph: replayed many times (each replay zeroes its counters),
    beside eager calls sharing the stream's counters, always the eager bits."""
    torch.manual_seed(0)
    a = torch.randn(8, 4864, device="cuda").bfloat16()
    w = (torch.randn(896, 4864, device="cuda") / 70).bfloat16()
    want = gemm(a, w)
    assert gemm_config(896, 4864, torch.bfloat16, torch.cuda.get_device_capability()).k_split or pytest.skip(
        "no split-K on this GPU"
    )
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemm(a, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemm(a, w)
    for _ in range(20):
        graph.replay()
        assert bits_equal(gemm(a, w), want)
    torch.cuda.synchronize()
    assert bits_equal(out, want)
