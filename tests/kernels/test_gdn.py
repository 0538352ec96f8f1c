"""CPR Gated DeltaNet: trainer (whole sequence) and decode (token by token) give the same bits for
prefill/decode split points {0, 1, 63, 64, 65, 130}, packed and unpacked, whatever the launch
parameters; the backward matches an fp64 recurrence within a stated tolerance."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from isoaudit.kernels import gdn as gdn_mod
from isoaudit.kernels.gdn import (
    GDNCache,
    GDNConfig,
    gdn_chunk,
    gdn_chunk_autograd,
    gdn_incremental,
    gdn_recurrent,
)

from .conftest import bits_equal, gpu, needs_triton

pytestmark = needs_triton
SPLITS = [0, 1, 63, 64, 65, 130]
# Backward tolerance against the fp64 recurrence: max |grad - ref| / max |ref| per input.
BWD_RTOL = 1e-4
# bf16 forward against the fp64 recurrence (flash-linear-attention's chunk kernels, which round the
# same operands to bf16, measured 3.8e-3 from the fp32 form on the bench's shapes).
BF16_REL_L2 = 1e-2
BF16_BWD_REL_L2 = 5e-2


def _inputs(t: int, h: int, dk: int, dv: int, dev: str, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(t, h, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(t, h, dk, generator=gen), dim=-1)
    v = torch.randn(t, h, dv, generator=gen)
    g = -torch.rand(t, h, generator=gen) * 0.3
    beta = torch.rand(t, h, generator=gen)
    return [x.to(dev) for x in (q.to(dtype), k.to(dtype), v.to(dtype), g, beta)]


def _decode(
    x: list[torch.Tensor], lens: list[int], split: int, dev: str, packed: bool, chunk: int
) -> torch.Tensor:
    """Prefill `split` tokens of every sequence, then decode the rest one token at a time (all
    sequences in one packed step if `packed`, else one sequence per call)."""
    h, dk, dv = x[0].shape[1], x[0].shape[2], x[2].shape[2]
    cache = GDNCache.empty(len(lens), h, dk, dv, x[0].dtype, torch.device(dev), chunk)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    out = [torch.zeros(n, h, dv, device=dev) for n in lens]
    pos = [0] * len(lens)
    while any(p < n for p, n in zip(pos, lens, strict=True)):
        live = [i for i in range(len(lens)) if pos[i] < lens[i]]
        groups = [live] if packed else [[i] for i in live]
        for grp in groups:
            take = {i: (min(split, lens[i]) if pos[i] == 0 and split > 0 else 1) for i in grp}
            rows = torch.cat(
                [torch.arange(starts[i] + pos[i], starts[i] + pos[i] + take[i]) for i in grp]
            ).to(dev)
            cu = torch.tensor(
                [0] + [sum(take[i] for i in grp[: j + 1]) for j in range(len(grp))], dtype=torch.int32
            )
            o = gdn_incremental(*(t[rows] for t in x), cu.to(dev), grp, cache, invariant=True, chunk=chunk)
            for j, i in enumerate(grp):
                out[i][pos[i] : pos[i] + take[i]] = o[int(cu[j]) : int(cu[j + 1])]
                pos[i] += take[i]
    return torch.cat(out)


def _check_splits(
    dev: str, dtype: torch.dtype, h: int, dk: int, dv: int, chunk: int, splits: list[int], lens: list[int]
) -> None:
    x = _inputs(sum(lens), h, dk, dv, dev, dtype)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device=dev)
    trainer, _ = gdn_chunk(*x, cu, chunk=chunk, impl="triton")
    # Unpacked trainer (each sequence alone) must equal the packed one.
    alone = torch.cat(
        [
            gdn_chunk(
                *(t[s : s + n] for t in x),
                torch.tensor([0, n], dtype=torch.int32, device=dev),
                chunk=chunk,
                impl="triton",
            )[0]
            for s, n in ((0, lens[0]), (lens[0], lens[1]))
        ]
    )
    assert bits_equal(alone, trainer)
    for split in splits:
        for packed in (True, False):
            assert bits_equal(_decode(x, lens, split, dev, packed, chunk), trainer), (split, packed)


def test_splits_cpu(dev: str) -> None:
    """The same structure at C=16 (the interpreter is slow): splits 0, 1, C-1, C, C+1, 2C+2."""
    _check_splits(
        dev, torch.float32, h=1, dk=16, dv=16, chunk=16, splits=[0, 1, 15, 16, 17, 34], lens=[40, 19]
    )


@pytest.mark.parametrize(
    ("chunk", "splits", "lens"),
    [(32, [0, 17, 33], [70, 37]), (64, [0, 40], [70, 20])],
)
def test_splits_across_slabs_cpu(dev: str, chunk: int, splits: list[int], lens: list[int]) -> None:
    """Chunks of two and four 16-row slabs: decode computes one slab per token, and after a
    prefill that left an open chunk it first computes the slabs before the token's, in order."""
    _check_splits(dev, torch.float32, h=2, dk=16, dv=16, chunk=chunk, splits=splits, lens=lens)


def test_matches_fp64_recurrence(dev: str) -> None:
    x = _inputs(150, 2, 32, 32, dev, torch.float32)
    cu = torch.tensor([0, 100, 150], dtype=torch.int32, device=dev)
    o, _ = gdn_chunk(*x, cu, impl="triton")
    o64, _ = gdn_recurrent(*x, cu, dtype=torch.float64)
    assert (o.double() - o64).abs().max().item() < 1e-5 * max(1.0, o64.abs().max().item())


def _assert_backward_near_fp64(dev: str, dk: int, dv: int, chunk: int, seed: int) -> None:
    """The kernels' gradients of every input within BWD_RTOL of the fp64 recurrence's: two
    sequences (70 and 30 tokens), so several chunks, open last chunks, and at C=64 a sequence
    shorter than one chunk."""
    t = 100
    x = _inputs(t, 2, dk, dv, dev, torch.float32, seed=seed)
    cu = torch.tensor([0, 70, t], dtype=torch.int32, device=dev)
    a = [y.clone().requires_grad_(True) for y in x]
    gout = torch.randn(t, 2, dv, device=dev, generator=torch.Generator(dev).manual_seed(seed + 3))
    got = torch.autograd.grad(gdn_chunk_autograd(*a, cu, chunk), a, gout)
    b = [y.double().clone().requires_grad_(True) for y in x]
    want = torch.autograd.grad(gdn_recurrent(*b, cu.cpu(), dtype=torch.float64)[0], b, gout.double())
    for ga, gb in zip(got, want, strict=True):
        err = (ga.double() - gb).abs().max() / gb.abs().max()
        assert err.item() < BWD_RTOL, err.item()


@pytest.mark.parametrize("chunk", [16, 64])
def test_backward_vs_fp64(dev: str, chunk: int) -> None:
    """The backward kernels (the interpreter on the CPU) at their default blocks."""
    _assert_backward_near_fp64(dev, 16, 16, chunk, seed=1)


@pytest.mark.parametrize(
    ("dk", "dv", "chunk", "blocks"),
    [
        (32, 48, 16, dict(query_key_bk=16, bv=16, state_bv=16, value_bv=16)),
        (64, 32, 32, dict(query_key_bk=32)),
    ],
)
def test_backward_blocks_vs_fp64(
    dev: str, dk: int, dv: int, chunk: int, blocks: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backward kernels' block loops: several dk blocks of the query/key kernel (their dG
    shares summed by the WY kernel), dv blocks that do not divide dv, and several dv programs of
    the state and value-local kernels."""
    import dataclasses

    from isoaudit.kernels import gdn_backward

    monkeypatch.setattr(
        gdn_backward, "BACKWARD_CONFIG", dataclasses.replace(gdn_backward.BACKWARD_CONFIG, **blocks)
    )
    _assert_backward_near_fp64(dev, dk, dv, chunk, seed=2)


def test_hand_backward_matches_autograd() -> None:
    """The hand-derived cross-chunk backward against autograd through the chunk loop: many chunks,
    partial last chunks, a sequence shorter than one chunk."""
    lens, chunk = [150, 33, 5], 16
    x = _inputs(sum(lens), 2, 16, 16, "cpu", torch.float32, seed=2)
    cu = torch.tensor([0, 150, 183, 188], dtype=torch.int32)
    gout = torch.randn(sum(lens), 2, 16)
    a = [y.clone().requires_grad_(True) for y in x]
    o, _ = gdn_mod.gdn_chunk_reference(*a, cu, None, chunk, solve="triangular")
    want = torch.autograd.grad(o, a, gout)
    got = gdn_mod._chunk_backward(
        [y.clone().requires_grad_(True) for y in x], gout, ([0, 150, 183], lens), chunk
    )
    for name, ga, gb in zip("q k v g beta".split(), got, want, strict=True):
        assert ((ga - gb).abs().max() / gb.abs().max()).item() < 1e-5, name


@gpu
def test_splits_gpu() -> None:
    _check_splits("cuda", torch.bfloat16, h=4, dk=128, dv=128, chunk=64, splits=SPLITS, lens=[140, 67])


@gpu
def test_launch_config_changes_no_bit_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Other warps, column blocks and dv blocks: the same trainer and decode bits."""
    lens = [140, 67]
    x = _inputs(sum(lens), 4, 128, 128, "cuda", torch.bfloat16)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device="cuda")
    base, _ = gdn_chunk(*x, cu, impl="triton")
    other = GDNConfig(prep_warps=8, prep_nb=128, state_warps=2, state_bv=16, out_warps=8, out_bv=128)
    monkeypatch.setattr(gdn_mod, "CONFIG", other)
    assert bits_equal(gdn_chunk(*x, cu, impl="triton")[0], base)
    assert bits_equal(_decode(x, lens, 65, "cuda", True, 64), base)


@gpu
def test_bf16_accuracy_gpu() -> None:
    """bf16 inputs on tensor cores: within bf16's reach of the fp64 recurrence (relative L2 over
    the output, at the engine's shapes: 4 heads of 128, sequences of several chunks)."""
    lens = [700, 324]
    x = _inputs(sum(lens), 4, 128, 128, "cuda", torch.bfloat16, seed=3)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device="cuda")
    o, _ = gdn_chunk(*x, cu, impl="triton")
    ref, _ = gdn_recurrent(*x, cu, dtype=torch.float64)
    rel = ((o.double() - ref).norm() / ref.norm()).item()
    assert rel < BF16_REL_L2, rel


@gpu
def test_bf16_backward_accuracy_gpu() -> None:
    """The backward kernels in bf16 against the fp64 recurrence's gradients (relative L2 per input)."""
    lens = [300, 212]
    x = _inputs(sum(lens), 4, 128, 128, "cuda", torch.bfloat16, seed=4)
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32, device="cuda")
    gout = torch.randn(sum(lens), 4, 128, device="cuda")
    a = [y.clone().requires_grad_(True) for y in x]
    got = torch.autograd.grad(gdn_chunk_autograd(*a, cu), a, gout)
    b = [y.double().clone().requires_grad_(True) for y in x]
    want = torch.autograd.grad(gdn_recurrent(*b, cu, dtype=torch.float64)[0], b, gout.double())
    rels = [((ga.double() - gb).norm() / gb.norm()).item() for ga, gb in zip(got, want, strict=True)]
    print("bf16 backward rel L2 (q, k, v, g, beta):", " ".join(f"{r:.2e}" for r in rels))
    assert max(rels) < BF16_BWD_REL_L2, rels
