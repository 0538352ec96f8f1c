"""Attention: prefill, chunked prefill and decode of the same tokens give the same bits."""

from __future__ import annotations

import importlib

import pytest
import torch
from isoaudit.kernels.attention import (
    CONFIG,
    AttnConfig,
    _math_attention,
    attention,
    attention_modes,
    attention_reference,
)

from .conftest import bits_equal, gpu, needs_triton

pytestmark = needs_triton
attention_mod = importlib.import_module(
    "isoaudit.kernels.attention"
)  # the package exports a function of that name

# Small tiles and splits so the CPU interpreter crosses several splits, and both launch paths run:
# chunks of <= 8 tokens per sequence take split-KV + combine, longer ones the prefill path.
CPU_CONFIG = AttnConfig(
    block_m=32, block_n=16, warps=4, stages=1, split=32, dec_block_m=16, dec_warps=4, dec_stages=1
)


def _modes(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: list[int],
    cfg: AttnConfig,
    decode_at: list[int],
) -> list[torch.Tensor]:
    return attention_modes(q, k, v, chunks, decode_at, cfg)


@pytest.fixture(params=[True, False], ids=["fused-merge", "merge-launch"])
def merge_in_split_launch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Split-KV partials merged by the last split program (eager) or by a second launch (graphs)."""
    monkeypatch.setattr(attention_mod, "_fuse_combine", lambda q: request.param)
    return request.param


def test_same_bits_cpu(dev: str, merge_in_split_launch: bool) -> None:
    torch.manual_seed(0)
    n, hq, hkv, d = 70, 4, 2, 32
    q = torch.randn(n, hq, d, device=dev)
    k, v = torch.randn(1, 80, hkv, d, device=dev), torch.randn(1, 80, hkv, d, device=dev)
    # Decode steps at every split and tile boundary and a few between (the interpreter is slow).
    at = [0, 1, 15, 16, 17, 31, 32, 33, 47, 50, 63, 64, 65, 69]
    outs = _modes(q, k, v, [7, 13, 64], CPU_CONFIG, at)
    for o in outs[1:]:
        assert bits_equal(o, outs[0])
    i32 = dict(device=dev, dtype=torch.int32)
    args = (q, k, v, torch.tensor([0, n], **i32), torch.tensor([0], **i32), torch.tensor([n], **i32))
    ref = attention_reference(*args, torch.tensor([0], **i32), None, CPU_CONFIG)
    full = attention(*args, config=CPU_CONFIG)
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        full, _math_attention(*args, torch.tensor([0], **i32), d**-0.5), rtol=1e-4, atol=1e-4
    )


# The launch variants the table can pick, under the interpreter: K/V tiles through TMA descriptors
# (their extent is the cached length) and the warp-specialised loop (a no-op there).
CPU_TMA = CPU_CONFIG._replace(tma=True, ws=True, dec_tma=True)


@pytest.mark.parametrize("cfg", [CPU_CONFIG, CPU_TMA], ids=["pointers", "tma"])
def test_short_cache_cpu(dev: str, cfg: AttnConfig) -> None:
    """Keys past a sequence's cached length count as zeros (not stale memory), in both paths."""
    torch.manual_seed(1)
    hq, hkv, d = 4, 2, 32
    k, v = torch.randn(2, 80, hkv, d, device=dev), torch.randn(2, 80, hkv, d, device=dev)
    i32 = dict(device=dev, dtype=torch.int32)
    for n in (3, 40):  # split-KV path, prefill path
        q = torch.randn(2 * n, hq, d, device=dev)
        args = (q, k, v, torch.tensor([0, n, 2 * n], **i32), torch.tensor([30, 50], **i32))
        kv_len, slots = torch.tensor([20, 45], **i32), torch.tensor([1, 0], **i32)
        out = attention(*args, kv_len, slots, config=cfg)
        ref = attention_reference(*args, kv_len, slots, None, cfg)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_tma_same_bits_cpu(dev: str) -> None:
    """Loading K/V tiles through descriptors changes no bit: every mode of the TMA launch equals
    the pointer launch's prefill, across splits and tiles, with a head size below its block."""
    torch.manual_seed(6)
    n, hq, hkv, d = 50, 4, 2, 24
    q = torch.randn(n, hq, d, device=dev)
    k, v = torch.randn(1, 56, hkv, d, device=dev), torch.randn(1, 56, hkv, d, device=dev)
    at = [0, 15, 16, 31, 32, 49]
    want = _modes(q, k, v, [], CPU_CONFIG, at)[0]
    for o in _modes(q, k, v, [7, 40], CPU_TMA, at):
        assert bits_equal(o, want)


def _one_split_matches_longer_cache(dev: str, dtype: torch.dtype, cfg: AttnConfig, at: list[int]) -> None:
    """A cache of at most one split takes the single-split launch (no running state, no partials);
    the same keys in a longer cache take the general ones. Every mode gives the same bits in both."""
    torch.manual_seed(2)
    n, hq, hkv, d = cfg.split - 3, 8, 2, 32 if dev == "cpu" else 128
    q = torch.randn(n, hq, d, device=dev).to(dtype)
    k, v = (torch.randn(1, cfg.split, hkv, d, device=dev).to(dtype) for _ in range(2))
    longer = [torch.cat([x, torch.randn_like(x)], 1) for x in (k, v)]
    short = _modes(q, k, v, [5], cfg, at)
    long = _modes(q, *longer, [5], cfg, at)
    for a, b in zip(short, long, strict=True):
        assert bits_equal(a, b)
        assert bits_equal(a, short[0])


def test_one_split_cache_cpu(dev: str) -> None:
    _one_split_matches_longer_cache(dev, torch.float32, CPU_CONFIG, [0, 15, 16, 28])


@gpu
def test_one_split_cache_gpu() -> None:
    _one_split_matches_longer_cache("cuda", torch.bfloat16, CONFIG, list(range(0, CONFIG.split - 3, 7)))


@gpu
def test_same_bits_gpu(merge_in_split_launch: bool) -> None:
    """The shipped tiles: prefill and decode use different BLOCK_M and warps, and the sequence
    crosses two split boundaries, so this also proves the per-row bits of the two shapes equal."""
    torch.manual_seed(0)
    n, hq, hkv, d = 2 * CONFIG.split + 100, 16, 4, 128
    q = torch.randn(n, hq, d, device="cuda").bfloat16()
    k = torch.randn(1, n + 64, hkv, d, device="cuda").bfloat16()
    v = torch.randn(1, n + 64, hkv, d, device="cuda").bfloat16()
    outs = _modes(q, k, v, [1, 63, 64, 65, 256], CONFIG, list(range(n)))
    for i, o in enumerate(outs[1:]):
        assert bits_equal(o, outs[0]), i
    i32 = dict(device="cuda", dtype=torch.int32)
    ref = _math_attention(
        q,
        k,
        v,
        torch.tensor([0, n], **i32),
        torch.tensor([0], **i32),
        torch.tensor([n], **i32),
        torch.tensor([0], **i32),
        d**-0.5,
    )
    assert ((outs[0].float() - ref).norm() / ref.norm()).item() < 1e-2


# Qwen2.5-0.5B/7B's group of 7, 1.5B's of 6; a group above the decode block (16) decodes on the
# prefill block (32), one token a block.
@pytest.mark.parametrize("hq_hkv", [(7, 1), (6, 2), (20, 1)])
def test_any_gqa_group_cpu(dev: str, hq_hkv: tuple[int, int]) -> None:
    """A group that does not divide the block: whole tokens per block, the tail rows idle; every
    mode gives the same bits, and the reference's values."""
    torch.manual_seed(3)
    hq, hkv = hq_hkv
    n, d = 40, 16
    q = torch.randn(n, hq, d, device=dev)
    k, v = torch.randn(1, 48, hkv, d, device=dev), torch.randn(1, 48, hkv, d, device=dev)
    outs = _modes(q, k, v, [3, 17], CPU_CONFIG, [0, 5, 31, 32, 33, 39])
    for o in outs[1:]:
        assert bits_equal(o, outs[0])
    i32 = dict(device=dev, dtype=torch.int32)
    args = (q, k, v, torch.tensor([0, n], **i32), torch.tensor([0], **i32), torch.tensor([n], **i32))
    ref = attention_reference(*args, torch.tensor([0], **i32), None, CPU_CONFIG)
    torch.testing.assert_close(attention(*args, config=CPU_CONFIG), ref, rtol=1e-5, atol=1e-5)


def test_gqa_group_too_large_is_refused(dev: str) -> None:
    q, k = torch.randn(2, 64, 16, device=dev), torch.randn(1, 8, 1, 16, device=dev)
    i32 = dict(device=dev, dtype=torch.int32)
    with pytest.raises(ValueError, match="GQA group 64/1"):
        attention(
            q,
            k,
            k,
            torch.tensor([0, 2], **i32),
            torch.tensor([0], **i32),
            torch.tensor([2], **i32),
            config=CPU_CONFIG,
        )


@gpu
@pytest.mark.parametrize("hq_hkv", [(28, 4), (12, 2), (14, 2)])
def test_any_gqa_group_gpu(hq_hkv: tuple[int, int]) -> None:
    """Groups of 7 and 6 (Qwen2.5-7B, -1.5B, -0.5B) on the shipped tiles, across a split boundary."""
    torch.manual_seed(0)
    hq, hkv = hq_hkv
    n, d = CONFIG.split + 100, 128 if hq != 14 else 64
    q = torch.randn(n, hq, d, device="cuda").bfloat16()
    k = torch.randn(1, n + 64, hkv, d, device="cuda").bfloat16()
    v = torch.randn(1, n + 64, hkv, d, device="cuda").bfloat16()
    outs = _modes(q, k, v, [1, 63, 200], CONFIG, list(range(0, n, 3)))
    for i, o in enumerate(outs[1:]):
        assert bits_equal(o, outs[0]), i
    i32 = dict(device="cuda", dtype=torch.int32)
    one = (torch.tensor([0, n], **i32), torch.tensor([0], **i32), torch.tensor([n], **i32))
    ref = _math_attention(q, k, v, *one, torch.tensor([0], **i32), d**-0.5)
    assert ((attention(q, k, v, *one).float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("uniform", [True, False], ids=["trainer-batch", "ragged"])
def test_backward_matches_autograd(dev: str, uniform: bool) -> None:
    """attention_autograd's gradients: the batched formulas for a uniform (trainer) batch, the
    per-sequence autograd otherwise; both against autograd through the fp32 math."""
    from isoaudit.kernels.attention import attention_autograd

    torch.manual_seed(4)
    b, lq, lk, hq, hkv, d = 3, 6, 10, 6, 2, 16
    q = torch.randn(b * lq, hq, d, device=dev, requires_grad=True)
    k = torch.randn(b, lk, hkv, d, device=dev, requires_grad=True)
    v = torch.randn(b, lk, hkv, d, device=dev, requires_grad=True)
    i32 = dict(device=dev, dtype=torch.int32)
    cu = torch.arange(b + 1, **i32) * lq
    p0 = torch.full((b,), lk - lq, **i32)
    kl = torch.full((b,), lk, **i32) if uniform else torch.tensor([lk, lk - 1, lk], **i32)
    if not uniform:
        p0 = kl - lq
    slots = torch.tensor([2, 0, 1], **i32)
    go = torch.randn(b * lq, hq, d, device=dev)
    got = torch.autograd.grad(attention_autograd(q, k, v, cu, p0, kl, slots, d**-0.5), (q, k, v), go)
    want = torch.autograd.grad(_math_attention(q, k, v, cu, p0, kl, slots, d**-0.5), (q, k, v), go)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("lq,lk,hq,hkv", [(40, 50, 6, 2), (33, 33, 7, 1)])
def test_triton_backward_kernels(dev: str, lq: int, lk: int, hq: int, hkv: int) -> None:
    """The two backward kernels (dQ per query block, dK/dV per key block, fixed order) across
    several tiles, queries after a cached prefix, a group of 7, against autograd through the math;
    the trainer's backward takes them for a uniform batch. With dQ fused into the dK/dV kernel
    (turn counters, descending key blocks): the same values, dK and dV the same bits."""
    from isoaudit.kernels.attention import _triton_uniform_backward, attention_autograd

    torch.manual_seed(5)
    b, d = 2, 16
    q = torch.randn(b * lq, hq, d, device=dev, requires_grad=True)
    k = torch.randn(b + 1, lk, hkv, d, device=dev, requires_grad=True)
    v = torch.randn(b + 1, lk, hkv, d, device=dev, requires_grad=True)
    i32 = dict(device=dev, dtype=torch.int32)
    cu, p0, kl = (
        torch.arange(b + 1, **i32) * lq,
        torch.full((b,), lk - lq, **i32),
        torch.full((b,), lk, **i32),
    )
    slots = torch.tensor([2, 0], **i32)
    go = torch.randn(b * lq, hq, d, device=dev)
    want = torch.autograd.grad(_math_attention(q, k, v, cu, p0, kl, slots, d**-0.5), (q, k, v), go)
    out = attention(q.detach(), k.detach(), v.detach(), cu, p0, kl, slots, d**-0.5)
    got = _triton_uniform_backward(
        q.detach(), k.detach(), v.detach(), out, go, lq, lk - lq, lk, slots, d**-0.5
    )
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-4)
    fused = _triton_uniform_backward(
        q.detach(),
        k.detach(),
        v.detach(),
        out,
        go,
        lq,
        lk - lq,
        lk,
        slots,
        d**-0.5,
        CONFIG._replace(bwd_fused=True),
    )
    torch.testing.assert_close(fused[0], want[0], rtol=1e-4, atol=1e-4)
    assert bits_equal(fused[1], got[1]) and bits_equal(fused[2], got[2])
    calls = []
    real = attention_mod._triton_uniform_backward
    attention_mod._triton_uniform_backward = lambda *a: calls.append(1) or real(*a)
    try:
        via = torch.autograd.grad(attention_autograd(q, k, v, cu, p0, kl, slots, d**-0.5), (q, k, v), go)
    finally:
        attention_mod._triton_uniform_backward = real
    assert calls == [1]
    for a, w in zip(via, got, strict=True):
        assert bits_equal(a, w)


@gpu
def test_triton_backward_gpu() -> None:
    """bf16 trainer shapes (64 x 256 tokens, 14/2 heads of 64): the kernels' gradients against
    autograd through the fp32 math, and run to run bitwise equal (no atomics)."""
    from isoaudit.kernels.attention import _triton_uniform_backward

    torch.manual_seed(0)
    b, lq, hq, hkv, d = 16, 256, 14, 2, 64
    q = torch.randn(b * lq, hq, d, device="cuda").bfloat16()
    k = torch.randn(b, lq, hkv, d, device="cuda").bfloat16()
    v = torch.randn(b, lq, hkv, d, device="cuda").bfloat16()
    i32 = dict(device="cuda", dtype=torch.int32)
    cu, p0, kl = torch.arange(b + 1, **i32) * lq, torch.zeros(b, **i32), torch.full((b,), lq, **i32)
    slots = torch.arange(b, **i32)
    go = torch.randn(b * lq, hq, d, device="cuda").bfloat16()
    out = attention(q, k, v, cu, p0, kl, slots, d**-0.5)
    got = _triton_uniform_backward(q, k, v, out, go, lq, 0, lq, slots, d**-0.5)
    again = _triton_uniform_backward(q, k, v, out, go, lq, 0, lq, slots, d**-0.5)
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(
        _math_attention(qf, kf, vf, cu, p0, kl, slots, d**-0.5), (qf, kf, vf), go.float()
    )
    for a, a2, w in zip(got, again, want, strict=True):
        assert bits_equal(a, a2)
        assert ((a.float() - w).norm() / w.norm()) < 2e-2
