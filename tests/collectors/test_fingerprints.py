"""Fingerprints: computed with torch (collectors.fingerprints), compared with numpy (audit.fingerprints):
order/chunk/batch invariance, one-ulp sensitivity, ladder brackets, sketch size."""

from __future__ import annotations

import isoaudit.collectors.fingerprints as fp
import numpy as np
import pytest
import torch
from isoaudit.audit.fingerprints import (
    digest_weights,
    estimate_relative_l2,
    first_agreeing_rung,
    relative_error_bound,
    rows_equal,
)
from isoaudit.audit.records import RegionFingerprints
from isoaudit.collectors.fingerprints import default_ladder_bits, fingerprint_rows

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
NP_INT_OF = {torch.bfloat16: np.int16, torch.float16: np.int16, torch.float32: np.int32}
MANTISSA = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def u64(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint64)


def reference_digest(row: torch.Tensor, bits_kept: int | None = None) -> int:
    """The digest with Python integers: Σ w_j · bits_j mod 2**64 (bits sign-extended)."""
    ints = row.contiguous().view(INT_OF[row.dtype]).numpy().astype(np.int64)
    if bits_kept is not None:
        ints = ints & -(1 << (MANTISSA[row.dtype] - bits_kept))
    weights = digest_weights(row.numel())
    return sum(int(w) * int(b) for w, b in zip(weights, ints, strict=True)) % (1 << 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_digest_and_ladder_equal_the_integer_reference(dtype: torch.dtype) -> None:
    x = (torch.randn(3, 37, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    f = fingerprint_rows(x)
    assert f.ladder_bits == default_ladder_bits(dtype)
    for i in range(3):
        assert int(u64(f.digest)[i]) == reference_digest(x[i])
        for j, k in enumerate(f.ladder_bits):
            assert int(u64(f.ladder)[i, j]) == reference_digest(x[i], k)


def test_digest_is_pinned() -> None:
    """Changing the seeds or the arithmetic would orphan every stored digest: pin one."""
    x = torch.arange(8, dtype=torch.float32).reshape(1, 8) / 8
    assert int(u64(fingerprint_rows(x).digest)[0]) == 0xEB4F855224000000
    assert all(int(w) & 1 for w in digest_weights(4096))
    assert int(digest_weights(2)[0]) == 0x7D4D2F18337CB107


@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_rows_equal_digests_whatever_batch_and_chunking(dtype: torch.dtype, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, 64, generator=gen).to(dtype)
    whole = fingerprint_rows(x)
    flat = x.reshape(20, 64)
    # the same rows in another batch, permuted, padded with other rows
    perm = torch.randperm(20, generator=gen)
    other = torch.cat([torch.randn(3, 64, generator=gen).to(dtype), flat[perm]])
    moved = fingerprint_rows(other).select(slice(3, None))
    assert np.array_equal(u64(moved.digest), u64(whole.digest)[perm.numpy()])
    assert np.array_equal(u64(moved.ladder), u64(whole.ladder)[perm.numpy()])
    # any chunk size, and a non-contiguous view of the same values
    for rows_per_chunk in (1, 3, 7):
        monkeypatch.setattr(fp, "_chunk_rows", lambda hidden, device, n=rows_per_chunk: n)
        chunked = fingerprint_rows(x)
        assert np.array_equal(u64(chunked.digest), u64(whole.digest))
        assert np.array_equal(u64(chunked.ladder), u64(whole.ladder))
    transposed = flat.t().contiguous().t()
    assert not transposed.is_contiguous()
    assert np.array_equal(u64(fingerprint_rows(transposed).digest), u64(whole.digest))
    assert rows_equal(whole.digest, fingerprint_rows(flat).digest).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_ulp_change_of_any_element_changes_the_digest(dtype: torch.dtype) -> None:
    row = torch.randn(1, 96, generator=torch.Generator().manual_seed(2)).to(dtype)
    row[0, 5] = 0.0
    base = int(u64(fingerprint_rows(row).digest)[0])
    bumped = []
    for j in range(row.shape[1]):
        for direction in (1, -1):
            changed = row.clone()
            ints = changed.view(INT_OF[dtype])
            ints[0, j] += direction  # one ulp (for +0.0 and -1: the bits of -nan; still one element)
            bumped.append(changed)
    digests = u64(fingerprint_rows(torch.cat(bumped)).digest)
    assert (digests != base).all()
    assert np.unique(digests).size == digests.size


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_activation_is_left_untouched(dtype: torch.dtype) -> None:
    x = torch.randn(5, 64).to(dtype)
    before = x.clone()
    fingerprint_rows(x)
    assert torch.equal(x.view(INT_OF[dtype]), before.view(INT_OF[dtype]))


def test_signed_zero_and_nan_payloads_are_bitwise() -> None:
    a = torch.tensor([[0.0, 1.0]], dtype=torch.bfloat16)
    b = torch.tensor([[-0.0, 1.0]], dtype=torch.bfloat16)
    assert not rows_equal(fingerprint_rows(a).digest, fingerprint_rows(b).digest)[0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_first_agreeing_rung_brackets_the_max_relative_error(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    n, h = 400, 32
    a = (torch.rand(n, h, generator=gen) + 0.5) * torch.where(
        torch.rand(n, h, generator=gen) < 0.5, -1.0, 1.0
    )
    a = a.to(dtype)
    # per-row relative perturbation sizes from 2**-(mantissa+1) to 2**-1, on a few elements per row
    scale = torch.exp2(-torch.randint(1, MANTISSA[dtype] + 2, (n, 1), generator=gen).float())
    hit = torch.rand(n, h, generator=gen) < 0.1
    b = (a.double() * (1 + scale * torch.rand(n, h, generator=gen) * hit)).to(dtype)
    fa, fb = fingerprint_rows(a), fingerprint_rows(b)
    rung = first_agreeing_rung(fa.ladder, fb.ladder)
    bits = np.asarray(fa.ladder_bits)
    rel = (
        ((a.double() - b.double()).abs() / torch.minimum(a.double().abs(), b.double().abs())).amax(-1).numpy()
    )
    ia = a.view(INT_OF[dtype]).numpy().astype(np.int64)
    ib = b.view(INT_OF[dtype]).numpy().astype(np.int64)
    seen = set()
    for i in range(n):
        r = rung[i]
        seen.add(int(r))
        if r >= 0:  # upper side: agreement on k bits bounds the error by 2**-k
            assert rel[i] < relative_error_bound(int(bits[r])), (i, r, rel[i])
        finer = r - 1 if r >= 0 else len(bits) - 1
        if finer >= 0:  # lower side: the next finer rung really differs in some element
            mask = -(1 << (MANTISSA[dtype] - int(bits[finer])))
            assert ((ia[i] & mask) != (ib[i] & mask)).any()
        if rows_equal(fa.digest, fb.digest)[i]:
            assert r == 0 and rel[i] == 0.0
    assert len(seen) >= 3  # the test exercised several rungs
    assert relative_error_bound(-1) == np.inf
    assert np.array_equal(relative_error_bound(np.array([6, 0])), [2.0**-6, 1.0])


def test_rung_agrees_on_a_last_bit_change() -> None:
    a = torch.tensor([[1.0, 1.5, -3.0, 100.0]], dtype=torch.bfloat16)  # all with low mantissa bit 0
    b = a.clone()
    b.view(torch.int16)[0, 1] += 1
    rung = first_agreeing_rung(fingerprint_rows(a).ladder, fingerprint_rows(b).ladder)
    assert rung.tolist() == [0]
    flipped = a.clone()
    flipped.view(torch.int16)[0, 2] ^= 1 << 7  # exponent's lowest bit: no rung can agree
    assert first_agreeing_rung(fingerprint_rows(a).ladder, fingerprint_rows(flipped).ladder).tolist() == [-1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sketch_estimates_relative_l2_within_2x(dtype: torch.dtype) -> None:
    """Within 2x for (nearly) every random difference: a 16-value sketch is a magnitude estimate."""
    gen = torch.Generator().manual_seed(4)
    n, h = 300, 1024
    a = torch.randn(n, h, generator=gen, dtype=torch.float64) * torch.exp(torch.randn(n, 1, generator=gen))
    size = torch.exp2(-torch.rand(n, 1, generator=gen, dtype=torch.float64) * 12)  # 2**-12 .. 1
    b = a + torch.randn(n, h, generator=gen, dtype=torch.float64) * a.abs().mean(-1, keepdim=True) * size
    a, b = a.to(dtype), b.to(dtype)
    truth = (a.double() - b.double()).norm(dim=-1) / torch.maximum(
        a.double().norm(dim=-1), b.double().norm(dim=-1)
    )
    fa, fb = fingerprint_rows(a), fingerprint_rows(b)
    est = estimate_relative_l2(fa.sketch.numpy(), fb.sketch.numpy(), fa.l2.numpy(), fb.l2.numpy())
    ratio = est / truth.numpy()
    assert (truth.numpy() > 0).all()
    # estimate/truth ~ sqrt(χ²₁₆/16): outside [1/2, 2] with probability 0.0011 per row
    within = (ratio > 0.5) & (ratio < 2.0)
    assert within.mean() >= 0.99, np.sort(ratio)[:5]
    assert (ratio < 2.0).all()  # P(χ²₁₆ > 64) ~ 1e-14
    assert 0.9 < np.median(ratio) < 1.1
    assert np.allclose(fa.l2.numpy(), a.double().norm(dim=-1).numpy(), rtol=1e-5)
    assert np.array_equal(fa.maxabs.numpy(), a.float().abs().amax(-1).numpy())
    same = estimate_relative_l2(fa.sketch.numpy(), fa.sketch.numpy(), fa.l2.numpy(), fa.l2.numpy())
    assert (same == 0.0).all()


def test_to_host_builds_a_record() -> None:
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    f = fingerprint_rows(x)
    host = f.to_host()
    arrays = host.fields()
    assert arrays["digest"].dtype == np.uint64 and arrays["ladder"].shape == (6, 4)
    assert arrays["sketch"].dtype == np.float32 and arrays["sketch"].shape == (6, 16)
    record = RegionFingerprints(
        run_id="r",
        step=0,
        side="trainer",
        case="trainer_fwd",
        sample_key="0" * 32,
        region="layers.0.mlp",
        positions=np.arange(6, dtype=np.int32),
        ladder_bits=list(host.ladder_bits),
        **arrays,
    )
    again = RegionFingerprints.model_validate_json(record.model_dump_json())
    assert np.array_equal(again.digest, arrays["digest"]) and np.array_equal(again.ladder, arrays["ladder"])


def test_empty_rows_and_bad_arguments() -> None:
    f = fingerprint_rows(torch.empty(0, 128, dtype=torch.bfloat16))
    assert len(f) == 0 and f.ladder.shape == (0, 4) and f.sketch.shape == (0, 16)
    with pytest.raises(TypeError, match="x: unsupported dtype"):
        fingerprint_rows(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="ladder_bits"):
        fingerprint_rows(torch.zeros(2, 4, dtype=torch.bfloat16), ladder_bits=(8, 2))
    with pytest.raises(ValueError, match="ladder_bits"):
        fingerprint_rows(torch.zeros(2, 4, dtype=torch.bfloat16), ladder_bits=(2, 4))
    with pytest.raises(ValueError, match="digest_b"):
        rows_equal(np.zeros(2, np.uint64), np.zeros(3, np.uint64))
    with pytest.raises(ValueError, match="ladder_b"):
        first_agreeing_rung(np.zeros((2, 4), np.uint64), np.zeros((2, 3), np.uint64))
    custom = fingerprint_rows(torch.randn(3, 8).to(torch.bfloat16), ladder_bits=(7, 3))
    assert custom.ladder_bits == (7, 3) and custom.ladder.shape == (3, 2)
    assert np.array_equal(u64(custom.ladder[:, 0]), u64(custom.digest))  # 7 bits kept = the digest


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(dtype: torch.dtype, monkeypatch) -> None:
    torch.backends.cuda.matmul.allow_tf32 = True  # the sketch must not depend on it
    x = torch.randn(3, 700, 4096).to(dtype)
    cpu, gpu = fingerprint_rows(x), fingerprint_rows(x.cuda())
    assert gpu.digest.is_cuda
    assert np.array_equal(u64(cpu.digest), u64(gpu.digest.cpu()))
    assert np.array_equal(u64(cpu.ladder), u64(gpu.ladder.cpu()))
    monkeypatch.setattr(fp, "_FUSED", False)  # the eager, chunked CUDA path too
    monkeypatch.setattr(fp, "_chunk_rows", lambda hidden, device: 100)
    eager = fingerprint_rows(x.cuda())
    assert np.array_equal(u64(cpu.digest), u64(eager.digest.cpu()))
    assert np.array_equal(u64(cpu.ladder), u64(eager.ladder.cpu()))
    torch.testing.assert_close(gpu.sketch.cpu(), cpu.sketch, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gpu.l2.cpu(), cpu.l2, rtol=1e-5, atol=0)
    assert torch.equal(gpu.maxabs.cpu(), cpu.maxabs)


def test_the_fused_kernel_gets_the_arguments_this_module_uses() -> None:
    """On CUDA :func:`fingerprint_rows` hands rows to ``isoaudit.kernels.fingerprint`` with its own digest
    weights, sketch and rung masks; the kernel's exact torch reference (which runs here) must then
    give the same integer fields bit for bit."""
    kernel = pytest.importorskip("isoaudit.kernels.fingerprint")
    x = torch.randn(37, 96).to(torch.bfloat16)
    want = fingerprint_rows(x)
    fmt = fp._format(x.dtype)
    masks = fp._device_masks(tuple(-(1 << (fmt.mantissa_bits - k)) for k in want.ladder_bits), x.device)
    got = kernel.fingerprint_rows(
        x,
        fp._device_weights(96, x.device),
        fp._device_sketch(96, x.device, torch.float32),
        masks,
        impl="torch",
    )
    assert np.array_equal(u64(got.digest), u64(want.digest)) and np.array_equal(
        u64(got.ladder), u64(want.ladder)
    )
    assert torch.equal(got.maxabs, want.maxabs)
    torch.testing.assert_close(got.l2, want.l2, rtol=1e-5, atol=0)
