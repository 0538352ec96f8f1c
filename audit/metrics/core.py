"""The token statistics of the train–rollout mismatch, per sample and per step (DESIGN.md, "Metrics").

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

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

import numpy as np
import pandas as pd
from isoaudit.audit.metrics.blocks import BLOCK_TOKENS, Key, Request, TokenBlocks, block_bounds
from isoaudit.audit.metrics.families import LOG_RATIO_BOUND, PARAMETRIC, TokenView
from isoaudit.audit.metrics.keys import (
    LENGTH_BUCKETS,
    STANDING_VARIANTS,
    length_bucket_bounds,
    length_bucket_of,
    length_key,
    parse_variant,
    variant_description,
    variant_key,
)
from isoaudit.audit.metrics.noise import NOISE_DESCRIPTIONS, NOISE_FIT, NOISE_SLICED, noise_figures

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
    **{name: NOISE_DESCRIPTIONS[name] for name in NOISE_SLICED},
}

#: Step figures of :func:`step_metrics` given for the whole step only (no length slices): the noise
#: fit, and ``token_fraction``, which lag slices (``token_fraction/lag_1``) give per lag.
UNSLICED_DESCRIPTIONS: dict[str, str] = {
    **{name: NOISE_DESCRIPTIONS[name] for name in NOISE_FIT},
    "token_fraction": "share of the step's tokens in this slice: 1 for the whole step; per lag "
    "(token_fraction/lag_L), of the tokens whose lag is known",
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
STEP_METRICS: tuple[str, ...] = (
    "n_samples",
    *SAMPLE_METRICS,
    "diverged_sample_fraction",
    *NOISE_SLICED,
)


def _all_descriptions() -> dict[str, str]:
    out = {name: _BASE_DESCRIPTIONS.get(name) or _STEP_ONLY_DESCRIPTIONS[name] for name in STEP_METRICS}
    for bucket, (lo, hi) in zip(LENGTH_BUCKETS, length_bucket_bounds(), strict=True):
        span = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        for name in STEP_METRICS:
            out[length_key(name, bucket)] = f"{out[name]}; samples with {span} completion tokens"
    out.update(UNSLICED_DESCRIPTIONS)
    for key in STANDING_VARIANTS:  # threshold figures computed on every step beside their defaults
        out[key] = variant_description(key)
    return out


#: One line per metric name :func:`step_metrics` can return (sliced names and the standing threshold
#: variants included; the threshold figures at their defaults are described in ``PARAMETRIC``).
METRIC_DESCRIPTIONS: dict[str, str] = _all_descriptions()


@dataclass
class SufficientStats:
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
    # noise vs bias (audit.metrics.noise), over samples with finite tokens, m_i their mean Δ, T_i their count
    sum_seq_d2: np.ndarray  # Σ m_i²
    sum_inv_len: np.ndarray  # Σ 1/T_i
    sum_len_d2: np.ndarray  # Σ T_i m_i²


_MAX_FIELDS = {"max_dp", "max_absd", "max_rho", "max_seq_lpd"}
_MIN_FIELDS = {"min_rho", "min_seq_lpd"}


def check_inputs(
    trainer_lp: np.ndarray, rollout_lp: np.ndarray, offsets: np.ndarray
) -> tuple[np.ndarray, ...]:
    """(trainer float32, rollout float32, int64 offsets) of a step's concatenated logprobs, or a
    ValueError naming the argument at fault."""
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


def per_sample_stats(
    t32: np.ndarray,
    r32: np.ndarray,
    offsets: np.ndarray,
    clip_eps: float,
    entropies: tuple[np.ndarray | None, np.ndarray | None] = (None, None),
    *,
    block_tokens: int | None = None,
    blocks: TokenBlocks | None = None,
    extra: Iterable[Request] = (),
    threads: int = 1,
) -> SufficientStats:
    """Per-sample sufficient statistics, measured in blocks of whole samples (about ``block_tokens``
    tokens each). Every statistic is a reduction over one sample's tokens, so a block's samples come
    out bit for bit as from one pass over the step; the one step-wide choice, how ρ is computed
    (:func:`_segment_stats`' ``exp_rho``), is made for the whole step. ``block_tokens`` defaults
    to :data:`BLOCK_TOKENS`. Given the step's ``blocks`` (audit.metrics.blocks) and every token
    finite, without entropies, the statistics are their reductions (the same arithmetic; a sample
    whose sides agree on most tokens sums its differing ones and counts the others' common value,
    :attr:`~audit.metrics.blocks.Block.agreeing`), measured in one pass with the reductions
    ``extra`` lists, on ``threads`` threads."""
    if blocks is not None and blocks.all_finite and entropies[0] is None and entropies[1] is None:
        return _block_stats(blocks, clip_eps, extra, threads)
    bounds = block_bounds(offsets, BLOCK_TOKENS if block_tokens is None else block_tokens)
    if len(bounds) <= 2:
        return segment_stats(t32, r32, offsets, clip_eps, entropies)

    def measure(exp_rho: bool | None) -> list[tuple[SufficientStats, bool]]:
        out = []
        for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
            a, b = int(offsets[lo]), int(offsets[hi])
            block_entropies = (
                entropies[0][a:b] if entropies[0] is not None else None,
                entropies[1][a:b] if entropies[1] is not None else None,
            )
            out.append(
                _segment_stats(
                    t32[a:b], r32[a:b], offsets[lo : hi + 1] - a, clip_eps, block_entropies, exp_rho
                )
            )
        return out

    measured = measure(None)
    if not all(inside for _, inside in measured):  # some |Δ| beyond the bound: ρ = exp(clamped Δ) everywhere
        measured = measure(True)
    return SufficientStats(
        **{
            f.name: np.concatenate([getattr(stats, f.name) for stats, _ in measured])
            for f in fields(SufficientStats)
        }
    )


def _core_requests(clip_eps: float, rho: str) -> dict[str, Request]:
    """The per-sample reductions of :func:`_segment_stats` on every token finite, by its names:
    ``rho`` is ``core_rho`` (1 + expm1 Δ) when every |Δ| is within the bound, else ``rho``."""
    s: dict[str, Key] = {
        "sum_dp": "core_dp",
        "sum_dp2": ("sq", "core_dp"),
        "sum_pt": "exp_t",
        "sum_pr": "core_pr",
        "sum_pt2": ("sq", "exp_t"),
        "sum_pr2": ("sq", "core_pr"),
        "sum_ptpr": ("mul", "exp_t", "core_pr"),
        "sum_absd": "abs_d",
        "sum_d": "d",
        "sum_k3": "core_k3",
        "sum_rho": rho,
        "sum_rho2": ("sq", rho),
        "sum_k2": "core_k2",
        "sum_k3rev": "core_k3rev",
        "sum_js": "core_js",
        "sum_expabs": "core_expabs",
        "sum_absd2": "d_sq",  # |Δ|·|Δ| is Δ·Δ exactly
        "sum_t": "t",
        "sum_r": "r",
    }
    return {
        **{name: ("sum", key) for name, key in s.items()},
        "n_mismatch": ("sum", "mismatch"),
        "n_clip": ("sum", ("clipped", rho, clip_eps)),
        "first_div": ("first", "mismatch"),
        "max_dp": ("max", "core_dp"),
        "max_absd": ("max", "abs_d"),
        "min_rho": ("min", rho),
        "max_rho": ("max", rho),
    }


def _block_stats(
    blocks: TokenBlocks, clip_eps: float, extra: Iterable[Request], threads: int
) -> SufficientStats:
    """:func:`per_sample_stats` of a step whose every token is finite, from its blocks' reductions."""
    requests = _core_requests(clip_eps, "core_rho")
    blocks.measure([*requests.values(), *extra], threads)
    if blocks.n_samples and blocks.max("abs_d") > LOG_RATIO_BOUND:  # ρ = exp(clamped Δ) everywhere
        requests = _core_requests(clip_eps, "rho")
        blocks.measure(requests.values(), threads)
    n = blocks.n_samples
    sums = {name: blocks.get(*request) for name, request in requests.items()}
    no_entropy = (np.zeros(n), np.zeros(n, dtype=np.int64))
    return _assemble(blocks.lengths, blocks.lengths, sums, [no_entropy, no_entropy])


def segment_stats(
    t32: np.ndarray,
    r32: np.ndarray,
    offsets: np.ndarray,
    clip_eps: float,
    entropies: tuple[np.ndarray | None, np.ndarray | None] = (None, None),
) -> SufficientStats:
    """One pass of vectorised token arithmetic over all of ``t32``/``r32``, then segment reductions
    per sample: :func:`per_sample_stats` without the blocks."""
    return _segment_stats(t32, r32, offsets, clip_eps, entropies, None)[0]


def _segment_stats(
    t32: np.ndarray,
    r32: np.ndarray,
    offsets: np.ndarray,
    clip_eps: float,
    entropies: tuple[np.ndarray | None, np.ndarray | None],
    exp_rho: bool | None,
) -> tuple[SufficientStats, bool]:
    """The statistics of :func:`segment_stats` and whether every finite |Δ| is within
    ``LOG_RATIO_BOUND``. ρ is ``1 + expm1(Δ)`` (exact near Δ = 0) when every |Δ| of the step is
    within the bound, else ``exp(clamped Δ)``: ``exp_rho`` forces the latter; None decides from
    these tokens."""
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
        all_inside = bool((absd <= LOG_RATIO_BOUND).all())
        if exp_rho or not all_inside:
            rho = np.exp(np.clip(d, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
        else:
            rho = 1.0 + em1p
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

    masked_max = (lambda x: x) if all_finite else (lambda x: np.where(finite, x, -np.inf))
    masked_min = (lambda x: x) if all_finite else (lambda x: np.where(finite, x, np.inf))
    sums = {
        "n_mismatch": n_mismatch,
        "n_clip": seg(np.add, clip, 0),
        "first_div": first_div,
        "sum_dp": seg(np.add, dp, 0.0),
        "sum_dp2": seg(np.add, dp * dp, 0.0),
        "max_dp": seg(np.maximum, masked_max(dp), -np.inf),
        "sum_pt": seg(np.add, pt, 0.0),
        "sum_pr": seg(np.add, pr, 0.0),
        "sum_pt2": seg(np.add, pt * pt, 0.0),
        "sum_pr2": seg(np.add, pr * pr, 0.0),
        "sum_ptpr": seg(np.add, pt * pr, 0.0),
        "sum_absd": seg(np.add, absd, 0.0),
        "max_absd": seg(np.maximum, masked_max(absd), -np.inf),
        "sum_d": seg(np.add, d, 0.0),
        "sum_k3": seg(np.add, k3, 0.0),
        "sum_rho": seg(np.add, rho_sum_src, 0.0),
        "sum_rho2": seg(np.add, rho_sum_src * rho_sum_src, 0.0),
        "min_rho": seg(np.minimum, masked_min(rho), np.inf),
        "max_rho": seg(np.maximum, masked_max(rho), -np.inf),
        "sum_k2": seg(np.add, 0.5 * d * d, 0.0),
        "sum_k3rev": seg(np.add, k3rev, 0.0),
        "sum_js": seg(np.add, js, 0.0),
        "sum_expabs": seg(np.add, expabs_src, 0.0),
        "sum_absd2": seg(np.add, absd * absd, 0.0),
        "sum_t": seg(np.add, t, 0.0),
        "sum_r": seg(np.add, r, 0.0),
    }
    ent = [_entropy_sums(e, finite, seg, n) for e in entropies]
    return _assemble(lengths, n_finite, sums, ent), all_inside


def _assemble(
    lengths: np.ndarray,
    n_finite: np.ndarray,
    sums: dict[str, np.ndarray],
    ent: list[tuple[np.ndarray, np.ndarray]],
) -> SufficientStats:
    """The sufficient statistics of samples from their per-sample token reductions (``sums``:
    counts, sums and extremes named as :func:`_segment_stats` makes them)."""
    n = lengths.size
    sum_negd = -sums["sum_d"]
    with np.errstate(invalid="ignore", divide="ignore"):
        lpd = sum_negd / n_finite
    has_seq = n_finite > 0
    lpd = np.where(has_seq, lpd, 0.0)
    with np.errstate(over="ignore"):
        ppl = np.where(has_seq, np.exp(lpd), 0.0)
    sum_absd, sum_k3 = sums["sum_absd"], sums["sum_k3"]
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        safe_n = np.where(has_seq, n_finite, 1)

        def per_seq(total: np.ndarray) -> np.ndarray:
            return np.where(has_seq, total / safe_n, 0.0)

        logppl_t, logppl_r = per_seq(-sums["sum_t"]), per_seq(-sums["sum_r"])
        ppl_t, ppl_r = np.exp(logppl_t), np.exp(logppl_r)
        seq_rho2 = np.exp(2.0 * np.clip(-sum_negd, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return SufficientStats(
        n_samples=np.ones(n, dtype=np.int64),
        n_seq=has_seq.astype(np.int64),
        n_diverged=(sums["n_mismatch"] > 0).astype(np.int64),
        n_tokens=lengths,
        n_finite=n_finite,
        n_mismatch=sums["n_mismatch"],
        n_clip=sums["n_clip"],
        first_div=sums["first_div"],
        sum_dp=sums["sum_dp"],
        sum_dp2=sums["sum_dp2"],
        max_dp=sums["max_dp"],
        sum_pt=sums["sum_pt"],
        sum_pr=sums["sum_pr"],
        sum_pt2=sums["sum_pt2"],
        sum_pr2=sums["sum_pr2"],
        sum_ptpr=sums["sum_ptpr"],
        sum_absd=sum_absd,
        max_absd=sums["max_absd"],
        sum_negd=sum_negd,
        sum_k3=sum_k3,
        sum_rho=sums["sum_rho"],
        sum_rho2=sums["sum_rho2"],
        min_rho=sums["min_rho"],
        max_rho=sums["max_rho"],
        sum_seq_lpd=lpd,
        sum_seq_ppl=ppl,
        sum_k2=sums["sum_k2"],
        sum_k3rev=sums["sum_k3rev"],
        sum_js=sums["sum_js"],
        sum_expabs=sums["sum_expabs"],
        sum_absd2=sums["sum_absd2"],
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
        sum_seq_d2=lpd * lpd,
        sum_inv_len=np.where(has_seq, 1.0 / safe_n, 0.0),
        sum_len_d2=n_finite * lpd * lpd,
    )


def _entropy_sums(
    entropy: np.ndarray | None, finite: np.ndarray, seg: Callable[..., np.ndarray], n: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample (Σ entropy, count) over tokens whose entropy is known (finite) and whose Δ is defined."""
    if entropy is None:
        return np.zeros(n), np.zeros(n, dtype=np.int64)
    known = finite & np.isfinite(entropy)
    return seg(np.add, np.where(known, entropy, 0.0), 0.0), seg(np.add, known, 0)


def _combine(stats: SufficientStats, mask: np.ndarray | None = None) -> SufficientStats:
    """Pool per-sample statistics into one group (all samples, or those in ``mask``)."""
    out = {}
    for f in fields(SufficientStats):
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
    return SufficientStats(**out)


def _derive(s: SufficientStats) -> dict[str, np.ndarray]:
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
    t, r, o = check_inputs(trainer_lp, rollout_lp, offsets)
    stats = per_sample_stats(
        t, r, o, _check_eps(clip_eps), _check_entropies(entropies, t), blocks=TokenBlocks(t, r, o)
    )
    return _sample_frame(stats)


def sample_and_step_metrics(
    trainer_lp: np.ndarray,
    rollout_lp: np.ndarray,
    offsets: np.ndarray,
    *,
    clip_eps: float = 0.2,
    entropies: tuple[np.ndarray | None, np.ndarray | None] = (None, None),
    variants: Iterable[str] = (),
    blocks: TokenBlocks | None = None,
    also: Iterable[Request] = (),
    threads: int = 1,
) -> tuple[pd.DataFrame, dict[str, float]]:
    """:func:`sample_metrics` and :func:`step_metrics` of the same step from one pass over the tokens.
    ``blocks``: the step's :class:`TokenBlocks` over these arrays (made here if not given), whose
    reductions ``also`` lists are measured in the same pass (on ``threads`` threads)."""
    stats, figures = _measured(
        trainer_lp, rollout_lp, offsets, clip_eps, entropies, variants, blocks, also, threads
    )
    return _sample_frame(stats), figures


def _measured(
    trainer_lp: np.ndarray,
    rollout_lp: np.ndarray,
    offsets: np.ndarray,
    clip_eps: float,
    entropies: tuple[np.ndarray | None, np.ndarray | None],
    variants: Iterable[str],
    blocks: TokenBlocks | None = None,
    also: Iterable[Request] = (),
    threads: int = 1,
) -> tuple[SufficientStats, dict[str, float]]:
    """A step's per-sample statistics and step figures: every reduction they read (and ``also``'s)
    measured in one pass over ``blocks`` when every token is finite."""
    t, r, o = check_inputs(trainer_lp, rollout_lp, offsets)
    blocks = TokenBlocks(t, r, o) if blocks is None else blocks
    entropies = _check_entropies(entropies, t)
    view = TokenView(t, r, o, blocks)
    thresholds = _threshold_reads(view, variants)
    extra = [*view.plan(thresholds), *also]
    stats = per_sample_stats(
        t, r, o, _check_eps(clip_eps), entropies, blocks=blocks, extra=extra, threads=threads
    )
    if view.blocks is not blocks:  # non-finite tokens: the threshold figures' finite tokens in their own pass
        view.blocks.measure(extra, threads)
    return stats, {**pooled_figures(stats), **thresholds()}


def _sample_frame(stats: SufficientStats) -> pd.DataFrame:
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
    all buckets; NaN when empty), then every :data:`PARAMETRIC` figure at its defaults, at the
    :data:`STANDING_VARIANTS` and at each of ``variants`` (keys of :func:`variant_key`, e.g.
    ``tis_mean[cap=3]``)."""
    return _measured(trainer_lp, rollout_lp, offsets, clip_eps, entropies, variants)[1]


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


def pooled_figures(per_sample: SufficientStats, total_tokens: float | None = None) -> dict[str, float]:
    """:data:`STEP_METRICS` and :data:`UNSLICED_DESCRIPTIONS`' figures over all samples, then
    :data:`STEP_METRICS` over each length bucket (``kl_k3/len_0_256``).
    ``total_tokens``: the denominator of ``token_fraction`` (default: these samples' tokens)."""
    buckets = length_bucket_of(per_sample.n_tokens)
    total = float(per_sample.n_tokens.sum()) if total_tokens is None else float(total_tokens)
    out: dict[str, float] = {}
    groups: list[tuple[str | None, np.ndarray | None]] = [
        (None, None),
        *((bucket, buckets == i) for i, bucket in enumerate(LENGTH_BUCKETS)),
    ]
    for bucket, mask in groups:
        pooled = _combine(per_sample, mask)
        derived = _derive(pooled)
        n_samples = float(pooled.n_samples[0])
        values = {
            "n_samples": n_samples,
            **{k: float(v[0]) for k, v in derived.items()},
            "diverged_sample_fraction": float(pooled.n_diverged[0] / n_samples)
            if n_samples
            else float("nan"),
            "token_fraction": float(pooled.n_tokens[0]) / total if total > 0 else float("nan"),
            **_noise(per_sample, pooled, mask),
        }
        for name in STEP_METRICS:
            out[name if bucket is None else length_key(name, bucket)] = values[name]
        if bucket is None:
            out.update({name: values[name] for name in UNSLICED_DESCRIPTIONS})
    return out


def _noise(per_sample: SufficientStats, pooled: SufficientStats, mask: np.ndarray | None) -> dict[str, float]:
    """audit.metrics.noise's figures of one group (``pooled``, the samples of ``per_sample`` in ``mask``)."""
    lengths = per_sample.n_finite if mask is None else per_sample.n_finite[mask]
    lengths = lengths[lengths > 0]
    return noise_figures(
        n_samples=float(pooled.n_seq[0]),
        n_tokens=float(pooled.n_finite[0]),
        sum_d=-float(pooled.sum_negd[0]),
        sum_m=-float(pooled.sum_seq_negd[0]),
        sum_m2=float(pooled.sum_seq_d2[0]),
        sum_inv_len=float(pooled.sum_inv_len[0]),
        sum_len_m2=float(pooled.sum_len_d2[0]),
        median_len=float(np.median(lengths)) if lengths.size else float("nan"),
    )


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


# ------------------------------------------------------------------------- threshold figures


def threshold_figures(view: TokenView, variants: Iterable[str]) -> dict[str, float]:
    """Every :data:`PARAMETRIC` figure at its defaults and at :data:`STANDING_VARIANTS`, then at each
    of ``variants`` (variant keys); the reductions they read are measured in one pass."""
    figures = _threshold_reads(view, variants)
    view.blocks.measure(view.plan(figures))
    return figures()


def _threshold_reads(view: TokenView, variants: Iterable[str]) -> Callable[[], dict[str, float]]:
    """The threshold figures of :func:`threshold_figures`, to compute (or to plan) on ``view``."""
    keys = dict.fromkeys([*PARAMETRIC, *STANDING_VARIANTS, *variants])

    def figures() -> dict[str, float]:
        out = {}
        for key in keys:
            name, params = parse_variant(key)
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                out[variant_key(name, params)] = float(PARAMETRIC[name].compute(view, **params)) + 0.0
        return out

    return figures
