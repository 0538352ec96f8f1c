"""Every configuration the attention tuning table can pick keeps its promise on the GPU (bf16, the
bench's heads: 32 query heads over 8 KV heads of 128): a launch candidate gives the shipped
configuration's bits in every mode (prefill whole, chunked, decode beside another sequence) and
for a sequence alone or packed with others; an arithmetic candidate gives one set of bits across
the modes; a backward candidate is deterministic, batch-invariant, and keeps the shipped
gradients' bits unless it changes the tiles or the dQ path that fix their summation order."""

from __future__ import annotations

import pytest
import torch
from isoaudit.kernels.attention import (
    ARITHMETIC_CANDIDATES,
    CONFIG,
    LAUNCH_CANDIDATES,
    AttnConfig,
    _math_attention,
    _triton_uniform_backward,
    attention,
    attention_modes,
)

from .conftest import bits_equal, gpu, needs_triton

pytestmark = needs_triton
HQ, HKV, D = 32, 8, 128


def _sequence(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    q = torch.randn(n, HQ, D, device="cuda").bfloat16()
    k = torch.randn(1, n + 64, HKV, D, device="cuda").bfloat16()
    v = torch.randn(1, n + 64, HKV, D, device="cuda").bfloat16()
    return q, k, v


def _positions(n: int, split: int) -> list[int]:
    """Every fifth position and both sides of each split boundary."""
    edges = [p for s in range(split, n, split) for p in (s - 1, s, s + 1)]
    return sorted(set(range(0, n, 5)) | set(edges))


def _packed(cfg: AttnConfig) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Four sequences of different lengths, each after a cached prefix, packed in one call (slots
    reversed), and each alone in its own call."""
    torch.manual_seed(1)
    lens, prefix = [700, 1500, 64, 2100], [0, 37, 1024, 5]
    i32 = dict(device="cuda", dtype=torch.int32)
    q = torch.randn(sum(lens), HQ, D, device="cuda").bfloat16()
    k = torch.randn(4, 2200, HKV, D, device="cuda").bfloat16()
    v = torch.randn(4, 2200, HKV, D, device="cuda").bfloat16()
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    kv_len = [p + n for p, n in zip(prefix, lens, strict=True)]
    slots = [3, 2, 1, 0]
    meta = (torch.tensor(cu, **i32), torch.tensor(prefix, **i32), torch.tensor(kv_len, **i32))
    packed = attention(q, k, v, *meta, torch.tensor(slots, **i32), config=cfg)
    alone = [
        attention(
            q[cu[b] : cu[b + 1]],
            k[slots[b] : slots[b] + 1],
            v[slots[b] : slots[b] + 1],
            torch.tensor([0, lens[b]], **i32),
            torch.tensor([prefix[b]], **i32),
            torch.tensor([kv_len[b]], **i32),
            config=cfg,
        )
        for b in range(4)
    ]
    return packed, alone


@gpu
@pytest.mark.parametrize(
    "fields", [f for f in LAUNCH_CANDIDATES["prefill"] + LAUNCH_CANDIDATES["decode"] if f], ids=str
)
def test_launch_candidate_same_bits_gpu(fields: dict) -> None:
    cfg = CONFIG._replace(**fields)
    n = 2 * CONFIG.split + 100
    q, k, v = _sequence(n)
    at = _positions(n, CONFIG.split)
    want = attention_modes(q, k, v, [], at, CONFIG)[0]
    for i, o in enumerate(attention_modes(q, k, v, [1, 63, 200], at, cfg)):
        assert bits_equal(o, want), i
    packed, alone = _packed(cfg)
    assert bits_equal(packed, _packed(CONFIG)[0])
    assert bits_equal(packed, torch.cat(alone))


@gpu
@pytest.mark.parametrize("split_block_n", ARITHMETIC_CANDIDATES, ids=str)
def test_arithmetic_candidate_modes_agree_gpu(split_block_n: tuple[int, int]) -> None:
    split, block_n = split_block_n
    cfg = CONFIG._replace(split=split, block_n=block_n)
    n = 2 * split + 100
    q, k, v = _sequence(n)
    outs = attention_modes(q, k, v, [1, 63, 200], _positions(n, split), cfg)
    for i, o in enumerate(outs[1:]):
        assert bits_equal(o, outs[0]), i
    packed, alone = _packed(cfg)
    assert bits_equal(packed, torch.cat(alone))
    i32 = dict(device="cuda", dtype=torch.int32)
    one = (torch.tensor([0, n], **i32), torch.tensor([0], **i32), torch.tensor([n], **i32))
    ref = _math_attention(q, k, v, *one, torch.tensor([0], **i32), D**-0.5)
    assert ((attention(q, k, v, *one, config=cfg).float() - ref).norm() / ref.norm()).item() < 1e-2


def _grads(b: int, cfg: AttnConfig, lq: int = 512) -> tuple[torch.Tensor, ...]:
    """The trainer's backward over ``b`` sequences of ``lq`` tokens (the same first sequence
    whatever ``b``)."""
    torch.manual_seed(2)
    q = torch.randn(4 * lq, HQ, D, device="cuda").bfloat16()[: b * lq]
    k = torch.randn(4, lq, HKV, D, device="cuda").bfloat16()[:b]
    v = torch.randn(4, lq, HKV, D, device="cuda").bfloat16()[:b]
    go = torch.randn(4 * lq, HQ, D, device="cuda").bfloat16()[: b * lq]
    i32 = dict(device="cuda", dtype=torch.int32)
    cu, p0, kl = torch.arange(b + 1, **i32) * lq, torch.zeros(b, **i32), torch.full((b,), lq, **i32)
    slots = torch.arange(b, **i32)
    out = attention(q, k, v, cu, p0, kl, slots, D**-0.5)
    return (q, k, v, go, *_triton_uniform_backward(q, k, v, out, go, lq, 0, lq, slots, D**-0.5, cfg))


@gpu
@pytest.mark.parametrize("fields", LAUNCH_CANDIDATES["backward"], ids=str)
def test_backward_candidate_gpu(fields: dict) -> None:
    cfg = CONFIG._replace(**fields)
    q, k, v, go, *got = _grads(4, cfg)
    again = _grads(4, cfg)[4:]
    first = _grads(1, cfg)[4:]
    lq = 512
    for a, a2, a1 in zip(got, again, first, strict=True):
        assert bits_equal(a, a2)  # no atomics: run to run the same
        assert bits_equal(a[: a1.shape[0]], a1)  # the first sequence alone: its gradients' bits
    if (cfg.bwd_dq_n, cfg.bwd_dkv_m) == (CONFIG.bwd_dq_n, CONFIG.bwd_dkv_m):
        shipped = _grads(4, CONFIG)[4:]
        assert bits_equal(got[1], shipped[1]) and bits_equal(got[2], shipped[2])
        if cfg.bwd_fused == CONFIG.bwd_fused:  # fusing dQ changes its order of addition
            assert bits_equal(got[0], shipped[0])
    i32 = dict(device="cuda", dtype=torch.int32)
    cu, p0, kl = torch.arange(5, **i32) * lq, torch.zeros(4, **i32), torch.full((4,), lq, **i32)
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(
        _math_attention(qf, kf, vf, cu, p0, kl, torch.arange(4, **i32), D**-0.5), (qf, kf, vf), go.float()
    )
    for a, w in zip(got, want, strict=True):
        assert ((a.float() - w).norm() / w.norm()) < 2e-2
