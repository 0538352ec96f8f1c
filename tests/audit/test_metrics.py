"""isoaudit.audit.metrics: hand-computed values, pooling rules and the edges (empty, one token, identical, -inf)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import pytest
from isoaudit.audit.metrics import (
    LENGTH_BUCKETS,
    METRIC_DESCRIPTIONS,
    PARAMETRIC,
    SAMPLE_AVERAGED,
    SAMPLE_METRICS,
    STEP_METRICS,
    UNKNOWN_LAG,
    lag_metrics,
    parse_variant,
    sample_and_step_metrics,
    sample_metrics,
    step_metrics,
    topk_entropy,
    variant_key,
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
    assert set(step) == set(METRIC_DESCRIPTIONS) | set(PARAMETRIC)
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
    """1,024 samples × 2,048 tokens: per-sample and per-step metrics (threshold figures included)
    inside a 2 s budget (about 0.6 s on an idle core). Best of three runs, so the other processes of a shared 2-core machine
    do not decide the outcome."""
    rng = np.random.default_rng(5)
    n = 1024 * 2048
    r = np.log(rng.uniform(0.01, 1.0, n)).astype(F32)
    t = np.minimum(r + rng.normal(0, 1e-3, n), 0).astype(F32)
    o = np.arange(0, n + 1, 2048, dtype=np.int64)
    sample_metrics(t[:4096], r[:4096], o[:3])  # warm-up

    def best(run: Callable[[], object]) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return min(times)

    assert best(lambda: (sample_metrics(t, r, o), step_metrics(t, r, o))) < 2.0
    assert best(lambda: sample_and_step_metrics(t, r, o)) < 1.2


# --------------------------------------------------------------- framework figures, by hand
# Two samples: A has Δ = [0.5, 0, -0.25] (T3, R3), B has Δ = [1.0]; every value below is computed
# with math from those numbers, not with audit.metrics.
TA, RA = [-1.0, -2.0, -0.5], [-1.5, -2.0, -0.25]
TB, RB = [-0.125], [-1.125]
DELTAS = [0.5, 0.0, -0.25, 1.0]


def two_samples(**kwargs):
    return step_metrics(arr(*TA, *TB), arr(*RA, *RB), offsets_of(3, 1), **kwargs)


def k3(x: float) -> float:
    return math.exp(x) - x - 1.0


def test_divergence_figures_by_hand() -> None:
    step = two_samples()
    n = len(DELTAS)
    assert step["kl_k2"] == pytest.approx(sum(d * d / 2 for d in DELTAS) / n)
    assert step["kl_k3_reverse"] == pytest.approx(sum(math.exp(-d) + d - 1 for d in DELTAS) / n)
    js = 0.0
    for t, r in zip(TA + TB, RA + RB, strict=True):
        m = math.log((math.exp(t) + math.exp(r)) / 2)
        js += 0.5 * k3(t - m) + 0.5 * k3(r - m)
    assert step["js_divergence"] == pytest.approx(js / n, rel=1e-9)
    assert step["token_mult_prob_error"] == pytest.approx(sum(math.exp(abs(d)) for d in DELTAS) / n)
    absd = [abs(d) for d in DELTAS]
    mean_abs = sum(absd) / n
    assert step["logprob_abs_diff_std"] == pytest.approx(
        math.sqrt(sum((a - mean_abs) ** 2 for a in absd) / n)
    )


def test_per_sample_reductions_by_hand() -> None:
    step = two_samples()
    # sample means first, then the mean over the two samples (slime's reduction, verl's PPL figures)
    assert step["logprob_abs_diff_sample_mean"] == pytest.approx((0.75 / 3 + 1.0) / 2)
    assert step["kl_k1_sample_mean"] == pytest.approx((-0.25 / 3 + -1.0) / 2)
    assert step["kl_k3_sample_mean"] == pytest.approx(((k3(0.5) + 0 + k3(-0.25)) / 3 + k3(1.0)) / 2)
    lpd = [(sum(RA) - sum(TA)) / 3, RB[0] - TB[0]]  # mean rollout lp - mean trainer lp
    assert step["log_ppl_diff"] == pytest.approx(sum(lpd) / 2)
    assert step["log_ppl_abs_diff"] == pytest.approx((abs(lpd[0]) + abs(lpd[1])) / 2)
    assert step["log_ppl_diff_max"] == pytest.approx(max(lpd))
    assert step["log_ppl_diff_min"] == pytest.approx(min(lpd))
    assert step["training_ppl"] == pytest.approx((math.exp(-sum(TA) / 3) + math.exp(-TB[0])) / 2)
    assert step["rollout_ppl"] == pytest.approx((math.exp(-sum(RA) / 3) + math.exp(-RB[0])) / 2)
    assert step["training_log_ppl"] == pytest.approx((-sum(TA) / 3 - TB[0]) / 2)
    assert step["rollout_log_ppl"] == pytest.approx((-sum(RA) / 3 - RB[0]) / 2)
    assert step["chi2_seq"] == pytest.approx((math.exp(2 * 0.25) + math.exp(2 * 1.0)) / 2 - 1)


def test_truncated_importance_weights_by_hand() -> None:
    step = two_samples(variants=["tis_mean[cap=3]", "is_fraction_high[aggregate=sample]"])
    rho = [math.exp(d) for d in DELTAS]
    w = [min(x, 2.0) for x in rho]  # verl's default rollout_is_threshold
    mean_w = sum(w) / 4
    assert step["tis_mean"] == pytest.approx(mean_w)
    assert step["tis_std"] == pytest.approx(math.sqrt(sum((x - mean_w) ** 2 for x in w) / 4))
    assert step["tis_min"] == pytest.approx(math.exp(-0.25)) and step["tis_max"] == 2.0
    assert step["tis_ess_fraction"] == pytest.approx(sum(w) ** 2 / (4 * sum(x * x for x in w)))
    assert step["tis_mean[cap=3]"] == pytest.approx(sum(min(x, 3.0) for x in rho) / 4)  # TRL's cap
    seq_means = [sum(w[:3]) / 3, w[3]]
    assert step["tis_seq_mean"] == pytest.approx(sum(seq_means) / 2)
    assert step["tis_seq_max"] == pytest.approx(2.0) and step["tis_seq_min"] == pytest.approx(seq_means[0])
    assert step["tis_seq_max_deviation"] == pytest.approx(1.0)
    assert step["is_fraction_high"] == pytest.approx(1 / 4)  # e^1 > 2
    assert step["is_fraction_high[aggregate=sample]"] == pytest.approx((0 / 3 + 1 / 1) / 2)
    assert step["is_fraction_low"] == 0.0  # nothing below 0.5
    assert step["is_seq_fraction_high"] == pytest.approx(1 / 2)  # sample B's mean weight e > 2
    assert step["is_oob_fraction"] == 0.0  # all inside [0.5, 5]


def test_bounds_are_parameters() -> None:
    step = two_samples(variants=["is_oob_fraction[upper=2]", "geo_oob_seq_fraction[upper=2]"])
    assert step["is_oob_fraction[upper=2]"] == pytest.approx(1 / 4)
    # geometric means exp(mean Δ): A exp(0.25/3) = 1.087, B e = 2.718
    assert step["geo_oob_seq_fraction[upper=2]"] == pytest.approx(1 / 2)
    assert variant_key("tis_mean", {"cap": 2.0}) == "tis_mean"
    assert (
        variant_key("is_oob_fraction", {"upper": 8, "lower": 0.125}) == "is_oob_fraction[lower=0.125,upper=8]"
    )
    assert parse_variant("tis_mean[cap=3]") == ("tis_mean", {"cap": 3.0})
    with pytest.raises(ValueError, match="tis_mean: bad parameter"):
        parse_variant("tis_mean[upper=3]")
    with pytest.raises(ValueError, match="aggregate"):
        parse_variant("is_fraction_high[aggregate=tokens]")


def test_rejection_sampling_fractions_by_hand() -> None:
    step = two_samples()
    # token_k1 keeps log(0.5) <= -Δ <= log(2): the Δ = 1 token is out -> 1 token, 1 sample of 2
    assert step["rs_token_k1_masked_fraction"] == pytest.approx(1 / 4)
    assert step["rs_token_k1_seq_masked_fraction"] == pytest.approx(1 / 2)
    # token_k3 <= 0.01: k3 = [0.149, 0, 0.0288, 0.718] -> 3 tokens out, both samples touched
    assert step["rs_token_k3_masked_fraction"] == pytest.approx(3 / 4)
    assert step["rs_token_k3_seq_masked_fraction"] == 1.0
    # seq_sum_k2 <= 1: sums 0.15625 and 0.5 -> nothing rejected
    assert step["rs_seq_sum_k2_masked_fraction"] == 0.0
    # seq_mean_k1 (geometric): means of -Δ are -0.083 and -1 -> sample B (1 token) rejected
    assert step["rs_seq_mean_k1_masked_fraction"] == pytest.approx(1 / 4)
    assert step["rs_seq_mean_k1_seq_masked_fraction"] == pytest.approx(1 / 2)
    # seq_max_k3 <= 0.01: both maxima (0.149, 0.718) exceed it -> all 4 tokens of both samples
    assert step["rs_seq_max_k3_masked_fraction"] == 1.0


def test_topk_entropy_and_kl_ent_ratio_by_hand() -> None:
    # one token with top-2 probabilities 1/2, 1/4: entropy 0.5 ln 2 + 0.25 ln 4 = ln 2
    entropy = topk_entropy(np.log(np.array([[0.5, 0.25]])))
    assert entropy[0] == pytest.approx(math.log(2))
    t, r = arr(-1.0), arr(-1.5)
    step = step_metrics(t, r, offsets_of(1), entropies=(entropy, None))
    assert step["trainer_topk_entropy"] == pytest.approx(math.log(2))
    assert math.isnan(step["rollout_topk_entropy"])
    assert step["kl_ent_ratio"] == pytest.approx(k3(0.5) / math.log(2))
    fallback = step_metrics(t, r, offsets_of(1), entropies=(None, entropy))
    assert fallback["kl_ent_ratio"] == pytest.approx(k3(0.5) / math.log(2))
    with pytest.raises(ValueError, match="entropies"):
        step_metrics(t, r, offsets_of(1), entropies=(np.zeros(2), None))


def test_lag_slices_by_hand() -> None:
    lags = np.array([0, 0, 1, 1])
    out = lag_metrics(arr(*TA, *TB), arr(*RA, *RB), offsets_of(3, 1), lags)
    assert out["policy_lag_mean"] == 0.5 and out["policy_lag_max"] == 1 and out["policy_lag_min"] == 0
    assert out["off_policy_token_fraction"] == 0.5
    # lag 0: Δ = [0.5, 0] (sample A); lag 1: Δ = [-0.25] (A) and [1.0] (B)
    assert out["kl_k3/lag_0"] == pytest.approx(k3(0.5) / 2)
    assert out["kl_k3/lag_1"] == pytest.approx((k3(-0.25) + k3(1.0)) / 2)
    assert out["n_samples/lag_1"] == 2 and out["n_tokens/lag_0"] == 2
    unknown = np.full(4, UNKNOWN_LAG)
    assert lag_metrics(arr(*TA, *TB), arr(*RA, *RB), offsets_of(3, 1), unknown) == {}


def test_identical_sides_read_as_no_mismatch_in_every_new_figure() -> None:
    t = arr(*TA, *TB)
    step = step_metrics(t, t.copy(), offsets_of(3, 1))
    for name in ("kl_k2", "kl_k3_reverse", "js_divergence", "logprob_abs_diff_std", "chi2_seq"):
        assert step[name] == 0.0, name
    assert step["token_mult_prob_error"] == 1.0 and step["tis_mean"] == 1.0
    fractions = [k for k in PARAMETRIC if k.startswith(("rs_", "is_", "geo_"))]
    assert fractions and all(step[k] == 0.0 for k in fractions)
