"""StepStats: the RL loop's own figures, stored once per step and served beside the mismatch."""

from __future__ import annotations

import math

import httpx
from isoaudit.audit.db import Store
from isoaudit.audit.records import Run, StepStats


def _stats(run: str, step: int, **figures: float) -> StepStats:
    return StepStats(run_id=run, step=step, **figures)


def test_ingest_and_read_back(store: Store) -> None:
    result = store.ingest(
        [
            Run(run_id="loop", name="loop"),
            _stats("loop", 0, reward_mean=0.25, reward_std=0.1, entropy=5.5, clip_fraction=0.05),
            StepStats(run_id="loop", step=1, reward_mean=0.5, generation_s=1.5, extras={"kl_penalty": 0.01}),
        ]
    )
    assert result.stored["step_stats"] == 2 and not result.rejected
    again = store.ingest([_stats("loop", 0, reward_mean=0.9)])  # a retried step stores nothing twice
    assert again.stored["step_stats"] == 0 and again.duplicates["step_stats"] == 1
    rows = store.step_stats("loop")
    assert [r.step for r in rows] == [0, 1]
    assert rows[0].figures() == {
        "reward_mean": 0.25,
        "reward_std": 0.1,
        "entropy": 5.5,
        "clip_fraction": 0.05,
    }
    assert rows[1].figures() == {"reward_mean": 0.5, "generation_s": 1.5, "kl_penalty": 0.01}
    assert [r.step for r in store.step_stats("loop", from_step=1)] == [1]


def test_bad_figures_are_refused_by_name_and_the_rest_stored(store: Store) -> None:
    good = _stats("loop", 3, reward_mean=1.0)
    nan = StepStats.model_construct(run_id="loop", step=4, reward_mean=math.nan)
    negative = {"kind": "step_stats", "run_id": "loop", "step": 5, "clip_fraction": 1.5}
    extra = {"kind": "step_stats", "run_id": "loop", "step": 6, "reward": 1.0}
    result = store.ingest([good, nan, negative, extra])
    assert result.stored["step_stats"] == 1
    fields = sorted((r.index, r.field) for r in result.rejected)
    assert fields == [(1, "reward_mean"), (2, "clip_fraction"), (3, "reward")]
    assert [r.step for r in store.step_stats("loop")] == [3]


def test_served_by_the_api(api: httpx.Client, other_token: str, server) -> None:
    reply = api.post(
        "/v1/ingest",
        json={
            "records": [
                {"kind": "run", "run_id": "served"},
                {"kind": "step_stats", "run_id": "served", "step": 0, "reward_mean": 0.1, "training_s": 2.0},
                {"kind": "step_stats", "run_id": "served", "step": 1, "reward_mean": 0.3},
            ]
        },
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["rejected"] == []
    rows = api.get("/v1/runs/served/step-stats").json()
    assert [(r["step"], r["figures"]) for r in rows] == [
        (0, {"reward_mean": 0.1, "training_s": 2.0}),
        (1, {"reward_mean": 0.3}),
    ]
    assert api.get("/v1/runs/served/step-stats", params={"from_step": 1}).json()[0]["step"] == 1
    foreign = httpx.get(
        f"{server.url}/v1/runs/served/step-stats", headers={"Authorization": f"Bearer {other_token}"}
    )
    assert foreign.status_code in (403, 404)


def test_sampling_params_and_weight_spans_survive_the_store(store: Store) -> None:
    """min-p and per-span weight versions go in and come back out (the off-policy lag)."""
    import numpy as np
    from isoaudit.audit.records import SampleLogprobs, WeightSpan

    tokens = np.arange(1, 9, dtype=np.int32)
    record = SampleLogprobs(
        run_id="spans",
        step=0,
        side="rollout",
        weight_version="3",
        prompt_len=3,
        token_ids=tokens,
        logprobs=np.full(5, -0.5, np.float32),
        min_p=0.05,
        weight_spans=[WeightSpan(start=0, version="3"), WeightSpan(start=2, version="4")],
    )
    bad = SampleLogprobs.model_construct(
        **{**dict(record), "weight_spans": [WeightSpan(start=9, version="4")]}
    )
    result = store.ingest([record, bad])
    assert result.stored["sample"] == 1 and [r.field for r in result.rejected] == ["weight_spans"]
    (back,) = store.samples("spans", 0)
    assert back.min_p == 0.05
    assert [(s.start, s.version) for s in back.weight_spans] == [(0, "3"), (2, "4")]
