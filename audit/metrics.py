"""Token metrics of the train–rollout mismatch (DESIGN.md, "Metrics").

``Δ = trainer − rollout`` per completion token. Every metric is defined once, in :func:`_derive`,
from a handful of additive *sufficient statistics* (sums, maxima, counts). Per-sample values come
from segment reductions over the concatenated token arrays (``np.*.reduceat``); step and
length-bucket values come from combining the per-sample statistics, so a step of millions of
tokens costs a few vectorised passes and no per-sample Python.

Conventions (documented here once, relied on by the comparator, the dashboard and alert rules):

* Inputs are float32 logprobs of the sampled tokens; arithmetic is float64.
* **Bitwise** metrics compare float32 bit patterns: ``-0.0`` and ``+0.0`` differ, two ``-inf``
  agree. ``first_diverging_position`` is the completion index of the first differing token, or -1.
* **Non-finite tokens** (``-inf`` or NaN on either side) count in ``n_tokens`` and in the bitwise
  metrics, and in ``n_nonfinite``; they are excluded from every probability, KL and
  importance-weight statistic (Δ is undefined there). Those statistics use ``n_finite`` tokens.
* Identical sides give exactly ``0.0`` for every KL, difference and chi² metric, ``1.0`` for the
  correlation and importance weights, and zero mismatches.
* A statistic over zero tokens is NaN (never 0: "no data" must not read as "no mismatch").
* Importance weights ``ρ = exp(Δ) = p_trainer / p_rollout`` use Δ clamped to ±20 before
  exponentiating (verl's safety bound), so one pathological token cannot overflow a step.
  ``kl_k3`` uses the unclamped Δ.
* Standard deviations are population ones (ddof=0; verl's ``torch.std`` uses ddof=1, a factor
  sqrt(n/(n-1)) that vanishes at realistic lengths and keeps one-token samples defined).
* Step values are token-weighted (sums over all tokens of the step), except the sequence-level
  perplexity metrics ``log_ppl_diff`` and ``ppl_ratio``, which, as in verl, average the per-sample
  values over samples.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import pandas as pd

#: Completion-length buckets for the sliced variants: ``[lo, hi)`` in completion tokens.
LENGTH_BUCKET_EDGES: tuple[int, ...] = (0, 256, 512, 1024, 2048)

#: verl's bound on |log ratio| before exponentiating importance weights.
LOG_RATIO_BOUND = 20.0


def _bucket_names(edges: tuple[int, ...] = LENGTH_BUCKET_EDGES) -> tuple[str, ...]:
    his = [str(e) for e in edges[1:]] + ["inf"]
    return tuple(f"len_{lo}_{hi}" for lo, hi in zip(edges, his, strict=True))


#: Suffixes of the length-sliced step metrics, e.g. ``kl_k3/len_0_256``.
LENGTH_BUCKETS: tuple[str, ...] = _bucket_names()

_BASE_DESCRIPTIONS: dict[str, str] = {
    "n_tokens": "completion tokens compared",
    "n_finite": "tokens with finite logprobs on both sides (the denominator of the statistics)",
    "n_nonfinite": "tokens with -inf or NaN on either side (excluded from the statistics)",
    "bitwise_mismatch_count": "tokens whose float32 logprob bits differ between the sides",
    "exact_match_fraction": "fraction of tokens whose float32 logprob bits agree",
    "first_diverging_position": "completion index of the first bitwise mismatch (-1: none; step: earliest)",
    "rollout_probs_diff_max": "max |p_trainer - p_rollout| over tokens",
    "rollout_probs_diff_mean": "mean |p_trainer - p_rollout| over tokens",
    "rollout_probs_diff_std": "std (ddof=0) of |p_trainer - p_rollout| over tokens",
    "rollout_actor_probs_pearson_corr": "Pearson correlation of token probabilities (1 when identical)",
    "logprob_abs_diff_mean": "mean |logprob_trainer - logprob_rollout| over tokens",
    "logprob_abs_diff_max": "max |logprob_trainer - logprob_rollout| over tokens",
    "kl_k1": "mismatch KL estimate k1 = mean(-Δ), Δ = logprob_trainer - logprob_rollout",
    "kl_k3": "mismatch KL estimate k3 = mean(exp(Δ) - Δ - 1), non-negative",
    "log_ppl_diff": "mean rollout logprob - mean trainer logprob per sample = log(ppl_trainer/ppl_rollout); step: mean over samples",
    "ppl_ratio": "ppl_trainer / ppl_rollout per sample; step: mean over samples",
    "chi2_token": "token chi-squared divergence mean(ρ²) - 1, ρ = exp(Δ)",
    "is_mean": "mean token importance weight ρ = p_trainer / p_rollout",
    "is_std": "std (ddof=0) of the token importance weights",
    "is_min": "min token importance weight",
    "is_max": "max token importance weight",
    "effective_sample_size": "Kish effective sample size of the token importance weights, (Σρ)²/Σρ², in tokens",
    "effective_sample_size_fraction": "effective_sample_size / n_finite in (0, 1] (verl's rollout_is_eff_sample_size)",
    "is_clipfrac": "fraction of tokens with |ρ - 1| > clip_eps (outside the PPO trust region)",
    "kl_k2": "mismatch KL estimate k2 = mean(Δ²/2)",
    "kl_k3_reverse": "reverse k3 = mean(exp(-Δ) + Δ - 1), estimates KL(trainer ‖ rollout) from rollout samples",
    "js_divergence": "per-token Jensen-Shannon estimate mean(k3(lp_t - lp_m)/2 + k3(lp_r - lp_m)/2), p_m = (p_t + p_r)/2",
    "token_mult_prob_error": "mean(exp|Δ|): the mean multiplicative probability error (1 when identical)",
    "logprob_abs_diff_std": "std (ddof=0) of |logprob_trainer - logprob_rollout| over tokens",
    "logprob_abs_diff_sample_mean": "mean over samples of each sample's mean |Δ| (sequence-weighted)",
    "kl_k1_sample_mean": "mean over samples of each sample's mean(-Δ) (sequence-weighted k1)",
    "kl_k3_sample_mean": "mean over samples of each sample's mean k3 (sequence-weighted k3)",
    "log_ppl_abs_diff": "mean over samples of |log_ppl_diff|",
    "log_ppl_diff_max": "max over samples of log_ppl_diff",
    "log_ppl_diff_min": "min over samples of log_ppl_diff",
    "training_ppl": "mean over samples of the trainer's perplexity exp(-mean logprob_trainer)",
    "rollout_ppl": "mean over samples of the rollout's perplexity exp(-mean logprob_rollout)",
    "training_log_ppl": "mean over samples of -mean logprob_trainer",
    "rollout_log_ppl": "mean over samples of -mean logprob_rollout",
    "chi2_seq": "sequence chi-squared divergence mean over samples of exp(2 ΣΔ) - 1 (ΣΔ clamped to ±20)",
    "trainer_topk_entropy": "mean per-token entropy -Σ p log p over the trainer's recorded top-k (a lower bound)",
    "rollout_topk_entropy": "mean per-token entropy -Σ p log p over the rollout's recorded top-k (a lower bound)",
    "kl_ent_ratio": "kl_k3 / trainer_topk_entropy (rollout_topk_entropy when the trainer recorded no top-k)",
}

_STEP_ONLY_DESCRIPTIONS: dict[str, str] = {
    "n_samples": "samples compared",
    "diverged_sample_fraction": "fraction of samples with at least one bitwise mismatch",
}

#: Step values that average per-sample values over samples (the rest pool tokens).
SAMPLE_AVERAGED: frozenset[str] = frozenset(
    {
        "log_ppl_diff",
        "ppl_ratio",
        "logprob_abs_diff_sample_mean",
        "kl_k1_sample_mean",
        "kl_k3_sample_mean",
        "log_ppl_abs_diff",
        "log_ppl_diff_max",
        "log_ppl_diff_min",
        "training_ppl",
        "rollout_ppl",
        "training_log_ppl",
        "rollout_log_ppl",
        "chi2_seq",
    }
)

#: Per-sample columns of :func:`sample_metrics`, in order.
SAMPLE_METRICS: tuple[str, ...] = tuple(_BASE_DESCRIPTIONS)

#: Keys of :func:`step_metrics` before the length-sliced variants, in order.
STEP_METRICS: tuple[str, ...] = ("n_samples", *SAMPLE_METRICS, "diverged_sample_fraction")


def _all_descriptions() -> dict[str, str]:
    out = {name: _BASE_DESCRIPTIONS.get(name) or _STEP_ONLY_DESCRIPTIONS[name] for name in STEP_METRICS}
    for bucket, (lo, hi) in zip(LENGTH_BUCKETS, _bucket_bounds(), strict=True):
        span = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        for name in STEP_METRICS:
            out[f"{name}/{bucket}"] = f"{out[name]}; samples with {span} completion tokens"
    return out


def _bucket_bounds() -> list[tuple[int, int | None]]:
    his: list[int | None] = [*LENGTH_BUCKET_EDGES[1:], None]
    return list(zip(LENGTH_BUCKET_EDGES, his, strict=True))


#: One line per metric name :func:`step_metrics` can return (sliced names included).
METRIC_DESCRIPTIONS: dict[str, str] = _all_descriptions()


@dataclass
class _Stats:
    """Additive sufficient statistics of a group of tokens (one entry per group)."""

    n_samples: np.ndarray
    n_seq: np.ndarray  # samples with at least one finite token
    n_diverged: np.ndarray  # samples with at least one mismatch
    n_tokens: np.ndarray
    n_finite: np.ndarray
    n_mismatch: np.ndarray
    n_clip: np.ndarray
    first_div: np.ndarray  # int64, -1 when none
    sum_dp: np.ndarray
    sum_dp2: np.ndarray
    max_dp: np.ndarray
    sum_pt: np.ndarray
    sum_pr: np.ndarray
    sum_pt2: np.ndarray
    sum_pr2: np.ndarray
    sum_ptpr: np.ndarray
    sum_absd: np.ndarray
    max_absd: np.ndarray
    sum_negd: np.ndarray
    sum_k3: np.ndarray
    sum_rho: np.ndarray
    sum_rho2: np.ndarray
    min_rho: np.ndarray
    max_rho: np.ndarray
    sum_seq_lpd: np.ndarray  # Σ over samples of the per-sample log_ppl_diff
    sum_seq_ppl: np.ndarray  # Σ over samples of the per-sample ppl_ratio
    sum_k2: np.ndarray
    sum_k3rev: np.ndarray
    sum_js: np.ndarray
    sum_expabs: np.ndarray
    sum_absd2: np.ndarray
    sum_seq_absd: np.ndarray  # Σ over samples of the per-sample mean |Δ|
    sum_seq_negd: np.ndarray  # Σ over samples of the per-sample mean(-Δ)
    sum_seq_k3: np.ndarray  # Σ over samples of the per-sample mean k3
    sum_seq_abs_lpd: np.ndarray
    max_seq_lpd: np.ndarray
    min_seq_lpd: np.ndarray
    sum_seq_ppl_t: np.ndarray  # Σ over samples of exp(-mean logprob_trainer)
    sum_seq_ppl_r: np.ndarray
    sum_seq_logppl_t: np.ndarray  # Σ over samples of -mean logprob_trainer
    sum_seq_logppl_r: np.ndarray
    sum_seq_rho2: np.ndarray  # Σ over samples of exp(2 clamp(ΣΔ))
    sum_ent_t: np.ndarray
    n_ent_t: np.ndarray
    sum_ent_r: np.ndarray
    n_ent_r: np.ndarray


_MAX_FIELDS = {"max_dp", "max_absd", "max_rho", "max_seq_lpd"}
_MIN_FIELDS = {"min_rho", "min_seq_lpd"}


def _check_inputs(
    trainer_lp: np.ndarray, rollout_lp: np.ndarray, offsets: np.ndarray
) -> tuple[np.ndarray, ...]:
    t = np.asarray(trainer_lp)
    r = np.asarray(rollout_lp)
    o = np.asarray(offsets)
    if t.ndim != 1:
        raise ValueError(f"trainer_lp: expected a 1-D array, got shape {list(t.shape)}")
    if r.ndim != 1:
        raise ValueError(f"rollout_lp: expected a 1-D array, got shape {list(r.shape)}")
    if t.shape != r.shape:
        raise ValueError(f"rollout_lp: {r.size} tokens but trainer_lp has {t.size}")
    if o.ndim != 1 or o.size < 1:
        raise ValueError(f"offsets: expected a 1-D array of n_samples + 1 entries, got shape {list(o.shape)}")
    if o.size and o.dtype.kind not in "iu":
        raise ValueError(f"offsets: expected integers, got {o.dtype}")
    o = o.astype(np.int64, copy=False)
    if o[0] != 0 or o[-1] != t.size:
        raise ValueError(f"offsets: must start at 0 and end at the token count {t.size}, got {o[0]}..{o[-1]}")
    if (np.diff(o) < 0).any():
        raise ValueError(f"offsets: decreasing at sample {int(np.flatnonzero(np.diff(o) < 0)[0])}")
    return t.astype(np.float32, copy=False), r.astype(np.float32, copy=False), o


def _per_sample_stats(
    t32: np.ndarray,
    r32: np.ndarray,
    offsets: np.ndarray,
    clip_eps: float,
    entropies: tuple[np.ndarray | None, np.ndarray | None] = (None, None),
) -> _Stats:
    """One pass of vectorised token arithmetic, then segment reductions per sample."""
    n = offsets.size - 1
    lengths = np.diff(offsets)
    nonempty = lengths > 0
    starts = offsets[:-1][nonempty]

    def seg(ufunc: np.ufunc, values: np.ndarray, fill: float | int) -> np.ndarray:
        # booleans are counted (int64) without first copying them to integers
        dtype = np.int64 if values.dtype == np.bool_ else values.dtype
        out = np.full(n, fill, dtype=dtype)
        if starts.size:
            out[nonempty] = ufunc.reduceat(values, starts, dtype=dtype)
        return out

    mismatch = t32.view(np.uint32) != r32.view(np.uint32)
    t = t32.astype(np.float64)
    r = r32.astype(np.float64)
    finite = np.isfinite(t) & np.isfinite(r)
    all_finite = bool(finite.all())
    with np.errstate(invalid="ignore", over="ignore"):
        d = t - r
        if not all_finite:
            d = np.where(finite, d, 0.0)
            t = np.where(finite, t, 0.0)
            r = np.where(finite, r, 0.0)
        absd = np.abs(d)
        em1p, em1n = np.expm1(d), np.expm1(-d)  # e^Δ - 1, e^-Δ - 1: exact near Δ = 0
        pt = np.exp(t)
        pr = pt * (1.0 + em1n)  # = e^r; exactly pt where the sides agree
        dp = np.abs(pt - pr)
        inside = absd <= LOG_RATIO_BOUND
        rho = 1.0 + em1p if inside.all() else np.exp(np.clip(d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        k3 = em1p - d
        k3rev = em1n + d
        # JS against the mixture m = (p_t + p_r)/2: since e^(lp_t - lp_m) + e^(lp_r - lp_m) = 2, the two
        # halves k3(lp_t - lp_m)/2 + k3(lp_r - lp_m)/2 sum to lp_m - (lp_t + lp_r)/2 = log cosh(Δ/2),
        # computed as log1p((e^Δ - 1)/2) - Δ/2.
        js = np.log1p(0.5 * em1p) - 0.5 * d
        expabs = 1.0 + np.maximum(em1p, em1n)
    clip = np.abs(rho - 1.0) > clip_eps
    if not all_finite:  # excluded tokens must not touch sums, maxima or counts
        pt = np.where(finite, pt, 0.0)
        pr = np.where(finite, pr, 0.0)
        dp = np.where(finite, dp, 0.0)
        clip &= finite
    rho_sum_src = rho if all_finite else np.where(finite, rho, 0.0)
    expabs_src = expabs if all_finite else np.where(finite, expabs, 0.0)

    n_finite = seg(np.add, finite, 0)
    n_mismatch = seg(np.add, mismatch, 0)
    first_div = np.full(n, -1, dtype=np.int64)
    where = np.flatnonzero(mismatch)
    if where.size:
        sample_of = np.searchsorted(offsets, where, side="right") - 1
        firsts = np.flatnonzero(np.r_[True, sample_of[1:] != sample_of[:-1]])
        first_div[sample_of[firsts]] = where[firsts] - offsets[sample_of[firsts]]

    sum_negd = -seg(np.add, d, 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        lpd = sum_negd / n_finite
    has_seq = n_finite > 0
    lpd = np.where(has_seq, lpd, 0.0)
    with np.errstate(over="ignore"):
        ppl = np.where(has_seq, np.exp(lpd), 0.0)

    sum_absd = seg(np.add, absd, 0.0)
    sum_k3 = seg(np.add, k3, 0.0)
    sum_t = seg(np.add, t, 0.0)
    sum_r = seg(np.add, r, 0.0)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        safe_n = np.where(has_seq, n_finite, 1)

        def per_seq(total: np.ndarray) -> np.ndarray:
            return np.where(has_seq, total / safe_n, 0.0)

        logppl_t, logppl_r = per_seq(-sum_t), per_seq(-sum_r)
        ppl_t, ppl_r = np.exp(logppl_t), np.exp(logppl_r)
        seq_rho2 = np.exp(2.0 * np.clip(-sum_negd, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    ent = [_entropy_sums(e, finite, seg, n) for e in entropies]

    masked_max = (lambda x: x) if all_finite else (lambda x: np.where(finite, x, -np.inf))
    masked_min = (lambda x: x) if all_finite else (lambda x: np.where(finite, x, np.inf))
    return _Stats(
        n_samples=np.ones(n, dtype=np.int64),
        n_seq=has_seq.astype(np.int64),
        n_diverged=(n_mismatch > 0).astype(np.int64),
        n_tokens=lengths,
        n_finite=n_finite,
        n_mismatch=n_mismatch,
        n_clip=seg(np.add, clip, 0),
        first_div=first_div,
        sum_dp=seg(np.add, dp, 0.0),
        sum_dp2=seg(np.add, dp * dp, 0.0),
        max_dp=seg(np.maximum, masked_max(dp), -np.inf),
        sum_pt=seg(np.add, pt, 0.0),
        sum_pr=seg(np.add, pr, 0.0),
        sum_pt2=seg(np.add, pt * pt, 0.0),
        sum_pr2=seg(np.add, pr * pr, 0.0),
        sum_ptpr=seg(np.add, pt * pr, 0.0),
        sum_absd=sum_absd,
        max_absd=seg(np.maximum, masked_max(absd), -np.inf),
        sum_negd=sum_negd,
        sum_k3=sum_k3,
        sum_rho=seg(np.add, rho_sum_src, 0.0),
        sum_rho2=seg(np.add, rho_sum_src * rho_sum_src, 0.0),
        min_rho=seg(np.minimum, masked_min(rho), np.inf),
        max_rho=seg(np.maximum, masked_max(rho), -np.inf),
        sum_seq_lpd=lpd,
        sum_seq_ppl=ppl,
        sum_k2=seg(np.add, 0.5 * d * d, 0.0),
        sum_k3rev=seg(np.add, k3rev, 0.0),
        sum_js=seg(np.add, js, 0.0),
        sum_expabs=seg(np.add, expabs_src, 0.0),
        sum_absd2=seg(np.add, absd * absd, 0.0),
        sum_seq_absd=per_seq(sum_absd),
        sum_seq_negd=lpd,
        sum_seq_k3=per_seq(sum_k3),
        sum_seq_abs_lpd=np.abs(lpd),
        max_seq_lpd=np.where(has_seq, lpd, -np.inf),
        min_seq_lpd=np.where(has_seq, lpd, np.inf),
        sum_seq_ppl_t=np.where(has_seq, ppl_t, 0.0),
        sum_seq_ppl_r=np.where(has_seq, ppl_r, 0.0),
        sum_seq_logppl_t=logppl_t,
        sum_seq_logppl_r=logppl_r,
        sum_seq_rho2=np.where(has_seq, seq_rho2, 0.0),
        sum_ent_t=ent[0][0],
        n_ent_t=ent[0][1],
        sum_ent_r=ent[1][0],
        n_ent_r=ent[1][1],
    )


def _entropy_sums(
    entropy: np.ndarray | None, finite: np.ndarray, seg: Callable[..., np.ndarray], n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample (Σ entropy, count) over tokens whose entropy is known (finite) and whose Δ is defined."""
    if entropy is None:
        return np.zeros(n), np.zeros(n, dtype=np.int64)
    known = finite & np.isfinite(entropy)
    return seg(np.add, np.where(known, entropy, 0.0), 0.0), seg(np.add, known, 0)


def _combine(stats: _Stats, mask: np.ndarray | None = None) -> _Stats:
    """Pool per-sample statistics into one group (all samples, or those in ``mask``)."""
    out = {}
    for f in fields(_Stats):
        v = getattr(stats, f.name)
        if mask is not None:
            v = v[mask]
        if f.name == "first_div":
            hit = v[v >= 0]
            out[f.name] = np.array([hit.min() if hit.size else -1], dtype=np.int64)
        elif f.name in _MAX_FIELDS:
            out[f.name] = np.array([v.max() if v.size else -np.inf])
        elif f.name in _MIN_FIELDS:
            out[f.name] = np.array([v.min() if v.size else np.inf])
        else:
            out[f.name] = np.array([v.sum()])
    return _Stats(**out)


def _derive(s: _Stats) -> dict[str, np.ndarray]:
    """The one definition of every metric, from sufficient statistics (vectorised over groups)."""
    nan = np.nan
    nf = s.n_finite.astype(np.float64)
    has = s.n_finite > 0
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        safe_nf = np.where(has, nf, 1.0)
        inv = np.where(has, 1.0 / safe_nf, nan)

        def mean(total: np.ndarray) -> np.ndarray:
            # a true division, so that n identical terms over n is exactly their value
            return np.where(has, total / safe_nf, nan)

        def std(total: np.ndarray, total_sq: np.ndarray) -> np.ndarray:
            m = mean(total)
            return np.sqrt(np.maximum(mean(total_sq) - m * m, 0.0))

        def extreme(v: np.ndarray) -> np.ndarray:
            return np.where(has, v, nan)

        vt = s.sum_pt2 - s.sum_pt * s.sum_pt * inv
        vr = s.sum_pr2 - s.sum_pr * s.sum_pr * inv
        cov = s.sum_ptpr - s.sum_pt * s.sum_pr * inv
        identical_p = has & (s.max_dp == 0.0)
        defined = (vt > 0) & (vr > 0)
        corr = np.where(defined, cov / np.sqrt(np.where(defined, vt * vr, 1.0)), nan)
        corr = np.where(identical_p, 1.0, np.clip(corr, -1.0, 1.0))
        ess = np.where(s.sum_rho2 > 0, s.sum_rho * s.sum_rho / np.where(s.sum_rho2 > 0, s.sum_rho2, 1.0), nan)
        ess = np.where(has, ess, nan)
        nt = s.n_tokens.astype(np.float64)
        has_tokens = s.n_tokens > 0
        nseq = s.n_seq.astype(np.float64)
        has_seq = s.n_seq > 0

        def seq_mean(total: np.ndarray) -> np.ndarray:
            return np.where(has_seq, total / np.where(has_seq, nseq, 1.0), nan)

        def entropy(total: np.ndarray, count: np.ndarray) -> np.ndarray:
            return np.where(count > 0, total / np.where(count > 0, count, 1), nan)

        ent_t, ent_r = entropy(s.sum_ent_t, s.n_ent_t), entropy(s.sum_ent_r, s.n_ent_r)
        k3 = mean(s.sum_k3)
        out = {
            "n_tokens": nt,
            "n_finite": nf,
            "n_nonfinite": nt - nf,
            "bitwise_mismatch_count": s.n_mismatch.astype(np.float64),
            "exact_match_fraction": np.where(
                has_tokens, 1.0 - s.n_mismatch / np.where(has_tokens, nt, 1.0), nan
            ),
            "first_diverging_position": s.first_div.astype(np.float64),
            "rollout_probs_diff_max": extreme(s.max_dp),
            "rollout_probs_diff_mean": mean(s.sum_dp),
            "rollout_probs_diff_std": std(s.sum_dp, s.sum_dp2),
            "rollout_actor_probs_pearson_corr": corr,
            "logprob_abs_diff_mean": mean(s.sum_absd),
            "logprob_abs_diff_max": extreme(s.max_absd),
            "kl_k1": mean(s.sum_negd),
            "kl_k3": k3,
            "log_ppl_diff": seq_mean(s.sum_seq_lpd),
            "ppl_ratio": seq_mean(s.sum_seq_ppl),
            "chi2_token": mean(s.sum_rho2) - 1.0,
            "is_mean": mean(s.sum_rho),
            "is_std": std(s.sum_rho, s.sum_rho2),
            "is_min": extreme(s.min_rho),
            "is_max": extreme(s.max_rho),
            "effective_sample_size": ess,
            "effective_sample_size_fraction": mean(ess),
            "is_clipfrac": mean(s.n_clip.astype(np.float64)),
            "kl_k2": mean(s.sum_k2),
            "kl_k3_reverse": mean(s.sum_k3rev),
            "js_divergence": mean(s.sum_js),
            "token_mult_prob_error": mean(s.sum_expabs),
            "logprob_abs_diff_std": std(s.sum_absd, s.sum_absd2),
            "logprob_abs_diff_sample_mean": seq_mean(s.sum_seq_absd),
            "kl_k1_sample_mean": seq_mean(s.sum_seq_negd),
            "kl_k3_sample_mean": seq_mean(s.sum_seq_k3),
            "log_ppl_abs_diff": seq_mean(s.sum_seq_abs_lpd),
            "log_ppl_diff_max": np.where(has_seq, s.max_seq_lpd, nan),
            "log_ppl_diff_min": np.where(has_seq, s.min_seq_lpd, nan),
            "training_ppl": seq_mean(s.sum_seq_ppl_t),
            "rollout_ppl": seq_mean(s.sum_seq_ppl_r),
            "training_log_ppl": seq_mean(s.sum_seq_logppl_t),
            "rollout_log_ppl": seq_mean(s.sum_seq_logppl_r),
            "chi2_seq": seq_mean(s.sum_seq_rho2) - 1.0,
            "trainer_topk_entropy": ent_t,
            "rollout_topk_entropy": ent_r,
            "kl_ent_ratio": np.where(np.isfinite(ent_t), k3 / ent_t, k3 / ent_r),
        }
    # ``+ 0.0`` turns the -0.0 of an all-zero Δ into +0.0: identical sides read as exactly 0.0.
    return {k: v + 0.0 for k, v in out.items()}


def _check_eps(clip_eps: float) -> float:
    eps = float(clip_eps)
    if not (eps > 0.0 and np.isfinite(eps)):
        raise ValueError(f"clip_eps: must be a positive finite number, got {clip_eps!r}")
    return eps


def length_bucket_of(n_tokens: np.ndarray) -> np.ndarray:
    """Index into :data:`LENGTH_BUCKETS` of each completion length."""
    return np.searchsorted(np.asarray(LENGTH_BUCKET_EDGES), np.asarray(n_tokens), side="right") - 1


def sample_metrics(
    trainer_lp: np.ndarray,
    rollout_lp: np.ndarray,
    offsets: np.ndarray,
    *,
    clip_eps: float = 0.2,
    entropies: tuple[np.ndarray | None, np.ndarray | None] = (None, None),
) -> pd.DataFrame:
    """One row per sample (columns :data:`SAMPLE_METRICS` plus ``length_bucket``).

    ``trainer_lp``/``rollout_lp`` are the concatenated float32 logprobs of all samples;
    sample ``i`` is ``[offsets[i], offsets[i+1])``. ``entropies`` are optional per-token
    entropies of each side from its recorded top-k (:func:`topk_entropy`; NaN where unknown).
    """
    t, r, o = _check_inputs(trainer_lp, rollout_lp, offsets)
    return _sample_frame(_per_sample_stats(t, r, o, _check_eps(clip_eps), _check_entropies(entropies, t)))


def sample_and_step_metrics(
    trainer_lp: np.ndarray,
    rollout_lp: np.ndarray,
    offsets: np.ndarray,
    *,
    clip_eps: float = 0.2,
    entropies: tuple[np.ndarray | None, np.ndarray | None] = (None, None),
    variants: Iterable[str] = (),
) -> tuple[pd.DataFrame, dict[str, float]]:
    """:func:`sample_metrics` and :func:`step_metrics` of the same step from one pass over the tokens."""
    t, r, o = _check_inputs(trainer_lp, rollout_lp, offsets)
    stats = _per_sample_stats(t, r, o, _check_eps(clip_eps), _check_entropies(entropies, t))
    return _sample_frame(stats), {**_step_dict(stats), **_parametric_dict(_TokenView(t, r, o), variants)}


def _sample_frame(stats: _Stats) -> pd.DataFrame:
    frame = pd.DataFrame(_derive(stats), columns=list(SAMPLE_METRICS))
    for name in ("n_tokens", "n_finite", "n_nonfinite", "bitwise_mismatch_count", "first_diverging_position"):
        frame[name] = frame[name].astype(np.int64)
    frame["length_bucket"] = np.asarray(LENGTH_BUCKETS, dtype=object)[length_bucket_of(stats.n_tokens)]
    frame.index.name = "sample"
    return frame


def step_metrics(
    trainer_lp: np.ndarray,
    rollout_lp: np.ndarray,
    offsets: np.ndarray,
    *,
    clip_eps: float = 0.2,
    entropies: tuple[np.ndarray | None, np.ndarray | None] = (None, None),
    variants: Iterable[str] = (),
) -> dict[str, float]:
    """Metrics of a whole step: :data:`STEP_METRICS` (token-weighted, or sample-averaged for
    :data:`SAMPLE_AVERAGED`), each again per completion-length bucket as ``name/len_lo_hi`` (always
    all buckets; NaN when empty), then every :data:`PARAMETRIC` figure at its defaults and at each of
    ``variants`` (keys of :func:`variant_key`, e.g. ``tis_mean[cap=3]``)."""
    t, r, o = _check_inputs(trainer_lp, rollout_lp, offsets)
    stats = _per_sample_stats(t, r, o, _check_eps(clip_eps), _check_entropies(entropies, t))
    return {**_step_dict(stats), **_parametric_dict(_TokenView(t, r, o), variants)}


def _check_entropies(
    entropies: tuple[np.ndarray | None, np.ndarray | None], t: np.ndarray
) -> tuple[np.ndarray | None, np.ndarray | None]:
    out = []
    for side, e in zip(("trainer", "rollout"), entropies, strict=True):
        if e is not None:
            e = np.asarray(e, dtype=np.float64)
            if e.shape != t.shape:
                raise ValueError(f"entropies: the {side}'s has {e.size} values for {t.size} tokens")
        out.append(e)
    return out[0], out[1]


def _step_dict(per_sample: _Stats) -> dict[str, float]:
    buckets = length_bucket_of(per_sample.n_tokens)
    out: dict[str, float] = {}
    for suffix, mask in [("", None), *((f"/{b}", buckets == i) for i, b in enumerate(LENGTH_BUCKETS))]:
        pooled = _combine(per_sample, mask)
        derived = _derive(pooled)
        n_samples = float(pooled.n_samples[0])
        values = {
            "n_samples": n_samples,
            **{k: float(v[0]) for k, v in derived.items()},
            "diverged_sample_fraction": float(pooled.n_diverged[0] / n_samples)
            if n_samples
            else float("nan"),
        }
        for name in STEP_METRICS:
            out[name + suffix] = values[name]
    return out


# ---------------------------------------------------------------------------- top-k entropy


def topk_entropy(topk_logprobs: np.ndarray) -> np.ndarray:
    """Per-token entropy ``-Σ p log p`` over a side's recorded top-k logprobs ([tokens, k]); a lower
    bound on the full entropy (the tail is missing). Non-finite entries count as p = 0."""
    lp = np.asarray(topk_logprobs, dtype=np.float64)
    if lp.ndim != 2:
        raise ValueError(f"topk_logprobs: expected [tokens, k], got shape {list(lp.shape)}")
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(lp)
        terms = np.where(np.isfinite(lp) & (p > 0), -p * lp, 0.0)
    return terms.sum(axis=1) + 0.0


# ------------------------------------------------------------------- threshold (parametric) figures

ParamValue = float | str


class _TokenView:
    """The finite tokens of a step, with the sample each belongs to: what thresholds are applied to.
    Token statistics shared by several figures are computed once (``cache``)."""

    def __init__(self, t32: np.ndarray, r32: np.ndarray, offsets: np.ndarray) -> None:
        t, r = t32.astype(np.float64), r32.astype(np.float64)
        finite = np.isfinite(t) & np.isfinite(r)
        self.sample = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))[finite]
        with np.errstate(invalid="ignore"):
            #: Δ clamped to ±LOG_RATIO_BOUND (verl's SAFETY_BOUND) and ρ = exp(Δ)
            self.d = np.clip((t - r)[finite], -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        self.rho = np.exp(self.d)
        self.n_per_sample = np.bincount(self.sample, minlength=offsets.size - 1)
        self.has = self.n_per_sample > 0
        self._starts = (
            np.flatnonzero(np.r_[True, self.sample[1:] != self.sample[:-1]]) if self.d.size else None
        )
        self.cache: dict[tuple[object, ...], Any] = {}

    def memo(self, key: tuple[object, ...], make: Callable[[], np.ndarray]) -> np.ndarray:
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]  # type: ignore[no-any-return]

    def per_sample(self, values: np.ndarray, how: str = "sum") -> np.ndarray:
        """Per-sample sum / mean / max of token values, for the samples that have tokens (in order)."""
        if self._starts is None:
            return np.zeros(0)
        if how == "max":
            return np.maximum.reduceat(values, self._starts)
        out = np.add.reduceat(values.astype(np.float64), self._starts)
        return out / self.n_per_sample[self.has] if how == "mean" else out

    def token_mean(self, values: np.ndarray, aggregate: ParamValue = "token") -> float:
        """Token-weighted mean, or (``aggregate="sample"``) the mean of per-sample means."""
        if not self.d.size:
            return float("nan")
        if aggregate == "sample":
            return float(self.per_sample(values, "mean").mean())
        return float(values.mean())


@dataclass(frozen=True)
class Parametric:
    """A figure that depends on bounds or thresholds: defaults and one definition."""

    description: str
    defaults: dict[str, ParamValue]
    compute: Callable[..., float]


def _nan_if_empty(f: Callable[..., float]) -> Callable[..., float]:
    def wrapped(view: _TokenView, **params: ParamValue) -> float:
        return f(view, **params) if view.d.size else float("nan")

    return wrapped


def _tis(view: _TokenView, cap: float) -> np.ndarray:
    return view.memo(("tis", cap), lambda: np.minimum(view.rho, cap))


def _tis_ess(view: _TokenView, cap: float) -> float:
    w = _tis(view, cap)
    return float(w.sum() ** 2 / (w.size * (w * w).sum())) if (w * w).sum() > 0 else float("nan")


def _oob(view: _TokenView, lower: float, upper: float) -> np.ndarray:
    return ((view.rho < lower) | (view.rho > upper)).astype(np.float64)


def _geo_oob(view: _TokenView, lower: float, upper: float) -> float:
    geo = np.exp(view.per_sample(view.d, "mean"))
    return float(((geo < lower) | (geo > upper)).mean())


#: verl's rejection-sampling options (rollout_corr rollout_rs): per-token divergence k1 = -Δ,
#: k2 = Δ²/2, k3 = e^Δ - 1 - Δ, at token level or as a per-sequence sum, mean or max.
RS_OPTIONS: tuple[str, ...] = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


def _rs_keep(view: _TokenView, option: str, lower: float, upper: float) -> tuple[np.ndarray, np.ndarray]:
    """(kept per token, kept per sample) under one rejection option; k1 bounds are ratio bounds
    compared in log space, k2/k3 an upper bound on the divergence. Shared by its two fractions."""
    key = ("rs_keep", option, lower, upper)
    if key not in view.cache:
        view.cache[key] = _rs_keep_compute(view, option, lower, upper)
    return view.cache[key]


def _rs_keep_compute(
    view: _TokenView, option: str, lower: float, upper: float
) -> tuple[np.ndarray, np.ndarray]:
    d = view.d
    kind = option[-2:]
    make = {"k1": lambda: -d, "k2": lambda: 0.5 * d * d, "k3": lambda: np.expm1(d) - d}[kind]
    stat = view.memo(("rs", kind), make)

    def ok(x: np.ndarray) -> np.ndarray:
        return (x >= np.log(lower)) & (x <= np.log(upper)) if kind == "k1" else x <= upper

    if option.startswith("token_"):
        token_ok = ok(stat)
        return token_ok, view.per_sample((~token_ok).astype(np.float64)) == 0
    sample_ok = ok(view.per_sample(stat, option.split("_")[1]))  # sum | mean | max
    return np.repeat(sample_ok, view.n_per_sample[view.has]), sample_ok


def _rs_figures() -> dict[str, Parametric]:
    out = {}
    for option in RS_OPTIONS:
        bounds: dict[str, ParamValue] = (
            {"lower": 0.5, "upper": 2.0}
            if option.endswith("k1")
            else {"upper": 0.01 if "sum" not in option else 1.0}
        )
        what = (
            "ratio bounds [lower, upper] on exp(-k1)"
            if option.endswith("k1")
            else "upper bound on the divergence"
        )

        def masked(view: _TokenView, option: str = option, **p: ParamValue) -> float:
            token_ok, _ = _rs_keep(view, option, float(p.get("lower", 0.0)), float(p["upper"]))
            return float(1.0 - token_ok.mean())

        def seq_masked(view: _TokenView, option: str = option, **p: ParamValue) -> float:
            _, sample_ok = _rs_keep(view, option, float(p.get("lower", 0.0)), float(p["upper"]))
            return float(1.0 - sample_ok.mean())

        out[f"rs_{option}_masked_fraction"] = Parametric(
            f"fraction of tokens rejected by rejection sampling {option} ({what})",
            bounds,
            _nan_if_empty(masked),
        )
        out[f"rs_{option}_seq_masked_fraction"] = Parametric(
            f"fraction of samples with a token rejected by rejection sampling {option} ({what})",
            bounds,
            _nan_if_empty(seq_masked),
        )
    return out


#: Every threshold figure, with its defaults (verl's unless named). ``aggregate`` is ``token``
#: (pool tokens) or ``sample`` (mean of per-sample means, slime's default reduction).
PARAMETRIC: dict[str, Parametric] = {
    "tis_mean": Parametric(
        "mean truncated importance weight min(ρ, cap)",
        {"cap": 2.0},
        _nan_if_empty(lambda v, cap: float(_tis(v, float(cap)).mean())),
    ),
    "tis_std": Parametric(
        "std (ddof=0) of the truncated importance weights min(ρ, cap)",
        {"cap": 2.0},
        _nan_if_empty(lambda v, cap: float(_tis(v, float(cap)).std())),
    ),
    "tis_min": Parametric(
        "min truncated importance weight min(ρ, cap)",
        {"cap": 2.0},
        _nan_if_empty(lambda v, cap: float(_tis(v, float(cap)).min())),
    ),
    "tis_max": Parametric(
        "max truncated importance weight min(ρ, cap)",
        {"cap": 2.0},
        _nan_if_empty(lambda v, cap: float(_tis(v, float(cap)).max())),
    ),
    "tis_ess_fraction": Parametric(
        "Kish effective sample size of the truncated weights over the token count, (Σw)²/(nΣw²)",
        {"cap": 2.0},
        _nan_if_empty(lambda v, cap: _tis_ess(v, float(cap))),
    ),
    "tis_seq_mean": Parametric(
        "mean over samples of each sample's mean truncated weight",
        {"cap": 2.0},
        _nan_if_empty(lambda v, cap: float(v.per_sample(_tis(v, float(cap)), "mean").mean())),
    ),
    "tis_seq_max": Parametric(
        "max over samples of each sample's mean truncated weight",
        {"cap": 2.0},
        _nan_if_empty(lambda v, cap: float(v.per_sample(_tis(v, float(cap)), "mean").max())),
    ),
    "tis_seq_min": Parametric(
        "min over samples of each sample's mean truncated weight",
        {"cap": 2.0},
        _nan_if_empty(lambda v, cap: float(v.per_sample(_tis(v, float(cap)), "mean").min())),
    ),
    "tis_seq_max_deviation": Parametric(
        "max over samples of |mean truncated weight - 1|",
        {"cap": 2.0},
        _nan_if_empty(lambda v, cap: float(np.abs(v.per_sample(_tis(v, float(cap)), "mean") - 1.0).max())),
    ),
    "is_fraction_high": Parametric(
        "fraction of tokens with importance weight ρ > upper",
        {"upper": 2.0, "aggregate": "token"},
        _nan_if_empty(
            lambda v, upper, aggregate: v.token_mean((v.rho > float(upper)).astype(float), aggregate)
        ),
    ),
    "is_fraction_low": Parametric(
        "fraction of tokens with importance weight ρ < lower",
        {"lower": 0.5, "aggregate": "token"},
        _nan_if_empty(
            lambda v, lower, aggregate: v.token_mean((v.rho < float(lower)).astype(float), aggregate)
        ),
    ),
    "is_seq_fraction_high": Parametric(
        "fraction of samples whose mean importance weight is > upper",
        {"upper": 2.0},
        _nan_if_empty(lambda v, upper: float((v.per_sample(v.rho, "mean") > float(upper)).mean())),
    ),
    "is_seq_fraction_low": Parametric(
        "fraction of samples whose mean importance weight is < lower",
        {"lower": 0.5},
        _nan_if_empty(lambda v, lower: float((v.per_sample(v.rho, "mean") < float(lower)).mean())),
    ),
    "is_oob_fraction": Parametric(
        "fraction of tokens with ρ outside [lower, upper] (what IcePop masks and TIS clamps)",
        {"lower": 0.5, "upper": 5.0, "aggregate": "token"},
        _nan_if_empty(
            lambda v, lower, upper, aggregate: v.token_mean(_oob(v, float(lower), float(upper)), aggregate)
        ),
    ),
    "geo_oob_seq_fraction": Parametric(
        "fraction of samples whose geometric-mean weight exp(mean Δ) is outside [lower, upper]",
        {"lower": 0.5, "upper": 5.0},
        _nan_if_empty(lambda v, lower, upper: _geo_oob(v, float(lower), float(upper))),
    ),
    **_rs_figures(),
}


def _format(value: ParamValue) -> str:
    return value if isinstance(value, str) else f"{float(value):g}"


def variant_key(name: str, params: dict[str, ParamValue] | None = None) -> str:
    """The stored key of a threshold figure at ``params``: the bare name at its defaults, else
    ``name[k=v,...]`` listing the parameters that differ, in definition order."""
    figure = PARAMETRIC.get(name)
    if figure is None:
        raise ValueError(f"metric: {name!r} is not a threshold figure (known: {', '.join(PARAMETRIC)})")
    params = dict(params or {})
    unknown = set(params) - set(figure.defaults)
    if unknown:
        raise ValueError(
            f"{name}: unknown parameter {sorted(unknown)[0]!r} (has {', '.join(figure.defaults)})"
        )
    changed = [
        f"{k}={_format(params[k])}"
        for k, default in figure.defaults.items()
        if k in params and _format(params[k]) != _format(default)
    ]
    return f"{name}[{','.join(changed)}]" if changed else name


_VARIANT = re.compile(r"^(?P<name>[a-z0-9_]+)\[(?P<params>[^\]]*)\]$")


def parse_variant(key: str) -> tuple[str, dict[str, ParamValue]]:
    """Inverse of :func:`variant_key`: (figure name, full parameters). Raises ValueError naming the part."""
    match = _VARIANT.match(key)
    name, body = (match["name"], match["params"]) if match else (key, "")
    figure = PARAMETRIC.get(name)
    if figure is None:
        raise ValueError(f"metric: {key!r} is not a threshold figure")
    params: dict[str, ParamValue] = dict(figure.defaults)
    for part in filter(None, body.split(",")):
        k, sep, v = part.partition("=")
        if not sep or k not in figure.defaults:
            raise ValueError(f"{name}: bad parameter {part!r} (has {', '.join(figure.defaults)})")
        if isinstance(figure.defaults[k], str):
            params[k] = v
        else:
            try:
                params[k] = float(v)
            except ValueError:
                raise ValueError(f"{name}: parameter {k} must be a number, got {v!r}") from None
    if params.get("aggregate", "token") not in ("token", "sample"):
        raise ValueError(f"{name}: aggregate must be token or sample, got {params['aggregate']!r}")
    return name, params


def _parametric_dict(view: _TokenView, variants: Iterable[str]) -> dict[str, float]:
    keys = dict.fromkeys([*PARAMETRIC, *variants])
    out = {}
    for key in keys:
        name, params = parse_variant(key)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            out[variant_key(name, params)] = float(PARAMETRIC[name].compute(view, **params)) + 0.0
    return out


# ------------------------------------------------------------------------------ lag slices

#: Step metrics repeated per policy lag (``kl_k3/lag_1``): the figures asynchronous RL is judged by.
LAG_SLICED: tuple[str, ...] = (
    "n_tokens",
    "n_samples",
    "kl_k1",
    "kl_k3",
    "logprob_abs_diff_mean",
    "logprob_abs_diff_max",
    "is_mean",
    "token_mult_prob_error",
    "exact_match_fraction",
)

_LAG_KEY = re.compile(r"^(?P<name>[a-z0-9_]+)/lag_(?P<lag>-?[0-9]+)$")


def lag_key(name: str, lag: int) -> str:
    return f"{name}/lag_{lag}"


def parse_lag_key(key: str) -> tuple[str, int] | None:
    """(metric, lag) of a lag-sliced key, or None when ``key`` is not one."""
    match = _LAG_KEY.match(key)
    if match is None or match["name"] not in LAG_SLICED:
        return None
    return match["name"], int(match["lag"])


def lag_metrics(
    trainer_lp: np.ndarray, rollout_lp: np.ndarray, offsets: np.ndarray, token_lag: np.ndarray
) -> dict[str, float]:
    """Policy lag per step (``policy_lag_{mean,max,min}`` over tokens whose lag is known, and
    ``off_policy_token_fraction`` of them with lag > 0), then :data:`LAG_SLICED` per lag as
    ``name/lag_L``: a sample counts toward each lag its tokens have. ``token_lag`` is int64 per token
    (the trainer's weight version minus the version that sampled it); -2**62 marks unknown."""
    t, r, o = _check_inputs(trainer_lp, rollout_lp, offsets)
    lag = np.asarray(token_lag, dtype=np.int64)
    if lag.shape != t.shape:
        raise ValueError(f"token_lag: {lag.size} values for {t.size} tokens")
    known = lag != UNKNOWN_LAG
    out: dict[str, float] = {}
    if not known.any():
        return out
    out["policy_lag_mean"] = float(lag[known].mean())
    out["policy_lag_max"] = float(lag[known].max())
    out["policy_lag_min"] = float(lag[known].min())
    out["off_policy_token_fraction"] = float((lag[known] > 0).mean())
    sample_of = np.repeat(np.arange(o.size - 1), np.diff(o))
    for value in np.unique(lag[known]):
        pick = lag == value
        counts = np.bincount(sample_of[pick], minlength=o.size - 1)
        counts = counts[counts > 0]
        sliced = _step_dict(_per_sample_stats(t[pick], r[pick], np.r_[0, np.cumsum(counts)], 0.2))
        for name in LAG_SLICED:
            out[lag_key(name, int(value))] = sliced[name]
    return out


#: The marker of a token whose policy lag is unknown (versions that are not integers, or absent).
UNKNOWN_LAG = -(2**62)
