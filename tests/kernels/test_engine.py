"""The reference engine as an engine runs: the native path batched over the cache (no loop over
requests), decode on the device with one host read at the end, and CUDA-graph decode per batch
bucket with the same bits as the eager step (kernels on)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from isoaudit.kernels import dispatch
from isoaudit.kernels.engine import RolloutEngine, bucket

from isoaudit import kernels

from .conftest import gpu


def _per_sequence(q, kc, vc, cu, p0, kvl, slots, scale):
    """The old native path: one SDPA per sequence (the semantics the batched call must keep)."""
    g = q.shape[1] // kc.shape[2]
    outs = []
    for b in range(cu.numel() - 1):
        s0, s1, pos0, n, slot = int(cu[b]), int(cu[b + 1]), int(p0[b]), int(kvl[b]), int(slots[b])
        qb = q[s0:s1].transpose(0, 1)[None]
        kb = kc[slot, :n].repeat_interleave(g, dim=1).transpose(0, 1)[None]
        vb = vc[slot, :n].repeat_interleave(g, dim=1).transpose(0, 1)[None]
        pos = torch.arange(pos0, pos0 + s1 - s0)
        mask = torch.arange(n)[None, :] <= pos[:, None]
        outs.append(
            F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)[0].transpose(0, 1)
        )
    return torch.cat(outs)


def _cache_case(
    lens: list[int], pos0: list[int], hq: int = 6, hkv: int = 2, d: int = 16, cache_len: int = 40
):
    torch.manual_seed(0)
    b = len(lens)
    q = torch.randn(sum(lens), hq, d)
    kc, vc = torch.randn(b + 1, cache_len, hkv, d), torch.randn(b + 1, cache_len, hkv, d)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    p0 = torch.tensor(pos0)
    kvl = p0 + torch.tensor(lens)
    slots = torch.tensor(list(range(b))[::-1])  # not the identity
    return q, kc, vc, cu, p0, kvl, slots


def test_native_prefill_is_one_batched_call_with_the_old_semantics() -> None:
    q, kc, vc, cu, p0, kvl, slots = _cache_case([5, 1, 12, 3], [0, 7, 4, 30])
    scale = 1 / math.sqrt(q.shape[-1])
    with kernels.disable():
        got = dispatch.attention(q, kc, vc, cu, p0, kvl, slots, scale)
        with_max = dispatch.attention(q, kc, vc, cu, p0, kvl, slots, scale, max_q=12)
    want = _per_sequence(q, kc, vc, cu, p0, kvl, slots, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(with_max, got, rtol=0, atol=0)


def test_native_decode_identity_slots_is_the_cache_view() -> None:
    q, kc, vc, cu, p0, kvl, _ = _cache_case([1, 1, 1], [3, 9, 20])
    scale = 1 / math.sqrt(q.shape[-1])
    with kernels.disable():
        view = dispatch.attention(q, kc, vc, cu, p0, kvl, None, scale)
        gathered = dispatch.attention(q, kc, vc, cu, p0, kvl, torch.arange(3), scale)
    torch.testing.assert_close(view, gathered, rtol=0, atol=0)
    torch.testing.assert_close(view, _per_sequence(q, kc, vc, cu, p0, kvl, torch.arange(3), scale))


def test_bucket() -> None:
    assert [bucket(n) for n in (1, 3, 16, 17, 64, 65, 256, 600)] == [1, 4, 16, 24, 64, 96, 256, 600]


def _tiny(dev: str, dtype: torch.dtype, layers: int = 2, hidden: int = 64, vocab: int = 256):
    transformers = pytest.importorskip("transformers")
    from isoaudit.kernels.adapters import HFCausalLM

    cfg = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 32, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return HFCausalLM(transformers.Qwen3ForCausalLM(cfg).to(dev, dtype).eval())


def test_generate_checks_its_requests() -> None:
    eng = RolloutEngine(_tiny("cpu", torch.float32), max_len=16)
    with pytest.raises(ValueError, match="prompts\\[1\\]"):
        eng.generate([[1, 2], [3] * 10], [3, 7])
    with pytest.raises(ValueError, match="max_new"):
        eng.generate([[1, 2]], [3, 4])
    with pytest.raises(ValueError, match="temperature"):
        eng.generate([[1, 2]], [3], temperature=0)


def test_decode_runs_through_a_wrapped_step() -> None:
    """A collector that wraps ``step`` (fingerprints) sees every packed step (here, on the CPU,
    every step: nothing is graphed), each holding only the live requests (no repeated positions),
    and the results are the unwrapped engine's bits."""
    model = _tiny("cpu", torch.float32)
    prompts, new = [[1, 2, 3], [4, 5, 6, 7, 8], [9]], [4, 2, 5]
    with kernels.enable():
        plain = RolloutEngine(model, max_len=32).generate(prompts, new, seed=3)
        calls = []
        original = model.step

        def wrapped(ids, positions, cu, slots, cache):
            calls.append(list(slots))
            return original(ids, positions, cu, slots, cache)

        model.step = wrapped
        try:
            eng = RolloutEngine(model, max_len=32)
            assert not eng.graphed()
            seen = eng.generate(prompts, new, seed=3)
        finally:
            del model.step
    assert calls == [[0, 1, 2], [0, 1, 2], [0, 2], [0, 2], [2]]  # the prefill, then the live requests
    assert [c.tokens for c in seen] == [c.tokens for c in plain]
    assert [c.logprobs for c in seen] == [c.logprobs for c in plain]
    assert [len(c.tokens) for c in seen] == new


def test_decode_is_step_per_token() -> None:
    """``decode`` (row i = slot i, what the graph captures) computes exactly ``step``'s bits."""
    model = _tiny("cpu", torch.float32)
    cache_a, cache_b = model.new_cache(3, 32), model.new_cache(3, 32)
    prompt = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9])
    pos = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 0])
    cu = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    with kernels.enable():
        for cache in (cache_a, cache_b):
            model.step(prompt, pos, cu, [0, 1, 2], cache)
        ids, at = torch.tensor([11, 12, 13]), torch.tensor([3, 5, 1])
        stepped = model.step(ids, at, torch.arange(4, dtype=torch.int32), [0, 1, 2], cache_a)
        decoded = model.decode(ids, at, cache_b)
    assert torch.equal(stepped, decoded)
    for (ka, va), (kb, vb) in zip(cache_a, cache_b, strict=True):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


class _CudaLike:
    """A model whose head reads as a CUDA tensor (what ``graphed()`` checks first), with a decode
    step that may say whether it is capturable."""

    def __init__(self, capturable: bool | None) -> None:
        self.lm_head_weight = SimpleNamespace(is_cuda=True)
        if capturable is not None:
            self.decode_capturable = lambda: capturable

    def decode(self, ids, positions, cache):  # never run here
        raise AssertionError


@pytest.mark.parametrize("capturable", [True, False, None])
def test_graphed_asks_the_model_whether_its_decode_is_capturable(capturable: bool | None) -> None:
    """A model that says its decode is not capturable in the current mode (an MoE model natively)
    is not graphed; one that does not say is (a dense decoder); ``cuda_graphs=False`` never is,
    and with ``bucketed_decode`` the uncapturable decode still runs bucketed, eagerly."""
    model = _CudaLike(capturable)
    assert RolloutEngine(model).graphed() is (capturable is not False)
    assert not RolloutEngine(model, cuda_graphs=False).graphed()
    assert RolloutEngine(model, bucketed_decode=True).bucketed()
    assert RolloutEngine(model).bucketed() is (capturable is not False)


@gpu
def test_graph_decode_same_bits_as_eager_gpu() -> None:
    """Kernels on: the CUDA-graph decode (a padded bucket, the graph captured once and replayed in
    a later call) gives the eager step's tokens and logprobs bit for bit, and the trainer's."""
    model = _tiny("cuda", torch.bfloat16, layers=4, hidden=256, vocab=1024)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1024, (n,), generator=gen).tolist() for n in (3, 17, 40, 64, 65)]
    new = [30, 12, 40, 25, 33]
    with kernels.enable():
        graphed = RolloutEngine(model, max_len=160)
        assert graphed.graphed()
        eager = RolloutEngine(model, max_len=160, cuda_graphs=False)
        for seed in (1, 2):  # the second call replays the graph captured in the first
            a = graphed.generate(prompts, new, seed=seed)
            b = eager.generate(prompts, new, seed=seed)
            assert [c.tokens for c in a] == [c.tokens for c in b]
            assert [c.logprobs for c in a] == [c.logprobs for c in b]
        assert list(graphed._graphs) == [(8, "invariant")]
        seqs = [c.prompt + c.tokens for c in a]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long, device="cuda")
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        hidden = model.full_hidden(ids)
        rows = [(i, len(c.prompt) + j - 1) for i, c in enumerate(a) for j in range(len(c.tokens))]
        h = hidden[torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])]
        tok = torch.tensor([t for c in a for t in c.tokens], device="cuda")
        trainer = dispatch.token_logprobs(h, model.lm_head_weight, tok).float().cpu()
    rollout = torch.tensor([x for c in a for x in c.logprobs])
    assert torch.equal(trainer, rollout)


@gpu
def test_native_graph_decode_gpu() -> None:
    """Kernels off: the graphed native decode runs (batched SDPA over the cache) and agrees with
    the eager one to bf16 rounding."""
    model = _tiny("cuda", torch.bfloat16, layers=4, hidden=256, vocab=1024)
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]]
    with kernels.disable():
        a = RolloutEngine(model, max_len=64).generate(prompts, [20, 20, 20], seed=1)
        b = RolloutEngine(model, max_len=64, cuda_graphs=False).generate(prompts, [20, 20, 20], seed=1)
    same = [
        (x, y)
        for ca, cb in zip(a, b, strict=True)
        for x, y, t, u in zip(ca.logprobs, cb.logprobs, ca.tokens, cb.tokens, strict=True)
        if t == u
    ]
    assert same and max(abs(x - y) for x, y in same) < 0.05
