"""Hand-built records for the data, query and callback tests (the browser suite uses a real
collector run instead: ``collector_run.py``)."""

from __future__ import annotations

import numpy as np
from isoaudit.audit.db import Store
from isoaudit.audit.records import Record
from isoaudit.audit.worker import ComparisonWorker

from tests import factories as f

#: Regions fingerprinted on both sides; the first two agree, ``layers.0.mlp`` is where samples diverge.
AGREEING = ("embed", "layers.0.attn")
DIVERGING = "layers.0.mlp"


def step_records(run_id: str, step: int, samples: int = 3, *, mismatch: bool = True) -> list[Record]:
    """``samples`` samples of one step on both sides; with ``mismatch`` the odd ones differ by 0.01
    per token and first diverge at ``layers.0.mlp``."""
    out: list[Record] = []
    for i in range(samples):
        seed = 1000 * step + i
        trainer = f.sample("trainer", run_id=run_id, step=step, seed=seed, n_completion=10 + 8 * i)
        differs = mismatch and i % 2 == 1
        rollout = f.sample(
            "rollout",
            run_id=run_id,
            step=step,
            seed=seed,
            n_completion=10 + 8 * i,
            logprobs=trainer.logprobs - np.float32(0.01 if differs else 0.0),
        )
        out += [trainer, rollout]
        for region in AGREEING:
            out += [
                f.fingerprints(trainer, region, seed=seed),
                f.fingerprints(rollout, region, "engine_prefill", seed=seed),
            ]
        out += [
            f.fingerprints(trainer, DIVERGING, seed=seed + 1),
            f.fingerprints(rollout, DIVERGING, "engine_prefill", seed=seed + (2 if differs else 1)),
        ]
    return out


def fill(
    store: Store, run_id: str = "run-1", steps: int = 3, samples: int = 3, name: str = "test run"
) -> None:
    """A run with manifests (dtype differs between the sides) and ``steps`` compared steps."""
    records: list[Record] = [
        f.run(run_id, name=name, config={"model": "none"}),
        f.manifest("trainer", run_id=run_id, runtime={"remediation": "native", "dtype": "bfloat16"}),
        f.manifest(
            "rollout", "engine_decode", run_id=run_id, runtime={"remediation": "native", "dtype": "float16"}
        ),
    ]
    for step in range(steps):
        records += step_records(run_id, step, samples)
    store.ingest(records)
    ComparisonWorker(store).run_once()
