"""Records of reference-engine FP8 rollouts (the CPU quantize-dequantize of ``kernels.fp8``, the
Triton FP8 GEMMs on CUDA) and a trainer's recompute, with both manifests as the collector builds
them and the rollout side's batch probe (its forward of the same sequence alone and in its batch):
shared by the diagnosis tests and the dashboard's browser test. :func:`collector_records` has the
trainer side recorded by the trainer collector itself, its own batch probe included."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from isoaudit.audit.compare import compare_sample
from isoaudit.audit.quantization import BATCH_PROBE
from isoaudit.audit.records import Manifest, SampleLogprobs
from isoaudit.collectors.held_weights import checkpoint_name, module_digests, tensor_digests
from isoaudit.collectors.manifest import trainer_runtime
from isoaudit.collectors.quantization import effective_digests
from isoaudit.kernels import dispatch
from isoaudit.kernels import fp8 as F8
from isoaudit.kernels.engine import RolloutEngine

from isoaudit import kernels
from tests.kernels.test_e2e import _requests

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


def held(model, source: str | None) -> dict[str, str]:
    """What the side holds: its parameters, or (``source``) the export in that dtype it was given."""
    if source is None:
        return module_digests(model)
    dtype = getattr(torch, source)
    return tensor_digests((checkpoint_name(n), p.detach().to(dtype)) for n, p in model.named_parameters())


def manifest(model, side: str, source: str | None = None, run_id: str = "quant-ref") -> Manifest:
    """The side's manifest as its collector builds it, in the kernels mode active now."""
    case = "trainer_recompute" if side == "trainer" else "engine_decode"
    return Manifest(
        run_id=run_id,
        side=side,
        case=case,
        runtime=trainer_runtime(model.model, quant_source=source),
        weight_tensor_digests=held(model.model, source),
        effective_weight_tensor_digests=effective_digests(model.model),
    )


def sample(
    side: str, comp, logprobs, probe: float | None = None, run_id: str = "quant-ref"
) -> SampleLogprobs:
    return SampleLogprobs(
        run_id=run_id,
        step=0,
        side=side,
        prompt_len=len(comp.prompt),
        token_ids=np.asarray(comp.prompt + comp.tokens, dtype=np.int32),
        logprobs=np.minimum(np.asarray(logprobs, dtype=np.float32), 0.0),
        temperature=1.0,
        path={} if probe is None else {BATCH_PROBE: probe},
    )


def records(model_r, model_t, r_mode, t_mode, r_source=None, t_source=None, run_id="quant-ref"):
    """Both sides' records of one step: (trainer samples, rollout samples, trainer manifest,
    rollout manifest, batch probe per sample)."""
    prompts, new = _requests(256, LENS, NEW)
    with r_mode():
        comps = rollout(model_r, prompts, new)
        probe = batch_probe(model_r, comps)
        rm = manifest(model_r, "rollout", r_source, run_id)
    with t_mode():
        scored = score(model_t, comps)
        tm = manifest(model_t, "trainer", t_source, run_id)
    ts = [sample("trainer", c, lp, run_id=run_id) for c, lp in zip(comps, scored, strict=True)]
    rs = [sample("rollout", c, c.logprobs, p, run_id=run_id) for c, p in zip(comps, probe, strict=True)]
    return ts, rs, tm, rm, probe


def collector_records(model_r, model_t, r_mode, t_mode, run_id="quant-collector"):
    """Both sides' records of one step, the trainer's from the trainer collector (its own forward,
    its own batch probe, its own manifest) over the rollout's completions; the rollout's without a
    probe. Returns (trainer samples, rollout samples, trainer manifest, rollout manifest, the trainer
    collector's stats)."""
    from isoaudit.collectors import trainer
    from isoaudit.collectors.layout import StepBatch
    from isoaudit.collectors.sinks import MemorySink

    prompts, new = _requests(256, LENS, NEW)
    with r_mode():
        comps = rollout(model_r, prompts, new)
        rm = manifest(model_r, "rollout", None, run_id)
    sink = MemorySink()
    with t_mode():
        handle = trainer.attach(model_t.model, run=run_id, sink=sink, strict=True, async_transfer=False)
        batch = StepBatch.padded([c.prompt for c in comps], [c.tokens for c in comps], temperature=1.0)
        handle.record_step(0, batch)
        assert sink.flush(30)
        stats = handle.stats()
        handle.detach()
    by_key = {s.sample_key: s for s in sink.of_kind("sample")}
    rs = [sample("rollout", c, c.logprobs, run_id=run_id) for c in comps]
    ts = [by_key[r.sample_key] for r in rs]
    return ts, rs, sink.of_kind("manifest")[-1], rm, stats


def diagnoses(model_r, model_t, r_mode, t_mode, r_source=None, t_source=None) -> tuple[list, list[float]]:
    ts, rs, tm, rm, probe = records(model_r, model_t, r_mode, t_mode, r_source, t_source)
    found = [compare_sample(t, r, (), (), [tm], [rm]).diagnosis for t, r in zip(ts, rs, strict=True)]
    return found, probe
