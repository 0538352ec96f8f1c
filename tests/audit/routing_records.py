"""A small MoE run for the routing tests of the API, /metrics, alerts and the dashboard: real
records through ``Store.ingest`` and the real comparison worker, with routing flips planted at
known (step, layer, position)."""

from __future__ import annotations

import numpy as np
from isoaudit.audit.db import Store
from isoaudit.audit.records import Routes
from isoaudit.audit.worker import ComparisonWorker

from tests import factories

LAYERS = [0, 2]  # MoE layers (layer 1 is dense)
TOP_K = 2
PROMPT, COMPLETION = 4, 6
N = PROMPT + COMPLETION

#: (step, layer, position) of each planted flip: step 0 agrees everywhere.
FLIPS = [(1, 2, 5), (2, 0, 3), (2, 2, 3), (2, 2, 7)]


def _experts(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (
        np.stack([rng.choice(8, size=TOP_K, replace=False) for _ in range(n * len(LAYERS))])
        .reshape(n, len(LAYERS) * TOP_K)
        .astype(np.uint8)
    )


def routed_run(
    store: Store, run_id: str = "moe-run", steps: int = 3, project: str = "default"
) -> dict[int, str]:
    """Ingest and compare ``steps`` steps of one sample each; return each step's sample key. The
    rollout routes positions 0..N-2 (never the last sampled token); the token after each flip
    carries the step's logprob gap, so the flip explains it."""
    keys = {}
    store.ingest([factories.run(run_id)], project=project)
    for step in range(steps):
        trainer = factories.sample(
            "trainer", run_id=run_id, step=step, seed=step, prompt_len=PROMPT, n_completion=COMPLETION
        )
        experts = _experts(N, seed=100 + step)
        rollout_experts = experts[: N - 1].copy()
        gaps = np.zeros(COMPLETION, np.float32)
        for s, layer, position in FLIPS:
            if s != step:
                continue
            col = LAYERS.index(layer) * TOP_K
            chosen = set(rollout_experts[position, col : col + TOP_K].tolist())
            rollout_experts[position, col + 1] = next(e for e in range(8) if e not in chosen)
            if position + 1 >= PROMPT:
                gaps[position + 1 - PROMPT] = 0.25
        trainer.routes = Routes(
            layers=LAYERS, top_k=TOP_K, num_experts=8, positions=np.arange(N, dtype=np.int32), experts=experts
        )
        rollout = factories.sample(
            "rollout",
            run_id=run_id,
            step=step,
            seed=step,
            prompt_len=PROMPT,
            n_completion=COMPLETION,
            logprobs=(trainer.logprobs - gaps).astype(np.float32),
        )
        rollout.routes = Routes(
            layers=LAYERS,
            top_k=TOP_K,
            num_experts=8,
            positions=np.arange(N - 1, dtype=np.int32),
            experts=rollout_experts,
        )
        result = store.ingest([trainer, rollout], project=project)
        assert not result.rejected, result.rejected
        keys[step] = trainer.sample_key
    ComparisonWorker(store).run_once(run_id)
    return keys
