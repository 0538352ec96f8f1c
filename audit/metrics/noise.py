"""Noise versus bias of Δ by response length: does the mismatch average out over a sample, or not?

Model: a sample's tokens carry ``Δ_t = b_i + ε_t`` with iid noise ``ε`` of variance ``σ²``, so the
sample's mean ``m_i = mean Δ`` over its ``T_i`` finite tokens has ``E[m_i²] = b_i² + σ²/T_i``: the
noise part shrinks as ``1/T``, a bias does not. Per group of samples (a step, or one length bucket)
the figures fit ``m_i² ≈ B² + σ²·(1/T_i)`` by weighted least squares with weight ``w_i = T_i``:

* ``B² = E[b_i²]``, the mean squared per-sample bias (a common bias and one that varies from sample
  to sample alike), ``σ²`` the per-token noise variance; both are constrained to be >= 0 (when the
  free fit makes one negative it is 0 and the other is refitted alone: ``σ² = Σ m_i² / Σ 1/T_i``
  through the origin, or ``B² = Σ T_i m_i² / Σ T_i`` flat);
* ``w_i = T_i`` is the inverse of the leading term of ``Var(m_i²) ≈ 4 b² σ²/T_i`` when a bias is
  present, and keeps every sum of the fit additive over samples (length buckets and steps pool the
  same sums); with ``b = 0`` it stays unbiased;
* ``delta_bias``: the signed common bias, estimated by the token-weighted mean Δ (``-kl_k1``);
  ``|delta_bias| <= delta_bias_rms`` in expectation, and a much larger ``delta_bias_rms`` means
  per-sample biases of varying sign;
* ``delta_noise_share = (σ²/T_med) / (σ²/T_med + B²)`` at the group's median sample length
  ``T_med``: the share of a typical sample's mean-square Δ that is noise; above 0.5 the mismatch is
  noise-dominated (it averages out), at or below 0.5 bias-dominated (it does not). ``σ²/B²`` is the
  length from which bias dominates.

``delta_bias`` needs :data:`NOISE_FIT_MIN_SAMPLES` samples with finite tokens, the fit as many and at
least two distinct lengths; otherwise they are NaN (never 0). The fit is made per step
(:data:`NOISE_FIT`); ``delta_bias`` and the spread of the per-sample means, ``delta_sample_mean_sd``
and ``delta_sample_mean_rms`` (which need two samples), are also given per length bucket, so a chart
shows the spread against length beside the fitted ``sqrt(B² + σ²/T)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

#: Samples (with at least one finite token) a group needs before bias and noise are told apart.
NOISE_FIT_MIN_SAMPLES = 4

#: The step figures of this module, with their one-line definitions.
NOISE_DESCRIPTIONS: dict[str, str] = {
    "delta_bias": "signed common bias of Δ: the token-weighted mean Δ = -kl_k1 (NaN below 4 samples)",
    "delta_bias_rms": "sqrt(B²) of the weighted least-squares fit (mean Δ_i)² ≈ B² + σ²/T_i, w_i = T_i, B², σ² >= 0: "
    "the RMS per-sample bias that does not shrink with length",
    "delta_noise_sd": "σ of the same fit: the per-token iid noise of Δ whose sample mean shrinks as 1/√T",
    "delta_noise_share": "(σ²/T_med) / (σ²/T_med + B²) at the median sample length T_med: > 0.5 noise-dominated, "
    "<= 0.5 bias-dominated",
    "delta_sample_mean_sd": "std (ddof=0) over samples of each sample's mean Δ (falls as 1/√T when noise dominates)",
    "delta_sample_mean_rms": "sqrt(mean over samples of (mean Δ_i)²): what the fit models; levels off at the bias",
}

#: Names of :data:`NOISE_DESCRIPTIONS`, in order.
NOISE_METRICS: tuple[str, ...] = tuple(NOISE_DESCRIPTIONS)
#: The figures of the fit, reported for a whole step only: a length bucket spans too narrow a range
#: of 1/T to tell B² from σ².
NOISE_FIT: tuple[str, ...] = ("delta_bias_rms", "delta_noise_sd", "delta_noise_share")
#: The rest, reported per length bucket too (the chart of spread against length).
NOISE_SLICED: tuple[str, ...] = tuple(name for name in NOISE_METRICS if name not in NOISE_FIT)


def noise_figures(
    *,
    n_samples: float,
    n_tokens: float,
    sum_d: float,
    sum_m: float,
    sum_m2: float,
    sum_inv_len: float,
    sum_len_m2: float,
    median_len: float,
) -> dict[str, float]:
    """:data:`NOISE_METRICS` of one group from its additive sums over the samples with finite tokens:
    ``n_samples`` of them, ``n_tokens`` = ΣT_i, ``sum_d`` = Σ_tokens Δ, ``sum_m`` = Σm_i,
    ``sum_m2`` = Σm_i², ``sum_inv_len`` = Σ1/T_i, ``sum_len_m2`` = ΣT_i m_i²; ``median_len`` = T_med."""
    nan = float("nan")
    out = dict.fromkeys(NOISE_METRICS, nan)
    if n_samples >= 2:
        mean_m = sum_m / n_samples
        out["delta_sample_mean_rms"] = math.sqrt(max(sum_m2 / n_samples, 0.0))
        out["delta_sample_mean_sd"] = math.sqrt(max(sum_m2 / n_samples - mean_m * mean_m, 0.0))
    if n_samples < NOISE_FIT_MIN_SAMPLES:
        return out
    out["delta_bias"] = sum_d / n_tokens + 0.0
    bias2, noise2 = fit_bias_noise(n_tokens, n_samples, sum_inv_len, sum_len_m2, sum_m2)
    if math.isnan(bias2):
        return out
    out["delta_bias_rms"] = math.sqrt(bias2)
    out["delta_noise_sd"] = math.sqrt(noise2)
    at_median = noise2 / median_len
    out["delta_noise_share"] = at_median / (at_median + bias2) if at_median + bias2 > 0 else nan
    return out


def fit_bias_noise(s0: float, s1: float, s2: float, y0: float, y1: float) -> tuple[float, float]:
    """(B², σ²) >= 0 minimising Σ w (y - B² - σ² x)² from ``s0`` = Σw, ``s1`` = Σwx, ``s2`` = Σwx²,
    ``y0`` = Σwy, ``y1`` = Σwxy; NaN for both when the x are all equal (one length: no fit)."""
    det = s0 * s2 - s1 * s1
    if not (s0 > 0 and s2 > 0 and det > 1e-12 * s0 * s2):
        return float("nan"), float("nan")
    bias2 = (s2 * y0 - s1 * y1) / det
    noise2 = (s0 * y1 - s1 * y0) / det
    if bias2 < 0:  # the constrained optimum lies on B² = 0: a fit through the origin
        return 0.0, max(y1 / s2, 0.0)
    if noise2 < 0:  # ... or on σ² = 0: a constant
        return max(y0 / s0, 0.0), 0.0
    return bias2, noise2


def noise_verdict(figures: Mapping[str, float | None]) -> str:
    """What a user reads off a step's (or bucket's) figures: ``noise-dominated``,
    ``bias-dominated``, ``no mismatch`` (σ = B = 0) or ``undefined`` (too few samples)."""
    share = figures.get("delta_noise_share")
    noise, bias = figures.get("delta_noise_sd"), figures.get("delta_bias_rms")
    if noise == 0.0 and bias == 0.0:
        return "no mismatch"
    if share is None or not np.isfinite(share):
        return "undefined"
    return "noise-dominated" if share > 0.5 else "bias-dominated"
