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
        # both quantize the same masters the same way: their effective weights agree
        assert d.evidence["effective_weights"]["differing"] == 0
        assert d.evidence["effective_weights"]["tensors_compared"] == 14


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
        # the rollout multiplies by dequantized FP8 weights, the trainer by its fp32 masters
        assert (
            d.evidence["effective_weights"]["differing"]
            == d.evidence["effective_weights"]["tensors_compared"]
            > 0
        )


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
        assert d.evidence["effective_weights"]["differing"] > 0, d.evidence["effective_weights"]


def test_trainer_collector_states_its_quantization() -> None:
    """The trainer collector's manifest in the FP8 mode: its quantization facts and the effective
    (dequantized) digest of every linear weight beside the masters'; none of it in the native mode."""
    from isoaudit.collectors import trainer
    from isoaudit.collectors.layout import StepBatch
    from isoaudit.collectors.sinks import MemorySink

    model = _hf("qwen3", 1, 128, 32, 256, torch.float32, "cpu").model
    for fp8 in (True, False):
        sink = MemorySink()
        with kernels.enable(fp8=True) if fp8 else kernels.disable():
            handle = trainer.attach(model, run="quant-trainer", sink=sink, strict=True)
            handle.record_step(
                0, StepBatch.padded([[1, 2, 3, 4]], [[5, 6]], temperature=1.0), weight_version="0"
            )
            assert sink.flush(30)
            handle.detach()
        m = sink.of_kind("manifest")[-1]
        if fp8:
            assert m.runtime.model_extra["quant"] == {
                "weights": "e4m3 block 128x128",
                "activations": "e4m3 per-token-group 1x128",
                "kv_cache": None,
                "source": "float32",
            }
            effective = m.effective_weight_tensor_digests
            assert len(effective) == 7 and all(v.startswith("float32[") for v in effective.values())
            assert all(effective[n] != m.weight_tensor_digests[n] for n in effective)
        else:
            assert "quant" not in (m.runtime.model_extra or {}) and m.effective_weight_tensor_digests == {}
