"""MoE router, experts and combine: the tie rule, and bitwise invariance of the layer's output to
expert placement, the number of (simulated) expert-parallel ranks, buffer capacity and batch
composition; kernels off, the native layer is order-dependent (the test has teeth). CPU tests run
isoaudit.kernels.cpu (bitwise in fp32 and bf16 by construction); `gpu` tests repeat the claims in bf16."""

from __future__ import annotations

import pytest
import torch
from isoaudit.kernels import moe

from isoaudit import kernels

from .conftest import bits_equal, gpu, needs_triton

E, K4 = 8, 4


def _layer(h: int, i: int, e: int, dtype: torch.dtype, dev: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(e, h, generator=g) * h**-0.5
    gate_up = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    down = torch.randn(e, h, i, generator=g) * i**-0.5
    return [t.to(dev, dtype) for t in (gate, gate_up, down)]


def _x(t: int, h: int, dtype: torch.dtype, dev: str, seed: int = 1) -> torch.Tensor:
    return torch.randn(t, h, generator=torch.Generator().manual_seed(seed)).to(dev, dtype)


PLACEMENTS = [
    moe.ExpertParallel(1),
    moe.ExpertParallel(2),
    moe.ExpertParallel(4, capacity=3),
    moe.ExpertParallel(8, capacity=1),
    moe.ExpertParallel(3, placement=(2, 0, 1, 1, 0, 2, 2, 0), capacity=7),
    moe.ExpertParallel(2, placement=(1, 0, 1, 0, 1, 0, 1, 0), capacity=64),
]


def test_topk_tie_rule() -> None:
    z = torch.tensor(
        [
            [1.0, 3.0, 3.0, 2.0, 3.0],
            [0.0, -0.0, 0.0, -1.0, -0.0],  # -0 equals +0
            [float("nan"), 1.0, float("-inf"), 1.0, 0.5],  # NaN ranks as -inf, below every finite value
            [-2.0, -1.0, -1.0, -3.0, float("inf")],
        ]
    )
    assert moe.stable_topk(z, 3).tolist() == [[1, 2, 4], [0, 1, 2], [1, 3, 4], [4, 1, 2]]
    # infinities rank as the extreme finite values, NaN below -inf (TIE_RULE)
    edge = torch.tensor([[float("nan"), float("-inf"), 3.4028235e38, float("inf"), -3.4028235e38]])
    assert moe.stable_topk(edge, 5).tolist() == [[2, 3, 1, 4, 0]]
    # Many ties: the same order as sorting by (-value, index).
    v = torch.randint(-3, 4, (200, 16), generator=torch.Generator().manual_seed(3)).float()
    got = moe.stable_topk(v, 5).tolist()
    want = [sorted(range(16), key=lambda j, r=r: (-float(v[r, j]), j))[:5] for r in range(200)]
    assert got == want
    with pytest.raises(ValueError, match="top_k must be in"):
        moe.stable_topk(v, 17)


@pytest.mark.parametrize("norm", [True, False])
def test_router_weights(norm: bool) -> None:
    gate, _, _ = _layer(64, 32, E, torch.float32, "cpu")
    x = _x(50, 64, torch.float32, "cpu")
    with kernels.enable():
        r = moe.route(x, gate, K4, norm)
        part = moe.route(x[7:19], gate, K4, norm)
    with kernels.disable():
        native = moe.route(x, gate, K4, norm)
    assert torch.equal(r.experts, native.experts)  # no ties here: the same selection
    torch.testing.assert_close(r.weights, native.weights, rtol=1e-6, atol=1e-7)
    assert r.weights.dtype == torch.float32 and r.logits.dtype == torch.float32
    if norm:
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(50), rtol=1e-6, atol=0)
    assert bits_equal(part.weights, r.weights[7:19]) and bits_equal(part.logits, r.logits[7:19])


def _invariance(dtype: torch.dtype, dev: str, t: int, h: int, i: int) -> None:
    gate, gate_up, down = _layer(h, i, E, dtype, dev)
    x = _x(t, h, dtype, dev)
    other = _x(3 * t, h, dtype, dev, seed=2)
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(4)).to(dev)
    with kernels.enable():
        ref = moe.moe_layer(x, gate, gate_up, down, K4)
        for ep in PLACEMENTS:  # placement, EP degree, capacity / padding
            assert bits_equal(moe.moe_layer(x, gate, gate_up, down, K4, ep=ep), ref), ep
        # batch composition: a prefix, a permutation, the tokens inside a larger batch
        assert bits_equal(moe.moe_layer(x[:5], gate, gate_up, down, K4), ref[:5])
        assert bits_equal(moe.moe_layer(x[perm], gate, gate_up, down, K4), ref[perm])
        mixed = moe.moe_layer(torch.cat([other[:t], x, other[t:]]), gate, gate_up, down, K4, ep=PLACEMENTS[4])
        assert bits_equal(mixed[t : 2 * t], ref)
    with kernels.disable():
        native = moe.moe_layer(x, gate, gate_up, down, K4)
    assert (native.float() - ref.float()).abs().max() < (0.05 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_invariance_cpu(dtype: torch.dtype) -> None:
    _invariance(dtype, "cpu", 41, 64, 32)


def test_native_combine_depends_on_arrival_order() -> None:
    """Kernels off, the layer index_adds in arrival order (rank-major): moving experts between
    ranks moves bits. (With top-2 it would not: a + b == b + a.)"""
    gate, gate_up, down = _layer(64, 32, E, torch.bfloat16, "cpu")
    x = _x(256, 64, torch.bfloat16, "cpu")
    with kernels.disable():
        one = moe.moe_layer(x, gate, gate_up, down, K4)
        two = moe.moe_layer(x, gate, gate_up, down, K4, ep=PLACEMENTS[5])
    assert not bits_equal(one, two)


def test_gradients_match_native() -> None:
    gate, gate_up, down = (p.requires_grad_() for p in _layer(32, 16, E, torch.float32, "cpu"))
    x = _x(20, 32, torch.float32, "cpu").requires_grad_()
    grads = []
    for mode in (kernels.enable, kernels.disable):
        with mode():
            out = moe.moe_layer(x, gate, gate_up, down, K4, norm_topk_prob=False)
            grads.append(torch.autograd.grad(out.square().sum(), (x, gate, gate_up, down)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_trace_routing_records_tagged_tokens() -> None:
    gate, gate_up, down = _layer(32, 16, E, torch.float32, "cpu")
    x = _x(6, 32, torch.float32, "cpu")
    seq, pos = torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0, 1, 2, 0, 1, 2])
    outside = moe.RoutingTrace()
    with kernels.enable(), moe.trace_routing() as a:
        with moe.tokens(seq, pos):
            moe.moe_layer(x, gate, gate_up, down, K4, layer=3)
        with moe.trace_routing() as b, moe.tokens(seq[3:], pos[3:]):  # traces nest
            r = moe.route(x[3:], gate, K4)
            moe.moe_layer(x[3:], gate, gate_up, down, K4, layer=3)
    assert a.layers() == [3] and len(a.calls) == 2 and len(b.calls) == 1
    call = a.calls[0]
    assert call.experts.dtype == torch.uint8 and call.experts.shape == (6, K4)
    assert b.table(3) == {(1, p): tuple(r.experts[p].tolist()) for p in range(3)}
    assert moe.agreement(a, b) == {3: 1.0}
    keys, ex = a.arrays(3)  # sorted, one row per token (the nested call's repeat of seq 1 folded)
    assert keys.tolist() == [[s, p] for s in (0, 1) for p in range(3)] and ex.shape == (6, K4)
    assert torch.equal(ex, call.experts)
    assert outside.calls == []
    # a different routing of one of the three common tokens: 2/3 agree
    others = sorted(set(range(E)) - set(b.table(3)[(1, 1)]))
    b.calls[0].experts[1] = torch.tensor(others, dtype=torch.uint8)
    assert moe.agreement(a, b) == {3: pytest.approx(2 / 3)}
    with moe.trace_routing() as c:
        moe.moe_layer(x, gate, gate_up, down, K4, layer=0)  # untagged
    with pytest.raises(ValueError, match="without token tags"):
        c.table(0)
    with moe.trace_routing() as d:  # a block without a layer index: counted, never a failure
        moe.moe_layer(x, gate, gate_up, down, K4)
    assert d.calls == [] and d.unlabelled == 1


@gpu
@pytest.mark.parametrize("t", [1, 7, 300])
def test_layer_invariance_gpu(t: int) -> None:
    _invariance(torch.bfloat16, "cuda", t, 512, 256)


@needs_triton
def test_grouped_gemm_rows_independent_of_grouping(dev: str) -> None:
    """The grouped kernel (CUDA path of the experts; here the interpreter on the CPU): one launch
    over every group equals each group alone and a regrouped launch, and the reference product."""
    from isoaudit.kernels.moe_grouped import grouped_gemm

    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator().manual_seed(5)
    w = torch.randn(4, 96, 80, generator=g).to(dev, dtype)
    sizes, experts = [0, 70, 1, 3, 65], [2, 0, 3, 1, 0]
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    x = torch.randn(offsets[-1], 80, generator=g).to(dev, dtype)
    whole = grouped_gemm(x, w, experts, offsets)
    for e, lo, hi in zip(experts, offsets[:-1], offsets[1:], strict=True):
        assert bits_equal(grouped_gemm(x[lo:hi], w, [e], [0, hi - lo]), whole[lo:hi])
        torch.testing.assert_close(
            whole[lo:hi].float(), x[lo:hi].float() @ w[e].float().T, rtol=2e-2, atol=2e-2
        )
    split = [0, 30, 70, 71, 74, 120, 139]  # groups 1 and 4 each cut in two
    regrouped = grouped_gemm(x, w, [0, 0, 3, 1, 0, 0], split)
    assert bits_equal(regrouped, whole)


@needs_triton
def test_layer_invariance_triton_path(dev: str) -> None:
    """The CUDA path (grouped kernel, Triton GEMM/SiLU) as a structure test: on the CPU under the
    interpreter via dispatch.set_cpu_impl("triton"); on CUDA it is the default path."""
    from isoaudit.kernels import dispatch

    prev = dispatch.set_cpu_impl("triton")
    try:
        gate, gate_up, down = _layer(64, 32, E, torch.float32, dev)
        x = _x(21, 64, torch.float32, dev)
        with kernels.enable():
            assert moe._use_grouped(x)
            ref = moe.moe_layer(x, gate, gate_up, down, K4)
            for ep in PLACEMENTS:
                assert bits_equal(moe.moe_layer(x, gate, gate_up, down, K4, ep=ep), ref), ep
            assert bits_equal(moe.moe_layer(x[3:8], gate, gate_up, down, K4), ref[3:8])
    finally:
        dispatch.set_cpu_impl(prev)
