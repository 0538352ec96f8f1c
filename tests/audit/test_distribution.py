"""The full-distribution metrics (audit.distribution) on hand-built distributions: the sketch's
estimator and its stated error, TV/KL on the top-k union, and what counts as "differs"."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from isoaudit.audit.distribution import (
    DISTRIBUTION_METRICS,
    SKETCH_DIM,
    distribution_metrics,
    position_distances,
    sketch_hellinger,
    sketch_projection,
    step_distribution_metrics,
)
from isoaudit.audit.metric_names import canonical_names, definition


def side(logprob_rows: np.ndarray, sampled: np.ndarray, k: int = 8, sketch: bool = True) -> SimpleNamespace:
    """What a collector records from full log-probability rows: sampled logprobs, top-k, sketch."""
    order = np.argsort(-logprob_rows, axis=1, kind="stable")[:, :k]
    return SimpleNamespace(
        logprobs=logprob_rows[np.arange(len(sampled)), sampled].astype(np.float32),
        topk_ids=order.astype(np.int32),
        topk_logprobs=np.take_along_axis(logprob_rows, order, axis=1).astype(np.float32),
        dist_sketch=(
            np.exp(logprob_rows / 2) @ sketch_projection(logprob_rows.shape[1]).astype(np.float64)
        ).astype(np.float32)
        if sketch
        else None,
    )


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def test_projection_is_fixed_signs_keyed_by_token() -> None:
    a, b = sketch_projection(1000), sketch_projection(50)
    assert a.shape == (1000, SKETCH_DIM) and a.dtype == np.float32
    np.testing.assert_array_equal(a[:50], b)  # a row depends on the token id only
    assert set(np.unique(a)) == {np.float32(-(SKETCH_DIM**-0.5)), np.float32(SKETCH_DIM**-0.5)}
    assert abs(float(a.mean())) < 0.01


def test_sketch_estimates_hellinger_within_the_stated_error() -> None:
    """Ĥ² is unbiased for H² with relative standard deviation at most √(2/32) = 0.25."""
    rng = np.random.default_rng(0)
    vocab, n = 32000, 400
    z = rng.normal(0, 3, (n, vocab))
    p = log_softmax(z)
    q = log_softmax(z + rng.normal(0, 0.05, (n, vocab)) * rng.uniform(0.1, 3, (n, 1)))
    truth = np.linalg.norm(np.exp(p / 2) - np.exp(q / 2), axis=1) / np.sqrt(2)
    sampled = np.zeros(n, dtype=np.int64)
    est = sketch_hellinger(side(p, sampled).dist_sketch, side(q, sampled).dist_sketch)
    ratio2 = (est / truth) ** 2
    assert abs(float(ratio2.mean()) - 1) < 0.05, ratio2.mean()
    assert float(ratio2.std()) < 0.3, ratio2.std()


def test_union_metrics_and_what_counts_as_differs() -> None:
    rng = np.random.default_rng(1)
    vocab = 64
    z = rng.normal(0, 2, (5, vocab))
    p = log_softmax(z).astype(np.float32)
    sampled = np.argmax(p, axis=1)
    same = distribution_metrics(side(p, sampled), side(p.copy(), sampled))
    assert (
        same["dist_differs_positions"] == 0
        and same["dist_union_tv_max"] == 0
        and same["dist_union_kl_max"] == 0
    )
    assert same["dist_topk_overlap"] == 1 and same["dist_sketch_hellinger_max"] == 0
    assert np.isnan(same["dist_first_differs_position"])

    # position 2: a token from outside the top-8 swaps with the 2nd most likely; the sampled token keeps its bits
    q = p.copy()
    order = np.argsort(-p[2])
    q[2, order[1]], q[2, order[20]] = p[2, order[20]], p[2, order[1]]
    found = position_distances(side(p, sampled), side(q, sampled))
    assert found is not None and found.differs.tolist() == [False, False, True, False, False]
    assert found.sampled_equal.all() and found.overlap[2] == 7 / 8
    m = distribution_metrics(side(p, sampled), side(q, sampled))
    assert m["dist_sampled_equal_differs"] == 1 and m["dist_first_differs_position"] == 2
    assert m["dist_union_tv_max"] > 0.01 and m["dist_sketch_hellinger_max"] > 0.01
    # the true TV is |p1 - p20|; on the union the missing entries stand in at the k-th probability
    true_tv = abs(np.exp(p[2, order[1]]) - np.exp(p[2, order[20]]))
    assert 0.5 * true_tv < m["dist_union_tv_max"] <= true_tv + 1e-6

    # without sketches (vLLM logprobs=k): the top-k alone decides, the sketch figures are NaN
    m = distribution_metrics(side(p, sampled, sketch=False), side(q, sampled, sketch=False))
    assert m["dist_sampled_equal_differs"] == 1 and np.isnan(m["dist_sketch_hellinger_mean"])
    # a side with no top-k: nothing to say
    assert distribution_metrics(SimpleNamespace(topk_ids=None), side(p, sampled)) == {}

    step = step_distribution_metrics(
        [(side(p, sampled), side(q, sampled)), (side(p, sampled), side(p, sampled))]
    )
    assert step["dist_positions"] == 10 and step["dist_sampled_equal_differs"] == 1


def test_masked_tokens_and_unequal_k() -> None:
    """-inf (a sampler's mask) is a probability of 0; k is the smaller side's."""
    with np.errstate(divide="ignore"):
        p = np.log(np.array([[0.5, 0.3, 0.2, 0.0, 0.0, 0.0]], dtype=np.float32))
        q = np.log(np.array([[0.5, 0.3, 0.1, 0.1, 0.0, 0.0]], dtype=np.float32))
    sampled = np.array([0])
    found = position_distances(side(p, sampled, k=4), side(q, sampled, k=3))
    assert found is not None and found.k == 3
    assert found.differs[0] and found.sampled_equal[0]
    assert found.tv[0] == pytest.approx(0.1, abs=1e-6)


def test_every_figure_is_described() -> None:
    for name, line in DISTRIBUTION_METRICS.items():
        assert definition(name) == line and name in canonical_names()
