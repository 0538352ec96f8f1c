"""The one-pass distribution sketch: the float32 rounding of the host's float64 ``exp(lp / 2) @ R``
(the rollout side's definition), for masked tokens, ragged shapes and strided rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from isoaudit.audit.distribution import SKETCH_SCALE, sketch_projection, sketch_sign_bits
from isoaudit.kernels.distribution import sketch_rows

from .conftest import gpu, needs_triton

pytestmark = needs_triton


def _rows(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=gen) * 3
    logits[:, ::7] = float("-inf")  # tokens a sampler masked
    return torch.log_softmax(logits, dim=-1)


def _host_sketch(rows: torch.Tensor) -> np.ndarray:
    lp = rows.detach().cpu().double().numpy()
    return (np.exp(lp * 0.5) @ sketch_projection(lp.shape[1]).astype(np.float64)).astype(np.float32)


def _check(dev: str, n: int, vocab: int, chunk: int | None = None) -> None:
    wide = _rows(n, vocab + 3).to(dev)
    rows = wide[:, :vocab]  # a row stride wider than the rows
    rows = torch.log_softmax(rows, dim=-1)[:, :vocab].contiguous()[:, :vocab]
    bits = torch.from_numpy(sketch_sign_bits(vocab)).to(dev)
    options = {} if chunk is None else {"chunk": chunk}
    got = sketch_rows(rows, bits, float(SKETCH_SCALE), **options).cpu().numpy()
    want = _host_sketch(rows)
    # float64 sums in another order: the same float32 but where one lies within a float64
    # rounding of a float32 boundary
    np.testing.assert_allclose(got, want, rtol=2**-23, atol=0)
    assert np.mean(got == want) > 0.99


@pytest.mark.parametrize("n,vocab", [(5, 200), (33, 64), (16, 1000)])  # ragged rows / slabs, exact ones
def test_sketch_is_the_hosts_float64_sketch(dev: str, n: int, vocab: int) -> None:
    _check(dev, n, vocab)


@pytest.mark.parametrize("n,vocab,chunk", [(5, 200, 64), (33, 1000, 128), (17, 1024, 256)])
def test_a_vocabulary_split_in_chunks_is_the_same_sketch(dev: str, n: int, vocab: int, chunk: int) -> None:
    """Chunks of the vocabulary (ragged last one included) summed at the end: the same sketch."""
    _check(dev, n, vocab, chunk)


def test_strided_rows_and_no_rows(dev: str) -> None:
    rows = _rows(6, 300).to(dev)
    bits = torch.from_numpy(sketch_sign_bits(150)).to(dev)
    got = sketch_rows(rows[:, ::2], bits, float(SKETCH_SCALE))  # column stride 2: copied first
    np.testing.assert_allclose(got.cpu().numpy(), _host_sketch(rows[:, ::2]), rtol=2**-23, atol=0)
    assert sketch_rows(rows[:0, :150], bits, float(SKETCH_SCALE)).shape == (0, 32)


def test_rejects_bad_arguments(dev: str) -> None:
    rows = _rows(4, 64).to(dev)
    bits = torch.from_numpy(sketch_sign_bits(64)).to(dev)
    with pytest.raises(ValueError, match="rows: expected float32"):
        sketch_rows(rows.double(), bits, 0.5)
    with pytest.raises(ValueError, match=r"sign_bits: expected int32 \[64\]"):
        sketch_rows(rows, bits[:10], 0.5)
    with pytest.raises(ValueError, match="chunk: expected a positive multiple of 64"):
        sketch_rows(rows, bits, 0.5, chunk=100)


@gpu
@pytest.mark.parametrize("n,vocab", [(37, 151936), (1024, 32000)])
def test_sketch_on_gpu_is_the_hosts(n: int, vocab: int) -> None:
    _check("cuda", n, vocab)
