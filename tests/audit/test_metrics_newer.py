"""The field's newer figures (audit.metrics): noise vs bias of Δ by length, band retention, token- vs
sample-weighted staleness, and what fail-closed reads of a step; each by hand and on simulated steps."""

from __future__ import annotations

import math

import numpy as np
import pytest
from isoaudit.audit.compare import compare_samples, step_summary
from isoaudit.audit.metric_names import definition, is_key
from isoaudit.audit.metrics import (
    LENGTH_BUCKETS,
    METRIC_DESCRIPTIONS,
    NOISE_FIT,
    NOISE_SLICED,
    STALENESS_DESCRIPTIONS,
    STANDING_VARIANTS,
    UNKNOWN_LAG,
    UNSLICED_DESCRIPTIONS,
    Exactness,
    lag_metrics,
    noise_verdict,
    parse_lag_key,
    step_metrics,
    variant_key,
)
from isoaudit.audit.records import SampleLogprobs

from tests import factories


def offsets_of(*lengths: int) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def simulated(
    seed: int, n: int, bias: float, noise: float, bias_sd: float = 0.0, lengths: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A step whose token Δ = b_i + ε, b_i ~ N(bias, bias_sd²), ε ~ N(0, noise²), lengths log-uniform."""
    rng = np.random.default_rng(seed)
    if lengths is None:
        lengths = np.exp(rng.uniform(np.log(16), np.log(4096), n)).astype(np.int64)
    o = offsets_of(*lengths)
    r = -rng.uniform(0.5, 3.0, o[-1])
    b = np.repeat(bias + bias_sd * rng.standard_normal(lengths.size), lengths)
    t = r + b + noise * rng.standard_normal(o[-1])
    return t.astype(np.float32), r.astype(np.float32), o


# ---------------------------------------------------------------- noise vs bias


def test_noise_fit_equals_a_weighted_least_squares_by_hand() -> None:
    # constant Δ within each sample: the per-sample means are exactly known
    lengths = [3, 10, 40, 7, 100]
    means = [0.018, -0.0095, 0.006, 0.011, -0.0036]
    r = -np.linspace(0.1, 2.0, sum(lengths))
    t = r + np.repeat(means, lengths)
    got = step_metrics(t.astype(np.float32), r.astype(np.float32), offsets_of(*lengths))
    delta = t.astype(np.float32).astype(np.float64) - r.astype(np.float32).astype(np.float64)
    m = np.add.reduceat(delta, offsets_of(*lengths)[:-1]) / lengths
    T = np.asarray(lengths, dtype=np.float64)
    design = np.stack([np.ones_like(T), 1 / T], axis=1) * np.sqrt(T)[:, None]
    (b2, s2), *_ = np.linalg.lstsq(design, m * m * np.sqrt(T), rcond=None)
    assert b2 > 0 and s2 > 0  # the free fit is inside the constraints here
    assert got["delta_bias_rms"] == pytest.approx(math.sqrt(b2), rel=1e-9)
    assert got["delta_noise_sd"] == pytest.approx(math.sqrt(s2), rel=1e-9)
    assert got["delta_bias"] == pytest.approx(delta.mean(), rel=1e-12) == -got["kl_k1"]
    at_median = s2 / np.median(T)
    assert got["delta_noise_share"] == pytest.approx(at_median / (at_median + b2), rel=1e-9)
    assert got["delta_sample_mean_sd"] == pytest.approx(m.std(), rel=1e-9)
    assert got["delta_sample_mean_rms"] == pytest.approx(math.sqrt((m * m).mean()), rel=1e-9)


def test_noise_dominated_step_reads_noise_and_recovers_sigma() -> None:
    t, r, o = simulated(1, 512, bias=0.0, noise=0.05)
    got = step_metrics(t, r, o)
    assert got["delta_noise_sd"] == pytest.approx(0.05, rel=0.1)
    assert got["delta_bias_rms"] < 0.002 and abs(got["delta_bias"]) < 0.001
    assert got["delta_noise_share"] > 0.9 and noise_verdict(got) == "noise-dominated"


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_bias_dominated_step_reads_bias_with_its_sign(sign: float) -> None:
    t, r, o = simulated(2, 512, bias=sign * 0.01, noise=0.02)
    got = step_metrics(t, r, o)
    assert got["delta_bias"] == pytest.approx(sign * 0.01, rel=0.05)
    assert got["delta_bias_rms"] == pytest.approx(0.01, rel=0.05)
    assert got["delta_noise_sd"] == pytest.approx(0.02, rel=0.25)
    assert got["delta_noise_share"] < 0.5 and noise_verdict(got) == "bias-dominated"


def test_a_bias_of_varying_sign_shows_in_the_rms_not_the_mean() -> None:
    t, r, o = simulated(3, 512, bias=0.0, noise=0.02, bias_sd=0.01)
    got = step_metrics(t, r, o)
    assert abs(got["delta_bias"]) < 0.002
    assert got["delta_bias_rms"] == pytest.approx(0.01, rel=0.15)
    assert noise_verdict(got) == "bias-dominated"


def test_the_spread_of_sample_means_falls_as_one_over_root_length_unless_biased() -> None:
    lengths = np.array([128] * 200 + [4096] * 200)
    noisy = step_metrics(*simulated(4, 0, bias=0.0, noise=0.05, lengths=lengths))
    ratio = noisy["delta_sample_mean_sd/len_0_256"] / noisy["delta_sample_mean_sd/len_2048_inf"]
    assert ratio == pytest.approx(math.sqrt(4096 / 128), rel=0.15)
    biased = step_metrics(*simulated(5, 0, bias=0.0, noise=0.05, bias_sd=0.02, lengths=lengths))
    ratio = biased["delta_sample_mean_rms/len_0_256"] / biased["delta_sample_mean_rms/len_2048_inf"]
    assert ratio < 2.0  # levels off at the per-sample bias


def test_too_few_samples_or_one_length_is_nan_never_zero() -> None:
    t, r, o = simulated(6, 3, bias=0.01, noise=0.05)
    few = step_metrics(t, r, o)
    assert all(math.isnan(few[k]) for k in (*NOISE_FIT, "delta_bias"))
    assert not math.isnan(few["delta_sample_mean_sd"])  # the spread needs two samples
    one_length = step_metrics(*simulated(7, 0, bias=0.01, noise=0.05, lengths=np.array([64] * 20)))
    assert all(math.isnan(one_length[k]) for k in NOISE_FIT)
    assert one_length["delta_bias"] == pytest.approx(0.01, abs=0.003)
    single = step_metrics(*simulated(8, 1, bias=0.01, noise=0.05))
    assert all(math.isnan(single[k]) for k in (*NOISE_FIT, *NOISE_SLICED))
    assert noise_verdict(single) == "undefined"


def test_identical_sides_read_zero_bias_and_noise() -> None:
    t, _, o = simulated(9, 20, bias=0.0, noise=0.05)
    got = step_metrics(t, t.copy(), o)
    for name in (
        "delta_bias",
        "delta_bias_rms",
        "delta_noise_sd",
        "delta_sample_mean_sd",
        "delta_sample_mean_rms",
    ):
        assert got[name] == 0.0 and math.copysign(1.0, got[name]) == 1.0, name
    assert math.isnan(got["delta_noise_share"]) and noise_verdict(got) == "no mismatch"


def test_a_negative_free_fit_is_clamped_and_refitted() -> None:
    # means that grow with length: the free slope is negative, so σ² = 0 and B² = ΣT m² / ΣT
    lengths = [10, 20, 40, 80]
    means = [0.001, 0.002, 0.004, 0.008]
    r = -np.full(sum(lengths), 1.0)
    t = r + np.repeat(means, lengths)
    got = step_metrics(t.astype(np.float32), r.astype(np.float32), offsets_of(*lengths))
    delta = t.astype(np.float32).astype(np.float64) - r.astype(np.float32).astype(np.float64)
    m = np.add.reduceat(delta, offsets_of(*lengths)[:-1]) / lengths
    assert got["delta_noise_sd"] == 0.0 and got["delta_noise_share"] == 0.0
    assert got["delta_bias_rms"] == pytest.approx(math.sqrt((np.array(lengths) * m * m).sum() / sum(lengths)))


def test_noise_keys_are_described_and_the_fit_is_not_sliced() -> None:
    t, r, o = simulated(10, 40, bias=0.0, noise=0.05)
    got = step_metrics(t, r, o)
    for name in NOISE_SLICED:
        assert all(f"{name}/{b}" in got for b in LENGTH_BUCKETS)
    for name in NOISE_FIT:
        assert name in UNSLICED_DESCRIPTIONS and not any(f"{name}/{b}" in got for b in LENGTH_BUCKETS)
    for name in (*NOISE_FIT, *NOISE_SLICED, "token_fraction"):
        assert is_key(name) and definition(name) == METRIC_DESCRIPTIONS[name]


# ---------------------------------------------------------------- band retention


def test_band_retention_by_hand() -> None:
    d = np.array([0.0, 0.005, -0.02, 0.04, 0.2, np.nan])  # |ρ-1| = 0, .005, .0198, .0408, .221
    r = np.array([-1.0] * 6)
    t = r + np.nan_to_num(d)
    t[-1] = -np.inf  # non-finite tokens are excluded, as in every ratio statistic
    got = step_metrics(t.astype(np.float32), r.astype(np.float32), offsets_of(6))
    assert got["band_retention"] == pytest.approx(2 / 5)
    assert got["band_exceedance"] == pytest.approx(3 / 5)
    assert got["band_retention[band=0.05]"] == pytest.approx(4 / 5)
    assert got["band_exceedance[band=0.05]"] == pytest.approx(1 / 5)
    assert got["band_retention[band=0.001]"] == pytest.approx(1 / 5)
    asked = step_metrics(
        t.astype(np.float32), r.astype(np.float32), offsets_of(6), variants=["band_retention[band=0.3]"]
    )
    assert asked["band_retention[band=0.3]"] == 1.0
    # at band = clip_eps the exceedance is is_clipfrac
    assert step_metrics(t, r, offsets_of(6), variants=["band_exceedance[band=0.2]"])[
        "band_exceedance[band=0.2]"
    ] == pytest.approx(got["is_clipfrac"])


def test_band_keys_are_standing_variants_of_one_family() -> None:
    assert variant_key("band_retention", {"band": 0.01}) == "band_retention"
    assert set(STANDING_VARIANTS) == {
        "band_retention[band=0.001]",
        "band_exceedance[band=0.001]",
        "band_retention[band=0.05]",
        "band_exceedance[band=0.05]",
    }
    for key in STANDING_VARIANTS:
        assert is_key(key) and "band" in definition(key)
    t = np.full(4, -1.0, np.float32)
    same = step_metrics(t, t.copy(), offsets_of(4))
    assert all(same[k] == (1.0 if "retention" in k else 0.0) for k in ("band_retention", *STANDING_VARIANTS))
    empty = step_metrics(np.zeros(0, np.float32), np.zeros(0, np.float32), offsets_of())
    assert math.isnan(empty["band_retention"]) and math.isnan(empty["band_exceedance[band=0.05]"])


# ---------------------------------------------------------------- staleness


def test_token_and_sample_weighted_staleness_with_mid_sample_version_changes() -> None:
    # A: 6 tokens, sampled by versions 3,3,3,3 then 4,4 (trainer at 5: lags 2,2,2,2,1,1)
    # B: 2 tokens, current (lag 0); C: 2 tokens of unknown lag
    lags = np.array([2, 2, 2, 2, 1, 1, 0, 0, UNKNOWN_LAG, UNKNOWN_LAG])
    r = -np.linspace(0.5, 2.0, 10).astype(np.float32)
    t = (r + 0.01).astype(np.float32)
    got = lag_metrics(t, r, offsets_of(6, 2, 2), lags)
    assert got["policy_lag_mean"] == pytest.approx(
        10 / 8
    )  # token-weighted: the long stale sample counts more
    assert got["policy_lag_sample_mean"] == pytest.approx((10 / 6 + 0) / 2)
    assert got["policy_lag_sample_max_mean"] == pytest.approx((2 + 0) / 2)
    assert got["mixed_version_sample_fraction"] == pytest.approx(1 / 2)
    shares = {lag: got[f"token_fraction/lag_{lag}"] for lag in (0, 1, 2)}
    assert shares == pytest.approx({0: 2 / 8, 1: 2 / 8, 2: 4 / 8}) and sum(shares.values()) == pytest.approx(
        1
    )
    assert parse_lag_key("token_fraction/lag_2") == ("token_fraction", 2)
    assert "lag" in definition("token_fraction/lag_2")
    assert set(STALENESS_DESCRIPTIONS) <= set(got)


def test_staleness_reaches_the_step_figures_from_weight_spans() -> None:
    n = 8
    rollout = factories.sample(
        "rollout",
        n_completion=n,
        weight_version="3",
        weight_spans=[{"start": 0, "version": "3"}, {"start": 5, "version": "4"}],
    )
    trainer = factories.sample(
        "trainer", n_completion=n, weight_version="5", logprobs=rollout.logprobs.copy()
    )
    other_r = factories.sample("rollout", seed=1, n_completion=4, weight_version="5")
    other_t = factories.sample(
        "trainer", seed=1, n_completion=4, weight_version="5", logprobs=other_r.logprobs
    )
    pairs: list[tuple[SampleLogprobs, SampleLogprobs]] = [(trainer, rollout), (other_t, other_r)]
    metrics = step_summary(pairs, compare_samples(pairs))["metrics"]
    assert metrics["policy_lag_mean"] == pytest.approx((5 * 2 + 3 * 1) / 12)
    assert metrics["policy_lag_sample_mean"] == pytest.approx(((5 * 2 + 3) / 8 + 0) / 2)
    assert metrics["mixed_version_sample_fraction"] == 0.5
    assert metrics["token_fraction/lag_2"] == pytest.approx(5 / 12)


# ---------------------------------------------------------------- exactness


def test_exactness_of_a_stored_step() -> None:
    same = Exactness.of(3, {"bitwise_mismatch_count": 0.0, "logprob_abs_diff_max": 0.0, "n_tokens": 12.0})
    assert same.identical and "all of 12" in same.describe()
    one = Exactness.of(4, {"bitwise_mismatch_count": 1.0, "logprob_abs_diff_max": 0.25, "n_tokens": 12.0})
    assert not one.identical and one.describe() == "differing tokens: 1 of 12, max |Δ| 0.25"
    unknown = Exactness.of(5, {"n_tokens": 12.0})
    assert not unknown.identical and unknown.differing_tokens is None
    signed_zero = np.array([0.0, -1.0], np.float32)
    got = step_metrics(signed_zero, np.array([-0.0, -1.0], np.float32), offsets_of(2))
    assert got["bitwise_mismatch_count"] == 1.0 and got["logprob_abs_diff_max"] == 0.0  # -0.0 differs in bits
