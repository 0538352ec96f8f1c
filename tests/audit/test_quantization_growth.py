"""Growth over steps as a quantization signature, through the comparison worker and the store: a run
whose FP8 rollout's mismatch grows from step to step (per-tensor scales) is named "grown ×k" in the
stored verdicts, one whose mismatch stays flat (block scales) "flat"; compared all at once or step by
step (then the earlier steps come from the stored step results)."""

from __future__ import annotations

import numpy as np
import pytest
from isoaudit.audit.db import Store
from isoaudit.audit.db.reads.steps import sample_detail
from isoaudit.audit.quantization_growth import GROWN, MIN_STEPS, WINDOW, trend
from isoaudit.audit.records import RuntimeFacts
from isoaudit.audit.worker import ComparisonWorker
from isoaudit.dashboard.data import evidence_items

from tests import factories

STEPS = 6
SAMPLES = 3

PER_TENSOR = {
    "weights": "e4m3 per-tensor",
    "activations": "e4m3 per-tensor dynamic",
    "kv_cache": None,
    "source": "bfloat16",
}
BLOCK = {**PER_TENSOR, "weights": "e4m3 block 128x128", "activations": "e4m3 per-token-group 1x128 dynamic"}


def _run(store: Store, run_id: str, quant: dict, size, worker: ComparisonWorker | None) -> None:
    """A run of an FP8 rollout against a bf16 trainer whose step ``s`` differs by about ``size(s)``
    per token (random signs); ``worker``: compare after each step, else not here."""
    store.ingest([factories.run(run_id, name=run_id)])
    store.ingest(
        [
            factories.manifest("trainer", "trainer_fwd", run_id, runtime=RuntimeFacts(dtype="bfloat16")),
            factories.manifest(
                "rollout", "engine_decode", run_id, runtime=RuntimeFacts(dtype="bfloat16", quant=quant)
            ),
        ]
    )
    rng = np.random.default_rng(3)
    for step in range(STEPS):
        records = []
        for i in range(SAMPLES):
            trainer = factories.sample(
                "trainer", run_id=run_id, step=step, seed=100 * step + i, n_completion=12
            )
            delta = size(step) * rng.choice([-1.0, 1.0], trainer.logprobs.size) * rng.uniform(0.8, 1.2, 12)
            logprobs = np.minimum(trainer.logprobs - delta, 0.0).astype(np.float32)
            records += [
                trainer,
                factories.sample(
                    "rollout",
                    run_id=run_id,
                    step=step,
                    seed=100 * step + i,
                    n_completion=12,
                    logprobs=logprobs,
                ),
            ]
        store.ingest(records)
        if worker is not None:
            worker.run_once()


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "step-by-step"])
def test_growth_over_steps_is_named_in_the_stored_verdicts(store: Store, batched: bool) -> None:
    worker = ComparisonWorker(store)
    _run(store, "fp8-grows", PER_TENSOR, lambda s: 0.004 * 1.8**s, None if batched else worker)
    _run(store, "mx-flat", BLOCK, lambda s: 0.01, None if batched else worker)
    worker.run_once()
    for run_id, word in (("fp8-grows", "growing"), ("mx-flat", "flat")):
        results = {r.step: r for r in store.step_results(run_id)}
        assert [results[s].diagnoses["counts"] for s in range(STEPS)] == [{"quantization": SAMPLES}] * STEPS
        for step in range(STEPS):
            for sample in store.sample_results(run_id, step):
                detail = sample.diagnosis_detail
                growth = detail["evidence"]["signature"].get("growth")
                if step + 1 < MIN_STEPS:  # too few quantization steps yet to read a trend from
                    assert growth is None and "over the last" not in detail["sentence"]
                    continue
                assert growth["trend"] == word, (run_id, step, growth)
                assert growth["steps"] == list(range(max(0, step + 1 - WINDOW), step + 1))
                values = [results[s].metrics["logprob_abs_diff_mean"] for s in growth["steps"]]
                assert growth["values"] == pytest.approx(values)
                if word == "growing":
                    assert growth["ratio"] >= GROWN and growth["slope_per_step"] > 0
                    assert (
                        f"has grown ×{growth['ratio']:.3g} over the last {len(values)}" in detail["sentence"]
                    )
                else:
                    assert 1 / GROWN < growth["ratio"] < GROWN
                    assert f"is flat over the last {len(values)} quantization steps" in detail["sentence"]
    last = store.sample_results("fp8-grows", STEPS - 1)[0]
    print(last.diagnosis_detail["sentence"])
    assert last.diagnosis_detail["evidence"]["signature"]["growth"]["ratio"] > 4  # 1.8 ** 5 first to last
    # what the sample page reads: the sentence with its growth clause, the evidence with the trend
    detail = sample_detail(store, "fp8-grows", STEPS - 1, last.sample_key)
    assert detail is not None and "has grown ×" in detail.sentence
    assert dict(evidence_items(detail.evidence))["signature"].count('"trend": "growing"') == 1


def test_trend_reads_a_robust_slope_and_ratio() -> None:
    assert trend([0, 1], [1.0, 2.0]) is None
    grown = trend([0, 1, 2, 3, 4, 5], [1.0, 1.5, 2.2, 3.4, 5.0, 7.6])
    assert grown is not None and grown["trend"] == "growing" and grown["ratio"] == pytest.approx(6.3 / 1.25)
    # one outlier does not move the Theil-Sen slope of a flat series
    flat = trend([0, 1, 2, 3, 4, 5, 6], [1.0, 1.01, 0.99, 9.0, 1.0, 1.02, 0.98])
    assert flat is not None and flat["trend"] == "flat" and abs(flat["slope_per_step"]) < 0.01
    shrunk = trend([2, 3, 4], [4.0, 2.0, 1.0])
    assert shrunk is not None and shrunk["trend"] == "shrinking" and shrunk["ratio"] == 0.25
