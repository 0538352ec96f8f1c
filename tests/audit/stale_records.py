"""A run whose middle step is stale engine state, for the store, worker and dashboard tests:
both sides hold equal weights at every version (equal per-tensor digests) and compute under one
numerical policy; after the sync to version 1 the rollout's canary differs from the trainer's
(its forward reads the old weights), so do its logprobs. Versions 0 and 2 are clean."""

from __future__ import annotations

import numpy as np
from isoaudit.audit.db import Store
from isoaudit.audit.records import Canary, CanaryOutput, Manifest, canary_digest, held_digest
from isoaudit.audit.worker import ComparisonWorker

from tests import factories

RUN = "stale-run"
POLICY = "f" * 64
CANARY = list(range(3, 19))
TOP = [7, 11, 13, 17, 19, 23, 29, 31]


def output(values: list[float], path: str) -> CanaryOutput:
    return CanaryOutput(
        path=path, digest=canary_digest(CANARY, TOP, values), top_ids=TOP, top_logprobs=values
    )


def canary(version: str, held: dict[str, str], values: list[float], path: str) -> Canary:
    return Canary(
        weight_version=version,
        held_digest=held_digest(held),
        tokens=CANARY,
        output=output(values, path),
        arithmetic=POLICY,
        seconds=0.01,
    )


def held_at(version: int) -> dict[str, str]:
    return {
        f"model.layers.{i}.mlp.down_proj.weight": f"bfloat16[64,128]:{version:04d}{i:012d}" for i in range(4)
    }


def values_at(version: float) -> list[float]:
    return [float(np.float32(-0.5 - 0.25 * k - 0.01 * version)) for k in range(len(TOP))]


def manifests(run_id: str, version: int, *, stale: bool) -> list[Manifest]:
    held = held_at(version)
    trainer_canary = canary(str(version), held, values_at(version), "the trainer's model forward, fp32 head")
    rollout_values = values_at(version - 0.5) if stale else values_at(version)  # neither old nor new
    rollout_canary = canary(str(version), held, rollout_values, "vLLM's LLM.generate (eager)")
    common = {"run_id": run_id, "weight_version": str(version), "weight_tensor_digests": held}
    return [
        factories.manifest(
            "trainer", "trainer_fwd", contract={"numerical_policy": POLICY}, canary=trainer_canary, **common
        ),
        factories.manifest(
            "rollout", "engine_decode", contract={"numerical_policy": POLICY}, canary=rollout_canary, **common
        ),
    ]


def stale_run(store: Store, run_id: str = RUN, project: str = "default") -> dict[int, str]:
    """Ingest and compare three steps (weight versions 0, 1, 2; version 1 stale on the rollout);
    return each step's sample key."""
    keys = {}
    store.ingest([factories.run(run_id)], project=project)
    for step in range(3):
        store.ingest(manifests(run_id, step, stale=step == 1), project=project)
        trainer = factories.sample("trainer", run_id=run_id, step=step, seed=step, weight_version=str(step))
        logprobs = trainer.logprobs - (np.float32(0.125) if step == 1 else np.float32(0))
        rollout = factories.sample(
            "rollout",
            run_id=run_id,
            step=step,
            seed=step,
            weight_version=str(step),
            logprobs=logprobs.astype(np.float32),
        )
        result = store.ingest([trainer, rollout], project=project)
        assert not result.rejected, result.rejected
        keys[step] = trainer.sample_key
    ComparisonWorker(store).run_once(run_id)
    return keys
