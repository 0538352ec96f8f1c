"""Reference-engine FP8 rollouts (the CPU quantize-dequantize of ``kernels.fp8``) against a trainer,
compared and diagnosed through ``audit.compare``: per-tensor dynamic activation scales show
batch-mate dependence (the batch probe: the rollout side's forward of the same sequence alone and in
its batch) and are
named ``quantization`` for it; per-token-group scales show none and agree exactly with a trainer in
the same mode; a rollout-only FP8 is ``quantization``, asymmetric; an FP8 rollout quantized from the
bf16 export against a trainer quantizing its fp32 masters is ``quantization`` naming the source."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from isoaudit.audit.compare import compare_sample
from isoaudit.audit.quantization import BATCH_PROBE
from isoaudit.audit.records import Manifest, SampleLogprobs
from isoaudit.collectors.manifest import trainer_runtime
from isoaudit.kernels import dispatch
from isoaudit.kernels import fp8 as F8
from isoaudit.kernels.engine import RolloutEngine

from isoaudit import kernels

from .conftest import needs_triton
from .test_e2e import _hf, _requests

pytestmark = needs_triton

LENS, NEW = [9, 20, 14], [6, 5, 6]


@contextmanager
def mode(fp8: bool, scaling: str = "group") -> Iterator[None]:
    """Kernels on (FP8 with ``scaling`` activation scales, or the bf16-invariant mode), or off."""
    prev = F8.set_act_scaling(scaling)
    try:
        with kernels.enable(fp8=fp8):
            yield
    finally:
        F8.set_act_scaling(prev)


def rollout(model, prompts, new) -> list:
    eng = RolloutEngine(model, max_len=max(map(len, prompts)) + max(new) + 8)
    return eng.generate(prompts, new, seed=1)


def batch_probe(model, comps) -> list[float]:
    """The rollout side's forward (its FP8 linear, in its mode) of each sampled sequence alone and in
    its batch: the largest |Δlogprob| over its completion (the same tokens in two batch compositions)."""
    batched = score(model, comps)
    return [float(np.abs(score(model, [c])[0] - b).max()) for c, b in zip(comps, batched, strict=True)]


def score(model, comps) -> list[np.ndarray]:
    """The trainer's recompute of every completion, the batch padded on the right."""
    dev = model.lm_head_weight.device
    seqs = [c.prompt + c.tokens for c in comps]
    n = max(map(len, seqs))
    ids = torch.zeros(len(seqs), n, dtype=torch.long, device=dev)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    with torch.no_grad():
        hidden = model.full_hidden(ids, mask)
        out = []
        for i, c in enumerate(comps):
            pos = torch.arange(len(c.prompt) - 1, len(c.prompt) - 1 + len(c.tokens), device=dev)
            tgt = torch.tensor(c.tokens, device=dev)
            out.append(
                dispatch.token_logprobs(hidden[i, pos], model.lm_head_weight, tgt).float().cpu().numpy()
            )
    return out


def manifest(model, side: str, source: str | None = None) -> Manifest:
    """The side's manifest as its collector builds it, in the kernels mode active now."""
    case = "trainer_recompute" if side == "trainer" else "engine_decode"
    return Manifest(
        run_id="quant-ref", side=side, case=case, runtime=trainer_runtime(model.model, quant_source=source)
    )


def sample(side: str, comp, logprobs, probe: float | None = None) -> SampleLogprobs:
    return SampleLogprobs(
        run_id="quant-ref",
        step=0,
        side=side,
        prompt_len=len(comp.prompt),
        token_ids=np.asarray(comp.prompt + comp.tokens, dtype=np.int32),
        logprobs=np.minimum(np.asarray(logprobs, dtype=np.float32), 0.0),
        temperature=1.0,
        path={} if probe is None else {BATCH_PROBE: probe},
    )


def diagnoses(model_r, model_t, r_mode, t_mode, r_source=None, t_source=None) -> tuple[list, list[float]]:
    prompts, new = _requests(256, LENS, NEW)
    with r_mode():
        comps = rollout(model_r, prompts, new)
        probe = batch_probe(model_r, comps)
        rm = manifest(model_r, "rollout", r_source)
    with t_mode():
        scored = score(model_t, comps)
        tm = manifest(model_t, "trainer", t_source)
    out = []
    for c, lp, p in zip(comps, scored, probe, strict=True):
        found = compare_sample(
            sample("trainer", c, lp), sample("rollout", c, c.logprobs, p), (), (), [tm], [rm]
        )
        out.append(found.diagnosis)
    return out, probe


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
