"""Reference-engine FP8 rollouts (the CPU quantize-dequantize of ``kernels.fp8``) against a trainer,
compared and diagnosed through ``audit.compare``: per-tensor dynamic activation scales show
batch-mate dependence (the batch probe: the rollout side's forward of the same sequence alone and in
its batch) and are named ``quantization`` for it; per-token-group scales show none and agree exactly
with a trainer in the same mode; a rollout-only FP8 is ``quantization``, asymmetric; an FP8 rollout
quantized from the bf16 export against a trainer quantizing its fp32 masters is ``quantization``
naming the source."""

from __future__ import annotations

import pytest
import torch

from isoaudit import kernels

from .conftest import needs_triton
from .quant_records import diagnoses, mode
from .test_e2e import _hf

pytestmark = needs_triton


@pytest.fixture(scope="module")
def model():
    return _hf("qwen3", 2, 128, 32, 256, torch.float32, "cpu")


def test_per_tensor_scales_named_batch_mates(model) -> None:
    found, probe = diagnoses(model, model, lambda: mode(True, "tensor"), lambda: mode(True, "tensor"))
    print("per-tensor probe", probe, [d.sentence for d in found])
    assert max(probe) > 0
    for d in found:
        assert d.kind == "quantization", d.sentence
        assert d.evidence["cause"] == "batch_mates" and "batch composition" in d.sentence
        assert d.evidence["symmetric"] is True and d.evidence["can_be_exact"] is False
        assert d.evidence["quantization"]["rollout"]["activations"] == "e4m3 per-tensor dynamic"


def test_per_group_scales_no_batch_mates(model) -> None:
    found, probe = diagnoses(model, model, lambda: mode(True, "group"), lambda: mode(True, "group"))
    print("per-group probe", probe, [d.kind for d in found])
    assert probe == [0.0] * len(probe)
    assert [d.kind for d in found] == ["clean"] * len(found), [d.sentence for d in found]


def test_rollout_only_fp8_is_asymmetric(model) -> None:
    found, probe = diagnoses(model, model, lambda: mode(True, "group"), lambda: kernels.disable())
    print("rollout-only", [d.sentence for d in found])
    for d in found:
        assert d.kind == "quantization", d.sentence
        assert d.evidence["cause"] == "asymmetric" and d.evidence["can_be_exact"] is False
        assert d.evidence["differing"]["weights"] == {"trainer": None, "rollout": "e4m3 block 128x128"}
        assert "batch_mates" not in d.evidence["signature"]


def test_bf16_export_vs_fp32_masters_names_the_source(model) -> None:
    export = _hf("qwen3", 2, 128, 32, 256, torch.float32, "cpu")
    with torch.no_grad():
        for p in export.model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # the bf16 export the rollout quantizes
    found, _ = diagnoses(
        export, model, lambda: mode(True, "group"), lambda: mode(True, "group"), r_source="bfloat16"
    )
    print("source", [d.sentence for d in found])
    for d in found:
        assert d.kind == "quantization", d.sentence
        assert d.evidence["cause"] == "source"
        assert d.evidence["differing"]["source"] == {"trainer": "float32", "rollout": "bfloat16"}
        assert "bfloat16" in d.sentence and "float32" in d.sentence
