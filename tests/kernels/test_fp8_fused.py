"""The activation quantizer fused into the W8A8 GEMM (``fused_quant``): the same bits as the
quantizer kernel followed by the GEMM, so whether a call fuses (``fuse_quant=True``, or at most
``FUSE_MAX_M`` rows: none by default, the fused kernel being slower on the device) changes no bit.

Under the interpreter both paths carry the activation's fp32 values before the E4M3 cast (the
interpreter's fp8 cast does not round to nearest even, so neither side casts): the comparison
checks the fused path's structure (each 128-K block's amax, scale, division and clamp written once
in ``_quantize_rows``, the ragged-K mask, the scales in the promotion, the split, the bias) against
the quantizer kernel's output fed to the unfused GEMM, exactly. On CUDA the E4M3 cast is in too.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from isoaudit.kernels import fp8 as F8
from isoaudit.kernels.fp8_quant import quantize_act, quantize_act_reference, quantize_weight

from .conftest import bits_equal, gpu, needs_triton

INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def _inputs(m: int, n: int, k: int, device: str = "cpu", seed: int = 0):
    """Rows of very different magnitudes (a scale per row and group), an all-zero row, a row with
    one loud group and the rest tiny, bf16; a weight and a bias."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
    if m > 2:
        x[1] = 0.0
        x[2] = torch.randn(k, generator=g) * 2.0**-20
        x[2, : min(k, 128)] *= 2.0**30
    w = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
    b = torch.randn(n, generator=g)
    return x.bfloat16().to(device), w.to(device), b.to(device)


def _interp_pair(x, wq, ws, bias, config=None, quantized=None):
    """(fused, unfused) under the interpreter on the same inputs: fp32 out, fp32 weight operand.
    ``quantized``: ``quantize_act(x, impl="triton")`` if already made."""
    fused = F8.w8a8_gemm(x, None, wq, ws, bias, torch.float32, impl="triton", config=config, fused_quant=True)
    # the quantizer kernel's output: the fp32 values before the cast, and the scales
    xq, xs = quantized or quantize_act(x, impl="triton")
    unfused = F8.w8a8_gemm(xq, xs, wq, ws, bias, torch.float32, impl="triton", config=config)
    return fused, unfused


INTERP_MS = (1, 3, 16, 64, 300)


@needs_triton
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    "n,k",
    [(200, 896), (96, 200), (64, 4096)],
    ids=["896-deep", "ragged-K-200", "4096-deep-split"],
)
def test_fused_equals_unfused_interpreter(n: int, k: int, with_bias: bool) -> None:
    """Bit for bit at every M (the shipped policy's tile for each M; 4096-deep: the weight's
    fixed split, as programs at M <= 128 and in turn at M = 300), with and without a bias."""
    if not INTERP:
        pytest.skip("interpreter structure test (CPU only)")
    x, w, b = _inputs(max(INTERP_MS), n, k)
    wq, ws = quantize_weight(w)
    wq = wq.float()
    bias = b if with_bias else None
    xq, xs = quantize_act(x, impl="triton")  # a row's quantization is its own: sliced below
    for m in INTERP_MS:
        fused, unfused = _interp_pair(x[:m], wq, ws, bias, quantized=(xq[:m], xs[:m]))
        assert bits_equal(fused, unfused), (n, k, m, (fused - unfused).abs().max().item())
        # not two empty answers: close to the exact-block reference on the E4M3 values
        rq, rs = quantize_act_reference(x[:m])
        ref = F8.w8a8_reference(rq, rs, quantize_weight(w)[0], ws, bias, torch.float32)
        assert ref.abs().max() > 0
        torch.testing.assert_close(fused, ref, rtol=0.1, atol=0.1 * ref.abs().max().item())


@needs_triton
def test_fused_equals_unfused_every_candidate_interpreter() -> None:
    """Every candidate tile (the lagged promotion too) with a split of 256 on a ragged K of 520:
    the spans as programs (M = 1) and summed in turn (M = 129)."""
    if not INTERP:
        pytest.skip("interpreter structure test (CPU only)")
    x, w, b = _inputs(129, 130, 520, seed=1)
    wq, ws = quantize_weight(w)
    wq = wq.float()
    quantized = {m: quantize_act(x[:m], impl="triton") for m in (1, 129)}
    for tile in F8.TILE_CANDIDATES:
        cfg = tile.with_split(256)
        for m in (1, 129):
            fused, unfused = _interp_pair(x[:m], wq, ws, b, cfg, quantized[m])
            assert bits_equal(fused, unfused), (tile.tag, m)


@needs_triton
def test_fused_rows_equal_unfused_batch_rows_interpreter() -> None:
    """A fixed tile (so the interpreter's matmul sees the same shapes): the fused call's rows at
    M = 1, 3, 33 equal the unfused call's first rows at M = 150, across the split grid (M <= 128)
    and the spans summed in turn (M = 150)."""
    if not INTERP:
        pytest.skip("interpreter structure test (CPU only)")
    x, w, b = _inputs(150, 96, 520, seed=2)
    wq, ws = quantize_weight(w)
    wq = wq.float()
    cfg = F8.Fp8Config(32, 32, 4, 2, 256)
    _, full = _interp_pair(x, wq, ws, b, cfg)
    for m in (1, 3, 33):
        fused, _ = _interp_pair(x[:m], wq, ws, b, cfg)
        assert bits_equal(fused, full[:m]), m


def test_plan_carries_the_fused_choice() -> None:
    """The fused plan differs from the unfused one only in FUSED_QUANT, A_FP8 (E4M3 on CUDA, the
    fp32 values before the cast under the interpreter) and QUANT_M (the activation rows a program
    quantizes: at M = 1 two rows, not the tile's 64); tile, split and grid are the same."""
    cfg = F8.Fp8Config(64, 64, 4, 4, 640)
    for dev, fp8 in ((torch.device("cpu"), False), (torch.device("cuda"), True)):
        plain = F8.plan(1, 896, 4864, True, dev, cfg)
        fused = F8.plan(1, 896, 4864, True, dev, cfg, True)
        assert fused is F8.plan(1, 896, 4864, True, dev, cfg, True)  # cached
        assert plain[1]["FUSED_QUANT"] is False and plain[1]["A_FP8"] is False and plain[1]["QUANT_M"] == 64
        assert fused[1]["FUSED_QUANT"] is True and fused[1]["A_FP8"] is fp8 and fused[1]["QUANT_M"] == 2
        own = ("FUSED_QUANT", "A_FP8", "QUANT_M")
        rest = {k: v for k, v in fused[1].items() if k not in own}
        assert rest == {k: v for k, v in plain[1].items() if k not in own}
        assert (fused[0], fused[2], fused[3]) == (plain[0], plain[2], plain[3])
    # off by default: the fused kernel costs more device time than the two launches at every M
    # measured on the H100, so only ``fuse_quant=True`` fuses
    assert F8.FUSE_MAX_M == 0


def test_quant_rows() -> None:
    """A fused program quantizes the least power of two >= M rows, at least 2, when M is under its
    tile's rows (the MMA operand repeats them), else the tile's rows."""
    assert [F8.quant_rows(m, 64) for m in (1, 2, 3, 5, 16, 17, 33, 63, 64, 65, 300)] == [
        2, 2, 4, 8, 16, 32, 64, 64, 64, 64, 64,
    ]  # fmt: skip
    assert [F8.quant_rows(m, 128) for m in (1, 64, 65, 127, 128, 129)] == [2, 64, 128, 128, 128, 128]
    for m in (1, 3, 64):
        assert (
            F8.plan(m, 96, 520, False, torch.device("cpu"), F8.Fp8Config(128, 64, 8, 4))[1]["QUANT_M"] == 128
        )


def test_torch_impl_fused_is_quantize_then_reference() -> None:
    x, w, b = _inputs(5, 96, 300)
    wq, ws = quantize_weight(w)
    xq, xs = quantize_act_reference(x)
    want = F8.w8a8_reference(xq, xs, wq, ws, b, torch.float32)
    got = F8.w8a8_gemm(x, None, wq, ws, b, torch.float32, impl="torch", fused_quant=True)
    assert bits_equal(got, want)
    with pytest.raises(ValueError, match="xs is needed"):
        F8.w8a8_gemm(xq, None, wq, ws, b, torch.float32, impl="torch")


def test_weight_lookup_by_identity() -> None:
    """The id-keyed front of the weight cache: the same entry while the master lives, a re-made
    copy after an in-place change or a new storage, and the entry gone once the master is."""
    w = torch.randn(256, 256).bfloat16()
    e = F8.fp8_weight(w)
    assert F8.fp8_weight(w) is e and id(w) in F8._WEIGHTS
    q0 = e.q.clone()
    w.mul_(-1.0)
    assert F8.fp8_weight(w) is e and not torch.equal(e.q.view(torch.uint8), q0.view(torch.uint8))
    assert torch.equal(e.q.view(torch.uint8), quantize_weight(w)[0].view(torch.uint8))
    w.set_(torch.randn(256, 256).bfloat16())  # another storage, same tensor object
    assert F8.fp8_weight(w) is e and e.ptr == w.data_ptr()
    assert torch.equal(e.scale, quantize_weight(w)[1])
    key = id(w)
    del w, e
    gc.collect()
    assert key not in F8._WEIGHTS


# ---------------------------------------------------------------------------------------- CUDA

GPU_SHAPES = [(896, 896), (4864, 896), (896, 4864), (4096, 4096)]
GPU_MS = (1, 2, 7, 16, 64, 255, 256, 257, 2048)


@gpu
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_fused_equals_quantize_then_gemm_gpu(n: int, k: int) -> None:
    """On CUDA, bf16 in: the fused GEMM equals ``quantize_act`` + the unfused GEMM bit for bit at
    every M (1 to 2048, both sides of the split grid's 128), fp32 and bf16 out, with a bias
    and without; the same bias values in bf16 and in fp32 give the same bits (the bias's dtype is
    part of the launch key: a launch compiled for the other would misread it)."""
    x, w, b = _inputs(max(GPU_MS), n, k, "cuda", seed=n + k)
    wq, ws = quantize_weight(w)
    b16 = b.bfloat16()
    b32 = b16.float()  # the same values: the kernel widens either to fp32
    differ = []
    for m in GPU_MS:
        xq, xs = quantize_act(x[:m])
        for odt in (torch.float32, torch.bfloat16):
            outs = {}
            for bias in (b32, b16, None):
                fused = F8.w8a8_gemm(x[:m], None, wq, ws, bias, odt, fused_quant=True)
                unfused = F8.w8a8_gemm(xq, xs, wq, ws, bias, odt)
                name = f"M={m} bias={None if bias is None else bias.dtype} out={odt}"
                outs[None if bias is None else bias.dtype] = fused
                if not bits_equal(fused, unfused):
                    differ.append(name)
            if not bits_equal(outs[torch.float32], outs[torch.bfloat16]):
                differ.append(f"M={m} out={odt}: fp32 bias != the same bias in bf16")
    assert not differ, f"N={n} K={k}: {differ}"


@gpu
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_linear_rows_fused_and_unfused_gpu(n: int, k: int, monkeypatch) -> None:
    """``fp8_linear``'s rows fused (``fuse_quant=True``) at M = 1, 2, 255, 256, 257 equal the same
    rows inside an M = 2048 call (quantizer kernel, then GEMM), and so do the default calls, which
    do not fuse at any M (``FUSE_MAX_M`` = 0)."""
    x, w, b = _inputs(2048, n, k, "cuda", seed=n * k)
    bias = b.bfloat16()
    seen = []
    launch = F8._launch

    def spy(a, *args):
        seen.append((a.shape[0], args[-1]))
        return launch(a, *args)

    monkeypatch.setattr(F8, "_launch", spy)

    def linear(xm, fuse=None):
        """The call's output; its one GEMM launch fused only where ``fuse_quant=True`` asked."""
        seen.clear()
        y = F8.fp8_linear(xm, w, bias, fuse_quant=fuse)
        assert seen == [(xm.numel() // k, fuse is True)], (xm.shape, fuse, seen)
        return y

    full = linear(x)
    for i in [0, 1, 2, 3, 17, 255, 256, 1000, 2047]:
        assert bits_equal(linear(x[i : i + 1], True), full[i : i + 1]), f"row {i}"
        assert bits_equal(linear(x[i : i + 1]), full[i : i + 1]), f"row {i}, default"
    for m in (2, 255, 256, 257):
        assert bits_equal(linear(x[:m], True), full[:m]), f"M={m}"
        assert bits_equal(linear(x[:m]), full[:m]), f"M={m}, default"
    # a 3-D input (batch, sequence, K) takes the same paths and gives the same rows
    assert bits_equal(linear(x[:6].view(2, 3, k)).view(6, n), full[:6])
    assert bits_equal(linear(x[:6].view(2, 3, k), True).view(6, n), full[:6])
