"""Reference-engine FP8 rollouts against a trainer, compared and diagnosed through ``audit.compare``:
per-tensor dynamic activation scales show batch-mate dependence (the batch probe: a side's forward
of the same sequence alone and in its batch, from the test's helper and from the trainer collector's
own probe) and are named ``quantization`` for it; per-token-group scales show none and agree exactly
with a trainer in the same mode; a rollout-only FP8 is ``quantization``, asymmetric; an FP8 rollout
quantized from the bf16 export against a trainer quantizing its fp32 masters is ``quantization``
naming the source.

Each test runs on the CPU (the exact quantize-dequantize of ``kernels.fp8``) and, marked ``gpu``, on
CUDA, where the linear layers run the real FP8 GEMMs (``kernels.fp8``'s Triton kernels on E4M3)."""

from __future__ import annotations

import pytest
import torch
from isoaudit.audit.compare import compare_sample
from isoaudit.audit.quantization import BATCH_PROBE

from isoaudit import kernels

from .conftest import CUDA, needs_triton
from .quant_records import collector_records, diagnoses, mode
from .test_e2e import _hf

pytestmark = needs_triton

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]),
]


@pytest.fixture(scope="module", params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(device: str):
    return _hf("qwen3", 2, 128, 32, 256, torch.float32, device)


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


def test_bf16_export_vs_fp32_masters_names_the_source(model, device: str) -> None:
    export = _hf("qwen3", 2, 128, 32, 256, torch.float32, device)
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


def test_trainer_collector_probe_per_tensor_names_batch_mates(model) -> None:
    """The trainer collector's own batch probe (no test helper): with per-tensor dynamic scales its
    probed samples moved with the batch composition, and the comparison names ``batch_mates`` from
    the trainer's record; the probe's cost is counted."""
    tensor = lambda: mode(True, "tensor")  # noqa: E731
    ts, rs, tm, rm, stats = collector_records(model, model, tensor, tensor)
    probed = {t.sample_key: t.path[BATCH_PROBE] for t in ts if BATCH_PROBE in t.path}
    print("trainer probe (per-tensor)", probed, {k: v for k, v in stats.items() if "probe" in k})
    assert len(probed) == 2 and max(probed.values()) > 0
    assert stats["batch_probe_samples"] == 2 and stats["batch_probe_forwards"] == 2
    assert stats["batch_probe_tokens"] > 0 and stats["batch_probe_errors"] == 0
    assert all(BATCH_PROBE not in r.path for r in rs)
    for t, r in zip(ts, rs, strict=True):
        d = compare_sample(t, r, (), (), [tm], [rm]).diagnosis
        assert d.kind == "quantization", d.sentence
        if probed.get(t.sample_key, 0) > 0:
            assert d.evidence["cause"] == "batch_mates" and "batch composition" in d.sentence
            assert d.evidence["signature"]["batch_mates"] == {"trainer": probed[t.sample_key]}
        else:
            assert d.evidence["cause"] == "per_tensor_dynamic"
        assert d.evidence["can_be_exact"] is False


def test_trainer_collector_probe_per_group_is_zero(model) -> None:
    """Per-token-group scales: the trainer collector's probe records exactly 0 for every probed
    sample, and no verdict names batch-mates."""
    group = lambda: mode(True, "group")  # noqa: E731
    ts, rs, tm, rm, stats = collector_records(model, model, group, group)
    probed = [t.path[BATCH_PROBE] for t in ts if BATCH_PROBE in t.path]
    print("trainer probe (per-group)", probed)
    assert probed == [0.0, 0.0] and stats["batch_probe_samples"] == 2
    for t, r in zip(ts, rs, strict=True):
        d = compare_sample(t, r, (), (), [tm], [rm]).diagnosis
        assert "batch_mates" not in d.evidence.get("signature", {}), d.sentence
        assert d.evidence.get("cause") != "batch_mates"


def test_trainer_collector_no_probe_unquantized(model) -> None:
    """``batch_probe="auto"`` probes only while the side quantizes activations: unquantized, nothing."""
    ts, _, _, _, stats = collector_records(model, model, lambda: kernels.disable(), lambda: kernels.disable())
    assert stats["batch_probe_samples"] == 0 and all(BATCH_PROBE not in t.path for t in ts)


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
