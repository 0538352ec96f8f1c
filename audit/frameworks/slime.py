"""slime (THUDM/slime): the train–rollout figures ``policy_loss_function`` reports
(``slime/backends/megatron_utils/loss.py``): ``train_rollout_logprob_abs_diff`` always; with
``--use-tis`` the vanilla TIS function's ``tis``/``tis_clipfrac``/``tis_abs``; with
``--custom-tis-function-path`` set to slime's mismatch helper
(``examples/train_infer_mismatch_helper/mis.py: compute_mis_weights_with_cp``) its ``mis_*`` figures.

Every figure is a per-token (or per-sample, spread over its tokens) value reduced by slime's
``sum_of_sample_mean``: with ``calculate_per_token_loss`` off (the default) each sample's masked mean,
summed over every sample of every process and divided by the step's sample count (a sample without
tokens counts, contributing 0); on, the masked sum over all tokens divided by the step's token count
(a sample without tokens counts as one). Each sample is its own rollout (slime's default rollout ids).
The helper's ``tis_*``/``rs_*`` settings have no argparse default: the values of its shipped
``mis.yaml`` are used unless declared. Batch normalisation is per process (one micro-batch each).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from isoaudit.audit.frameworks.base import Era, Figure, Framework, Settings, StepTokens

_LOSS = "slime/backends/megatron_utils/loss.py:policy_loss_function"
_VANILLA = "slime/backends/megatron_utils/loss.py:vanilla_tis_function"
_MIS = "examples/train_infer_mismatch_helper/mis.py:compute_mis_weights"
_SAFETY = 20.0

DEFAULTS: dict[str, object] = {
    # slime/utils/arguments.py
    "use_tis": False,
    "get_mismatch_metrics": False,
    "custom_tis_function_path": None,
    "tis_clip": 2.0,
    "tis_clip_low": 0.0,
    "calculate_per_token_loss": False,
    "use_rollout_logprobs": False,
    # examples/train_infer_mismatch_helper/mis.yaml
    "use_rs": True,
    "tis_level": "token",
    "rs_level": "token",
    "tis_mode": "truncate",
    "tis_lower_bound": 0.5,
    "tis_upper_bound": 2.0,
    "rs_lower_bound": None,
    "rs_upper_bound": None,
    "rs_veto_threshold": 1.0e-4,
    "tis_batch_normalize": True,
}


@dataclass(frozen=True)
class _Rules:
    """What changed between slime's releases."""

    prefixed: bool  #: mis_tis_*/mis_rs_* names, final-weight stats, metrics over the pre-rejection masks
    original_denominators: bool  #: the rebuilt reducer keeps each sample's original token count
    compares_current: bool  #: with use_rollout_logprobs, the abs diff compares the current logprobs


def _is_icepop(path: object) -> bool:
    return (
        isinstance(path, str)
        and path.replace(":", ".") == "slime.backends.megatron_utils.loss.icepop_function"
    )


def _is_helper(path: object) -> bool:
    return isinstance(path, str) and path.replace(":", ".").endswith("mis.compute_mis_weights_with_cp")


def _log_ratio(delta: np.ndarray, level: str) -> np.ndarray:
    if level == "token":
        return delta
    if level == "sequence":
        return np.full_like(delta, delta.sum())
    if level == "geometric":
        return np.full_like(delta, delta.sum() / max(delta.size, 1))
    raise ValueError(level)


class _Sample:
    """One sample's per-token figures and its mask after rejection."""

    def __init__(self, n: int) -> None:
        self.values: dict[str, np.ndarray] = {}
        self.kept = np.ones(n)

    def put(self, name: str, value: np.ndarray | float, n: int) -> None:
        self.values[name] = np.broadcast_to(np.asarray(value, dtype=np.float64), (n,)).copy()


def _ppl(s: _Sample, t: np.ndarray, r: np.ndarray) -> None:
    n = t.size
    mean_t = t.sum() / max(n, 1)
    mean_r = r.sum() / max(n, 1)
    delta = t - r
    s.put("training_log_ppl", -mean_t, n)
    s.put("training_ppl", math.exp(-mean_t), n)
    s.put("rollout_log_ppl", -mean_r, n)
    s.put("rollout_ppl", math.exp(-mean_r), n)
    s.put("kl", r - t, n)
    s.put("k3_kl", np.exp(delta) - delta - 1, n)
    s.put("log_ppl_diff", mean_r - mean_t, n)
    s.put("log_ppl_abs_diff", abs(mean_r - mean_t), n)
    s.put("ppl_ratio", math.exp(mean_r - mean_t), n)
    rho = np.exp(np.clip(delta, -_SAFETY, _SAFETY))
    s.put("chi2_token", (rho**2).sum() / max(n, 1) - 1.0, n)
    s.put("chi2_seq", math.exp(2.0 * float(np.clip(delta.sum(), -_SAFETY, _SAFETY))) - 1.0, n)


def _helper_rank(part: StepTokens, st: Settings, rules: _Rules) -> list[_Sample] | None:
    """compute_mis_weights on one process's micro-batch: per sample, its figures (unprefixed names as
    the helper appends them) and its mask after rejection. None where slime fails."""
    tis_pre = "tis_" if rules.prefixed else ""
    rs_pre = "rs_" if rules.prefixed else ""
    samples: list[_Sample] = []
    for i in range(part.n_samples):
        lo, hi = part.offsets[i], part.offsets[i + 1]
        s = _Sample(int(hi - lo))
        _ppl(s, part.trainer[lo:hi], part.rollout[lo:hi])
        samples.append(s)
    if not st["use_tis"]:
        return samples
    if st["tis_upper_bound"] is None:
        return None  # the helper needs an upper bound
    upper = float(st["tis_upper_bound"])
    lower = float(st["tis_lower_bound"]) if st["tis_lower_bound"] is not None else 1.0 / upper
    rs_lower = float(st["rs_lower_bound"]) if st["rs_lower_bound"] is not None else lower
    rs_upper = float(st["rs_upper_bound"]) if st["rs_upper_bound"] is not None else upper
    mode = st["tis_mode"]
    if mode not in ("truncate", "clip", "mask") or (mode != "truncate" and not lower < upper):
        return None
    if st["use_rs"] and not rs_lower < rs_upper:
        return None
    if not rules.prefixed and mode == "mask" and st["use_rs"]:
        return None  # both append to "mask_fraction_*": the reducer's split fails
    weights: list[np.ndarray] = []
    for i, s in enumerate(samples):
        lo, hi = part.offsets[i], part.offsets[i + 1]
        n = int(hi - lo)
        delta = part.trainer[lo:hi] - part.rollout[lo:hi]
        try:
            log_tis = _log_ratio(delta, st["tis_level"])
        except ValueError:
            return None
        w = np.exp(np.clip(log_tis, -_SAFETY, _SAFETY))
        s.put("tis_weight_before_bound", w, n)
        if mode == "truncate":
            s.put(f"{tis_pre}truncate_fraction", (w > upper).astype(float), n)
            w = np.clip(w, 0.0, upper)
        elif mode == "clip":
            s.put(f"{tis_pre}clip_fraction_low", (w < lower).astype(float), n)
            s.put(f"{tis_pre}clip_fraction_high", (w > upper).astype(float), n)
            w = np.clip(w, lower, upper)
        else:
            s.put(f"{tis_pre}mask_fraction_low", (w < lower).astype(float), n)
            s.put(f"{tis_pre}mask_fraction_high", (w > upper).astype(float), n)
            s.kept = s.kept * ((w >= lower) & (w <= upper))
        s.put("tis_weight_after_bound", w, n)
        if st["use_rs"]:
            try:
                log_rs = log_tis if st["rs_level"] == st["tis_level"] else _log_ratio(delta, st["rs_level"])
            except ValueError:
                return None
            rw = np.exp(np.clip(log_rs, -_SAFETY, _SAFETY))
            s.put(f"{rs_pre}mask_fraction_low", (rw < rs_lower).astype(float), n)
            s.put(f"{rs_pre}mask_fraction_high", (rw > rs_upper).astype(float), n)
            s.kept = s.kept * ((rw >= rs_lower) & (rw <= rs_upper))
            if st["rs_veto_threshold"] is not None:
                bad = delta < math.log(float(st["rs_veto_threshold"]))
                s.put(f"{rs_pre}catastrophic_token_fraction", bad.astype(float), n)
                s.put(f"{rs_pre}catastrophic_seq_fraction", float(bad.any()), n)
                if bad.any():
                    s.kept = s.kept * 0.0
        s.put("is_ratio_mean_after_tis_rs" if rules.prefixed else "ratio_mean_after_tis", w, n)
        weights.append(w)
    if st["tis_batch_normalize"]:
        if st["tis_level"] == "token":
            mean = sum(float(w.sum()) for w in weights) / max(sum(w.size for w in weights), 1)
        elif st["tis_level"] == "sequence":
            mean = sum(float(w.sum()) / max(w.size, 1) for w in weights) / len(weights)
        else:
            return None  # slime raises for geometric
        for s, w in zip(samples, weights, strict=True):
            s.put("batch_norm_factor", mean if mean > 1e-8 else 1.0, w.size)
        if mean > 1e-8:
            weights = [w / mean for w in weights]
    if rules.prefixed:
        for s, w in zip(samples, weights, strict=True):
            n = w.size
            s.put("is_ratio_mean_final", w.sum() / max(n, 1), n)
            s.put("is_ratio_min_final", float(w.min()) if n else 0.0, n)
            s.put("is_ratio_max_final", float(w.max()) if n else 0.0, n)
    return samples


def _vanilla(tokens: StepTokens, st: Settings) -> list[_Sample]:
    samples = []
    for i in range(tokens.n_samples):
        lo, hi = tokens.offsets[i], tokens.offsets[i + 1]
        n = int(hi - lo)
        tis = np.exp(tokens.trainer[lo:hi] - tokens.rollout[lo:hi])
        s = _Sample(n)
        s.put("tis", tis, n)
        s.put(
            "tis_clipfrac",
            (np.clip(tis, float(st["tis_clip_low"]), float(st["tis_clip"])) != tis).astype(float),
            n,
        )
        s.put("tis_abs", np.abs(tis - 1), n)
        samples.append(s)
    return samples


def _compute(rules: _Rules) -> Callable[[StepTokens, Settings], dict[str, float]]:
    def figures(tokens: StepTokens, st: Settings) -> dict[str, float]:
        lengths = tokens.lengths.astype(np.float64)
        per_token = bool(st["calculate_per_token_loss"])
        n_samples = tokens.n_samples
        n_tokens = float(np.maximum(lengths, 1).sum())

        def reduce(values: list[np.ndarray], masks: list[np.ndarray], denominators: np.ndarray) -> float:
            sums = np.array([float((v * m).sum()) for v, m in zip(values, masks, strict=True)])
            if per_token:
                return float(sums.sum() / n_tokens)
            return float((sums / np.maximum(denominators, 1)).sum() / n_samples)

        active = bool(st["use_tis"] or st["get_mismatch_metrics"])
        samples: list[_Sample] | None = None
        prefix = ""
        if active:
            path = st["custom_tis_function_path"]
            if path is None or _is_icepop(path):
                if path is None and not st["use_tis"]:
                    return {}  # slime refuses get_mismatch_metrics without a custom function
                samples = _vanilla(tokens, st)  # IcePop logs the same: a weight outside the bounds is 0
            elif _is_helper(path):
                prefix = "mis_"
                samples = []
                for part in tokens.per_rank():
                    got = _helper_rank(part, st, rules)
                    if got is None:
                        return {}
                    samples += got
                if tokens.ranks is not None and len(tokens.per_rank()) > 1:
                    samples = _in_step_order(tokens, samples)
            else:
                return {}  # another custom function: its figures are its own
        out: dict[str, float] = {}
        # train_rollout_logprob_abs_diff: the loss's reducer, rebuilt on the kept tokens when active
        zero = st["use_rollout_logprobs"] and not rules.compares_current
        if not active:  # every token kept: each sample's Σ|Δ| from the step's blocks
            sums = np.zeros(n_samples) if zero else np.array(tokens.blocks.sums("abs_d"))
            out["train_rollout_logprob_abs_diff"] = float(
                sums.sum() / n_tokens if per_token else (sums / np.maximum(lengths, 1)).sum() / n_samples
            )
            return out
        ones = [np.ones(int(n)) for n in lengths]
        kept = [s.kept for s in samples] if samples is not None else ones
        diff = [
            np.abs(tokens.trainer[a:b] - tokens.rollout[a:b])
            for a, b in zip(tokens.offsets[:-1], tokens.offsets[1:], strict=True)
        ]
        if zero:
            diff = [np.zeros_like(d) for d in diff]
        denominators = lengths if rules.original_denominators else np.array([k.sum() for k in kept])
        out["train_rollout_logprob_abs_diff"] = reduce(diff, kept, denominators)
        if samples is not None:
            masks = ones if rules.prefixed else kept
            denominators = lengths if rules.prefixed else np.array([k.sum() for k in kept])
            for name in samples[0].values if samples else ():
                out[prefix + name] = reduce([s.values[name] for s in samples], masks, denominators)
        return out

    return figures


def _in_step_order(tokens: StepTokens, by_rank: list[_Sample]) -> list[_Sample]:
    """Per-rank samples (rank order) back in the step's sample order."""
    assert tokens.ranks is not None
    order = np.concatenate([np.flatnonzero(tokens.ranks == r) for r in np.unique(tokens.ranks)])
    out: list[_Sample | None] = [None] * tokens.n_samples
    for position, sample in zip(order, by_rank, strict=True):
        out[int(position)] = sample
    return [s for s in out if s is not None]


# -- the figures ------------------------------------------------------------------------------------
_AGG = (
    "; reduced by sum_of_sample_mean: per sample over its tokens then mean over the step's samples "
    "(calculate_per_token_loss: token mean)"
)
_ACTIVE = ("use_tis", "get_mismatch_metrics", "custom_tis_function_path", "calculate_per_token_loss")
_TIS = ("tis_mode", "tis_level", "tis_lower_bound", "tis_upper_bound")
_RS = ("use_rs", "rs_level", "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold")


def _f(name: str, definition: str, settings: tuple[str, ...], source: str) -> Figure:
    return Figure(name, definition + _AGG, also=(f"train/{name}",), settings=settings, source=source)


def _figures(rules: _Rules) -> tuple[Figure, ...]:
    kept = (
        "the kept (not rejected) tokens over each sample's original token count"
        if rules.original_denominators
        else "the kept (not rejected) tokens over each sample's kept token count"
    )
    metric_masks = "over each sample's tokens" if rules.prefixed else "over each sample's kept tokens"
    current = (
        "the current policy's logprobs (= trainer's on the first step) with use_rollout_logprobs"
        if rules.compares_current
        else "0 with use_rollout_logprobs (it compares the rollout's with themselves)"
    )
    ppl = ("use_tis", "get_mismatch_metrics", "custom_tis_function_path", "calculate_per_token_loss")
    w_settings = (*_ACTIVE, *_TIS, *_RS)
    figs = [
        _f(
            "train_rollout_logprob_abs_diff",
            f"|trainer − rollout| logprob; with TIS/mismatch metrics on, summed over {kept}; {current}",
            (*_ACTIVE, *_TIS, *_RS, "use_rollout_logprobs"),
            _LOSS,
        ),
        _f(
            "tis",
            "vanilla TIS (--use-tis, no custom function) or IcePop (loss.icepop_function): exp(trainer − rollout) "
            "per token, unclamped",
            _ACTIVE,
            _VANILLA,
        ),
        _f(
            "tis_clipfrac",
            "vanilla TIS or IcePop: share of tokens whose exp(Δ) lies outside [tis_clip_low, tis_clip]",
            (*_ACTIVE, "tis_clip", "tis_clip_low"),
            _VANILLA,
        ),
        _f("tis_abs", "vanilla TIS or IcePop: |exp(trainer − rollout) − 1| per token", _ACTIVE, _VANILLA),
        _f("mis_training_log_ppl", "mismatch helper: −(the sample's mean trainer logprob)", ppl, _MIS),
        _f("mis_training_ppl", "mismatch helper: exp(−mean trainer logprob) per sample", ppl, _MIS),
        _f("mis_rollout_log_ppl", "mismatch helper: −(the sample's mean rollout logprob)", ppl, _MIS),
        _f("mis_rollout_ppl", "mismatch helper: exp(−mean rollout logprob) per sample", ppl, _MIS),
        _f("mis_kl", "mismatch helper: rollout − trainer logprob per token (k1)", ppl, _MIS),
        _f(
            "mis_k3_kl",
            "mismatch helper: exp(Δ) − Δ − 1 per token, Δ = trainer − rollout, unclamped",
            ppl,
            _MIS,
        ),
        _f("mis_log_ppl_diff", "mismatch helper: mean rollout − mean trainer logprob per sample", ppl, _MIS),
        _f(
            "mis_log_ppl_abs_diff",
            "mismatch helper: |mean rollout − mean trainer logprob| per sample",
            ppl,
            _MIS,
        ),
        _f(
            "mis_ppl_ratio", "mismatch helper: exp(mean rollout − mean trainer logprob) per sample", ppl, _MIS
        ),
        _f("mis_chi2_token", "mismatch helper: the sample's mean of exp(clamp(Δ, ±20))² minus 1", ppl, _MIS),
        _f("mis_chi2_seq", "mismatch helper: exp(2·clamp(ΣΔ, ±20)) − 1 per sample", ppl, _MIS),
        _f(
            "mis_tis_weight_before_bound",
            "mismatch helper (use_tis): exp(clamp(log-ratio at tis_level, ±20)) per token",
            w_settings,
            _MIS,
        ),
        _f(
            "mis_tis_weight_after_bound",
            "the weight after tis_mode's bound (mask mode: unchanged)",
            w_settings,
            _MIS,
        ),
    ]
    frac = f"{metric_masks}"
    if rules.prefixed:
        figs += [
            _f(
                "mis_tis_truncate_fraction",
                f"truncate mode: share of weights > tis_upper_bound, {frac}",
                w_settings,
                _MIS,
            ),
            _f(
                "mis_tis_clip_fraction_low",
                f"clip mode: share of weights < the lower bound, {frac}",
                w_settings,
                _MIS,
            ),
            _f(
                "mis_tis_clip_fraction_high",
                f"clip mode: share of weights > tis_upper_bound, {frac}",
                w_settings,
                _MIS,
            ),
            _f(
                "mis_tis_mask_fraction_low",
                f"mask mode: share of weights < the lower bound, {frac}",
                w_settings,
                _MIS,
            ),
            _f(
                "mis_tis_mask_fraction_high",
                f"mask mode: share of weights > tis_upper_bound, {frac}",
                w_settings,
                _MIS,
            ),
            _f(
                "mis_rs_mask_fraction_low",
                f"use_rs: share of rs_level ratios < rs_lower_bound, {frac}",
                w_settings,
                _MIS,
            ),
            _f(
                "mis_rs_mask_fraction_high",
                f"use_rs: share of rs_level ratios > rs_upper_bound, {frac}",
                w_settings,
                _MIS,
            ),
            _f(
                "mis_rs_catastrophic_token_fraction",
                f"rs_veto_threshold: share of tokens with Δ < log(threshold), {frac}",
                w_settings,
                _MIS,
            ),
            _f(
                "mis_rs_catastrophic_seq_fraction",
                f"rs_veto_threshold: share of samples with such a token, {frac}",
                w_settings,
                _MIS,
            ),
            _f("mis_is_ratio_mean_after_tis_rs", "the bounded weight per token", w_settings, _MIS),
            _f(
                "mis_batch_norm_factor",
                "tis_batch_normalize: the process's mean bounded weight (token or sequence level; 1 if ≤ 1e-8)",
                (*w_settings, "tis_batch_normalize"),
                _MIS,
            ),
            _f(
                "mis_is_ratio_mean_final",
                "the sample's mean final (normalised) weight",
                (*w_settings, "tis_batch_normalize"),
                _MIS,
            ),
            _f(
                "mis_is_ratio_min_final",
                "the sample's min final weight",
                (*w_settings, "tis_batch_normalize"),
                _MIS,
            ),
            _f(
                "mis_is_ratio_max_final",
                "the sample's max final weight",
                (*w_settings, "tis_batch_normalize"),
                _MIS,
            ),
        ]
    else:
        figs += [
            _f(
                "mis_truncate_fraction",
                f"truncate mode: share of weights > tis_upper_bound, {frac}",
                w_settings,
                _MIS,
            ),
            _f(
                "mis_clip_fraction_low",
                f"clip mode: share of weights < the lower bound, {frac}",
                w_settings,
                _MIS,
            ),
            _f(
                "mis_clip_fraction_high",
                f"clip mode: share of weights > tis_upper_bound, {frac}",
                w_settings,
                _MIS,
            ),
            _f(
                "mis_mask_fraction_low",
                f"mask mode, or use_rs (rs_level ratio < rs_lower_bound): share of tokens below, {frac}",
                w_settings,
                _MIS,
            ),
            _f(
                "mis_mask_fraction_high",
                f"mask mode, or use_rs (ratio > the upper bound): share of tokens above, {frac}",
                w_settings,
                _MIS,
            ),
            _f(
                "mis_catastrophic_token_fraction",
                f"rs_veto_threshold: share of tokens with Δ < log(threshold), {frac}",
                w_settings,
                _MIS,
            ),
            _f(
                "mis_catastrophic_seq_fraction",
                f"rs_veto_threshold: share of samples with such a token, {frac}",
                w_settings,
                _MIS,
            ),
            _f("mis_ratio_mean_after_tis", "the bounded weight per token", w_settings, _MIS),
            _f(
                "mis_batch_norm_factor",
                "tis_batch_normalize: the process's mean bounded weight (1 if ≤ 1e-8)",
                (*w_settings, "tis_batch_normalize"),
                _MIS,
            ),
        ]
    return tuple(figs)


def _era(since: str, commit: str, date: str, change: str, rules: _Rules) -> Era:
    return Era(since, commit, date, change, _figures(rules), _compute(rules), DEFAULTS)


_ERAS = (
    _era(
        "0.2.1",
        "9d7f34d0ddaf2c3d8032b893147640d00d7437c8",
        "2025-12-03",
        "vanilla TIS moved to a function; tis_abs becomes |exp(Δ) − 1| (was exp(|Δ|))",
        _Rules(prefixed=False, original_denominators=False, compares_current=False),
    ),
    _era(
        "0.2.2",
        "57b9c3d2f28f3f2101801f82e8c894d7091d16b4",
        "2025-12-22",
        "mis_tis_*/mis_rs_* names, final-weight stats; TIS/mismatch metrics over the pre-rejection tokens",
        _Rules(prefixed=True, original_denominators=False, compares_current=False),
    ),
    _era(
        "0.3.0",
        "7405851ff1d78941a90e828f182b4854fb746c7a",
        "2026-05-25",
        "per-rollout denominators: after rejection each sample keeps its original token count",
        _Rules(prefixed=True, original_denominators=True, compares_current=False),
    ),
    _era(
        "0.3.1",
        "6ad61127ef0d37803ac7cb2acc79964462bb1fa0",
        "2026-07-01",
        "train_rollout_logprob_abs_diff compares the current logprobs under use_rollout_logprobs",
        _Rules(prefixed=True, original_denominators=True, compares_current=True),
    ),
)

FRAMEWORK = Framework("slime", "THUDM/slime", _ERAS)
