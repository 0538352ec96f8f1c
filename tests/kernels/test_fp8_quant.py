"""The FP8 quantizers: their rounding (E4M3, round to nearest even, saturation at ±448), the scale
formula (amax / 448 per token group of 128, per 128×128 weight block), per-token invariance, and on
CUDA the Triton kernel's bits against the CPU reference."""

from __future__ import annotations

import pytest
import torch
from isoaudit.kernels.fp8_quant import (
    AMAX_FLOOR,
    E4M3_MAX,
    FP8,
    GROUP,
    dequantize_act,
    dequantize_weight,
    quantize_act,
    quantize_act_reference,
    quantize_per_tensor,
    quantize_weight,
    quantize_weight_reference,
)

from .conftest import gpu, needs_triton


def _row_with_unit_scale(values: list[float]) -> torch.Tensor:
    """One token of one group whose amax is 448, so its scale is exactly 1 and q = e4m3(v)."""
    row = torch.zeros(1, GROUP)
    row[0, 0] = E4M3_MAX
    row[0, 1 : 1 + len(values)] = torch.tensor(values)
    return row


def test_rounding_is_nearest_even_with_saturation() -> None:
    # (input, E4M3 value): ties between neighbours go to the even mantissa; subnormals (step 2^-9)
    # round the same way; nothing exceeds 448.
    cases = [
        (1.0625, 1.0),  # halfway 1.0 | 1.125 -> 1.0 (mantissa 000)
        (1.1875, 1.25),  # halfway 1.125 | 1.25 -> 1.25 (mantissa 010)
        (1.0626, 1.125),  # above the tie -> up
        (-1.0625, -1.0),
        (2.0**-10, 0.0),  # halfway 0 | 2^-9 (the smallest subnormal) -> 0
        (3 * 2.0**-10, 2.0**-8),  # halfway 2^-9 | 2^-8 -> 2^-8
        (2.0**-9, 2.0**-9),
        (416.0, 416.0),  # representable (1.625 * 2^8)
        (432.0, 448.0),  # halfway 416 | 448 -> 448 (mantissa 110)
        (447.9, 448.0),
        (-448.0, -448.0),
    ]
    row = _row_with_unit_scale([v for v, _ in cases])
    q, s = quantize_act_reference(row)
    assert s.item() == 1.0
    got = q.float()[0, 1 : 1 + len(cases)].tolist()
    assert got == [e for _, e in cases]
    # saturation: a weight block's values are divided by the block's scale, so only rounding can
    # reach past 448; the clamp makes anything beyond 448 (or an overflowing division) 448
    from isoaudit.kernels.fp8_quant import _to_e4m3

    sat = _to_e4m3(torch.tensor([460.0, 1e9, -1e9, float("inf")])).float().tolist()
    assert sat == [448.0, 448.0, -448.0, 448.0]


def test_scale_formula_and_zero_group() -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3 * GROUP + 40)
    x[2, GROUP : 2 * GROUP] = 0.0  # an all-zero group
    q, s = quantize_act_reference(x)
    assert q.dtype == FP8 and q.shape == x.shape and s.shape == (5, 4)
    for j in range(4):
        amax = x[:, j * GROUP : (j + 1) * GROUP].abs().amax(dim=1)
        assert torch.equal(s[:, j], torch.clamp(amax, min=AMAX_FLOOR) / E4M3_MAX)
    assert torch.equal(q[2, GROUP : 2 * GROUP].float(), torch.zeros(GROUP))
    # each group's largest magnitude maps to ±448 exactly or to its rounding neighbour
    assert q.float().abs().amax().item() == E4M3_MAX
    # dequantized error: half an E4M3 step (3 mantissa bits: 2^-4 relative) of each value
    deq = dequantize_act(q, s)
    assert (
        (deq - x).abs() <= x.abs() * 2.0**-4 + s.repeat_interleave(GROUP, 1)[:, : x.shape[1]] * 2.0**-9
    ).all()


def test_weight_blocks() -> None:
    torch.manual_seed(1)
    w = torch.randn(300, 200).bfloat16()
    q, s = quantize_weight_reference(w)
    assert q.shape == (300, 200) and s.shape == (3, 2)
    wf = w.float()
    for i in range(3):
        for j in range(2):
            blk = wf[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert s[i, j].item() == (blk.abs().max() / 448.0).item()
            assert torch.equal(
                q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128],
                (blk / s[i, j]).clamp(-448, 448).to(FP8),
            )
    deq = dequantize_weight(q, s)
    assert (deq - wf).abs().max() <= 2.0**-4 * wf.abs().max()


def test_per_token_scales_ignore_batch_mates() -> None:
    """A token's scales and bits are its own: the same alone, in any batch, at any position. A
    per-tensor dynamic scale moves when a batch-mate's amax does."""
    torch.manual_seed(2)
    x = torch.randn(9, 256)
    loud = torch.cat([x, 50 * torch.randn(1, 256)])
    q, s = quantize_act(x)
    q2, s2 = quantize_act(loud)
    assert torch.equal(q.view(torch.uint8), q2[:9].view(torch.uint8)) and torch.equal(s, s2[:9])
    q1, s1 = quantize_act(x[4:5])
    assert torch.equal(q1.view(torch.uint8), q[4:5].view(torch.uint8)) and torch.equal(s1, s[4:5])
    pq, ps = quantize_per_tensor(x)
    pq2, ps2 = quantize_per_tensor(loud)
    assert ps.item() != ps2.item()
    assert not torch.equal(pq.view(torch.uint8), pq2[:9].view(torch.uint8))


@needs_triton
def test_triton_kernel_structure_fp32() -> None:
    """The Triton quantizer under the interpreter (fp32 q: the interpreter's own fp8 cast is not the
    hardware's): the scales bit for bit, and the pre-cast values, cast by torch, are the
    reference's E4M3 bits. K = 300: a partial last group."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter structure test (CPU only)")
    torch.manual_seed(3)
    x = torch.randn(37, 300) * 7
    q, s = quantize_act_reference(x)
    qi, si = quantize_act(x, impl="triton")
    assert torch.equal(si, s)
    assert torch.equal(qi.to(FP8).view(torch.uint8), q.view(torch.uint8))
    assert qi.abs().max() <= E4M3_MAX
    w = torch.randn(300, 200) * 3
    wq, ws = quantize_weight_reference(w)
    wqi, wsi = quantize_weight(w, impl="triton")
    assert torch.equal(wsi, ws)
    assert torch.equal(wqi.to(FP8).view(torch.uint8), wq.view(torch.uint8))


def _adversarial(m: int, k: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random rows plus rows built to hit E4M3 ties, subnormals, saturation and all-zero groups."""
    g = torch.Generator(device="cpu").manual_seed(4)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 4, m)[:, None]
    grid = torch.arange(-2048, 2048, dtype=torch.float32) / 8.0  # many exact ties after scaling
    x[0, : min(k, 4096)] = grid[: min(k, 4096)]
    x[1, :] = 0.0
    x[2, ::7] = 1e-30
    x[3, :] = torch.randn(k, generator=g) * 2.0**-12
    return x.to(dtype).to(device)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [896, 4864, 4096, 300])
def test_gpu_kernel_bits_equal_cpu_reference(dtype: torch.dtype, k: int) -> None:
    """The CUDA kernel's E4M3 activations and scales equal the CPU reference's bit for bit (so the
    CPU path tests the arithmetic the GPU runs), and the weight quantizer on CUDA equals it on CPU."""
    x = _adversarial(257, k, dtype, "cuda")
    q, s = quantize_act(x)
    rq, rs = quantize_act_reference(x.cpu())
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    w = _adversarial(384, k, dtype, "cuda")
    wq, ws = quantize_weight(w)
    cq, cs = quantize_weight_reference(w.cpu())
    assert torch.equal(ws.cpu(), cs), int((ws.cpu() != cs).sum())
    assert torch.equal(wq.cpu().view(torch.uint8), cq.view(torch.uint8)), int(
        (wq.cpu().view(torch.uint8) != cq.view(torch.uint8)).sum()
    )


@gpu
def test_gpu_cast_exhaustive_over_e4m3_neighbourhoods() -> None:
    """Every E4M3 value, every midpoint between neighbours and a point either side of it, through
    the kernel (scale 1 by a 448 in each group) against torch's CPU cast."""
    codes = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    vals = codes[torch.isfinite(codes)].unique().sort().values
    mids = (vals[1:] + vals[:-1]) / 2
    pts = torch.cat(
        [vals, mids, mids.nextafter(torch.tensor(float("inf"))), mids.nextafter(torch.tensor(-1e9))]
    )
    pts = pts.clamp(-448, 448)
    n = pts.numel()
    per = GROUP - 1
    rows = -(-n // per)
    x = torch.zeros(rows, GROUP)
    x[:, 0] = 448.0
    flat = torch.zeros(rows * per)
    flat[:n] = pts
    x[:, 1:] = flat.view(rows, per)
    q, s = quantize_act(x.cuda())
    assert (s == 1.0).all()
    ref = x.to(FP8)
    assert torch.equal(q.cpu().view(torch.uint8), ref.view(torch.uint8))
