"""The comparator measures a large step's tokens once: the per-sample metrics and the step's figures
come from one pass and are handed on to ``step_summary`` (small steps share one frame and get their
figures from ``step_summary``). Either way, what the worker stores must be exactly what the public
definitions (``audit.metrics``, ``audit.summaries.POSITION_BIN_EDGES``) give."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from isoaudit.audit import compare as compare_module
from isoaudit.audit.compare import compare_samples, framework_tokens, in_step_order, step_summary
from isoaudit.audit.db import Store
from isoaudit.audit.db.models import StepSummaryRow
from isoaudit.audit.frameworks import framework_figures
from isoaudit.audit.metric_names import required_variants
from isoaudit.audit.metrics import UNKNOWN_LAG, lag_metrics, sample_metrics, step_metrics
from isoaudit.audit.policy_lag import token_lags
from isoaudit.audit.records import Run, SampleLogprobs
from isoaudit.audit.summaries import POSITION_BIN_EDGES, position_bins
from isoaudit.audit.worker import ComparisonWorker
from sqlalchemy import select

from tests import factories

RUN = "run-1"
Pair = tuple[SampleLogprobs, SampleLogprobs]


def synthetic_step(step: int, n: int = 5, *, undrawable: bool = True) -> list[Pair]:
    """Samples of different lengths (one past the 256-token bins), small noise on 30% of the tokens,
    a stale rollout weight version (policy lag 1), one sample with identical sides and, when
    ``undrawable``, one token neither side could have drawn (-inf on both: no Δ; the store refuses
    such records, the comparator must still leave them out)."""
    rng = np.random.default_rng(100 + step)
    pairs = []
    for i in range(n):
        length = (3, 40, 300, 17, 64)[i % 5]
        trainer = factories.sample(
            "trainer", run_id=RUN, step=step, seed=10 * step + i, n_completion=length, weight_version="7"
        )
        noise = (rng.random(length) < 0.3) * rng.normal(0, 1e-2, length)
        rollout_lp = (
            trainer.logprobs if i == 3 else np.minimum(trainer.logprobs + noise, 0).astype(np.float32)
        )
        rollout = factories.sample(
            "rollout",
            run_id=RUN,
            step=step,
            seed=10 * step + i,
            n_completion=length,
            logprobs=rollout_lp,
            weight_version="6",
        )
        if i == 2 and undrawable:
            lp_t, lp_r = trainer.logprobs.copy(), rollout.logprobs.copy()
            lp_t[5] = lp_r[5] = -np.inf
            trainer = trainer.model_copy(update={"logprobs": lp_t})
            rollout = rollout.model_copy(update={"logprobs": lp_r})
        pairs.append((trainer, rollout))
    return pairs


@pytest.fixture(params=["one pass", "small steps"])
def one_pass(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways of measuring a step: with its figures in one pass (as a large step is), or its
    samples in the batch's frame and its figures apart (as a small one is)."""
    if request.param == "one pass":
        monkeypatch.setattr(compare_module, "ONE_PASS_TOKENS", 0)
    return request.param == "one pass"


def stored(value: Any) -> Any:
    """A figure as the store keeps it: JSON has no NaN or inf."""
    value = value.item() if isinstance(value, np.generic) else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def expected_sample_metrics(pairs: list[Pair]) -> dict[str, dict[str, Any]]:
    """Each sample's metrics by the public definitions, over its step's tokens in key order."""
    ordered = in_step_order(pairs)
    offsets = np.r_[0, np.cumsum([t.logprobs.size for t, _ in ordered])]
    frame = sample_metrics(
        np.concatenate([t.logprobs for t, _ in ordered]),
        np.concatenate([r.logprobs for _, r in ordered]),
        offsets,
    )
    out = {}
    for (trainer, rollout), row in zip(ordered, frame.to_dict("records"), strict=True):
        lags = token_lags(trainer, rollout)
        known = lags[lags != UNKNOWN_LAG]
        row.update(policy_lag_max=int(known.max()), policy_lag_min=int(known.min()))
        out[trainer.sample_key] = {k: stored(v) for k, v in row.items()}
    return out


def expected_step_metrics(pairs: list[Pair], clip_eps: float = 0.2) -> dict[str, Any]:
    ordered = in_step_order(pairs)
    offsets = np.r_[0, np.cumsum([t.logprobs.size for t, _ in ordered])]
    trainer = np.concatenate([t.logprobs for t, _ in ordered])
    rollout = np.concatenate([r.logprobs for _, r in ordered])
    metrics = step_metrics(trainer, rollout, offsets, clip_eps=clip_eps, variants=required_variants())
    metrics.update(
        lag_metrics(trainer, rollout, offsets, np.concatenate([token_lags(t, r) for t, r in ordered]))
    )
    metrics.update(framework_figures(framework_tokens(ordered)))
    return {k: stored(v) for k, v in metrics.items()}


def expected_position_bins(pairs: list[Pair]) -> dict[str, list[Any]]:
    """Token by token, from the bin edges alone: count, mean (summed in token order), max and the
    last sample (in the order given) holding it."""
    n_bins = int(np.searchsorted(POSITION_BIN_EDGES, max(t.logprobs.size for t, _ in pairs) - 1, "right"))
    seen: list[list[tuple[float, str]]] = [[] for _ in range(n_bins)]
    for trainer, rollout in pairs:
        for position, (a, b) in enumerate(
            zip(trainer.logprobs.tolist(), rollout.logprobs.tolist(), strict=True)
        ):
            delta = abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.nan
            if math.isfinite(delta):
                seen[int(np.searchsorted(POSITION_BIN_EDGES, position, "right")) - 1].append(
                    (delta, trainer.sample_key)
                )
    out: dict[str, list[Any]] = {"count": [], "mean": [], "max": [], "max_key": []}
    for values in seen:
        top = max((v for v, _ in values), default=None)
        out["count"].append(len(values))
        out["mean"].append(sum(v for v, _ in values) / len(values) if values else None)
        out["max"].append(top)
        out["max_key"].append([k for v, k in values if v == top][-1] if values else None)
    return out


def test_the_worker_stores_exactly_the_public_definitions(store: Store, one_pass: bool):
    steps = {step: synthetic_step(step, undrawable=False) for step in range(3)}
    store.ingest([Run(run_id=RUN, name=RUN)])
    for pairs in steps.values():
        store.ingest([record for pair in pairs for record in pair])
    # One pass of the worker compares all three steps in one batch, as it does in production.
    assert ComparisonWorker(store).run_once() == 15
    results = {(r.step, r.sample_key): r for r in store.sample_results(RUN)}
    step_rows = {r.step: r for r in store.step_results(RUN)}
    with store.sessions() as session:
        summaries = {row.step: row for row in session.scalars(select(StepSummaryRow))}
    for step, pairs in steps.items():
        for key, metrics in expected_sample_metrics(pairs).items():
            assert results[(step, key)].metrics == metrics
        assert step_rows[step].metrics == expected_step_metrics(pairs)
        assert summaries[step].position_bins == expected_position_bins(in_step_order(pairs))


def test_step_figures_are_handed_on_and_equal_the_ones_computed_afresh(one_pass: bool):
    pairs = [pair for step in range(3) for pair in synthetic_step(step)]
    shuffled = [pairs[i] for i in np.random.default_rng(0).permutation(len(pairs))]
    comparisons = compare_samples(shuffled)
    assert [c.sample_key for c in comparisons] == [t.sample_key for t, _ in shuffled]
    assert all((c.step_figures is not None) == one_pass for c in comparisons)
    for step in range(3):
        expected = expected_sample_metrics([p for p in shuffled if p[0].step == step])
        for c in (c for c in comparisons if c.step == step):
            assert {k: stored(v) for k, v in c.metrics.items()} == expected[c.sample_key]
    for step in range(3):
        mine = [c for c in comparisons if c.step == step]
        step_pairs = [p for p in shuffled if p[0].step == step]
        # Taken from the comparisons: the same figures whatever order the caller holds the pairs in.
        handed_on = step_summary(step_pairs, mine)
        assert handed_on["metrics"] == expected_step_metrics(step_pairs)
        assert step_summary(list(reversed(step_pairs)), mine) == handed_on
        # Comparisons of part of the step carry figures of that part only: computed afresh.
        part = compare_samples(step_pairs[:2])
        assert step_summary(step_pairs, part)["metrics"] == handed_on["metrics"]
        # Figures at another clip ε are computed afresh, not taken from the comparisons' 0.2.
        tight = step_summary(step_pairs, mine, clip_eps=0.005)["metrics"]
        assert tight == expected_step_metrics(step_pairs, clip_eps=0.005)
        assert tight["is_clipfrac"] > handed_on["metrics"]["is_clipfrac"]


def test_position_bin_maxima_equal_the_token_by_token_definition_ties_included():
    pairs = synthetic_step(0)
    # Two samples holding the same largest |Δ| in the first bin: the later one is named.
    tie = [
        (
            factories.sample("trainer", seed=50 + i, n_completion=20, logprobs=np.full(20, -1.0, np.float32)),
            factories.sample("rollout", seed=50 + i, n_completion=20, logprobs=np.full(20, -3.0, np.float32)),
        )
        for i in range(2)
    ]
    for case in (pairs, pairs + tie, tie + pairs[::-1]):
        assert position_bins(case) == expected_position_bins(case)
    assert position_bins(pairs + tie)["max_key"][0] == tie[1][0].sample_key
