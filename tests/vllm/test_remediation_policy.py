"""The contracts sides build from what they run (collectors.policy), without an engine: valid,
equal where the sides run the same kernels, and differing exactly in the regions where they do not;
and the invariant log-softmax the vLLM sampler gets on masked (top-k/top-p) logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from isoaudit.audit.contract import identities, numerical_policy_fields, policy_regions, validate
from isoaudit.collectors.policy import (
    Impl,
    build_contract,
    hf_contracts,
    kernel_ops,
    model_spec,
    native_regions,
    torch_op,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from isoaudit.collectors.tiny_models import load_tiny_model, make_tiny_model

    path = make_tiny_model("qwen3", tmp_path_factory.mktemp("policy") / "m", num_layers=2, dtype="bfloat16")
    return load_tiny_model(Path(path), dtype=torch.bfloat16)[0]


def _diff(a: Any, b: Any) -> list[str]:
    fa, fb = numerical_policy_fields(a), numerical_policy_fields(b)
    return policy_regions(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


def test_contracts_are_valid_in_both_modes(model: Any) -> None:
    for mode in ("native", "invariant"):
        assert validate(hf_contracts(model)(mode)) == [], mode


def test_trainer_and_reference_engine_share_the_invariant_policy_only(model: Any) -> None:
    trainer, engine = hf_contracts(model), hf_contracts(model, native_attention=torch_op("sdpa"))
    assert (
        identities(trainer("invariant")).numerical_policy == identities(engine("invariant")).numerical_policy
    )
    assert _diff(trainer("native"), engine("native")) == ["layers.0.attn", "layers.1.attn"]
    assert trainer("invariant").model.lm_head_dtype == "float32"
    assert trainer("native").model.lm_head_dtype == "bfloat16"


def test_a_native_attention_makes_only_the_attention_regions_differ(model: Any) -> None:
    spec = model_spec(model.config, dtype="bfloat16", lm_head_dtype="float32")
    ours = hf_contracts(model)("invariant")
    ops = {**{k: v for k, v in _ops(model).items()}, "attention": Impl("vllm.attention.CPU_ATTN", "0.32.0")}
    theirs = build_contract(spec, ops, qk_norm=True)
    assert validate(theirs) == []
    assert _diff(ours, theirs) == ["layers.0.attn", "layers.1.attn"]
    assert native_regions(theirs) == ["layers.0.attn", "layers.1.attn"]  # rotary (transformers) too
    entries = {(e.region, e.case): e for e in theirs.composition}
    assert entries[("layers.0.mlp", "engine_decode")].route == "invariant"
    assert entries[("embed", "engine_decode")].route == "native"  # a torch gather, claimed exact (0 ulps)


def _ops(model: Any) -> dict[str, Impl]:
    from isoaudit.collectors.policy import hf_ops

    return hf_ops(model, "invariant")


def test_kernel_versions_follow_their_source() -> None:
    ops = kernel_ops("cpu")
    assert ops["linear"].id == "kernels.cpu.linear" and len(ops["linear"].version) == 12
    assert ops["linear"].version == ops["norm"].version  # one module, one digest
    assert kernel_ops("cuda")["linear"].id == "kernels.gemm.linear"


def test_policy_regions_name_regions_of_entries_and_claims() -> None:
    names = [
        "composition.layers.3.attn.engine_decode.implementation",
        "claims.tolerance.embed.trainer_fwd",
        "model.lm_head_dtype",
        "claims.state_invalidation.prefix_cache",
        "composition.final_norm.trainer_recompute.route",
    ]
    assert policy_regions(names) == ["embed", "layers.3.attn", "final_norm"]


def test_the_invariant_log_softmax_keeps_masked_logits_masked() -> None:
    from isoaudit.collectors.vllm.worker.remediation import _log_softmax

    logits = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    logits[0, 10:] = float("-inf")  # what top-k leaves
    got = _log_softmax(logits)
    assert torch.isinf(got[0, 10:]).all() and torch.isfinite(got[0, :10]).all()
    reference = torch.log_softmax(logits, -1)
    finite = torch.isfinite(reference)
    assert (got[finite] - reference[finite]).abs().max() < 1e-5
    # batch-invariant: a row alone gives the same bits as in the batch
    assert torch.equal(_log_softmax(logits[1:2])[0], got[1])
