"""The fused fingerprint pass: digest, ladder and max-abs bitwise equal to the torch definition,
sketch and L2 to fp32 rounding; every row's fields independent of the row count."""

from __future__ import annotations

import pytest
import torch
from isoaudit.kernels.fingerprint import BLOCK_H, SKETCH_DIM, fingerprint_reference, fingerprint_rows

from .conftest import bits_equal, gpu, needs_triton

pytestmark = needs_triton

MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def _inputs(n: int, hidden: int, dtype: torch.dtype, dev: str, rungs: tuple[int, ...]):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(n, hidden, generator=g) * 3).to(dtype)
    x[0, : min(hidden, 5)] = torch.tensor([0.0, -0.0, 1e-30, -7.5, 65504.0][: min(hidden, 5)]).to(dtype)
    weights = torch.randint(-(2**62), 2**62, (hidden,), generator=g, dtype=torch.int64) * 2 + 1
    sketch = torch.where(torch.rand(hidden, SKETCH_DIM, generator=g) < 0.5, 0.25, -0.25).float()
    masks = torch.tensor([-(1 << (MANTISSA[dtype] - k)) for k in rungs], dtype=torch.int64)
    return [t.to(dev) for t in (x, weights, sketch, masks)]


def _check(x, weights, sketch, masks) -> None:
    got = fingerprint_rows(x, weights, sketch, masks, impl="triton")
    want = fingerprint_reference(x, weights, sketch, masks)
    assert bits_equal(got.digest, want.digest)
    assert bits_equal(got.ladder, want.ladder)
    assert bits_equal(got.maxabs, want.maxabs)
    # L2: each slab's squares added in column order from zero, then the slab sums in turn: at most
    # (BLOCK_H + slabs) roundings of 2^-24 relative each (the square root halves it).
    hidden = x.shape[-1]
    torch.testing.assert_close(got.l2, want.l2, rtol=(BLOCK_H + -(-hidden // BLOCK_H)) * 2.0**-24, atol=0)
    torch.testing.assert_close(got.sketch, want.sketch, rtol=1e-5, atol=1e-5 * float(want.l2.max()))
    # a row's fields do not depend on how many rows share the launch, or where
    for m in (1, 5, 33):
        part = fingerprint_rows(x[m : 2 * m], weights, sketch, masks, impl="triton")
        for a, b in zip(part, got, strict=True):
            assert bits_equal(a, b[m : 2 * m])


@pytest.mark.parametrize("hidden", [200, 128])  # a partial slab, and exact slabs
def test_fp32_matches_definition(dev: str, hidden: int) -> None:
    _check(*_inputs(70, hidden, torch.float32, dev, (16, 10, 7, 4, 0)))


def test_wide_rows_are_summed_in_column_chunks(dev: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows past the width threshold (a vocabulary's logits) go through the column-chunked launch
    and its combine: the same definition, and still independent of the row count. The threshold
    and chunk are lowered here so the interpreter walks few columns (3 chunks, the last partial)."""
    from isoaudit.kernels import fingerprint as kernel

    monkeypatch.setattr(kernel, "WIDE_ROW", 256)
    monkeypatch.setattr(kernel, "CHUNK_H", 2 * BLOCK_H)
    assert kernel.column_chunks(700) == 3 and kernel.column_chunks(256) == 0
    _check(*_inputs(40, 700, torch.float32, dev, (16, 10, 7, 4, 0)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [200, 700])
def test_rows_read_as_float32_equal_their_float32_copy(
    dev: str, dtype: torch.dtype, hidden: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``as_float32``: bf16/fp16 rows fingerprinted as their fp32 values, widened in registers,
    are the fields of their fp32 copy bit for bit (whole rows, and column-chunked at 700)."""
    from isoaudit.kernels import fingerprint as kernel

    monkeypatch.setattr(kernel, "WIDE_ROW", 256)
    monkeypatch.setattr(kernel, "CHUNK_H", 2 * BLOCK_H)
    x, weights, sketch, masks = _inputs(40, hidden, torch.float32, dev, (16, 10, 7, 4, 0))
    low = x.to(dtype)
    low[1, :3] = torch.tensor([float("inf"), -0.0, -1e-7]).to(dtype)  # inf, a signed zero, a subnormal
    got = fingerprint_rows(low, weights, sketch, masks, impl="triton", as_float32=True)
    want = fingerprint_rows(low.float(), weights, sketch, masks, impl="triton")
    for a, b in zip(got, want, strict=True):
        assert bits_equal(a, b)
    reference = fingerprint_rows(low, weights, sketch, masks, impl="torch", as_float32=True)
    assert bits_equal(reference.digest, want.digest) and bits_equal(reference.ladder, want.ladder)


def test_bf16_integer_fields(dev: str) -> None:
    """bf16 read as int16 and widened by shifts only (the interpreter's bf16 casts are not used)."""
    _check(*_inputs(40, 136, torch.bfloat16, dev, (6, 4, 2)))  # 3 rungs: padded to 4 inside


def test_rejects_bad_arguments(dev: str) -> None:
    x, w, s, m = _inputs(4, 32, torch.float32, dev, (4,))
    with pytest.raises(ValueError, match="weights"):
        fingerprint_rows(x, w[:-1], s, m)
    with pytest.raises(ValueError, match="sketch"):
        fingerprint_rows(x, w, s.double(), m)
    with pytest.raises(TypeError, match="x: dtype"):
        fingerprint_rows(x.double(), w, s, m)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hidden", [896, 4096, 5000])
def test_gpu_matches_definition(dtype: torch.dtype, hidden: int) -> None:
    rungs = {torch.bfloat16: (6, 4, 2, 0), torch.float16: (8, 6, 4, 2, 0), torch.float32: (16, 10, 7, 4, 0)}
    _check(*_inputs(1030, hidden, dtype, "cuda", rungs[dtype]))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_wide_rows_match_definition(dtype: torch.dtype) -> None:
    """A 151,936-entry vocabulary's rows: summed in column chunks on the GPU."""
    from isoaudit.kernels.fingerprint import column_chunks

    assert column_chunks(151936) > 1
    _check(*_inputs(200, 151936, dtype, "cuda", (6, 4, 2, 0)))


@gpu
def test_gpu_logits_read_as_float32_equal_their_float32_copy() -> None:
    """bf16 logits of a 151,936-entry vocabulary widened in registers: their fp32 copy's bits."""
    x, weights, sketch, masks = _inputs(300, 151936, torch.float32, "cuda", (16, 10, 7, 4, 0))
    low = x.bfloat16()
    got = fingerprint_rows(low, weights, sketch, masks, as_float32=True)
    want = fingerprint_rows(low.float(), weights, sketch, masks)
    for a, b in zip(got, want, strict=True):
        assert bits_equal(a, b)


@gpu
def test_gpu_matches_collector_torch_path() -> None:
    """Bit for bit against the collector's own torch fingerprints where they are importable."""
    import importlib

    for name in ("isoaudit.collectors.fingerprints", "isoaudit.audit.fingerprints"):
        try:
            mod = importlib.import_module(name)
            ref_fn = mod.fingerprint_rows
            break
        except (ImportError, AttributeError):
            continue
    else:
        pytest.skip("no torch fingerprint path to compare with")
    import numpy as np
    from isoaudit.audit.fingerprints import digest_weights, sketch_matrix

    x = torch.randn(2048, 896, device="cuda").bfloat16()
    ref = ref_fn(x)
    w = torch.from_numpy(digest_weights(896).view(np.int64)).cuda()
    s = torch.from_numpy(sketch_matrix(896)).cuda()
    masks = torch.tensor([-(1 << (7 - k)) for k in ref.ladder_bits], dtype=torch.int64, device="cuda")
    got = fingerprint_rows(x, w, s, masks)
    assert bits_equal(got.digest, ref.digest) and bits_equal(got.ladder, ref.ladder)
    assert bits_equal(got.maxabs, ref.maxabs)
    torch.testing.assert_close(got.l2, ref.l2, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.sketch, ref.sketch, rtol=1e-4, atol=1e-4 * float(ref.l2.max()))


def test_writes_into_wider_preallocated_buffers(dev: str) -> None:
    """``out=``: a slot of a captured graph's buffers, wider than the fields and strided."""
    x, weights, sketch, masks = _inputs(20, 200, torch.float32, dev, (16, 10, 7, 4, 0))
    ints = torch.full((2, 20, 11), 7, dtype=torch.int64, device=dev)
    floats = torch.full((2, 20, 21), 7.0, dtype=torch.float32, device=dev)
    got = fingerprint_rows(x, weights, sketch, masks, impl="triton", out=(ints[1], floats[1]))
    want = fingerprint_rows(x, weights, sketch, masks, impl="triton")
    for a, b in zip(got, want, strict=True):
        assert bits_equal(a, b)
    assert bits_equal(ints[1, :, 0], want.digest) and bits_equal(floats[1, :, 16], want.l2)
    assert (ints[0] == 7).all() and (floats[1, :, 18:] == 7).all()  # nothing outside the fields
    with pytest.raises(ValueError, match=r"out\[0\] \(ints\)"):
        fingerprint_rows(x, weights, sketch, masks, out=(ints[1, :, :5], floats[1]))
