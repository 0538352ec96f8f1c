"""A run of the real vLLM engine (CPU build) against the HF bf16 trainer, both attached through
``isoaudit.session``, compared and diagnosed: what the KV-cache quantization tests share (each test
module starts its own engine with the cache dtype it checks)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from isoaudit.audit.compare import compare_samples
from isoaudit.audit.records import Manifest, Run
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.sessions import MemoryDestination

import isoaudit
from tests.vllm.conftest import by_key, generate, prompts_of

SAMPLES = 4
PROMPT_LEN = 70
TEMPERATURE = 0.7

#: What the last :func:`run_case` saw beside its diagnoses: the rollout collector's ``stats()``
#: (``rollout_stats``), its samples in the diagnoses' order (``rollout_samples``) and how long the
#: step's ``generate`` took (``generate_us``: the baseline of the probe's cost).
LAST: dict[str, Any] = {}


def run_case(
    llm: Any, path: Path, name: str, seed: int = 0, batch_probe: str = "auto"
) -> tuple[list[Any], Manifest, Manifest]:
    """One step of ``SAMPLES`` rollouts and the trainer's recompute: the diagnoses, both manifests.
    ``batch_probe``: the rollout collector's probe policy (its samples and stats: :data:`LAST`)."""
    from isoaudit.collectors.tiny_models import load_tiny_model

    model, _ = load_tiny_model(path, dtype=torch.bfloat16)
    run = Run(run_id=f"quant-{name}", name=name, config={})
    destination = MemoryDestination()
    with isoaudit.session(run, destination=destination, strict=True, report=False) as audit:
        rollout = audit.watch_vllm(llm, fingerprint="all", batch_probe=batch_probe)
        trainer = audit.watch_trainer(model, async_transfer=False)
        began = time.perf_counter()
        outputs = generate(llm, prompts_of([PROMPT_LEN] * SAMPLES, seed=2000 + seed), temperature=TEMPERATURE)
        LAST["generate_us"] = int((time.perf_counter() - began) * 1e6)
        rollout.record_step(0, outputs)
        prompts = [list(o.prompt_token_ids) for o in outputs]
        completions = [list(o.outputs[0].token_ids) for o in outputs]
        trainer.record_step(0, StepBatch.padded(prompts, completions, temperature=TEMPERATURE))
        LAST["rollout_stats"] = rollout.stats()
    sinks = destination.sinks
    t, r = by_key(sinks["trainer"], "sample", 0), by_key(sinks["rollout"], "sample", 0)
    tp, rp = by_key(sinks["trainer"], "fingerprints", 0), by_key(sinks["rollout"], "fingerprints", 0)
    keys = sorted(t.keys() & r.keys())
    LAST["rollout_samples"] = [r[k][0] for k in keys]
    assert len(keys) == SAMPLES, f"{len(keys)} samples paired of {SAMPLES}"
    found = compare_samples(
        [(t[k][0], r[k][0]) for k in keys],
        {k: (tp.get(k, []), rp.get(k, [])) for k in keys},
        (sinks["trainer"].of_kind("manifest"), sinks["rollout"].of_kind("manifest")),
    )
    return found, sinks["trainer"].of_kind("manifest")[-1], sinks["rollout"].of_kind("manifest")[-1]
