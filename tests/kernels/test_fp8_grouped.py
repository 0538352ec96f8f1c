"""The FP8 grouped GEMM (every expert's rows in one launch) against the per-expert W8A8 path: each
group's rows bit for bit what the FP8 linear gives them alone, whatever the other groups hold.
CPU: the kernel's structure under the interpreter (fp32 operands holding E4M3 values, against the
per-group W8A8 kernel under the same interpreter), the torch reference path, the straight-through
backward, the expert-weight cache, and a Qwen3-MoE in the ``invariant-fp8`` mode with the grouped
path on and off. `gpu`: bits against ``fp8_linear`` per expert at decode and prefill sizes, and in
a captured CUDA graph."""

from __future__ import annotations

import os

import pytest
import torch
from isoaudit.kernels import dispatch, moe
from isoaudit.kernels import fp8 as F8
from isoaudit.kernels import fp8_grouped as G
from isoaudit.kernels.fp8_quant import quantize_act, quantize_act_reference, quantize_weight
from isoaudit.kernels.moe_grouped import device_groups

from isoaudit import kernels

from .conftest import bits_equal, gpu, needs_triton

INTERP = os.environ.get("TRITON_INTERPRET") == "1"


def _offsets(counts: list[int]) -> list[int]:
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return offsets


def _experts(e: int, n: int, k: int, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, n, k, generator=g) / k**0.5).bfloat16().to(device)


def _rows(s: int, k: int, device: str = "cpu", seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(s, k, generator=g) * torch.rand(s, 1, generator=g) * 4).bfloat16().to(device)


def _interp() -> None:
    if not INTERP:
        pytest.skip("interpreter structure test (CPU only)")


# ------------------------------------------------------------------ CPU: the kernel's structure

#: (N, K): a fixed split-K on a K that 128 divides, a split on a ragged K, no split on a ragged K.
INTERP_SHAPES = [(64, 2048), (200, 2100), (200, 300)]
#: Groups of 0, 1, 3, 17 and 130 rows, in an expert order that is not ascending, with and without
#: empty experts.
GROUPINGS = {
    "with-empty": ([4, 0, 2, 5, 1, 3], [3, 0, 17, 1, 130, 0]),
    "no-empty": ([1, 5, 0, 3], [17, 3, 130, 1]),
}


@needs_triton
@pytest.mark.parametrize(
    "n,k,grouping",
    [(n, k, g) for n, k in INTERP_SHAPES for g in GROUPINGS if (n, k, g) != (200, 2100, "no-empty")],
)
def test_kernel_structure_fp32(n: int, k: int, grouping: str) -> None:
    """Under the interpreter: each group's rows from the one grouped launch equal ``w8a8_gemm`` on
    that group's rows alone with the expert's weight (the same interpreter, the same tile, the
    weight's split), bit for bit; a lagged-promotion tile too."""
    _interp()
    experts, counts = GROUPINGS[grouping]
    offsets = _offsets(counts)
    w = G.fp8_experts(_experts(6, n, k))
    wq, ws = w.q.float(), w.scale
    xq, xs = quantize_act_reference(_rows(offsets[-1], k))
    xq = xq.float()
    split = F8.weight_split(n, k)
    assert (split > 0) == (k >= 2048)
    for tile in (F8.Fp8Tile(32, 32, 4, 2), F8.Fp8Tile(32, 64, 4, 2, lag=True)):
        y = G.fp8_grouped_gemm(xq, xs, wq, ws, experts, offsets, torch.float32, impl="triton", tile=tile)
        for e, lo, hi in zip(experts, offsets[:-1], offsets[1:], strict=True):
            if hi == lo:
                continue
            want = F8.w8a8_gemm(
                xq[lo:hi],
                xs[lo:hi],
                wq[e],
                ws[e],
                None,
                torch.float32,
                impl="triton",
                config=tile.with_split(split),
            )
            assert bits_equal(y[lo:hi], want), (tile, e, hi - lo)
        # against the exact-block reference: the interpreter's fp32 block sums differ by roundings
        ref = G.fp8_grouped_gemm(xq, xs, wq, ws, experts, offsets, torch.float32, impl="torch")
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


@needs_triton
def test_device_table_and_scatter_fp32() -> None:
    """The device-table launch (experts 0..E-1 in order, counts on the device, an upper-bound grid)
    gives the host-table launch's bits, and with ``perm`` stores sorted row r at row perm[r]."""
    _interp()
    n, k = 64, 2100
    counts = [3, 0, 17, 1, 130, 0]
    offsets = _offsets(counts)
    w = G.fp8_experts(_experts(6, n, k, seed=3))
    wq, ws = w.q.float(), w.scale
    xq, xs = quantize_act_reference(_rows(offsets[-1], k, seed=4))
    xq = xq.float()
    tile = F8.Fp8Tile(32, 64, 4, 2)
    host = G.fp8_grouped_gemm(
        xq, xs, wq, ws, list(range(6)), offsets, torch.float32, impl="triton", tile=tile
    )
    groups = device_groups(torch.tensor(counts), tile.block_m)
    dev = G.fp8_grouped_counts(xq, xs, wq, ws, groups, tile, torch.float32)
    assert bits_equal(dev, host)
    perm = torch.randperm(offsets[-1], generator=torch.Generator().manual_seed(5)).to(torch.int32)
    scattered = G.fp8_grouped_counts(xq, xs, wq, ws, groups, tile, torch.float32, perm=perm)
    assert bits_equal(scattered[perm.long()], host)


@needs_triton
def test_gather_quant_fp32() -> None:
    """Sorted rows quantized from their tokens in one launch: ``quantize_act`` of the gathered
    rows, bit for bit (the interpreter's fp32 values before the E4M3 cast, and the scales)."""
    _interp()
    x = _rows(11, 2100, seed=6).float()
    top_k = 3
    perm = torch.randperm(33, generator=torch.Generator().manual_seed(7)).to(torch.int32)
    q, s = G.gather_quant(x, perm, top_k)
    wq, ws = quantize_act(x[perm.long() // top_k], impl="triton")
    assert bits_equal(q, wq) and bits_equal(s, ws)


@needs_triton
def test_fast_path_structure_fp32() -> None:
    """The host-sync-free expert path (sort, gather-quantize, gate-up grouped GEMM, SiLU * up,
    quantize, down grouped GEMM scattering back) under the interpreter, against each (token, slot)
    row through its expert alone: the quantizer, the W8A8 kernel, SiLU then the product, the
    quantizer, the W8A8 kernel (the same interpreter, tiles and splits)."""
    _interp()
    from isoaudit.kernels.elementwise import silu

    t, top_k, e, h, i = 13, 3, 6, 256, 160
    g = torch.Generator().manual_seed(8)
    flat = torch.randint(0, e, (t * top_k,), generator=g)
    flat[flat == 2] = 4  # an expert no row is routed to
    x = _rows(t, h, seed=9).float()
    gu, dn = G.fp8_experts(_experts(e, 2 * i, h, seed=10)), G.fp8_experts(_experts(e, h, i, seed=11))
    gate_up, down = (gu.q.float(), gu.scale), (dn.q.float(), dn.scale)
    got = G.expert_outputs_fp8(x, flat, top_k, gate_up, down)
    s = t * top_k
    groups = min(e, s)
    t1 = G.grouped_tile(s, groups, 2 * i, h, x.device)
    t2 = G.grouped_tile(s, groups, h, i, x.device)
    for ex in range(e):
        rows = (flat == ex).nonzero()[:, 0]
        if not rows.numel():
            continue
        xq, xs = quantize_act(x[rows // top_k], impl="triton")
        y = F8.w8a8_gemm(xq, xs, gate_up[0][ex], gate_up[1][ex], None, torch.float32, impl="triton",
                         config=t1.with_split(F8.weight_split(2 * i, h)))  # fmt: skip
        hq, hs = quantize_act(silu(y[:, :i], impl="triton") * y[:, i:], impl="triton")
        want = F8.w8a8_gemm(hq, hs, down[0][ex], down[1][ex], None, torch.float32, impl="triton",
                            config=t2.with_split(F8.weight_split(h, i)))  # fmt: skip
        assert bits_equal(got[rows], want), ex


# ------------------------------------------------------------------ CPU: the torch path


def _per_expert(x, w, experts, offsets) -> torch.Tensor:
    outs = [
        F8.fp8_linear(x[lo:hi], w[e]) for e, lo, hi in zip(experts, offsets[:-1], offsets[1:], strict=True)
    ]
    return torch.cat(outs)


@pytest.mark.parametrize("n,k", [(200, 300), (256, 2100)])
def test_cpu_reference_equals_per_expert(n: int, k: int) -> None:
    """On the CPU (the torch reference) each group's rows are ``fp8_linear``'s on those rows alone
    (N = 256: the experts' weights quantized in one call; N = 200: expert by expert)."""
    experts, counts = GROUPINGS["with-empty"]
    offsets = _offsets(counts)
    w = _experts(6, n, k, seed=12)
    x = _rows(offsets[-1], k, seed=13)
    y = G.fp8_grouped_linear(x, w, experts, offsets)
    assert y.dtype == x.dtype
    assert bits_equal(y, _per_expert(x, w, experts, offsets))
    one = G.fp8_grouped_linear(x[3:20], w, [2], [0, 17])  # one group alone: its bits in the layer's call
    assert bits_equal(one, y[3:20])


def test_straight_through_backward() -> None:
    """Backward in the master dtype, per group, as ``fp8_linear``'s: the same gradients."""
    experts, counts = [2, 0, 3], [5, 9, 4]
    offsets = _offsets(counts)
    w = _experts(4, 128, 256, seed=14)
    x = _rows(offsets[-1], 256, seed=15)
    grads = []
    for fn in (G.fp8_grouped_linear, _per_expert):
        xp = x.clone().requires_grad_(True)
        wp = torch.nn.Parameter(w.clone())
        y = fn(xp, wp, experts, offsets)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(16)).bfloat16())
        grads.append((y.detach(), xp.grad, wp.grad))
    (y0, gx0, gw0), (y1, gx1, gw1) = grads
    assert bits_equal(y0, y1)
    torch.testing.assert_close(gx0, gx1, rtol=0, atol=0)
    torch.testing.assert_close(gw0, gw1, rtol=0, atol=0)


@pytest.mark.parametrize("n", [128, 200])
def test_expert_cache_follows_the_master(n: int) -> None:
    """The stacked E4M3 copy: each expert's blocks are ``quantize_weight(master[e])``'s, found by the
    master's identity, re-made in place when the master changes (an optimizer step)."""
    p = torch.nn.Parameter(_experts(3, n, 300, seed=17))
    entry = G.fp8_experts(p)
    assert G.fp8_experts(p) is entry
    for e in range(3):
        q, s = quantize_weight(p.detach()[e])
        assert torch.equal(entry.q[e].view(torch.uint8), q.view(torch.uint8)) and torch.equal(
            entry.scale[e], s
        )
    ptr = entry.q.data_ptr()
    with torch.no_grad():
        p[1].mul_(2.0)  # exact in bf16: the codes stay, expert 1's scales double
    assert G.fp8_experts(p) is entry and entry.q.data_ptr() == ptr
    q, s = quantize_weight(p.detach()[1])
    assert torch.equal(entry.scale[1], s) and torch.equal(entry.q[1].view(torch.uint8), q.view(torch.uint8))
    with torch.no_grad():
        p[2].add_(1.0)
    assert G.refresh_fp8_experts() >= 1
    assert torch.equal(entry.scale[2], quantize_weight(p.detach()[2])[1])


def _layer(h: int, i: int, e: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate = torch.randn(e, h, generator=g) * h**-0.5
    gate_up = torch.randn(e, 2 * i, h, generator=g) * h**-0.5
    down = torch.randn(e, h, i, generator=g) * i**-0.5
    return gate, gate_up, down


def test_layer_grouped_on_off_and_batch_invariant_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE layer in the ``invariant-fp8`` mode on the CPU: the grouped path (which runs: one
    grouped call per projection) gives the per-expert path's bits, and a row's output does not
    change when other rows join the batch."""
    gate, gate_up, down = _layer(256, 128, 8)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(18))
    calls = []
    real = G.fp8_grouped_linear
    monkeypatch.setattr(G, "fp8_grouped_linear", lambda *a: calls.append(1) or real(*a))
    with kernels.enable(fp8=True), torch.no_grad():
        assert moe._use_fp8_grouped(x)
        on = moe.moe_layer(x, gate, gate_up, down, 4)
        assert len(calls) == 2
        for m in (1, 7, 39):
            assert bits_equal(moe.moe_layer(x[:m], gate, gate_up, down, 4), on[:m]), m
        perm = torch.randperm(40, generator=torch.Generator().manual_seed(19))
        assert bits_equal(moe.moe_layer(x[perm], gate, gate_up, down, 4), on[perm])
        monkeypatch.setenv("ISOAUDIT_MOE_GROUPED", "0")
        assert not moe._use_fp8_grouped(x)
        before = len(calls)
        off = moe.moe_layer(x, gate, gate_up, down, 4)
    assert len(calls) == before and bits_equal(on, off)


def _logprobs(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every next-token logprob of ``ids`` (B, L) through the trainer's path (differentiable), and
    the gradient of their sum on the first MoE layer's gate-up experts."""
    model.model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        hidden = model.full_hidden(ids, torch.ones_like(ids))
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        lp = dispatch.token_logprobs(h, model.lm_head_weight, ids[:, 1:].reshape(-1))
        lp.sum().backward()
    experts = next(m for m in model.model.modules() if hasattr(m, "gate_up_proj"))
    return lp.detach().view(ids.shape[0], -1), experts.gate_up_proj.grad.clone()


def test_qwen3_moe_grouped_on_off_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small Qwen3-MoE in the ``invariant-fp8`` mode (fp32 masters, CPU): the same logprobs with
    the FP8 grouped path on and off (``ISOAUDIT_MOE_GROUPED``), the same expert gradients, and a
    sequence's logprobs the same alone and batched with others."""
    from .test_moe_e2e import hf_moe

    model = hf_moe("qwen3_moe", 2, 128, 8, 2, 256, torch.float32, "cpu")
    ids = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(20))
    with kernels.enable(fp8=True):
        on, g_on = _logprobs(model, ids)
        alone, _ = _logprobs(model, ids[1:2])
        monkeypatch.setenv("ISOAUDIT_MOE_GROUPED", "0")
        off, g_off = _logprobs(model, ids)
    assert bits_equal(on, off)
    assert bits_equal(alone, on[1:2])
    torch.testing.assert_close(g_on, g_off, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------- CUDA

#: A 64-expert top-8 MoE's projections (hidden 2048, expert intermediate 768): gate-up, down.
QWEN_SHAPES = [(1536, 2048), (2048, 768)]


def _routing_counts(total: int, n_exp: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    flat = torch.randint(0, n_exp, (total,), generator=g)
    return torch.bincount(flat, minlength=n_exp).tolist()


@gpu
@pytest.mark.parametrize("n,k", QWEN_SHAPES)
@pytest.mark.parametrize("n_exp", [8, 64])
@pytest.mark.parametrize("total", [1, 2, 5, 8, 16, 2048])
def test_grouped_matches_fp8_linear_gpu(n: int, k: int, n_exp: int, total: int) -> None:
    """Decode (1-16 rows over 8 or 64 experts, mostly one row an expert) and prefill (2048 rows):
    each expert's rows from the host-table and the device-table launches equal ``fp8_linear`` on
    those rows alone, bit for bit; and the whole call's bits stay when only one expert's rows are
    sent."""
    counts = _routing_counts(total, n_exp, seed=total + n_exp)
    offsets = _offsets(counts)
    w = _experts(n_exp, n, k, "cuda", seed=21)
    x = _rows(total, k, "cuda", seed=22)
    experts = list(range(n_exp))
    y = G.fp8_grouped_linear(x, w, experts, offsets)
    want = _per_expert(x, w, experts, offsets)
    assert bits_equal(y, want)
    entry = G.fp8_experts(w)
    xq, xs = quantize_act(x)
    tile = G.grouped_tile(total, min(n_exp, total), n, k, x.device)
    groups = device_groups(torch.tensor(counts, device="cuda"), tile.block_m)
    assert bits_equal(G.fp8_grouped_counts(xq, xs, entry.q, entry.scale, groups, tile, x.dtype), want)
    e = max(range(n_exp), key=lambda i: counts[i])
    lo, hi = offsets[e], offsets[e + 1]
    assert bits_equal(G.fp8_grouped_linear(x[lo:hi], w, [e], [0, hi - lo]), y[lo:hi])


@gpu
@pytest.mark.parametrize("t", [1, 2, 16, 256])
def test_fast_path_matches_per_expert_gpu(t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MoE layer's experts in the ``invariant-fp8`` mode, 64 experts top-8, hidden 2048, expert
    intermediate 768: the host-sync-free path and the host-table grouped path give the per-expert
    path's bits (``ISOAUDIT_MOE_GROUPED=0``), and a token's outputs do not depend on its batch."""
    gate, gate_up, down = (p.cuda().bfloat16() for p in _layer(2048, 768, 64, seed=23))
    x = torch.randn(t, 2048, generator=torch.Generator().manual_seed(24)).cuda().bfloat16()
    with kernels.enable(fp8=True), torch.no_grad():
        experts = moe.route(x, gate, 8).experts
        assert moe._fast(x, gate_up, down)
        fast = moe.expert_outputs(x, experts, gate_up, down)
        monkeypatch.setenv("ISOAUDIT_MOE_FAST", "0")
        host = moe.expert_outputs(x, experts, gate_up, down)
        monkeypatch.setenv("ISOAUDIT_MOE_GROUPED", "0")
        per = moe.expert_outputs(x, experts, gate_up, down)
        monkeypatch.delenv("ISOAUDIT_MOE_GROUPED")
        monkeypatch.delenv("ISOAUDIT_MOE_FAST")
        first = moe.expert_outputs(x[:1], experts[:1], gate_up, down)
    assert bits_equal(fast, per) and bits_equal(host, per)
    assert bits_equal(first, fast[:1])


@gpu
@pytest.mark.parametrize("t", [1, 16, 2048])
def test_cuda_graph_same_bits_gpu(t: int) -> None:
    """The host-sync-free FP8 experts captured in a CUDA graph: the replay equals the eager call,
    and after an in-place update of the masters (re-quantized into the same buffers before the
    replay) equals the eager call on the new weights."""
    _, gate_up, down = (p.cuda().bfloat16() for p in _layer(2048, 768, 64, seed=25))
    x = torch.randn(t, 2048, generator=torch.Generator().manual_seed(26)).cuda().bfloat16()
    flat = torch.randint(0, 64, (t * 8,), generator=torch.Generator().manual_seed(27)).cuda()
    with torch.no_grad():
        eager = G.expert_outputs_fast(x, flat, 8, gate_up, down)
        static_x, static_flat = x.clone(), flat.clone()
        G.expert_outputs_fast(static_x, static_flat, 8, gate_up, down)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = G.expert_outputs_fast(static_x, static_flat, 8, gate_up, down)
        graph.replay()
        torch.cuda.synchronize()
        assert bits_equal(out, eager)
        gate_up.mul_(0.5)  # exact: the E4M3 codes stay, the scales halve
        assert G.refresh_fp8_experts() >= 1
        graph.replay()
        torch.cuda.synchronize()
        assert bits_equal(out, G.expert_outputs_fast(x, flat, 8, gate_up, down))
        assert not bits_equal(out, eager)
