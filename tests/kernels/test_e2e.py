"""End to end: a model run as a trainer (whole sequences, autograd) and as a rollout engine
(batched requests of different lengths, prefill or chunked prefill, incremental decode with a KV
cache). Kernels off: the native mismatch, reported. Kernels on, both sides: every sampled-token
logprob bitwise equal (mean |delta| exactly 0)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from isoaudit.kernels import dispatch
from isoaudit.kernels.engine import RolloutEngine
from isoaudit.kernels.models.gdn_lm import GDNLM, GDNLMConfig

from isoaudit import kernels

from .conftest import gpu, needs_triton

pytestmark = needs_triton


def _hf(family: str, layers: int, hidden: int, head_dim: int, vocab: int, dtype: torch.dtype, dev: str):
    transformers = pytest.importorskip("transformers")
    from isoaudit.kernels.adapters import HFCausalLM

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=max(1, hidden // head_dim // 2),
        head_dim=head_dim,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, attn_implementation="sdpa"))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, attn_implementation="sdpa"))
    with torch.no_grad():
        for p in model.parameters():  # random init with some spread in the norms, as trained models have
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return HFCausalLM(model.to(dev, dtype).eval())


def _gdn(layers: int, hidden: int, chunk: int, vocab: int, dtype: torch.dtype, dev: str) -> GDNLM:
    torch.manual_seed(0)
    kinds = tuple("gdn" if i % 2 == 0 else "attn" for i in range(layers))
    cfg = GDNLMConfig(
        vocab=vocab,
        hidden=hidden,
        layers=kinds,
        heads=hidden // 64 or 1,
        kv_heads=max(1, hidden // 128),
        head_dim=64,
        gdn_heads=hidden // 64 or 1,
        gdn_head_dim=64,
        mlp=2 * hidden,
        chunk=chunk,
    )
    model = GDNLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, p.shape[1] ** -0.5)
    return model.to(dev, dtype).eval()


def run_pair(
    model,
    enabled: bool,
    prompts: list[list[int]],
    max_new: list[int],
    prefill_chunk: int | None = None,
    fp8: bool = False,
) -> dict:
    """Roll out with the engine, recompute with the trainer, compare sampled-token logprobs
    (``fp8``: in the ``invariant-fp8`` mode)."""
    with kernels.enable(fp8=fp8) if enabled else kernels.disable():
        eng = RolloutEngine(
            model, max_len=max(len(p) for p in prompts) + max(max_new) + 8, prefill_chunk=prefill_chunk
        )
        comps = eng.generate(prompts, max_new, seed=1)
        dev = model.lm_head_weight.device
        seqs = [c.prompt + c.tokens for c in comps]
        n = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), n, dtype=torch.long, device=dev)
        mask = torch.zeros_like(ids)
        bi, pi, tgt = [], [], []
        for i, (s, c) in enumerate(zip(seqs, comps, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
            for j, t in enumerate(c.tokens):
                bi.append(i)
                pi.append(len(c.prompt) + j - 1)
                tgt.append(t)
        with torch.enable_grad():
            hidden = model.full_hidden(ids, mask)
            h = hidden[torch.tensor(bi, device=dev), torch.tensor(pi, device=dev)]
            lp = dispatch.token_logprobs(h, model.lm_head_weight, torch.tensor(tgt, device=dev))
            lp.sum().backward()  # the trainer's path is differentiable
    trainer = lp.detach().float().cpu()
    rollout = torch.tensor([x for c in comps for x in c.logprobs], dtype=torch.float32)
    delta = (trainer - rollout).abs()
    return {
        "enabled": enabled,
        "tokens": int(delta.numel()),
        "mean_abs_delta": float(delta.mean()),
        "max_abs_delta": float(delta.max()),
        "exact_fraction": float((delta == 0).float().mean()),
        "replays": eng.replays,  # decode steps replayed from a CUDA graph
    }


def _report(name: str, res: dict) -> None:
    print(f"\n[e2e] {name}: {json.dumps(res)}")
    out = os.environ.get("ISOAUDIT_KERNELS_REPORT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps({"case": name, **res}) + "\n")


def _requests(vocab: int, lens: list[int], new: list[int]) -> tuple[list[list[int]], list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens], new


def test_qwen3_cpu(dev: str) -> None:
    model = _hf("qwen3", 2, 64, 32, 256, torch.float32, dev)
    prompts, new = _requests(256, [3, 9, 20], [6, 3, 5])
    for chunk in (None, 4):
        res = run_pair(model, True, prompts, new, chunk)
        _report(f"qwen3-cpu-fp32 chunk={chunk}", res)
        assert res["mean_abs_delta"] == 0.0 and res["exact_fraction"] == 1.0


def test_gdn_lm_cpu(dev: str) -> None:
    model = _gdn(2, 64, 16, 256, torch.float32, dev)
    prompts, new = _requests(256, [3, 15, 17], [20, 4, 16])
    res = run_pair(model, True, prompts, new, None)
    _report("gdn-lm-cpu-fp32", res)
    assert res["mean_abs_delta"] == 0.0 and res["exact_fraction"] == 1.0


LENS, NEW = [5, 17, 40, 63, 64, 65, 100, 130], [40, 24, 70, 12, 66, 30, 20, 50]


@gpu
@pytest.mark.parametrize("family,layers", [("qwen3", 8), ("llama", 4)])
def test_hf_gpu(family: str, layers: int) -> None:
    model = _hf(family, layers, 256, 64, 1024, torch.bfloat16, "cuda")
    prompts, new = _requests(1024, LENS, NEW)
    native = run_pair(model, False, prompts, new)
    _report(f"{family}-{layers}L-bf16 native", native)
    assert native["mean_abs_delta"] > 0
    for chunk in (None, 16):
        res = run_pair(model, True, prompts, new, chunk)
        _report(f"{family}-{layers}L-bf16 kernels chunk={chunk}", res)
        assert res["mean_abs_delta"] == 0.0 and res["exact_fraction"] == 1.0


@gpu
def test_gdn_lm_gpu() -> None:
    model = _gdn(4, 256, 64, 1024, torch.bfloat16, "cuda")
    prompts, new = _requests(1024, LENS, NEW)
    native = run_pair(model, False, prompts, new)
    _report("gdn-lm-4L-bf16 native", native)
    assert native["mean_abs_delta"] > 0
    for chunk in (None, 16):
        res = run_pair(model, True, prompts, new, chunk)
        _report(f"gdn-lm-4L-bf16 kernels chunk={chunk}", res)
        assert res["mean_abs_delta"] == 0.0 and res["exact_fraction"] == 1.0


@gpu
def test_split_k_weights_gpu(split_k) -> None:
    """Hidden 1024, MLP 2048: the down projection (N=1024, K=2048) takes the fixed split-K, its
    small-M decode calls the split grid and the trainer's recompute the in-program spans; trainer
    and rollout still agree on every bit."""
    from isoaudit.kernels.gemm_policy import gemm_config

    if not gemm_config(1024, 2048, torch.bfloat16, torch.cuda.get_device_capability()).k_split:
        pytest.skip("no split-K on this GPU")
    model = _hf("qwen3", 2, 1024, 64, 1024, torch.bfloat16, "cuda")
    prompts, new = _requests(1024, LENS, NEW)
    res = run_pair(model, True, prompts, new)
    _report("qwen3-2L-h1024-bf16 kernels (split-K down projection)", res)
    assert res["mean_abs_delta"] == 0.0 and res["exact_fraction"] == 1.0
