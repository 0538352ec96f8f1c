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

from dataclasses import dataclass, fields

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
}

_STEP_ONLY_DESCRIPTIONS: dict[str, str] = {
    "n_samples": "samples compared",
    "diverged_sample_fraction": "fraction of samples with at least one bitwise mismatch",
}

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


_MAX_FIELDS = {"max_dp", "max_absd", "max_rho"}
_MIN_FIELDS = {"min_rho"}


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


def _per_sample_stats(t32: np.ndarray, r32: np.ndarray, offsets: np.ndarray, clip_eps: float) -> _Stats:
    """One pass of vectorised token arithmetic, then segment reductions per sample."""
    n = offsets.size - 1
    lengths = np.diff(offsets)
    nonempty = lengths > 0
    starts = offsets[:-1][nonempty]

    def seg(ufunc: np.ufunc, values: np.ndarray, fill: float | int) -> np.ndarray:
        out = np.full(n, fill, dtype=values.dtype)
        if starts.size:
            out[nonempty] = ufunc.reduceat(values, starts)
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
        pt = np.exp(t)
        pr = np.exp(r)
        dp = np.abs(pt - pr)
        absd = np.abs(d)
        rho = np.exp(np.clip(d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        k3 = np.expm1(d) - d
    clip = np.abs(rho - 1.0) > clip_eps
    if not all_finite:  # excluded tokens must not touch sums, maxima or counts
        pt = np.where(finite, pt, 0.0)
        pr = np.where(finite, pr, 0.0)
        dp = np.where(finite, dp, 0.0)
        clip &= finite
    rho_sum_src = rho if all_finite else np.where(finite, rho, 0.0)

    n_finite = seg(np.add, finite.astype(np.int64), 0)
    n_mismatch = seg(np.add, mismatch.astype(np.int64), 0)
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

    masked_max = (lambda x: x) if all_finite else (lambda x: np.where(finite, x, -np.inf))
    masked_min = (lambda x: x) if all_finite else (lambda x: np.where(finite, x, np.inf))
    return _Stats(
        n_samples=np.ones(n, dtype=np.int64),
        n_seq=has_seq.astype(np.int64),
        n_diverged=(n_mismatch > 0).astype(np.int64),
        n_tokens=lengths,
        n_finite=n_finite,
        n_mismatch=n_mismatch,
        n_clip=seg(np.add, clip.astype(np.int64), 0),
        first_div=first_div,
        sum_dp=seg(np.add, dp, 0.0),
        sum_dp2=seg(np.add, dp * dp, 0.0),
        max_dp=seg(np.maximum, masked_max(dp), -np.inf),
        sum_pt=seg(np.add, pt, 0.0),
        sum_pr=seg(np.add, pr, 0.0),
        sum_pt2=seg(np.add, pt * pt, 0.0),
        sum_pr2=seg(np.add, pr * pr, 0.0),
        sum_ptpr=seg(np.add, pt * pr, 0.0),
        sum_absd=seg(np.add, absd, 0.0),
        max_absd=seg(np.maximum, masked_max(absd), -np.inf),
        sum_negd=sum_negd,
        sum_k3=seg(np.add, k3, 0.0),
        sum_rho=seg(np.add, rho_sum_src, 0.0),
        sum_rho2=seg(np.add, rho_sum_src * rho_sum_src, 0.0),
        min_rho=seg(np.minimum, masked_min(rho), np.inf),
        max_rho=seg(np.maximum, masked_max(rho), -np.inf),
        sum_seq_lpd=lpd,
        sum_seq_ppl=ppl,
    )


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
            "kl_k3": mean(s.sum_k3),
            "log_ppl_diff": np.where(has_seq, s.sum_seq_lpd / np.where(has_seq, nseq, 1.0), nan),
            "ppl_ratio": np.where(has_seq, s.sum_seq_ppl / np.where(has_seq, nseq, 1.0), nan),
            "chi2_token": mean(s.sum_rho2) - 1.0,
            "is_mean": mean(s.sum_rho),
            "is_std": std(s.sum_rho, s.sum_rho2),
            "is_min": extreme(s.min_rho),
            "is_max": extreme(s.max_rho),
            "effective_sample_size": ess,
            "effective_sample_size_fraction": mean(ess),
            "is_clipfrac": mean(s.n_clip.astype(np.float64)),
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
    trainer_lp: np.ndarray, rollout_lp: np.ndarray, offsets: np.ndarray, *, clip_eps: float = 0.2
) -> pd.DataFrame:
    """One row per sample (columns :data:`SAMPLE_METRICS` plus ``length_bucket``).

    ``trainer_lp``/``rollout_lp`` are the concatenated float32 logprobs of all samples;
    sample ``i`` is ``[offsets[i], offsets[i+1])``.
    """
    t, r, o = _check_inputs(trainer_lp, rollout_lp, offsets)
    return _sample_frame(_per_sample_stats(t, r, o, _check_eps(clip_eps)))


def sample_and_step_metrics(
    trainer_lp: np.ndarray, rollout_lp: np.ndarray, offsets: np.ndarray, *, clip_eps: float = 0.2
) -> tuple[pd.DataFrame, dict[str, float]]:
    """:func:`sample_metrics` and :func:`step_metrics` of the same step from one pass over the tokens."""
    t, r, o = _check_inputs(trainer_lp, rollout_lp, offsets)
    stats = _per_sample_stats(t, r, o, _check_eps(clip_eps))
    return _sample_frame(stats), _step_dict(stats)


def _sample_frame(stats: _Stats) -> pd.DataFrame:
    frame = pd.DataFrame(_derive(stats), columns=list(SAMPLE_METRICS))
    for name in ("n_tokens", "n_finite", "n_nonfinite", "bitwise_mismatch_count", "first_diverging_position"):
        frame[name] = frame[name].astype(np.int64)
    frame["length_bucket"] = np.asarray(LENGTH_BUCKETS, dtype=object)[length_bucket_of(stats.n_tokens)]
    frame.index.name = "sample"
    return frame


def step_metrics(
    trainer_lp: np.ndarray, rollout_lp: np.ndarray, offsets: np.ndarray, *, clip_eps: float = 0.2
) -> dict[str, float]:
    """Token-weighted metrics of a whole step (keys :data:`STEP_METRICS`), then every one of them
    again per completion-length bucket as ``name/len_lo_hi`` (always all buckets; NaN when empty)."""
    t, r, o = _check_inputs(trainer_lp, rollout_lp, offsets)
    return _step_dict(_per_sample_stats(t, r, o, _check_eps(clip_eps)))


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
