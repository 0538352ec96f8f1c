"""End to end on MoE models: our MoELM and HF's Qwen3-MoE and Mixtral (random weights, built from
configs), run as a trainer and through the rollout engine. Kernels on: every sampled-token logprob
bitwise equal and every token's top-k set the same on both sides in every MoE layer. Kernels off:
the native mismatch and the routing-agreement figure per layer, reported."""

from __future__ import annotations

import pytest
import torch
from isoaudit.kernels import moe
from isoaudit.kernels.models.moe_lm import MoELM, MoELMConfig

from .conftest import gpu
from .test_e2e import _report, _requests, run_pair


class _Traced:
    """An engine model whose trainer and engine calls are traced apart."""

    def __init__(self, model) -> None:
        self.model, self.engine, self.trainer = model, moe.RoutingTrace(), moe.RoutingTrace()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.lm_head_weight

    def new_cache(self, slots: int, max_len: int):
        return self.model.new_cache(slots, max_len)

    def step(self, *args):
        with moe.trace_routing() as t:
            out = self.model.step(*args)
        self.engine.calls += t.calls
        return out

    def full_hidden(self, *args):
        with moe.trace_routing() as t:
            out = self.model.full_hidden(*args)
        self.trainer.calls += t.calls
        return out


def _pair(model, enabled: bool, prompts, new, chunk=None) -> dict:
    traced = _Traced(model)
    res = run_pair(traced, enabled, prompts, new, chunk)
    agree = moe.agreement(traced.engine, traced.trainer)
    assert agree and len(agree) == len(traced.engine.layers())
    res["routing_agreement"] = {str(k): round(v, 4) for k, v in agree.items()}
    res["routing_agreement_min"] = min(agree.values())
    return res


def _init(model: torch.nn.Module, dev: str, dtype: torch.dtype) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():  # spread in the norms and fan-in-scaled matrices
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, p.shape[-1] ** -0.5)
    return model.to(dev, dtype).eval()


def moe_lm(layers: int, hidden: int, experts: int, top_k: int, vocab: int, dtype, dev) -> MoELM:
    torch.manual_seed(0)
    cfg = MoELMConfig(
        vocab=vocab,
        hidden=hidden,
        layers=layers,
        heads=max(1, hidden // 64),
        kv_heads=max(1, hidden // 128),
        head_dim=min(64, hidden // 2),
        experts=experts,
        top_k=top_k,
        expert_mlp=hidden // 2,
        dense_layers=(0,) if layers > 2 else (),
    )
    return _init(MoELM(cfg), dev, dtype)  # type: ignore[return-value]


def hf_moe(family: str, layers: int, hidden: int, experts: int, top_k: int, vocab: int, dtype, dev):
    transformers = pytest.importorskip("transformers")
    from isoaudit.kernels.adapters_moe import HFMoECausalLM

    head_dim = min(64, hidden // 2)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=max(1, hidden // head_dim // 2),
        head_dim=head_dim,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        num_experts_per_tok=top_k,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **common, num_experts=experts, moe_intermediate_size=hidden // 2, intermediate_size=2 * hidden,
            norm_topk_prob=True, mlp_only_layers=[0] if layers > 2 else [],
        )  # fmt: skip
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(
            **common, num_local_experts=experts, intermediate_size=hidden // 2, sliding_window=None
        )
        model = transformers.MixtralForCausalLM(cfg)
    return HFMoECausalLM(_init(model, dev, dtype))


MODELS = ["moe_lm", "qwen3_moe", "mixtral"]


def _model(name: str, layers: int, hidden: int, experts: int, top_k: int, vocab: int, dtype, dev):
    if name == "moe_lm":
        return moe_lm(layers, hidden, experts, top_k, vocab, dtype, dev)
    return hf_moe(name, layers, hidden, experts, top_k, vocab, dtype, dev)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", MODELS)
def test_moe_e2e_cpu(name: str, dtype: torch.dtype) -> None:
    model = _model(name, 2, 64, 8, 2, 256, dtype, "cpu")
    prompts, new = _requests(256, [3, 9, 20], [6, 3, 5])
    native = _pair(model, False, prompts, new)
    _report(f"{name}-cpu-{dtype} native", native)
    chunk = None if dtype == torch.float32 else 4  # whole prefill, and chunked
    res = _pair(model, True, prompts, new, chunk)
    _report(f"{name}-cpu-{dtype} kernels chunk={chunk}", res)
    assert res["mean_abs_delta"] == 0.0 and res["exact_fraction"] == 1.0
    assert res["routing_agreement_min"] == 1.0


LENS, NEW = [5, 17, 40, 63, 64, 65, 100, 130], [40, 24, 70, 12, 66, 30, 20, 50]


@gpu
@pytest.mark.parametrize("name", MODELS)
def test_moe_e2e_gpu(name: str) -> None:
    model = _model(name, 4, 256, 16, 4, 1024, torch.bfloat16, "cuda")
    prompts, new = _requests(1024, LENS, NEW)
    native = _pair(model, False, prompts, new)
    _report(f"{name}-4L-bf16 native", native)
    assert native["mean_abs_delta"] > 0
    for chunk in (None, 16):
        res = _pair(model, True, prompts, new, chunk)
        _report(f"{name}-4L-bf16 kernels chunk={chunk}", res)
        assert res["mean_abs_delta"] == 0.0 and res["exact_fraction"] == 1.0
        assert res["routing_agreement_min"] == 1.0
