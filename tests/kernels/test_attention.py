"""Attention: prefill, chunked prefill and decode of the same tokens give the same bits."""

from __future__ import annotations

import torch

from kernels.attention import _math_attention, attention, attention_reference

from .conftest import bits_equal, gpu, needs_triton

pytestmark = needs_triton


def _modes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[int]) -> list[torch.Tensor]:
    """One sequence (slot 0) as full prefill, as chunked prefill for each chunk size, and decoded
    token by token; plus a batch where it rides along with other sequences."""
    n, dev = q.shape[0], q.device
    i32 = dict(device=dev, dtype=torch.int32)
    full = attention(q, k, v, torch.tensor([0, n], **i32), torch.tensor([0], **i32), torch.tensor([n], **i32))
    outs = [full]
    for c in chunks:
        parts = [
            attention(
                q[s : s + c],
                k,
                v,
                torch.tensor([0, min(c, n - s)], **i32),
                torch.tensor([s], **i32),
                torch.tensor([min(s + c, n)], **i32),
            )
            for s in range(0, n, c)
        ]
        outs.append(torch.cat(parts))
    # Several sequences of different lengths packed with it, decoding position p of ours.
    other = torch.randn(3, *q.shape[1:], device=dev, dtype=q.dtype)
    kk = torch.stack([k[0], torch.randn_like(k[0])])
    vv = torch.stack([v[0], torch.randn_like(v[0])])
    rows = []
    for p in range(n):
        qq = torch.cat([other, q[p : p + 1]])
        o = attention(
            qq,
            kk,
            vv,
            torch.tensor([0, 3, 4], **i32),
            torch.tensor([p % 7, p], **i32),
            torch.tensor([p % 7 + 3, p + 1], **i32),
            torch.tensor([1, 0], **i32),
        )
        rows.append(o[3:])
    outs.append(torch.cat(rows))
    return outs


def test_same_bits_cpu(dev: str) -> None:
    torch.manual_seed(0)
    n, hq, hkv, d = 70, 4, 2, 32
    q = torch.randn(n, hq, d, device=dev)
    k, v = torch.randn(1, 80, hkv, d, device=dev), torch.randn(1, 80, hkv, d, device=dev)
    outs = _modes(q, k, v, [1, 13, 64])
    for o in outs[1:]:
        assert bits_equal(o, outs[0])
    i32 = dict(device=dev, dtype=torch.int32)
    args = (q, k, v, torch.tensor([0, n], **i32), torch.tensor([0], **i32), torch.tensor([n], **i32))
    ref = attention_reference(*args, torch.tensor([0], **i32))
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        outs[0], _math_attention(*args, torch.tensor([0], **i32), d**-0.5), rtol=1e-4, atol=1e-4
    )


@gpu
def test_same_bits_gpu() -> None:
    torch.manual_seed(0)
    n, hq, hkv, d = 600, 16, 4, 128
    q = torch.randn(n, hq, d, device="cuda").bfloat16()
    k = torch.randn(1, 1024, hkv, d, device="cuda").bfloat16()
    v = torch.randn(1, 1024, hkv, d, device="cuda").bfloat16()
    outs = _modes(q, k, v, [1, 63, 64, 65, 256])
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
