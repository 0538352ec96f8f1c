"""The per-step aggregates the worker stores for the dashboard (audit.summaries)."""

from __future__ import annotations

import numpy as np
from isoaudit.audit.db.models import StepSummaryRow
from isoaudit.audit.summaries import (
    POSITION_BIN_EDGES,
    Verdict,
    bin_label,
    first_divergence_counts,
    position_bins,
)
from isoaudit.audit.worker import ComparisonWorker
from sqlalchemy import delete, select

from tests import factories as f
from tests.dashboard.records import DIVERGING, fill, step_records


def test_bin_edges_are_fixed_and_labelled():
    assert POSITION_BIN_EDGES[0] == 0 and np.all(np.diff(POSITION_BIN_EDGES) > 0)
    assert POSITION_BIN_EDGES[16] == 256 and bin_label(0) == "0–15" and bin_label(16) == "256–319"
    assert bin_label(len(POSITION_BIN_EDGES) - 1).endswith("+")


def test_position_bins_match_a_direct_computation():
    rng = np.random.default_rng(0)
    pairs = []
    for i, n in enumerate((5, 40, 300)):
        t = f.sample("trainer", seed=i, n_completion=n)
        r = f.sample(
            "rollout", seed=i, n_completion=n, logprobs=t.logprobs - rng.random(n).astype(np.float32) * 0.1
        )
        pairs.append((t, r))
    bins = position_bins(pairs)
    # 300 tokens reach the bin [256, 320): 17 bins.
    assert len(bins["mean"]) == 17
    for b in (0, 2, 16):
        lo, hi = POSITION_BIN_EDGES[b], POSITION_BIN_EDGES[b + 1]
        values = [
            (abs(float(t.logprobs[p]) - float(r.logprobs[p])), t.sample_key)
            for t, r in pairs
            for p in range(t.logprobs.size)
            if lo <= p < hi
        ]
        assert bins["count"][b] == len(values)
        assert np.isclose(bins["mean"][b], np.mean([v for v, _ in values]))
        best = max(values)
        assert np.isclose(bins["max"][b], best[0]) and bins["max_key"][b] == best[1]


def test_nonfinite_tokens_are_left_out_and_empty_input_is_empty():
    # A -inf logprob on both sides (a token the sampler could not have drawn) gives a NaN Δ.
    t = f.sample("trainer", n_completion=3).model_copy(
        update={"logprobs": np.array([-1.0, -np.inf, -0.5], np.float32)}
    )
    r = f.sample("rollout", n_completion=3).model_copy(
        update={"logprobs": np.array([-1.5, -np.inf, -0.5], np.float32)}
    )
    bins = position_bins([(t, r)])
    assert bins["count"] == [2] and np.isclose(bins["mean"][0], 0.25) and np.isclose(bins["max"][0], 0.5)
    assert position_bins([]) == {"count": [], "mean": [], "max": [], "max_key": []}


def test_first_divergence_counts_keep_an_example():
    outcomes = [Verdict("b", "numerical", "layers.1.mlp"), Verdict("a", "numerical", "layers.1.mlp"),
                Verdict("c", "clean", None)]  # fmt: skip
    assert first_divergence_counts(outcomes) == {"layers.1.mlp": {"count": 2, "example": "a"}}


def test_the_worker_stores_one_summary_per_compared_step(store):
    fill(store, steps=2, samples=3)
    with store.sessions() as session:
        rows = list(session.scalars(select(StepSummaryRow).order_by(StepSummaryRow.step)))
    assert [r.step for r in rows] == [0, 1]
    row = rows[0]
    assert row.n_samples == 3 and row.n_fingerprinted == 3 and row.n_tokens == 10 + 18 + 26
    assert row.first_divergence[DIVERGING]["count"] == 1
    assert sum(row.diagnoses.values()) == 3 and row.ingested_at is not None
    assert len(row.position_bins["max"]) == 2  # 26 tokens: bins 0-15 and 16-31
    # A late sample re-queues the step: the summary is rewritten to cover old and new samples.
    late = [r for r in step_records("run-1", 0, samples=4) if getattr(r, "sample_key", None)]
    store.ingest(late)
    ComparisonWorker(store).run_once()
    with store.sessions() as session:
        again = session.get(StepSummaryRow, ("run-1", 0))
    assert again.n_samples == 4 and sum(again.diagnoses.values()) == 4
    assert again.first_divergence[DIVERGING]["count"] == 2


def test_steps_compared_before_summaries_existed_are_backfilled(store):
    fill(store, steps=2, samples=3)
    with store.sessions.begin() as session:
        expected = session.get(StepSummaryRow, ("run-1", 1)).first_divergence
        session.execute(delete(StepSummaryRow))
    worker = ComparisonWorker(store)
    assert worker.backfill(limit=1) == 1 and worker.backfill(limit=5) == 1 and worker.backfill() == 0
    with store.sessions() as session:
        row = session.get(StepSummaryRow, ("run-1", 1))
    assert row.first_divergence == expected and row.n_samples == 3 and sum(row.diagnoses.values()) == 3
