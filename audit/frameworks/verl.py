"""verl (verl-project/verl): the train–rollout mismatch figures its PPO trainer logs, by release.

In decoupled mode (``algorithm.rollout_correction.bypass_mode: false``, the default) the trainer's
driver computes, once per step on the whole batch after recomputing ``old_log_probs``:
``calculate_debug_metrics`` (``training/rollout_probs_diff_*``, ``verl/utils/debug/metrics.py``)
and ``compute_rollout_correction_and_add_to_batch`` (``rollout_corr/*``,
``verl/trainer/ppo/rollout_corr_helper.py``): off-policy diagnostics always, importance-sampling
figures when ``rollout_is`` is set, rejection-sampling figures when ``rollout_rs`` is set, on the
step's whole batch. Before 0.8.0 the actor (legacy workers, the default then) logs the off-policy
figures again from each process's micro-batch, with the response mask after rejection sampling,
and those replace the driver's: per process, then reduced over processes by verl's
``reduce_metrics`` (max for a name with "max", min for "min", else mean). Masked means divide by
the token count plus 1e-8, as verl's ``masked_mean`` does; per-sample statistics average over the
batch's samples, a sample with no kept token counting as 0.

Modelled: decoupled mode only (bypass mode logs these names from the policy being updated, in
the loss); the yaml defaults of ``algorithm.rollout_correction`` (``rollout_is: null``; the
dataclass's ``"sequence"`` is not what a run gets).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
from isoaudit.audit.frameworks.base import REQUIRED, Era, Figure, Framework, Settings, StepTokens
from isoaudit.audit.metrics import RS_OPTIONS  # verl's divergence-based rejection options (0.7.1 on)
from packaging.version import Version

HELPER = "verl/trainer/ppo/rollout_corr_helper.py"
_OFFPOLICY = f"{HELPER}:compute_offpolicy_metrics"
_IS = f"{HELPER}:compute_rollout_correction_weights"
_RS = f"{HELPER}:compute_rollout_rejection_mask"
_VETO = f"{HELPER}:compute_rollout_correction_and_rejection_mask"
_DEBUG = "verl/utils/debug/metrics.py:calculate_debug_metrics"
_ACTOR = f"{HELPER}:compute_rollout_corr_metrics_from_logprobs"

#: verl's SAFETY_BOUND: |log ratio| is clamped to it before exponentiating.
BOUND = 20.0
#: verl's masked_mean adds this to the count.
EPS = 1e-8
RC = "rollout_corr/"

#: The rejection levels before 0.7.1 (bounds on the importance weight).
OLD_RS_LEVELS: tuple[str, ...] = ("token", "sequence", "geometric")


def _from(era: str, release: str) -> bool:
    """Whether ``era`` (an era's first release) is ``release`` or later."""
    return Version(era) >= Version(release)


# -- arithmetic shared by the eras ------------------------------------------------------------------


@dataclass(frozen=True)
class _Batch:
    """The step as verl's driver sees it: per-token arrays over the masked-in tokens, and per-sample
    reductions with verl's masked_mean (count + 1e-8)."""

    tokens: StepTokens

    @property
    def n(self) -> int:
        return self.tokens.n_tokens

    @cached_property
    def counts(self) -> np.ndarray:
        return self.tokens.lengths.astype(np.float64)

    @cached_property
    def valid(self) -> np.ndarray:
        return self.tokens.lengths > 0

    @cached_property
    def d(self) -> np.ndarray:
        return self.tokens.delta

    @cached_property
    def d_safe(self) -> np.ndarray:
        return self.tokens.clamped_delta(BOUND)

    @cached_property
    def rho_safe(self) -> np.ndarray:
        """exp(Δ clamped to ±SAFETY_BOUND): the token importance weight."""
        return self.tokens.exp_clamped_delta(BOUND)

    @cached_property
    def log_sum(self) -> np.ndarray:
        """Σ log ratio per sample."""
        return self.tokens.delta_sums

    def mean(self, values: np.ndarray) -> float:
        """verl_F.masked_mean over the step's tokens."""
        return float(values.sum() / (self.n + EPS))

    def seq_mean(self, values: np.ndarray) -> np.ndarray:
        """verl_F.masked_mean(values, mask, axis=-1): per sample."""
        return self.tokens.sample_sums(values) / (self.counts + EPS)

    def seq_max(self, values: np.ndarray) -> np.ndarray:
        """Per-sample max (0 for a sample without tokens)."""
        out = np.zeros(self.tokens.n_samples)
        for i in np.flatnonzero(self.valid):
            out[i] = values[self.tokens.offsets[i] : self.tokens.offsets[i + 1]].max()
        return out

    def per_token(self, per_sample: np.ndarray) -> np.ndarray:
        """A per-sample value broadcast to its tokens."""
        return np.repeat(per_sample, self.tokens.lengths)


def _std1(values: np.ndarray) -> float:
    """torch.std (ddof=1), as verl logs it where there is more than one value; 0.0 otherwise."""
    return float(np.std(values, ddof=1)) if values.size > 1 else 0.0


def _log32(value: float) -> float:
    """torch.log(torch.tensor(value)): the threshold's log in float32, as verl compares it."""
    return float(np.log(np.float32(value)))


def _clamped_std(b: _Batch, values: np.ndarray, low: float, high: float) -> float:
    """verl's std of clamped values: sqrt(max(mean(v²) − mean(v)², 0)) over tokens, 0.0 for one token."""
    if b.n <= 1:
        return 0.0
    v = np.clip(values, low, high)
    m = b.mean(v)
    return float(math.sqrt(max(b.mean(v * v) - m * m, 0.0)))


def _ess(b: _Batch, values: np.ndarray, low: float, high: float) -> float:
    """verl's rollout_is_eff_sample_size: 1 / mean((w / (mean w + 1e-8))²) of the clamped weights
    (NaN where every weight is 0, where verl divides by zero)."""
    w = np.clip(values, low, high)
    denominator = b.mean((w / (b.mean(w) + EPS)) ** 2)
    return 1.0 / denominator if denominator != 0.0 else float("nan")


def _offpolicy(b: _Batch) -> dict[str, float]:
    """compute_offpolicy_metrics (unchanged since its first release)."""
    tokens = b.tokens
    mean_t = tokens.blocks.sums("t") / (b.counts + EPS)
    mean_r = tokens.blocks.sums("r") / (b.counts + EPS)
    log_ppl_diff = mean_r - mean_t
    return {
        RC + "training_ppl": float(np.exp(-mean_t).mean()),
        RC + "training_log_ppl": float((-mean_t).mean()),
        # Σ(rollout − trainer) is −ΣΔ exactly: each partial sum negates
        RC + "kl": -tokens.total("d") / (b.n + EPS),
        RC + "k3_kl": tokens.total("k3") / (b.n + EPS),
        RC + "rollout_ppl": float(np.exp(-mean_r).mean()),
        RC + "rollout_log_ppl": float((-mean_r).mean()),
        RC + "log_ppl_diff": float(log_ppl_diff.mean()),
        RC + "log_ppl_abs_diff": float(np.abs(log_ppl_diff).mean()),
        RC + "log_ppl_diff_max": float(log_ppl_diff.max()),
        RC + "log_ppl_diff_min": float(log_ppl_diff.min()),
        RC + "ppl_ratio": float(np.exp(log_ppl_diff).mean()),
        RC + "chi2_token": tokens.total(("sq", "rho")) / (b.n + EPS) - 1.0,
        RC + "chi2_seq": float(np.exp(2.0 * np.clip(b.log_sum, -BOUND, BOUND)).mean()) - 1.0,
    }


def _debug(b: _Batch) -> dict[str, float]:
    """calculate_debug_metrics: |p_actor − p_rollout| over tokens (std ddof=1) and the Pearson
    correlation of the probabilities (torch.corrcoef: the co-moment over the root of the two
    centred square sums)."""
    blocks = b.tokens.blocks
    corr = float("nan")
    if b.n > 1:
        n, _, m2_actor = blocks.moments("exp_t")
        m2_rollout = blocks.moments("exp_r")[2]
        with np.errstate(all="ignore"):
            c = np.float64(blocks.comoment("exp_t", "exp_r")) / (n - 1)
            c = c / np.sqrt(np.float64(m2_actor) / (n - 1)) / np.sqrt(np.float64(m2_rollout) / (n - 1))
        corr = float(np.clip(c, -1.0, 1.0))
    return {
        "training/rollout_probs_diff_valid": 1.0,
        "training/rollout_probs_diff_max": blocks.max("abs_p_diff"),
        "training/rollout_probs_diff_mean": b.tokens.mean_of("abs_p_diff"),
        "training/rollout_probs_diff_std": blocks.std("abs_p_diff", ddof=1) if b.n > 1 else float("nan"),
        "training/rollout_actor_probs_pearson_corr": corr,
    }


# -- importance sampling ------------------------------------------------------------------------------


def _is_threshold(spec: Any, icepop: bool) -> tuple[float, float | None]:
    """(upper, lower) of rollout_is_threshold: a number (TIS), or from 0.8.0 "lower_upper" (IcePop)."""
    if isinstance(spec, bool):
        raise ValueError("framework_config.rollout_is_threshold: a number, not a boolean")
    if isinstance(spec, str) and "_" in spec.strip():
        if not icepop:
            raise ValueError(
                "framework_config.rollout_is_threshold: 'lower_upper' (IcePop) needs verl 0.8.0 or later"
            )
        low, high = spec.strip().split("_", 1)
        lower, upper = float(low), float(high)
        if not 0 < lower <= upper:
            raise ValueError(f"framework_config.rollout_is_threshold: {spec!r} needs 0 < lower <= upper")
        return upper, lower
    upper = float(spec)
    if upper <= 0:
        raise ValueError(f"framework_config.rollout_is_threshold: {spec!r} must be positive")
    return upper, None


def _is_figures(b: _Batch, s: Settings, era: str) -> dict[str, float]:
    """compute_rollout_correction_weights with its compute_is_metrics. Before 0.8.0 the statistics
    are of the weights before truncation (std and ESS clamp them to [1/threshold, threshold]); from
    0.8.0 of the applied weights (truncated, or zeroed outside IcePop's bounds; std and ESS clamp
    to [0, threshold]), the fractions over the threshold of the raw weights; from 0.9.0 the
    sequence fractions too."""
    level = s.get("rollout_is")
    if level is None or s.get("rollout_is_threshold") is None:
        return {}
    if level not in ("token", "sequence"):
        raise ValueError(f"framework_config.rollout_is: {level!r} is not 'token' or 'sequence'")
    applied_stats = _from(era, "0.8.0")
    upper, icepop_lower = _is_threshold(s["rollout_is_threshold"], icepop=applied_stats)
    lower = 1.0 / upper if icepop_lower is None else icepop_lower
    if level == "token":
        raw = b.rho_safe
    else:
        raw = b.per_token(np.exp(np.clip(b.log_sum, -BOUND, BOUND)))
    if icepop_lower is None:
        applied = np.minimum(raw, upper)
    else:
        applied = np.where((raw >= icepop_lower) & (raw <= upper), raw, 0.0)
    stats = applied if applied_stats else raw
    out: dict[str, float] = {}
    if level == "sequence":
        out["rollout_is_max"] = math.exp(min(float(b.log_sum.max()), BOUND))
        out["rollout_is_min"] = math.exp(float(b.log_sum.min()))
        out["rollout_is_mean"] = b.mean(stats)
        out["rollout_is_ratio_fraction_high"] = float((b.log_sum > _log32(upper)).mean())
        out["rollout_is_ratio_fraction_low"] = float((b.log_sum < _log32(lower)).mean())
    else:
        out["rollout_is_mean"] = b.mean(stats)
        out["rollout_is_ratio_fraction_high"] = b.mean((raw > upper).astype(float))
        out["rollout_is_ratio_fraction_low"] = b.mean((raw < lower).astype(float))
        out["rollout_is_max"] = float(stats.max())
        out["rollout_is_min"] = float(stats.min())
    clamp_low = 0.0 if applied_stats else lower
    out["rollout_is_std"] = _clamped_std(b, stats, clamp_low, upper)
    out["rollout_is_eff_sample_size"] = _ess(b, stats, clamp_low, upper)
    seq = b.seq_mean(stats)
    out["rollout_is_seq_mean"] = float(seq.mean())
    out["rollout_is_seq_std"] = _std1(seq)
    out["rollout_is_seq_max"] = float(seq.max())
    out["rollout_is_seq_min"] = float(seq.min())
    out["rollout_is_seq_max_deviation"] = float(np.abs(seq - 1.0).max())
    seq_for_fractions = b.seq_mean(raw) if _from(era, "0.9.0") else seq
    out["rollout_is_seq_fraction_high"] = float((seq_for_fractions > upper).mean())
    out["rollout_is_seq_fraction_low"] = float((seq_for_fractions < lower).mean())
    if icepop_lower is not None:
        out["rollout_is_oob_ratio"] = b.mean(((raw < icepop_lower) | (raw > upper)).astype(float))
    if s.get("rollout_is_batch_normalize"):
        if level == "token":
            factor = b.mean(applied)
        elif _from(era, "0.7.0"):  # over the samples with tokens
            valid = b.valid.astype(float)
            factor = float((b.seq_mean(applied) * valid).sum() / max(valid.sum(), 1e-8))
        else:
            factor = float(b.seq_mean(applied).mean())
        out["rollout_is_batch_norm_factor"] = factor if factor > 1e-8 else 1.0
    return {RC + k: v for k, v in out.items()}


# -- rejection sampling before 0.7.1: bounds on the importance weight, and the veto ----------------------


Rejection = tuple[dict[str, float], np.ndarray | None]


def _old_rs_figures(b: _Batch, s: Settings) -> Rejection:
    """compute_rollout_rejection_mask and compute_rs_metrics (0.6.1–0.7.0): reject tokens (token) or
    samples (sequence: Π ρ; geometric: exp(mean Δ)) whose weight is outside [lower, upper]. Also
    the tokens kept (None: no rejection)."""
    level = s.get("rollout_rs")
    if level is None or s.get("rollout_rs_threshold") is None:
        return {}, None
    if level not in OLD_RS_LEVELS:
        raise ValueError(f"framework_config.rollout_rs: {level!r} is not one of {', '.join(OLD_RS_LEVELS)}")
    upper = float(s["rollout_rs_threshold"])
    lower_setting = s.get("rollout_rs_threshold_lower")
    lower = 1.0 / upper if lower_setting is None else float(lower_setting)
    if level == "token":
        log_ratio = b.d
        w = b.rho_safe
    else:
        log_ratio = b.log_sum if level == "sequence" else b.seq_mean(b.d)
        w = b.per_token(np.exp(np.clip(log_ratio, -BOUND, BOUND)))
    keep = (w >= lower) & (w <= upper)
    out: dict[str, float] = {}
    if level == "token":
        out["rollout_rs_mean"] = b.mean(w)
        out["rollout_rs_ratio_fraction_high"] = b.mean((w > upper).astype(float))
        out["rollout_rs_ratio_fraction_low"] = b.mean((w < lower).astype(float))
        out["rollout_rs_max"] = float(w.max())
        out["rollout_rs_min"] = float(w.min())
    else:
        out["rollout_rs_max"] = math.exp(min(float(log_ratio.max()), BOUND))
        out["rollout_rs_min"] = math.exp(float(log_ratio.min()))
        out["rollout_rs_mean"] = b.mean(w)
        out["rollout_rs_ratio_fraction_high"] = float((log_ratio > _log32(upper)).mean())
        out["rollout_rs_ratio_fraction_low"] = float((log_ratio < _log32(lower)).mean())
    out["rollout_rs_std"] = _clamped_std(b, w, lower, upper)
    out["rollout_rs_eff_sample_size"] = _ess(b, w, lower, upper)
    seq = b.seq_mean(w)
    out["rollout_rs_seq_mean"] = float(seq.mean())
    out["rollout_rs_seq_std"] = _std1(seq)
    out["rollout_rs_seq_max"] = float(seq.max())
    out["rollout_rs_seq_min"] = float(seq.min())
    out["rollout_rs_seq_max_deviation"] = float(np.abs(seq - 1.0).max())
    out["rollout_rs_seq_fraction_high"] = float((seq > upper).mean())
    out["rollout_rs_seq_fraction_low"] = float((seq < lower).mean())
    rejected = (~keep).astype(float)
    out["rollout_rs_masked_fraction"] = b.mean(rejected)
    if level == "token":
        out["rollout_rs_seq_masked_fraction"] = float((b.tokens.sample_sums(rejected) > 0).mean())
    else:
        sample_ok = (np.exp(np.clip(log_ratio, -BOUND, BOUND)) >= lower) & (
            np.exp(np.clip(log_ratio, -BOUND, BOUND)) <= upper
        )
        out["rollout_rs_seq_masked_fraction"] = float((1.0 - sample_ok).mean())
    return {RC + k: v for k, v in out.items()}, keep


def _veto_figures(b: _Batch, s: Settings) -> Rejection:
    """The catastrophic-token veto (0.6.1–0.7.0), logged as 0.0 while rollout_token_veto_threshold
    is unset: samples with a token whose log ratio is below log(threshold) are rejected whole."""
    threshold = s.get("rollout_token_veto_threshold")
    if threshold is None:
        return {
            RC + "rollout_is_veto_fraction": 0.0,
            RC + "rollout_is_catastrophic_token_fraction": 0.0,
        }, None
    if float(threshold) <= 0:
        raise ValueError("framework_config.rollout_token_veto_threshold: must be positive")
    catastrophic = b.d < _log32(float(threshold))
    vetoed = b.tokens.sample_sums(catastrophic.astype(float)) > 0
    figures = {
        RC + "rollout_is_veto_fraction": float(vetoed.mean()),
        RC + "rollout_is_catastrophic_token_fraction": b.mean(catastrophic.astype(float)),
    }
    return figures, ~b.per_token(vetoed)


# -- rejection sampling from 0.7.1: divergence bounds (trust region masking) -------------------------------


def _rs_options(spec: Any) -> list[str]:
    if not isinstance(spec, str):
        raise ValueError("framework_config.rollout_rs: comma-separated options like 'token_k1,seq_mean_k3'")
    options: list[str] = []
    for option in (o.strip() for o in spec.split(",")):
        if not option:
            continue
        if option not in RS_OPTIONS:
            raise ValueError(f"framework_config.rollout_rs: {option!r} is not one of {', '.join(RS_OPTIONS)}")
        if option not in options:
            options.append(option)
    if not options:
        raise ValueError("framework_config.rollout_rs: no option given")
    return options


def _rs_thresholds(options: list[str], spec: Any) -> dict[str, tuple[float | None, float]]:
    """{option: (lower, upper)} from rollout_rs_threshold: one bound for every option or one per
    option, comma-separated; a k1 option takes "lower_upper" ratio bounds (lower 1/upper if one)."""
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise ValueError("framework_config.rollout_rs_threshold: a number or a string of bounds")
    parts = [str(spec)] if not isinstance(spec, str) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise ValueError(
            f"framework_config.rollout_rs_threshold: one bound for all options or {len(options)}, "
            f"got {len(parts)}"
        )
    parts = parts * len(options) if len(parts) == 1 else parts
    out: dict[str, tuple[float | None, float]] = {}
    for option, part in zip(options, parts, strict=True):
        if option.endswith("k1"):
            low, high = part.split("_", 1) if "_" in part else (str(1.0 / float(part)), part)
            lower, upper = float(low), float(high)
            if not 0 < lower <= upper:
                raise ValueError(
                    f"framework_config.rollout_rs_threshold: {part!r} for {option} needs 0 < lower <= upper"
                )
            out[option] = (lower, upper)
        else:
            if "_" in part:
                raise ValueError(
                    f"framework_config.rollout_rs_threshold: {option} takes one upper bound, not {part!r}"
                )
            upper = float(part)
            if upper <= 0:
                raise ValueError(
                    f"framework_config.rollout_rs_threshold: {part!r} for {option} must be positive"
                )
            out[option] = (None, upper)
    return out


def _rs_figures(b: _Batch, s: Settings) -> Rejection:
    """compute_rollout_rejection_mask and compute_rs_metrics (0.7.1 on): per option a divergence
    (k1 = −Δ, k2 = Δ²/2, k3 = e^Δ − 1 − Δ on Δ clamped to ±20) per token, or its per-sample sum,
    mean or max; k1 kept within [log lower, log upper], k2/k3 at most upper; every option must pass."""
    if s.get("rollout_rs") is None or s.get("rollout_rs_threshold") is None:
        return {}, None
    options = _rs_options(s["rollout_rs"])
    bounds = _rs_thresholds(options, s["rollout_rs_threshold"])
    x = b.d_safe
    token_stat = {"k1": -x, "k2": 0.5 * x**2, "k3": np.exp(x) - 1.0 - x}
    valid = b.valid
    combined = np.ones(b.n, dtype=bool)
    out: dict[str, float] = {}
    for option in options:
        lower, upper = bounds[option]
        k1 = option.endswith("k1")
        high = math.log(upper) if k1 else upper
        low = math.log(lower) if k1 and lower is not None else 0.0
        per_token = token_stat[option[-2:]]
        if option.startswith("token_"):
            stat = per_token
            keep = (stat >= low) & (stat <= high) if k1 else stat <= high
            seq_values = b.seq_mean(stat)
        else:
            reduce: Callable[[np.ndarray], np.ndarray] = {
                "sum": b.tokens.sample_sums,
                "mean": b.seq_mean,
                "max": b.seq_max,
            }[option.split("_")[1]]
            seq_values = reduce(per_token)
            sample_keep = (seq_values >= low) & (seq_values <= high) if k1 else seq_values <= high
            stat = b.per_token(seq_values)
            keep = b.per_token(sample_keep)
        seq_valid = seq_values[valid]
        p = f"rollout_rs_{option}_"
        out[p + "mean"] = b.mean(stat)
        if option.startswith("token_"):
            out[p + "max"], out[p + "min"] = float(stat.max()), float(stat.min())
            out[p + "fraction_high"] = b.mean((stat > high).astype(float))
            out[p + "fraction_low"] = b.mean((stat < low).astype(float)) if k1 else 0.0
        else:
            out[p + "max"], out[p + "min"] = float(seq_valid.max()), float(seq_valid.min())
            out[p + "fraction_high"] = float((seq_valid > high).mean())
            out[p + "fraction_low"] = float((seq_valid < low).mean()) if k1 else 0.0
        out[p + "std"] = _clamped_std(b, stat, low if k1 else 0.0, high)
        out[p + "seq_mean"] = float(seq_valid.mean())
        out[p + "seq_std"] = _std1(seq_valid)
        out[p + "seq_max"] = float(seq_valid.max())
        out[p + "seq_min"] = float(seq_valid.min())
        out[p + "seq_max_deviation"] = float(np.abs(seq_valid).max())
        out[p + "seq_fraction_high"] = float((seq_valid > high).mean())
        if k1:
            out[p + "seq_fraction_low"] = float((seq_valid < low).mean())
        rejected = ~keep
        out[p + "masked_fraction"] = b.mean(rejected.astype(float))
        sample_rejected = b.tokens.sample_sums(rejected.astype(float)) > 0
        out[p + "seq_masked_fraction"] = float(sample_rejected[valid].sum() / valid.sum())
        combined &= keep
    out["rollout_rs_masked_fraction"] = b.mean((~combined).astype(float))
    out["rollout_rs_seq_masked_fraction"] = float(
        (b.tokens.sample_sums((~combined).astype(float)) > 0).mean()
    )
    return {RC + k: v for k, v in out.items()}, combined


# -- the eras -----------------------------------------------------------------------------------------------


def _kept(tokens: StepTokens, keep: np.ndarray) -> StepTokens:
    """The step with the rejected tokens masked out (a sample may keep none)."""
    o = tokens.offsets
    return StepTokens.of(
        [tokens.trainer[o[i] : o[i + 1]][keep[o[i] : o[i + 1]]] for i in range(tokens.n_samples)],
        [tokens.rollout[o[i] : o[i + 1]][keep[o[i] : o[i + 1]]] for i in range(tokens.n_samples)],
        ranks=tokens.ranks,
    )


def _actor_offpolicy(tokens: StepTokens, keep: np.ndarray | None) -> dict[str, float]:
    """The actor's compute_rollout_corr_metrics_from_logprobs (before 0.8.0): the off-policy figures
    per process, on its micro-batch with the response mask after rejection sampling, reduced over
    processes as verl's reduce_metrics does (max for a name with "max", min for "min", else mean).
    The actor's log_prob is the current policy's: with one micro-batch per process and step, the
    weights that computed old_log_probs. verl asserts where a process keeps no token (NaN here)."""
    step = tokens if keep is None else _kept(tokens, keep)
    parts = [_Batch(part) for part in step.per_rank()]
    if any(part.n == 0 for part in parts):
        return {name: float("nan") for name in _offpolicy(_Batch(tokens))}
    values = [_offpolicy(part) for part in parts]
    out = {}
    for name in values[0]:
        per_rank = np.array([v[name] for v in values])
        reduce = np.max if "max" in name else np.min if "min" in name else np.mean
        out[name] = float(reduce(per_rank))
    return out


def _compute(era: str) -> Callable[[StepTokens, Settings], dict[str, float]]:
    def compute(tokens: StepTokens, settings: Settings) -> dict[str, float]:
        b = _Batch(tokens)
        out = _debug(b)
        out.update(_is_figures(b, settings, era))
        keep: np.ndarray | None = None
        if not _from(era, "0.7.1"):
            for figures, kept in (_old_rs_figures(b, settings), _veto_figures(b, settings)):
                out.update(figures)
                if kept is not None:
                    keep = kept if keep is None else keep & kept
        else:
            figures, keep = _rs_figures(b, settings)
            out.update(figures)
        if not _from(era, "0.8.0"):
            out.update(_actor_offpolicy(tokens, keep))
        else:
            out.update(_offpolicy(b))
        return out

    return compute


_IS_SETTINGS = ("rollout_is", "rollout_is_threshold")


def _debug_figures() -> list[Figure]:
    what = "|exp(old_log_probs) − exp(rollout_log_probs)| over the response tokens"
    return [
        Figure("training/rollout_probs_diff_valid", "1 when the batch has response tokens", source=_DEBUG),
        Figure(
            "training/rollout_probs_diff_max",
            f"max of {what}",
            source=_DEBUG,
            same_as="rollout_probs_diff_max",
        ),
        Figure(
            "training/rollout_probs_diff_mean",
            f"mean of {what}",
            source=_DEBUG,
            same_as="rollout_probs_diff_mean",
        ),
        Figure("training/rollout_probs_diff_std", f"torch.std (ddof=1) of {what}", source=_DEBUG),
        Figure(
            "training/rollout_actor_probs_pearson_corr",
            "Pearson correlation (torch.corrcoef) of the token probabilities of actor and rollout",
            source=_DEBUG,
            same_as="rollout_actor_probs_pearson_corr",
        ),
    ]


def _offpolicy_figures(era: str) -> list[Figure]:
    actor = not _from(era, "0.8.0")
    rejection: tuple[str, ...] = ("rollout_rs", "rollout_rs_threshold")
    if not _from(era, "0.7.1"):
        rejection += ("rollout_rs_threshold_lower", "rollout_token_veto_threshold")
    where = (
        "; the actor's, per process, on its tokens kept by rejection sampling, reduced over processes"
        if actor
        else ""
    )

    def f(name: str, definition: str, same_as: str | None = None) -> Figure:
        reduce = (
            " (max over processes)"
            if actor and "max" in name
            else " (min over processes)"
            if actor and "min" in name
            else " (mean over processes)"
            if actor
            else ""
        )
        return Figure(
            RC + name,
            definition + reduce + where,
            settings=rejection if actor else (),
            same_as=None if actor else same_as,
            source=_ACTOR if actor else _OFFPOLICY,
        )

    return [
        f("training_ppl", "mean over samples of exp(−mean old_log_prob of the sample)", "training_ppl"),
        f("training_log_ppl", "mean over samples of −mean old_log_prob of the sample", "training_log_ppl"),
        f("kl", "token mean of rollout_log_prob − old_log_prob (k1)", "kl_k1"),
        f("k3_kl", "token mean of exp(Δ) − Δ − 1, Δ = old − rollout log prob, unclamped", "kl_k3"),
        f("rollout_ppl", "mean over samples of exp(−mean rollout_log_prob of the sample)", "rollout_ppl"),
        f("rollout_log_ppl", "mean over samples of −mean rollout_log_prob of the sample", "rollout_log_ppl"),
        f("log_ppl_diff", "mean over samples of (mean rollout − mean old log prob)", "log_ppl_diff"),
        f("log_ppl_abs_diff", "mean over samples of |mean rollout − mean old log prob|", "log_ppl_abs_diff"),
        f("log_ppl_diff_max", "max over samples of (mean rollout − mean old log prob)", "log_ppl_diff_max"),
        f("log_ppl_diff_min", "min over samples of (mean rollout − mean old log prob)", "log_ppl_diff_min"),
        f("ppl_ratio", "mean over samples of exp(mean rollout − mean old log prob)", "ppl_ratio"),
        f("chi2_token", "token mean of exp(Δ)², Δ clamped to ±20, minus 1"),
        f("chi2_seq", "mean over samples of exp(2 Σ Δ), the sum clamped to ±20, minus 1", "chi2_seq"),
    ]


def _is_figure_list(era: str) -> list[Figure]:
    applied = (
        "applied (truncated, or IcePop-zeroed) weights"
        if _from(era, "0.8.0")
        else "weights before truncation"
    )
    raw = "raw weights" if _from(era, "0.8.0") else "weights"
    clamp = "[0, threshold]" if _from(era, "0.8.0") else "[1/threshold, threshold]"
    seq_src = "raw" if _from(era, "0.9.0") else "applied" if _from(era, "0.8.0") else "untruncated"

    def f(name: str, definition: str, settings: tuple[str, ...] = _IS_SETTINGS) -> Figure:
        return Figure(RC + name, definition, settings=settings, source=_IS)

    out = [
        f("rollout_is_mean", f"token mean of the {applied} (sequence: each sample's weight on its tokens)"),
        f(
            "rollout_is_ratio_fraction_high",
            f"token: fraction of tokens whose {raw} > threshold; sequence: of samples whose Σ Δ > log threshold",
        ),
        f(
            "rollout_is_ratio_fraction_low",
            f"as _high, below the lower bound (1/threshold{', or IcePop lower' if _from(era, '0.8.0') else ''})",
        ),
        f("rollout_is_max", f"token: max of the {applied}; sequence: exp(min(max Σ Δ, 20))"),
        f("rollout_is_min", f"token: min of the {applied}; sequence: exp(min Σ Δ)"),
        f(
            "rollout_is_std",
            f"sqrt(mean(w²) − mean(w)²) over tokens of the {applied} clamped to {clamp}; 0 for one token",
        ),
        f(
            "rollout_is_eff_sample_size",
            f"1 / token mean of (w / (mean w + 1e-8))², w the {applied} clamped to {clamp}",
        ),
        f("rollout_is_seq_mean", f"mean over samples of each sample's mean of the {applied}"),
        f("rollout_is_seq_std", f"torch.std (ddof=1) over samples of each sample's mean of the {applied}"),
        f("rollout_is_seq_max", f"max over samples of each sample's mean of the {applied}"),
        f("rollout_is_seq_min", f"min over samples of each sample's mean of the {applied}"),
        f("rollout_is_seq_max_deviation", f"max over samples of |sample mean of the {applied} − 1|"),
        f("rollout_is_seq_fraction_high", f"fraction of samples whose mean {seq_src} weight > threshold"),
        f(
            "rollout_is_seq_fraction_low",
            f"fraction of samples whose mean {seq_src} weight < the lower bound",
        ),
        f(
            "rollout_is_batch_norm_factor",
            "the mean applied weight the weights are divided by (token mean, or the mean over samples"
            + (" with tokens" if _from(era, "0.7.0") else "")
            + " of per-sample means); 1.0 if ≤ 1e-8",
            (*_IS_SETTINGS, "rollout_is_batch_normalize"),
        ),
    ]
    if _from(era, "0.8.0"):
        out.append(
            f(
                "rollout_is_oob_ratio",
                "IcePop (threshold 'lower_upper'): fraction of tokens whose raw weight is outside [lower, upper]",
            )
        )
    return out


def _old_rs_figure_list() -> list[Figure]:
    settings = ("rollout_rs", "rollout_rs_threshold", "rollout_rs_threshold_lower")
    w = "weight (token: exp Δ; sequence: exp Σ Δ; geometric: exp mean Δ, each clamped to ±20)"

    def f(name: str, definition: str) -> Figure:
        return Figure(RC + name, definition, settings=settings, source=_RS)

    return [
        f("rollout_rs_mean", f"token mean of the {w}"),
        f(
            "rollout_rs_ratio_fraction_high",
            "token: fraction of tokens with weight > upper; sequence/geometric: of samples with log weight > log upper",
        ),
        f(
            "rollout_rs_ratio_fraction_low",
            "as _high, below lower (rollout_rs_threshold_lower, default 1/upper)",
        ),
        f("rollout_rs_max", "token: max weight; sequence/geometric: exp(min(max log weight, 20))"),
        f("rollout_rs_min", "token: min weight; sequence/geometric: exp(min log weight)"),
        f("rollout_rs_std", "sqrt(mean(w²) − mean(w)²) over tokens of the weights clamped to [lower, upper]"),
        f(
            "rollout_rs_eff_sample_size",
            "1 / token mean of (w / (mean w + 1e-8))², w clamped to [lower, upper]",
        ),
        f("rollout_rs_seq_mean", "mean over samples of each sample's mean weight"),
        f("rollout_rs_seq_std", "torch.std (ddof=1) over samples of each sample's mean weight"),
        f("rollout_rs_seq_max", "max over samples of each sample's mean weight"),
        f("rollout_rs_seq_min", "min over samples of each sample's mean weight"),
        f("rollout_rs_seq_max_deviation", "max over samples of |sample mean weight − 1|"),
        f("rollout_rs_seq_fraction_high", "fraction of samples whose mean weight > upper"),
        f("rollout_rs_seq_fraction_low", "fraction of samples whose mean weight < lower"),
        f("rollout_rs_masked_fraction", "fraction of tokens rejected (weight outside [lower, upper])"),
        f(
            "rollout_rs_seq_masked_fraction",
            "fraction of samples with a rejected token (token) or rejected (sequence/geometric)",
        ),
    ]


def _veto_figure_list() -> list[Figure]:
    def f(name: str, definition: str) -> Figure:
        return Figure(RC + name, definition, settings=("rollout_token_veto_threshold",), source=_VETO)

    return [
        f(
            "rollout_is_veto_fraction",
            "fraction of samples with a token whose Δ < log(veto threshold); 0.0 while unset",
        ),
        f(
            "rollout_is_catastrophic_token_fraction",
            "fraction of tokens with Δ < log(veto threshold); 0.0 while unset",
        ),
    ]


def _rs_figure_list() -> list[Figure]:
    settings = ("rollout_rs", "rollout_rs_threshold")
    out: list[Figure] = []
    for option in RS_OPTIONS:
        k1 = option.endswith("k1")
        stat = f"{option}'s statistic ({'per token' if option.startswith('token_') else 'per sample, on its tokens'})"
        bound = "log upper" if k1 else "upper"
        low = "log lower" if k1 else "0"
        rows = [
            ("mean", f"token mean of {stat}"),
            ("max", "max of the statistic (per-sample values for sequence options)"),
            ("min", "min of the statistic (per-sample values for sequence options)"),
            ("fraction_high", f"fraction of tokens (sequence options: samples) with statistic > {bound}"),
            ("fraction_low", "fraction with statistic < log lower" if k1 else "0.0 (no lower bound)"),
            ("std", f"sqrt(mean(s²) − mean(s)²) over tokens of the statistic clamped to [{low}, {bound}]"),
            ("seq_mean", "mean over samples of the per-sample statistic (token options: per-sample mean)"),
            ("seq_std", "torch.std (ddof=1) over samples of the per-sample statistic"),
            ("seq_max", "max over samples of the per-sample statistic"),
            ("seq_min", "min over samples of the per-sample statistic"),
            ("seq_max_deviation", "max over samples of |per-sample statistic|"),
            ("seq_fraction_high", f"fraction of samples with per-sample statistic > {bound}"),
            *(
                [("seq_fraction_low", "fraction of samples with per-sample statistic < log lower")]
                if k1
                else []
            ),
            ("masked_fraction", f"fraction of tokens {option} rejects"),
            ("seq_masked_fraction", f"fraction of samples with a token {option} rejects"),
        ]
        out += [
            Figure(f"{RC}rollout_rs_{option}_{suffix}", text, settings=settings, source=_RS)
            for suffix, text in rows
        ]
    out += [
        Figure(
            RC + "rollout_rs_masked_fraction",
            "fraction of tokens rejected by any option",
            settings=settings,
            source=_RS,
        ),
        Figure(
            RC + "rollout_rs_seq_masked_fraction",
            "fraction of samples with a token rejected by any option",
            settings=settings,
            source=_RS,
        ),
    ]
    return out


_OLD_DEFAULTS: dict[str, Any] = {
    "rollout_is": None,
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": False,
    "rollout_rs": None,
    "rollout_rs_threshold": REQUIRED,
    "rollout_rs_threshold_lower": None,
    "rollout_token_veto_threshold": None,
}
_DEFAULTS: dict[str, Any] = {
    "rollout_is": None,
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": False,
    "rollout_rs": None,
    "rollout_rs_threshold": REQUIRED,
}


def _era(since: str, commit: str, date: str, change: str) -> Era:
    rs = [*_old_rs_figure_list(), *_veto_figure_list()] if not _from(since, "0.7.1") else _rs_figure_list()
    return Era(
        since=since,
        commit=commit,
        date=date,
        change=change,
        figures=(*_debug_figures(), *_is_figure_list(since), *rs, *_offpolicy_figures(since)),
        compute=_compute(since),
        defaults=_OLD_DEFAULTS if not _from(since, "0.7.1") else _DEFAULTS,
    )


FRAMEWORK = Framework(
    "verl",
    "verl-project/verl",
    (
        _era(
            "0.6.1",
            "2c6c65cb0f69dd3761e71682fb01d939aa437710",
            "2025-11-12",
            "first release of rollout correction (418f964, metrics fixed in 2c6c65c): IS, "
            "weight-bound rejection (token/sequence/geometric), token veto, off-policy diagnostics "
            "(logged by the actor per process)",
        ),
        _era(
            "0.7.0",
            "2a36450b7e77a30bc8492c727ce94caa3704b1df",
            "2025-11-25",
            "sequence-level rollout_is_batch_norm_factor averages over the samples with tokens only",
        ),
        _era(
            "0.7.1",
            "97eac90487a0c6f7ef38e38d305e8f3fad7c4f0b",
            "2026-01-14",
            "rejection sampling by divergence bounds (rollout_rs token_k*/seq_sum_k*/seq_mean_k*/"
            "seq_max_k*, per-option rollout_rs_<option>_* figures); veto and weight-bound RS removed",
        ),
        _era(
            "0.8.0",
            "044bbba27e5861e1212727aba67813cccb2db291",
            "2026-04-20",
            "IcePop (d2916f5, 2026-03-24: rollout_is_threshold 'lower_upper', rollout_is_oob_ratio; "
            "IS statistics of the applied weights, fractions of the raw ones); the legacy actor "
            "removed (044bbba), so the off-policy figures are the driver's, on the whole batch",
        ),
        _era(
            "0.9.0",
            "bdfedd4617931e35f05c17c2c4954489efe68054",
            "2026-06-25",
            "rollout_is_seq_fraction_high/low from the raw weights' per-sample means",
        ),
    ),
)
