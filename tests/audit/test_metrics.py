"""audit.metrics: hand-computed values, pooling rules and the edges (empty, one token, identical, -inf)."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from audit.metrics import (
    LENGTH_BUCKETS,
    METRIC_DESCRIPTIONS,
    SAMPLE_AVERAGED,
    SAMPLE_METRICS,
    STEP_METRICS,
    sample_and_step_metrics,
    sample_metrics,
    step_metrics,
)

F32 = np.float32


def arr(*values: float) -> np.ndarray:
    return np.array(values, dtype=F32)


def offsets_of(*lengths: int) -> np.ndarray:
    return np.r_[0, np.cumsum(lengths)].astype(np.int64)


# Exactly representable logprobs, so Δ is exact: Δ = trainer - rollout = [0.5, 0, -0.25].
T3 = arr(-1.0, -2.0, -0.5)
R3 = arr(-1.5, -2.0, -0.25)
D3 = [0.5, 0.0, -0.25]


def test_hand_computed_single_sample() -> None:
    row = sample_metrics(T3, R3, offsets_of(3)).iloc[0]
    pt = [math.exp(x) for x in (-1.0, -2.0, -0.5)]
    pr = [math.exp(x) for x in (-1.5, -2.0, -0.25)]
    dp = [abs(a - b) for a, b in zip(pt, pr, strict=True)]
    rho = [math.exp(d) for d in D3]
    mean_dp = sum(dp) / 3
    assert row["n_tokens"] == 3 and row["n_finite"] == 3 and row["n_nonfinite"] == 0
    assert row["bitwise_mismatch_count"] == 2
    assert row["exact_match_fraction"] == pytest.approx(1 / 3)
    assert row["first_diverging_position"] == 0
    assert row["rollout_probs_diff_max"] == pytest.approx(max(dp))
    assert row["rollout_probs_diff_mean"] == pytest.approx(mean_dp)
    assert row["rollout_probs_diff_std"] == pytest.approx(math.sqrt(sum((x - mean_dp) ** 2 for x in dp) / 3))
    assert row["rollout_actor_probs_pearson_corr"] == pytest.approx(np.corrcoef(pt, pr)[0, 1])
    assert row["logprob_abs_diff_mean"] == pytest.approx(0.75 / 3)
    assert row["logprob_abs_diff_max"] == pytest.approx(0.5)
    assert row["kl_k1"] == pytest.approx(-0.25 / 3)
    assert row["kl_k3"] == pytest.approx(((math.exp(0.5) - 1.5) + 0.0 + (math.exp(-0.25) - 0.75)) / 3)
    # mean rollout logprob - mean trainer logprob = (-3.75 + 3.5) / 3
    assert row["log_ppl_diff"] == pytest.approx(-0.25 / 3)
    assert row["ppl_ratio"] == pytest.approx(math.exp(-0.25 / 3))
    assert row["chi2_token"] == pytest.approx(sum(x * x for x in rho) / 3 - 1)
    assert row["is_mean"] == pytest.approx(sum(rho) / 3)
    assert row["is_std"] == pytest.approx(float(np.std(rho)))
    assert row["is_min"] == pytest.approx(math.exp(-0.25))
    assert row["is_max"] == pytest.approx(math.exp(0.5))
    ess = sum(rho) ** 2 / sum(x * x for x in rho)
    assert row["effective_sample_size"] == pytest.approx(ess)
    assert row["effective_sample_size_fraction"] == pytest.approx(ess / 3)
    # |ρ-1|: e^0.5-1 = 0.649, 0, 1-e^-0.25 = 0.221
    assert row["is_clipfrac"] == pytest.approx(2 / 3)
    assert sample_metrics(T3, R3, offsets_of(3), clip_eps=0.3).iloc[0]["is_clipfrac"] == pytest.approx(1 / 3)
    assert sample_metrics(T3, R3, offsets_of(3), clip_eps=0.7).iloc[0]["is_clipfrac"] == 0.0


def test_columns_and_descriptions() -> None:
    frame = sample_metrics(T3, R3, offsets_of(3))
    assert list(frame.columns) == [*SAMPLE_METRICS, "length_bucket"]
    step = step_metrics(T3, R3, offsets_of(3))
    assert set(step) == set(METRIC_DESCRIPTIONS)
    for name in STEP_METRICS:
        for bucket in LENGTH_BUCKETS:
            assert f"{name}/{bucket}" in step
    assert all(isinstance(v, float) for v in step.values())
    assert all(d and "\n" not in d for d in METRIC_DESCRIPTIONS.values())
    for name in (
        "rollout_probs_diff_max",
        "rollout_probs_diff_mean",
        "rollout_probs_diff_std",
        "rollout_actor_probs_pearson_corr",
        "kl_k1",
        "kl_k3",
        "log_ppl_diff",
        "ppl_ratio",
        "chi2_token",
        "is_mean",
        "is_std",
        "is_min",
        "is_max",
        "effective_sample_size",
        "logprob_abs_diff_mean",
        "logprob_abs_diff_max",
        "bitwise_mismatch_count",
        "exact_match_fraction",
        "first_diverging_position",
        "n_samples",
        "n_tokens",
    ):
        assert name in step


def random_step(
    seed: int, lengths: list[int], noise: float = 1e-2
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    rollout = np.log(rng.uniform(0.05, 1.0, n)).astype(F32)
    trainer = np.minimum(rollout + rng.normal(0, noise, n) * (rng.uniform(size=n) < 0.5), 0).astype(F32)
    return trainer, rollout, offsets_of(*lengths)


def test_per_sample_matches_each_sample_alone() -> None:
    lengths = [5, 1, 300, 0, 17]
    t, r, o = random_step(1, lengths)
    frame = sample_metrics(t, r, o)
    for i in range(len(lengths)):
        alone = sample_metrics(t[o[i] : o[i + 1]], r[o[i] : o[i + 1]], offsets_of(lengths[i])).iloc[0]
        for name in SAMPLE_METRICS:
            a, b = frame.iloc[i][name], alone[name]
            assert (np.isnan(a) and np.isnan(b)) or a == pytest.approx(b, rel=1e-12, abs=1e-15), (i, name)


def test_step_is_token_weighted_and_ppl_is_sample_averaged() -> None:
    lengths = [5, 1, 300, 0, 17]
    t, r, o = random_step(2, lengths)
    step = step_metrics(t, r, o)
    pooled = sample_metrics(t, r, offsets_of(len(t))).iloc[0]
    token_weighted = [n for n in SAMPLE_METRICS if n not in SAMPLE_AVERAGED | {"first_diverging_position"}]
    for name in token_weighted:
        if np.isnan(pooled[name]):  # top-k entropies: none recorded
            assert np.isnan(step[name]), name
            continue
        assert step[name] == pytest.approx(pooled[name], rel=1e-9, abs=1e-12), name
    frame = sample_metrics(t, r, o)
    assert step["log_ppl_diff"] == pytest.approx(frame["log_ppl_diff"].dropna().mean())
    assert step["ppl_ratio"] == pytest.approx(frame["ppl_ratio"].dropna().mean())
    assert step["n_samples"] == 5.0
    assert step["n_tokens"] == float(sum(lengths))
    firsts = frame["first_diverging_position"]
    assert step["first_diverging_position"] == float(firsts[firsts >= 0].min())
    assert step["diverged_sample_fraction"] == pytest.approx((frame["bitwise_mismatch_count"] > 0).mean())


def test_one_pass_equals_the_two_functions() -> None:
    t, r, o = random_step(6, [3, 0, 400, 2100])
    frame, step = sample_and_step_metrics(t, r, o)
    assert frame.equals(sample_metrics(t, r, o))
    expected = step_metrics(t, r, o)
    assert step.keys() == expected.keys()
    assert all(step[k] == expected[k] or (math.isnan(step[k]) and math.isnan(expected[k])) for k in step)


def test_length_buckets_equal_the_subset() -> None:
    lengths = [10, 300, 20, 700, 3000, 255, 256]
    t, r, o = random_step(3, lengths)
    step = step_metrics(t, r, o)
    small = [0, 2, 5]  # lengths < 256
    idx = np.concatenate([np.arange(o[i], o[i + 1]) for i in small])
    sub = step_metrics(t[idx], r[idx], offsets_of(*[lengths[i] for i in small]))
    for name in STEP_METRICS:
        a, b = step[f"{name}/len_0_256"], sub[name]
        assert a == pytest.approx(b, rel=1e-12, nan_ok=True), name
    assert step["n_samples/len_256_512"] == 2.0
    assert step["n_samples/len_512_1024"] == 1.0
    assert step["n_samples/len_1024_2048"] == 0.0
    assert math.isnan(step["kl_k3/len_1024_2048"])
    assert step["n_samples/len_2048_inf"] == 1.0


def test_identical_sides_are_exactly_zero() -> None:
    t, _, o = random_step(4, [50, 1, 7])
    t[3] = -np.inf  # identical -inf on both sides: bits agree, excluded from statistics
    step = step_metrics(t, t.copy(), o)
    frame = sample_metrics(t, t.copy(), o)
    for values in [step, *(frame.iloc[i] for i in range(3))]:
        for name in (
            "kl_k1",
            "kl_k3",
            "chi2_token",
            "logprob_abs_diff_mean",
            "logprob_abs_diff_max",
            "rollout_probs_diff_max",
            "rollout_probs_diff_mean",
            "rollout_probs_diff_std",
            "log_ppl_diff",
            "is_std",
            "bitwise_mismatch_count",
            "is_clipfrac",
        ):
            assert values[name] == 0.0 and math.copysign(1.0, values[name]) == 1.0, name
        for name in (
            "exact_match_fraction",
            "is_mean",
            "is_min",
            "is_max",
            "ppl_ratio",
            "rollout_actor_probs_pearson_corr",
            "effective_sample_size_fraction",
        ):
            assert values[name] == 1.0, name
        assert values["first_diverging_position"] == -1
    assert step["n_nonfinite"] == 1.0


def test_empty_step_and_empty_sample() -> None:
    empty = np.array([], dtype=F32)
    frame = sample_metrics(empty, empty, np.array([0]))
    assert len(frame) == 0 and list(frame.columns) == [*SAMPLE_METRICS, "length_bucket"]
    step = step_metrics(empty, empty, np.array([0]))
    assert step["n_samples"] == 0.0 and step["n_tokens"] == 0.0
    assert math.isnan(step["kl_k3"]) and math.isnan(step["exact_match_fraction"])
    assert step["first_diverging_position"] == -1.0
    row = sample_metrics(empty, empty, np.array([0, 0])).iloc[0]
    assert (
        row["n_tokens"] == 0 and row["bitwise_mismatch_count"] == 0 and row["first_diverging_position"] == -1
    )
    for name in (
        "kl_k1",
        "kl_k3",
        "rollout_probs_diff_mean",
        "is_mean",
        "log_ppl_diff",
        "ppl_ratio",
        "effective_sample_size",
        "rollout_actor_probs_pearson_corr",
        "exact_match_fraction",
    ):
        assert math.isnan(row[name]), name


def test_one_token() -> None:
    row = sample_metrics(arr(-1.0), arr(-1.25), offsets_of(1)).iloc[0]
    assert row["kl_k1"] == pytest.approx(-0.25)
    assert row["kl_k3"] == pytest.approx(math.exp(0.25) - 1.25)
    assert row["rollout_probs_diff_std"] == 0.0 and row["is_std"] == 0.0
    assert row["effective_sample_size"] == pytest.approx(1.0)
    assert math.isnan(row["rollout_actor_probs_pearson_corr"])  # one point has no correlation
    assert row["first_diverging_position"] == 0 and row["bitwise_mismatch_count"] == 1


def test_neg_inf_on_one_side_is_a_mismatch_excluded_from_statistics() -> None:
    t = arr(-1.0, -np.inf, -0.5, -2.0)
    r = arr(-1.5, -3.0, -0.25, -2.0)
    row = sample_metrics(t, r, offsets_of(4)).iloc[0]
    without = sample_metrics(np.delete(t, 1), np.delete(r, 1), offsets_of(3)).iloc[0]
    assert row["n_nonfinite"] == 1 and row["n_finite"] == 3
    assert row["bitwise_mismatch_count"] == 3
    assert row["exact_match_fraction"] == pytest.approx(1 / 4)
    for name in (
        "kl_k1",
        "kl_k3",
        "chi2_token",
        "is_mean",
        "is_max",
        "is_min",
        "rollout_probs_diff_max",
        "rollout_probs_diff_mean",
        "logprob_abs_diff_max",
        "log_ppl_diff",
        "rollout_actor_probs_pearson_corr",
        "effective_sample_size",
        "is_clipfrac",
    ):
        assert row[name] == without[name], name
    only_inf = sample_metrics(arr(-np.inf), arr(-1.0), offsets_of(1)).iloc[0]
    assert only_inf["bitwise_mismatch_count"] == 1 and only_inf["first_diverging_position"] == 0
    assert math.isnan(only_inf["kl_k3"]) and math.isnan(only_inf["is_max"])


def test_bitwise_semantics_and_first_divergence() -> None:
    t = arr(-1.0, -0.0, -2.0, -3.0, -4.0)
    r = arr(-1.0, 0.0, -2.0, np.nextafter(F32(-3.0), F32(0)), -4.0)
    row = sample_metrics(t, r, offsets_of(5)).iloc[0]
    assert row["bitwise_mismatch_count"] == 2  # -0.0 vs +0.0 and one ulp at index 3
    assert row["first_diverging_position"] == 1
    frame = sample_metrics(t, r, offsets_of(1, 4))
    assert list(frame["first_diverging_position"]) == [-1, 0]
    assert list(frame["bitwise_mismatch_count"]) == [0, 2]


def test_extreme_ratios_stay_finite() -> None:
    row = sample_metrics(arr(-0.0, -1e4), arr(-1e4, -0.0), offsets_of(2)).iloc[0]
    assert np.isfinite(row["is_max"]) and row["is_max"] == pytest.approx(math.exp(20.0))
    assert row["is_min"] == pytest.approx(math.exp(-20.0))
    assert row["is_clipfrac"] == 1.0


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"trainer_lp": arr(-1.0), "rollout_lp": arr(-1.0, -2.0), "offsets": offsets_of(1)}, "rollout_lp"),
        ({"trainer_lp": arr(-1.0, -2.0), "rollout_lp": arr(-1.0, -2.0), "offsets": offsets_of(1)}, "offsets"),
        (
            {"trainer_lp": arr(-1.0, -2.0), "rollout_lp": arr(-1.0, -2.0), "offsets": np.array([0, 2, 1, 2])},
            "offsets",
        ),
        (
            {"trainer_lp": np.zeros((2, 2), F32), "rollout_lp": arr(-1.0), "offsets": offsets_of(1)},
            "trainer_lp",
        ),
    ],
)
def test_bad_inputs_name_the_argument(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        step_metrics(**kwargs)
    with pytest.raises(ValueError, match="clip_eps"):
        step_metrics(T3, R3, offsets_of(3), clip_eps=0.0)


def test_a_full_step_is_fast() -> None:
    """1,024 samples × 2,048 tokens: per-sample and per-step metrics well inside the 2 s budget."""
    rng = np.random.default_rng(5)
    n = 1024 * 2048
    r = np.log(rng.uniform(0.01, 1.0, n)).astype(F32)
    t = np.minimum(r + rng.normal(0, 1e-3, n), 0).astype(F32)
    o = np.arange(0, n + 1, 2048, dtype=np.int64)
    sample_metrics(t[:4096], r[:4096], o[:3])  # warm-up
    start = time.perf_counter()
    sample_metrics(t, r, o)
    step_metrics(t, r, o)
    assert time.perf_counter() - start < 1.0
    start = time.perf_counter()
    sample_and_step_metrics(t, r, o)
    assert time.perf_counter() - start < 0.5
