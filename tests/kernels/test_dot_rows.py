"""What CPR GDN's slab decode rests on (:mod:`isoaudit.kernels.gdn_decode`): row i of a 64-row ``tl.dot``
(``wgmma`` on Hopper) has the same bits as row i of a 16-row one (``mma.sync``) over the same K
and N, for bf16 and tf32 operands, with and without an accumulator, whatever the warps."""

from __future__ import annotations

import itertools

import pytest
import torch
from isoaudit.kernels._triton import HAVE_TRITON, tl, triton

from .conftest import bits_equal, gpu

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")

if HAVE_TRITON:

    @triton.jit
    def _rows_dot(a_ptr, b_ptr, c_ptr, o_ptr, row0, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr,
                  PREC: tl.constexpr, ACC: tl.constexpr, TRANS_B: tl.constexpr):  # fmt: skip
        r = row0 + tl.arange(0, M)
        kk = tl.arange(0, K)
        n = tl.arange(0, N)
        a = tl.load(a_ptr + r[:, None] * K + kk[None, :])
        if TRANS_B:
            b = tl.trans(tl.load(b_ptr + n[:, None] * K + kk[None, :]))
        else:
            b = tl.load(b_ptr + kk[:, None] * N + n[None, :])
        if ACC:
            o = tl.dot(a, b, tl.load(c_ptr + r[:, None] * N + n[None, :]), input_precision=PREC)
        else:
            o = tl.dot(a, b, input_precision=PREC)
        tl.store(o_ptr + r[:, None] * N + n[None, :], o)


def _spread(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Values over 16 binades, so the products' alignment inside the tensor core matters."""
    x = torch.randn(shape, generator=gen, device="cuda")
    return (x * torch.exp2(torch.randint(-8, 9, shape, generator=gen, device="cuda").float())).to(dtype)


CASES = [
    *itertools.product((torch.bfloat16, torch.float32), (64, 128), (32, 64, 128), (False, True), (False, True), (4,), (4,)),
    *itertools.product((torch.bfloat16, torch.float32), (64,), (64,), (True,), (False,), (8,), (1, 2)),
]  # fmt: skip


@gpu
@pytest.mark.parametrize(("dtype", "k", "n", "acc", "trans_b", "warps64", "warps16"), CASES)
def test_slab_rows_equal_tile_rows_gpu(dtype, k, n, acc, trans_b, warps64, warps16) -> None:
    gen = torch.Generator(device="cuda").manual_seed(k * n)
    prec = "tf32" if dtype == torch.float32 else "ieee"
    a = _spread((64, k), dtype, gen)
    b = _spread((n, k) if trans_b else (k, n), dtype, gen)
    c = _spread((64, n), torch.float32, gen)
    tile, slabs = (torch.empty(64, n, device="cuda") for _ in range(2))
    flags = dict(K=k, N=n, PREC=prec, ACC=acc, TRANS_B=trans_b)
    _rows_dot[(1,)](a, b, c, tile, 0, M=64, **flags, num_warps=warps64)
    for s in range(4):
        _rows_dot[(1,)](a, b, c, slabs, 16 * s, M=16, **flags, num_warps=warps16)
    assert bits_equal(slabs, tile)
