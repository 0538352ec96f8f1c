"""The multi-region fingerprint launch: every region's rows, read through the table's addresses and
strides, get the per-region kernel's bits in their slot (the two kernels share one row tile)."""

from __future__ import annotations

import pytest
import torch
from isoaudit.kernels.fingerprint import TABLE_WIDTH, fingerprint_regions, fingerprint_rows, rows_aligned

from .conftest import bits_equal, gpu, needs_triton
from .test_fingerprint import _inputs

pytestmark = needs_triton


def _regions(dev: str, dtype: torch.dtype, n: int, hidden: int):
    """Five regions of one width: contiguous rows, a row-strided view of a wider tensor, one that
    ends where another starts (neighbours in one allocation), and slots out of order."""
    # three rungs: the kernel pads them to four (the padding rung is written past the fields)
    x, weights, sketch, masks = _inputs(3 * n, 2 * hidden, dtype, dev, (6, 4, 2))
    big = x.reshape(3 * n, 2 * hidden)
    wide = torch.randn(n, hidden + 40, generator=torch.Generator().manual_seed(7)).to(dtype).to(dev)
    xs = [
        big[:n, :hidden].contiguous(),
        big[n : 2 * n, hidden:],  # row stride 2 * hidden
        wide[:, 8 : 8 + hidden],  # row stride hidden + 40, offset start
        big[2 * n :, :hidden].contiguous(),
        big[:n, hidden:].contiguous(),
    ]
    slots = [3, 0, 5, 1, 4]
    return xs, slots, weights[:hidden], sketch[:hidden], masks


def _check(dev: str, dtype: torch.dtype, n: int, hidden: int) -> None:
    xs, slots, weights, sketch, masks = _regions(dev, dtype, n, hidden)
    r = masks.shape[0]
    width = 1 + (1 << (r - 1).bit_length())
    ints = torch.full((6, n, width + 1), 7, dtype=torch.int64, device=dev)  # wider than the fields
    floats = torch.full((6, n, 19), 7.0, dtype=torch.float32, device=dev)
    table = torch.tensor(
        [[x.data_ptr(), x.stride(0), s] for x, s in zip(xs, slots, strict=True)],
        dtype=torch.int64,
        device=dev,
    )
    assert table.shape[1] == TABLE_WIDTH
    fingerprint_regions(table, len(xs), n, hidden, dtype, weights, sketch, masks, ints, floats)
    for x, slot in zip(xs, slots, strict=True):
        want = fingerprint_rows(x, weights, sketch, masks, impl="triton")
        assert bits_equal(ints[slot, :, 0], want.digest), slot
        assert bits_equal(ints[slot, :, 1 : 1 + r], want.ladder), slot
        assert bits_equal(floats[slot, :, :16], want.sketch), slot
        assert bits_equal(floats[slot, :, 16], want.l2), slot
        assert bits_equal(floats[slot, :, 17], want.maxabs), slot
    for untouched in (2,):  # a slot no region names keeps what it held
        assert bool((ints[untouched] == 7).all()) and bool((floats[untouched] == 7.0).all())
    assert bool((ints[..., -1] == 7).all()) and bool((floats[..., -1] == 7.0).all())  # past the buffers' rows
    # told the rows are 16-byte aligned (they are: the offset view starts 8 elements in), the
    # kernel loads them 16 bytes at a time and gives the same bits
    assert rows_aligned([x.data_ptr() for x in xs], [x.stride(0) for x in xs], dtype)
    again_ints, again_floats = torch.full_like(ints, 7), torch.full_like(floats, 7.0)
    fingerprint_regions(
        table, len(xs), n, hidden, dtype, weights, sketch, masks, again_ints, again_floats, True
    )
    assert bits_equal(again_ints, ints) and bits_equal(again_floats, floats)


def test_rows_aligned() -> None:
    assert rows_aligned([4096, 4096 + 32], [896, 4864], torch.bfloat16)
    assert not rows_aligned([4096, 4096 + 6], [896, 896], torch.bfloat16)  # an address 6 bytes in
    assert not rows_aligned([4096], [900 + 1], torch.bfloat16)  # a row stride of 1802 bytes
    assert rows_aligned([4096], [4], torch.float32) and not rows_aligned([4096], [2], torch.float32)


@pytest.mark.parametrize("n,hidden", [(5, 200), (17, 128)])  # partial row block / slab, and exact ones
def test_regions_equal_the_per_region_kernel(dev: str, n: int, hidden: int) -> None:
    """fp32 (the interpreter's exact dtype on the CPU): every slot bit for bit the single-region
    kernel's fields of that region."""
    _check(dev, torch.float32, n, hidden)


def test_wide_regions_equal_the_per_region_kernel(dev: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regions past the width threshold: each region's column chunks combined into its slot, the
    per-region kernel's bits (threshold and chunk lowered so the interpreter walks few columns)."""
    from isoaudit.kernels import fingerprint as kernel

    monkeypatch.setattr(kernel, "WIDE_ROW", 128)
    monkeypatch.setattr(kernel, "CHUNK_H", 128)
    _check(dev, torch.float32, 5, 300)


def test_rejects_bad_arguments(dev: str) -> None:
    xs, slots, weights, sketch, masks = _regions(dev, torch.float32, 4, 64)
    ints = torch.zeros(6, 4, 5, dtype=torch.int64, device=dev)
    floats = torch.zeros(6, 4, 18, dtype=torch.float32, device=dev)
    table = torch.zeros(2, TABLE_WIDTH, dtype=torch.int64, device=dev)
    with pytest.raises(ValueError, match="table"):
        fingerprint_regions(table, 3, 4, 64, torch.float32, weights, sketch, masks, ints, floats)
    with pytest.raises(ValueError, match="ints"):
        fingerprint_regions(table, 2, 4, 64, torch.float32, weights, sketch, masks, ints[:, :, :3], floats)
    with pytest.raises(ValueError, match="floats"):
        fingerprint_regions(table, 2, 3, 64, torch.float32, weights, sketch, masks, ints[:, :3], floats)
    with pytest.raises(TypeError, match="dtype"):
        fingerprint_regions(table, 2, 4, 64, torch.float64, weights, sketch, masks, ints, floats)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n,hidden", [(8, 896), (37, 200), (1024, 896), (40, 151936)])
def test_regions_equal_the_per_region_kernel_gpu(dtype: torch.dtype, n: int, hidden: int) -> None:
    _check("cuda", dtype, n, hidden)
