"""SkyRL (NovaSky-AI/SkyRL): the rollout–trainer figures it logs.

- ``policy/rollout_train_*``: the trainer's, after the policy's forward pass over the whole training
  batch (``RayPPOTrainer.fwd_logprobs_values_reward``), token-wise over the batch's loss-masked
  tokens, ``torch.std`` (ddof=1) for the std.
- ``policy/loss_metrics/*``: the off-policy correction's (``off_policy_correction_utils.py:
  compute_off_policy_correction``), computed by each worker on its micro-batch when a correction is
  configured, then reduced as SkyRL's workers reduce metrics (``worker_utils.py: reduce_metrics``,
  ``all_reduce_metrics``): a mean over processes, a max (``*_max``) or a min (``*_min``). Its
  importance ratio is ``exp`` of the logprob difference clamped to ±20, taken in float32
  (``safe_exp_delta`` casts to float32).
- ``policy/minibatch_rollout_logprobs_abs_diff_*`` (0.3.0 on): each worker's micro-batch token mean and
  second moment of |Δ| averaged over processes, the std rebuilt as sqrt(E[x²] − E[x]²).

Releases: the ``skyrl-train`` package (``skyrl_train-v*`` tags) up to 0.4.0, then the ``skyrl``
package from 0.1.0 (March 2026), whose numbers restart. A ``skyrl-train`` release is declared with
the local label ``+train`` (``skyrl==0.4.0+train``); a plain version is the ``skyrl`` package.
One micro-batch and one mini-batch per process and step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from isoaudit.audit.frameworks.base import (
    Era,
    Figure,
    Framework,
    Settings,
    StepTokens,
    parse_version,
)
from isoaudit.audit.metrics.blocks import Key
from packaging.version import Version

_TRAINER = "skyrl/train/trainer.py:RayPPOTrainer.fwd_logprobs_values_reward"
_TRAINER_TRAIN = "skyrl-train/skyrl_train/trainer.py:RayPPOTrainer.fwd_logprobs_values_reward"
_OPC = "skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py:compute_off_policy_correction"
_OPC_TRAIN = "skyrl-train/skyrl_train/utils/off_policy_correction_utils.py:compute_off_policy_correction"
_MINI = "skyrl/backends/skyrl_train/workers/worker_utils.py:compute_minibatch_rollout_logprob_diff_metrics"
_P = "policy/"
_LM = "policy/loss_metrics/"
_MB = "policy/minibatch_rollout_logprobs_abs_diff_"
_TRAIN = "train"  # the local label of a skyrl-train release
_OC = "off_policy_correction."

_OPC_DEFAULTS: dict[str, object] = {
    _OC + "tis_ratio_type": None,
    _OC + "token_tis_ratio_clip_high": 2.0,
    _OC + "sequence_tis_ratio_clip_high": 5.0,
    _OC + "sequence_mask_metric": None,
    _OC + "geo_mask_high": 1.01,
    _OC + "geo_mask_low": 0.99,
    _OC + "product_mask_high": 2.0,
    _OC + "product_mask_low": 0.5,
    _OC + "outlier_token_is_threshold_low": None,
    _OC + "outlier_token_is_threshold_high": None,
}
_TOKEN_MASK_DEFAULTS: dict[str, object] = {
    _OC + "token_mask_is_threshold_low": None,
    _OC + "token_mask_is_threshold_high": None,
}


@dataclass(frozen=True)
class _Rules:
    """What SkyRL logs at a release."""

    abs_diff: bool  #: |Δ| figures (before: the probability ratio exp(rollout − trainer))
    range_: bool  #: the trainer's max and min of |Δ|
    correction: bool  #: off_policy_correction's loss metrics
    token_mask: bool  #: off_policy_correction's per-token hard mask
    minibatch: bool  #: the workers' minibatch_rollout_logprobs_abs_diff_*
    #: the trainer skips the policy forward (and its figures) for losses on the rollout's logprobs
    skips_forward: bool = False
    cispo_anchor: bool = False  #: CISPO anchored on the rollout skips it too


def _ratio(log_ratio: np.ndarray) -> np.ndarray:
    """safe_exp_delta: clamp to ±20 and exp, in float32."""
    return np.exp(np.clip(log_ratio.astype(np.float32), -20.0, 20.0)).astype(np.float64)


def _trainer(tokens: StepTokens, rules: _Rules) -> dict[str, float]:
    blocks = tokens.blocks
    if not rules.abs_diff:
        ratio: Key = ("abs", "exp_neg_d")  # exp(rollout − trainer)
        return {
            _P + "rollout_train_prob_diff_mean": tokens.mean_of(ratio),
            _P + "rollout_train_prob_diff_std": blocks.std(ratio, ddof=1)
            if tokens.n_tokens > 1
            else float("nan"),
        }
    if rules.range_ and tokens.n_tokens == 0:
        return {}
    out = {
        _P + "rollout_train_logprobs_abs_diff_mean": tokens.mean_of("abs_d"),
        _P + "rollout_train_logprobs_abs_diff_std": blocks.std("abs_d", ddof=1)
        if tokens.n_tokens > 1
        else float("nan"),
    }
    if rules.range_:
        out[_P + "rollout_train_logprobs_abs_diff_max"] = blocks.max("abs_d")
        out[_P + "rollout_train_logprobs_abs_diff_min"] = blocks.min("abs_d")
    return out


def _correction_enabled(st: Settings) -> bool:
    """off_policy_correction_enabled (skyrl 0.3.0 on)."""
    get = lambda key: st.get(_OC + key)  # noqa: E731
    return (
        get("tis_ratio_type") is not None
        or get("sequence_mask_metric") is not None
        or get("outlier_token_is_threshold_low") is not None
        or get("outlier_token_is_threshold_high") is not None
        or (
            get("token_mask_is_threshold_low") is not None and get("token_mask_is_threshold_high") is not None
        )
    )


def _skips_forward(st: Settings, rules: _Rules) -> bool:
    """RayPPOTrainer._skip_policy_forward: a loss on the rollout's logprobs (rollout_is, dppo; CISPO
    anchored on the rollout), no KL reward penalty, no off-policy correction."""
    if not rules.skips_forward:
        return False
    loss = st.get("policy_loss_type")
    without_old = loss in ("rollout_is", "dppo")
    if rules.cispo_anchor and loss == "cispo":
        without_old = st.get("cispo.cispo_anchor") == "rollout"
    return without_old and not st.get("use_kl_in_reward") and not _correction_enabled(st)


def _correction_part(part: StepTokens, st: Settings, rules: _Rules) -> dict[str, float] | None:
    """compute_off_policy_correction's metrics on one process's micro-batch (None: SkyRL raises)."""
    get = lambda key: st.get(_OC + key)  # noqa: E731
    tis_type = get("tis_ratio_type")
    seq_metric = get("sequence_mask_metric")
    lo_out, hi_out = get("outlier_token_is_threshold_low"), get("outlier_token_is_threshold_high")
    lo_tok, hi_tok = get("token_mask_is_threshold_low"), get("token_mask_is_threshold_high")
    if rules.token_mask:  # outlier and token masks are corrections of their own, applied when set
        outlier = lo_out is not None or hi_out is not None
        token_mask = lo_tok is not None and hi_tok is not None
        if not (tis_type is not None or seq_metric is not None or outlier or token_mask):
            return {}
    else:  # TIS or a sequence mask enables the correction, which then always runs the outlier mask
        if tis_type is None and seq_metric is None:
            return {}
        outlier, token_mask = True, False
    n = part.n_samples
    sample = part.sample_of_token
    delta = part.delta
    ratio = _ratio(delta)
    mask = np.ones(part.n_tokens)
    out: dict[str, float] = {
        "is_ratio_mean": float(ratio.sum() / max(part.n_tokens, 1)),
        "is_ratio_max": float(ratio.max()) if ratio.size else 0.0,
    }
    if outlier:
        over = ratio > hi_out if hi_out is not None else np.zeros(ratio.size, bool)
        under = ratio < lo_out if lo_out is not None else np.zeros(ratio.size, bool)
        has_over = np.bincount(sample, weights=over, minlength=n) > 0
        has_under = np.bincount(sample, weights=under, minlength=n) > 0
        bad = has_over | has_under
        out["outlier_seq_masked_ratio"] = float(bad.sum() / n)
        out["outlier_seq_over_high_ratio"] = float(has_over.sum() / n)
        out["outlier_seq_under_low_ratio"] = float(has_under.sum() / n)
        mask = mask * ~bad[sample]
    if token_mask:
        in_bounds = (ratio >= lo_tok) & (ratio <= hi_tok)
        valid = mask > 0
        out["token_mask_ratio"] = float((~in_bounds & valid).sum() / max(valid.sum(), 1))
        mask = mask * in_bounds
    if tis_type is not None:
        if tis_type == "token":
            valid = mask > 0
            capped = (ratio > get("token_tis_ratio_clip_high")) & valid
            out["tis_token_clip_high_ratio"] = float(capped.sum() / max(valid.sum(), 1))
        elif tis_type == "sequence":
            seq = _ratio(np.bincount(sample, weights=delta * mask, minlength=n))
            out["tis_seq_clip_high_ratio"] = float((seq > get("sequence_tis_ratio_clip_high")).sum() / n)
        else:
            return None
    if seq_metric is not None:
        log_sum = np.bincount(sample, weights=delta * mask, minlength=n)
        if seq_metric == "geometric":
            count = np.maximum(np.bincount(sample, weights=mask, minlength=n), 1.0)
            seq = _ratio(log_sum / count)
            high, low, name = get("geo_mask_high"), get("geo_mask_low"), "geo_sequence_mask"
        elif seq_metric == "product":
            seq = _ratio(log_sum)
            high, low, name = get("product_mask_high"), get("product_mask_low"), "product_sequence_mask"
        else:
            return None
        over, under = seq > high, seq < low
        out[f"{name}_masked_ratio"] = float((over | under).sum() / n)
        out[f"{name}_over_high_ratio"] = float(over.sum() / n)
        out[f"{name}_under_low_ratio"] = float(under.sum() / n)
    return out


def _across_processes(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """all_reduce_metrics: min for *_min, max for *_max, else the mean over processes."""
    out: dict[str, float] = {}
    for key in per_rank[0]:
        values = [r[key] for r in per_rank]
        if key.endswith("_max"):
            out[key] = max(values)
        elif key.endswith("_min"):
            out[key] = min(values)
        else:
            out[key] = sum(values) / len(values)
    return out


def _compute(rules: _Rules) -> Callable[[StepTokens, Settings], dict[str, float]]:
    def figures(tokens: StepTokens, st: Settings) -> dict[str, float]:
        out = {} if _skips_forward(st, rules) else _trainer(tokens, rules)
        parts = tokens.per_rank()
        if rules.correction:
            try:
                per_rank = [_correction_part(p, st, rules) for p in parts]
            except TypeError:
                return {}  # a bound set to None where SkyRL compares with it: SkyRL raises
            if any(r is None for r in per_rank):
                return {}  # SkyRL raises on an unknown tis_ratio_type / sequence_mask_metric
            if per_rank[0]:
                out |= {_LM + k: v for k, v in _across_processes(per_rank).items()}  # type: ignore[arg-type]
        if rules.minibatch:
            moments = []
            for p in parts:
                size = max(p.n_tokens, 1)
                moments.append(
                    {
                        "mean": p.total("abs_d") / size,
                        "sq_mean": p.total("d_sq") / size,  # |Δ|² is Δ² exactly
                        "_max": p.blocks.max("abs_d") if p.n_tokens else 0.0,
                    }
                )
            reduced = _across_processes(moments)
            out[_MB + "mean"] = reduced["mean"]
            out[_MB + "std"] = float(np.sqrt(max(0.0, reduced["sq_mean"] - reduced["mean"] ** 2)))
            out[_MB + "max"] = reduced["_max"]
        return out

    return figures


# -- the figures ------------------------------------------------------------------------------------
def _trainer_figures(rules: _Rules, source: str) -> list[Figure]:
    figs = _trainer_figures_of(rules, source)
    if not rules.skips_forward:
        return figs
    keys = ("policy_loss_type", "use_kl_in_reward", *_OPC_DEFAULTS, *_TOKEN_MASK_DEFAULTS)
    keys += ("cispo.cispo_anchor",) if rules.cispo_anchor else ()
    skip = (
        "; not logged when the forward pass is skipped (a loss on the rollout's logprobs without correction)"
    )
    return [
        Figure(f.name, f.definition + skip, settings=keys, same_as=f.same_as, source=f.source) for f in figs
    ]


def _trainer_figures_of(rules: _Rules, source: str) -> list[Figure]:
    if not rules.abs_diff:
        return [
            Figure(
                _P + "rollout_train_prob_diff_mean",
                "token mean of exp(rollout − trainer logprob) (a probability ratio, not a difference) "
                "over the batch's loss-masked tokens",
                source=source,
            ),
            Figure(
                _P + "rollout_train_prob_diff_std",
                "sample std (ddof=1) of exp(rollout − trainer logprob) over the batch's loss-masked tokens",
                source=source,
            ),
        ]
    figs = [
        Figure(
            _P + "rollout_train_logprobs_abs_diff_mean",
            "token mean of |rollout − trainer| logprob over the batch's loss-masked tokens",
            same_as="logprob_abs_diff_mean",
            source=source,
        ),
        Figure(
            _P + "rollout_train_logprobs_abs_diff_std",
            "sample std (torch.std, ddof=1) of |rollout − trainer| logprob over the batch's loss-masked tokens",
            source=source,
        ),
    ]
    if rules.range_:
        figs += [
            Figure(
                _P + "rollout_train_logprobs_abs_diff_max",
                "max of |rollout − trainer| logprob over the batch's loss-masked tokens",
                same_as="logprob_abs_diff_max",
                source=source,
            ),
            Figure(
                _P + "rollout_train_logprobs_abs_diff_min",
                "min of |rollout − trainer| logprob over the batch's loss-masked tokens",
                source=source,
            ),
        ]
    return figs


def _correction_figures(rules: _Rules, source: str) -> list[Figure]:
    keys = tuple(_OPC_DEFAULTS) + (tuple(_TOKEN_MASK_DEFAULTS) if rules.token_mask else ())
    ratio = "ρ = exp(clamp(trainer − rollout, ±20)) in float32"
    per = "; per process (its micro-batch), then the mean over processes"

    def f(name: str, definition: str, reduce: str = per) -> Figure:
        return Figure(_LM + name, definition + reduce, settings=keys, source=source)

    rows = "the process's sequences"
    figs = [
        f("is_ratio_mean", f"with any correction configured: token mean of {ratio} over loss-masked tokens"),
        f(
            "is_ratio_max",
            f"with any correction configured: max of {ratio} over loss-masked tokens",
            "; max over processes",
        ),
        f(
            "outlier_seq_masked_ratio",
            f"outlier thresholds set (skyrl-train: any correction on): share of {rows} with a token ρ outside them",
        ),
        f("outlier_seq_over_high_ratio", f"share of {rows} with a token ρ > outlier_token_is_threshold_high"),
        f("outlier_seq_under_low_ratio", f"share of {rows} with a token ρ < outlier_token_is_threshold_low"),
        f(
            "tis_token_clip_high_ratio",
            "tis_ratio_type token: share of the tokens kept by the masks before it with ρ > token_tis_ratio_clip_high",
        ),
        f(
            "tis_seq_clip_high_ratio",
            f"tis_ratio_type sequence: share of {rows} with exp(clamp(Σ kept Δ, ±20)) > sequence_tis_ratio_clip_high",
        ),
    ]
    for kind, what in (("geo", "exp(clamp(mean kept Δ, ±20))"), ("product", "exp(clamp(Σ kept Δ, ±20))")):
        for part, test in (("masked", "outside"), ("over_high", "above"), ("under_low", "below")):
            figs.append(
                f(
                    f"{kind}_sequence_mask_{part}_ratio",
                    f"sequence_mask_metric {'geometric' if kind == 'geo' else 'product'}: share of {rows} "
                    f"whose {what} is {test} [{kind}_mask_low, {kind}_mask_high]",
                )
            )
    if rules.token_mask:
        figs.append(
            f(
                "token_mask_ratio",
                "token mask thresholds set: share of the tokens kept by the outlier mask with ρ outside "
                "[token_mask_is_threshold_low, token_mask_is_threshold_high]",
            )
        )
    return figs


def _minibatch_figures() -> list[Figure]:
    return [
        Figure(
            _MB + "mean",
            "mean over processes of each process's token mean of |trainer − rollout| logprob (the logprobs "
            "the loss optimises against; on the first mini-batch the trainer's)",
            source=_MINI,
        ),
        Figure(
            _MB + "std",
            "sqrt(max(0, E[|Δ|²] − E[|Δ|]²)) from the per-process token moments averaged over processes",
            source=_MINI,
        ),
        Figure(
            _MB + "max",
            "max over processes of the max |trainer − rollout| logprob over loss-masked tokens",
            same_as="logprob_abs_diff_max",
            source=_MINI,
        ),
    ]


def _era(
    since: str, commit: str, date: str, change: str, rules: _Rules, train_line: bool, released: bool = True
) -> Era:
    figs = _trainer_figures(rules, _TRAINER_TRAIN if train_line else _TRAINER)
    defaults: dict[str, object] = {}
    if rules.correction:
        figs += _correction_figures(rules, _OPC_TRAIN if train_line else _OPC)
        defaults |= _OPC_DEFAULTS
    if rules.token_mask:
        defaults |= _TOKEN_MASK_DEFAULTS
    if rules.minibatch:
        figs += _minibatch_figures()
    if rules.skips_forward:
        defaults |= {"policy_loss_type": "regular", "use_kl_in_reward": False}
    if rules.cispo_anchor:
        defaults |= {"cispo.cispo_anchor": "old"}
    return Era(since, commit, date, change, tuple(figs), _compute(rules), defaults, released=released)


_ERAS = (
    _era(
        f"0.2.0+{_TRAIN}",
        "81f2973f591df96353416051e679d1ef95b928fc",
        "2025-08-14",
        "skyrl-train: the rollout/trainer probability ratio exp(rollout − trainer), mean and std",
        _Rules(abs_diff=False, range_=False, correction=False, token_mask=False, minibatch=False),
        train_line=True,
    ),
    _era(
        f"0.4.0+{_TRAIN}",
        "5102468dcd15f27b9cacdd5f49e4e169ede09a8b",
        "2026-02-03",
        "skyrl-train: |rollout − trainer| replaces the ratio (b89e119, 2026-01-21); off_policy_correction "
        "config and its loss metrics",
        _Rules(abs_diff=True, range_=False, correction=True, token_mask=False, minibatch=False),
        train_line=True,
    ),
    _era(
        "0.1.0",
        "4ded618a3ff998ba85d1297f037a38810c25e3e9",
        "2026-03-03",
        "the skyrl package (renamed from skyrl-train); the per-token hard mask and its token_mask_ratio",
        _Rules(abs_diff=True, range_=False, correction=True, token_mask=True, minibatch=False),
        train_line=False,
    ),
    _era(
        "0.3.0",
        "7f45370462952b85443366adc3d785fb905a2d9b",
        "2026-06-21",
        "the trainer's max/min of |Δ| (18f0ac7, 2026-05-27); the workers' minibatch_rollout_logprobs_abs_diff_*; "
        "no forward pass (nor its figures) for rollout_is/dppo without correction",
        _Rules(
            abs_diff=True, range_=True, correction=True, token_mask=True, minibatch=True, skips_forward=True
        ),
        train_line=False,
    ),
    _era(
        "main@dda1cb3",
        "dda1cb3c8f0823236d98026c78ce290372683ab1",
        "2026-07-28",
        "CISPO anchored on the rollout (cispo.cispo_anchor) also skips the forward pass and its figures",
        _Rules(
            abs_diff=True,
            range_=True,
            correction=True,
            token_mask=True,
            minibatch=True,
            skips_forward=True,
            cispo_anchor=True,
        ),
        train_line=False,
        released=False,
    ),
)


class _SkyRL(Framework):
    """SkyRL's two release lines: ``skyrl-train`` (declared ``X.Y.Z+train``) and ``skyrl``."""

    def era(self, version: str | None = None) -> Era:
        if version is None:
            return self.head
        wanted = parse_version(version, f"{self.name} version")
        line = [
            e
            for e in self.eras
            if e.released and (Version(e.since).local == _TRAIN) == (wanted.local == _TRAIN)
        ]
        precision = len(wanted.release)
        chosen: Era | None = None
        for era in line:
            if Version(era.since).release[:precision] <= wanted.release:
                chosen = era
        if chosen is None:
            package = "skyrl-train" if wanted.local == _TRAIN else "skyrl"
            raise ValueError(
                f"framework: {package} {version} is older than the oldest release isoaudit covers "
                f"({line[0].since})"
            )
        return chosen


FRAMEWORK = _SkyRL("skyrl", "NovaSky-AI/SkyRL", _ERAS)
