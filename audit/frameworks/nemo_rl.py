"""NeMo-RL (NVIDIA-NeMo/RL): the train–rollout mismatch figures its GRPO loss logs
(``ClippedPGLossFn.__call__`` in ``nemo_rl/algorithms/loss_functions.py``, from 0.6.0
``nemo_rl/algorithms/loss/loss_functions.py``), comparing ``prev_logprobs`` (the trainer's) with
``generation_logprobs`` (the rollout's), and from 0.6.0 the per-sample errors ``grpo.py`` logs before
the loss (``compute_and_apply_seq_logprob_error_masking``), whose threshold drops samples from the
loss's figures.

Each micro-batch divides its sums by the global count of valid tokens (or sequences) and
``grpo.py`` sums the micro-batches' values (``np.sum``), so a token figure is the token mean over
the whole step; isoaudit assumes one micro-batch per process. The loss function refuses settings
it asserts against (a truncation ratio without the importance-sampling correction, sequence-level
ratios with the token-level loss, a lower bound missing where it is required): the framework
then logs nothing, and so nothing is computed here."""

from __future__ import annotations

from typing import Any

import numpy as np
from isoaudit.audit.frameworks.base import Era, Figure, Framework, Settings, StepTokens
from isoaudit.audit.metrics.blocks import Key

_SOURCE_04 = "nemo_rl/algorithms/loss_functions.py:ClippedPGLossFn.__call__"
_SOURCE_06 = "nemo_rl/algorithms/loss/loss_functions.py:ClippedPGLossFn.__call__"

_RATIO = "truncated_importance_sampling_ratio"
_TYPE = "truncated_importance_sampling_type"
_MIN = "truncated_importance_sampling_ratio_min"
_SEQ = "sequence_level_importance_ratios"
_KL = "reference_policy_kl_type"
_USE_IS = "use_importance_sampling_correction"
_TOKEN_LOSS = "token_level_loss"
_SEQ_THRESHOLD = "seq_logprob_error_threshold"


#: ``masked_mean``'s guard on its denominator, sum / (count + 1e-8)
_EPS = 1e-8


def _global_mean(values: np.ndarray) -> float:
    """``masked_mean`` over the step's valid tokens (or samples) with the global count."""
    return float(np.sum(values) / (values.size + _EPS)) if values.size else float("nan")


def _finite_or_zero(values: np.ndarray) -> np.ndarray:
    """``torch.nan_to_num(..., nan=0, posinf=0, neginf=0)``."""
    return np.where(np.isfinite(values), values, 0.0)


#: The per-token quantity (audit.metrics.blocks) of ``calculate_kl`` on log(p_train/p_gen) = Δ and on
#: log(p_gen/p_train) = −Δ, by estimator: k1 −logr, k2 logr²/2, k3 exp(logr) − 1 − logr.
_KL_OF_DELTA: dict[str, Key] = {"k1": ("neg", "d"), "k2": ("half", "d_sq"), "k3": "nemo_k3"}
_KL_OF_NEG_DELTA: dict[str, Key] = {"k1": "d", "k2": ("half", "d_sq"), "k3": "nemo_k3_reverse"}


def _diagnostics(tokens: StepTokens, kl_type: str) -> dict[str, float]:
    """The figures every era logs the same way, but for the KL estimator's type: token means of
    exp|Δ|, of the KL estimator on Δ (gen) and −Δ (policy) and of the Jensen–Shannon divergence
    (``nemo_js``: log_m = log(0.5 e^p + 0.5 e^g), 0.5 (e^a − a − 1) + 0.5 (e^b − b − 1),
    a = p − log_m, b = g − log_m)."""
    if kl_type not in _KL_OF_DELTA:
        raise ValueError(f"framework_config.{_KL}: {kl_type!r} is not k1, k2 or k3")
    return {
        "token_mult_prob_error": _global_mean_of(tokens, "exp_abs_d"),
        "gen_kl_error": _global_mean_of(tokens, _KL_OF_DELTA[kl_type]),
        "policy_kl_error": _global_mean_of(tokens, _KL_OF_NEG_DELTA[kl_type]),
        "js_divergence_error": _global_mean_of(tokens, "nemo_js"),
    }


def _global_mean_of(tokens: StepTokens, key: Key) -> float:
    """:func:`_global_mean` of the per-token quantity ``key`` (audit.metrics.blocks)."""
    return tokens.total(key) / (tokens.n_tokens + _EPS) if tokens.n_tokens else float("nan")


def _weights(tokens: StepTokens, sequence_level: bool) -> np.ndarray:
    """The importance weights, per token or (sequence-level) per sample: exp of Δ or of the
    sample's ΣΔ, non-finite weights set to 0."""
    with np.errstate(over="ignore"):
        if sequence_level:
            return _finite_or_zero(np.exp(tokens.delta_sums))
        return _finite_or_zero(tokens.exp_delta)


def _ranks(tokens: StepTokens) -> np.ndarray:
    return np.zeros(tokens.n_samples, dtype=np.int64) if tokens.ranks is None else tokens.ranks


def _sampling_ratio(
    tokens: StepTokens, weights: np.ndarray | None, sequence_level: bool, dropped: dict[int, int]
) -> float:
    """``sampling_importance_ratio``: the token mean of the weights (None: untruncated); sequence-level, each micro-
    batch's weights [B, 1] times its sample mask [B] broadcast to [B, B] and summed, over the global
    sample count, summed over micro-batches: a process's (ΣW + its samples dropped by the sequence
    error mask, whose weight is exp(0)) times its kept samples."""
    if weights is None:  # untruncated token weights: exp(Δ), non-finite ones 0
        return _global_mean_of(tokens, ("finite_or_zero", "exp_d"))
    if not sequence_level:
        return _global_mean(weights)
    ranks = _ranks(tokens)
    total = sum(
        (float(np.sum(weights[ranks == r])) + dropped.get(int(r), 0)) * int(np.sum(ranks == r))
        for r in np.unique(ranks)
    )
    return total / (tokens.n_samples + _EPS)


def _sequence_errors(tokens: StepTokens, settings: Settings, era: int) -> tuple[dict[str, float], np.ndarray]:
    """From 0.6.0, grpo.py's per-sample multiplicative probability error (the mean exp|Δ| of each
    sample) and, with seq_logprob_error_threshold, the samples it keeps (error ≤ threshold): the
    loss then sees the kept samples only."""
    error = tokens.blocks.sums("exp_abs_d") / np.maximum(tokens.lengths, 1)
    threshold = settings.get(_SEQ_THRESHOLD)
    kept = np.ones(tokens.n_samples, dtype=bool) if threshold is None else error <= threshold
    out: dict[str, float] = {}
    valid = error if era < 7 else error[tokens.lengths > 0]
    out["max_seq_mult_prob_error"] = float(valid.max()) if valid.size else 0.0
    out["num_masked_seqs_by_logprob_error"] = float(np.sum(~kept))
    if era >= 7:
        out["mean_seq_mult_prob_error"] = float(valid.mean()) if valid.size else 0.0
        out["min_seq_mult_prob_error"] = float(valid.min()) if valid.size else 0.0
        after = error[kept & (tokens.lengths > 0)] if threshold is not None else valid
        for stat, fn in (("max", np.max), ("mean", np.mean), ("min", np.min)):
            out[f"{stat}_seq_mult_prob_error_after_mask"] = float(fn(after)) if after.size else 0.0
    return out, kept


def _per_token(tokens: StepTokens, values: np.ndarray, sequence_level: bool) -> np.ndarray:
    return values[tokens.sample_of_token] if sequence_level else values


def _valid(settings: Settings, era: int) -> bool:
    """Whether ``ClippedPGLossFn`` accepts these settings (its asserts and its ValueError)."""
    ratio, kind, low = settings.get(_RATIO), settings.get(_TYPE), settings.get(_MIN)
    if settings.get(_SEQ) and settings.get(_TOKEN_LOSS, True):
        return False
    if era >= 7 and kind is not None and (ratio is None or not settings.get(_USE_IS)):
        return False
    if ratio is None:
        return True
    if not settings.get(_USE_IS) or ratio <= 0:
        return False
    if era < 6:
        return True
    if kind not in ("tis", "icepop", "seq-mask-tis"):
        return False
    if kind in ("icepop", "seq-mask-tis") and low is None:
        return False
    if kind == "seq-mask-tis" and settings.get(_SEQ):
        return False
    return not (era >= 7 and low is not None and low > ratio)


def _truncated(
    tokens: StepTokens, settings: Settings, era: int
) -> tuple[np.ndarray | None, dict[str, float]]:
    """The weights after truncation (None: token weights untruncated, read from the step's blocks)
    and, from 0.6.0, ``is_oob_ratio`` (with a truncation ratio)."""
    sequence_level = bool(settings.get(_SEQ))
    ratio = settings.get(_RATIO)
    if ratio is None and not sequence_level:
        return None, {}
    w = _weights(tokens, sequence_level)
    if ratio is None:
        return w, {}
    if era < 6:
        return np.minimum(w, ratio), {}
    kind, low = settings.get(_TYPE), settings.get(_MIN)
    if kind == "tis":
        lower = 0.0 if era < 7 or low is None else low
        out = (w > ratio) | (w < lower)
        w = np.clip(w, lower, ratio)
    elif kind == "icepop":
        out = (w < low) | (w > ratio)
        w = np.where(out, 0.0, w)
    else:  # seq-mask-tis: each sample's geometric-mean ratio decides whether it is kept
        mean_delta = tokens.sample_sums(_finite_or_zero(tokens.delta)) / (tokens.lengths + _EPS)
        geo = np.exp(mean_delta)
        out = (geo < low) | (geo > ratio)
        w = np.where(out[tokens.sample_of_token], 0.0, w)
    share = (
        out.astype(float) if kind == "seq-mask-tis" else _per_token(tokens, out.astype(float), sequence_level)
    )
    if era >= 7:
        return w, {"is_oob_ratio": _global_mean(share)}
    # each micro-batch logged 1 − (its kept count / the global count); grpo.py sums them
    processes = len(tokens.per_rank())
    return w, {"is_oob_ratio": processes - float(np.sum(1.0 - share) / (share.size + _EPS))}


def _compute(era: int) -> Any:
    def compute(tokens: StepTokens, settings: Settings) -> dict[str, float]:
        if not _valid(settings, era):
            return {}
        out: dict[str, float] = {}
        kept = np.ones(tokens.n_samples, dtype=bool)
        if era >= 6:
            errors, kept = _sequence_errors(tokens, settings, era)
            out.update(errors)
        loss = tokens if kept.all() else tokens.select(np.flatnonzero(kept))
        if loss.n_tokens == 0:  # no micro-batch with a valid sample: the loss logs nothing
            return out
        dropped_ranks = _ranks(tokens)[~kept]
        dropped = {int(r): int(np.sum(dropped_ranks == r)) for r in np.unique(dropped_ranks)}
        out.update(_diagnostics(loss, settings.get(_KL, "k3") if era >= 5 else "k3"))
        sequence_level = bool(settings.get(_SEQ))
        weights, oob = _truncated(loss, settings, era)
        out["sampling_importance_ratio"] = _sampling_ratio(loss, weights, sequence_level, dropped)
        out.update(oob)
        return out

    return compute


_ALSO = "train/"


def _figures(era: int) -> tuple[Figure, ...]:
    source = _SOURCE_06 if era >= 6 else _SOURCE_04
    kl = (_KL,) if era >= 5 else ()
    kl_word = "reference_policy_kl_type's estimator" if era >= 5 else "k3"
    truncation = (_USE_IS, _RATIO, _SEQ, _TOKEN_LOSS) + ((_TYPE, _MIN) if era >= 6 else ())

    def f(name: str, definition: str, settings: tuple[str, ...] = (), same_as: str | None = None) -> Figure:
        return Figure(
            name, definition, also=(_ALSO + name,), settings=settings, same_as=same_as, source=source
        )

    if era < 6:
        truncate = "capped at truncated_importance_sampling_ratio when set"
    elif era < 7:
        truncate = "truncated by truncated_importance_sampling_type (tis caps, icepop zeroes out-of-bounds tokens, seq-mask-tis zeroes samples)"
    else:
        truncate = "truncated by truncated_importance_sampling_type (tis clamps to [ratio_min or 0, ratio], icepop zeroes out-of-bounds tokens, seq-mask-tis zeroes samples)"
    figures = [
        f(
            "token_mult_prob_error",
            "token mean of exp(|trainer − rollout logprob|) over the step's valid tokens",
            same_as="token_mult_prob_error",
        ),
        f(
            "gen_kl_error",
            f"token mean of KL(P_gen ‖ P_train) per sampled token, {kl_word} on log(p_train/p_gen)",
            kl,
        ),
        f(
            "policy_kl_error",
            f"token mean of KL(P_train ‖ P_gen) per sampled token, {kl_word} on log(p_gen/p_train)",
            kl,
        ),
        f(
            "js_divergence_error",
            "token mean of the Jensen–Shannon divergence of the two sampled-token probabilities "
            "(k3 of each against their mean)",
            same_as="js_divergence",
        ),
        f(
            "sampling_importance_ratio",
            "token mean of the importance weights exp(trainer − rollout) (non-finite → 0), "
            f"{truncate}; with sequence_level_importance_ratios, weights exp(ΣΔ) per sample whose "
            "reduction broadcasts [B,1]×[B]: Σ over processes of (ΣW × samples) / all samples",
            truncation,
        ),
    ]
    if era >= 6:
        oob = (
            "share of tokens (seq-mask-tis: of samples) whose weight is out of bounds, plus the number "
            "of processes − 1 (each micro-batch logs 1 − its kept share of the global count; grpo.py sums)"
            if era < 7
            else "share of tokens (seq-mask-tis: of samples) whose importance weight is out of the "
            "truncation bounds"
        )
        figures.append(f("is_oob_ratio", f"{oob}; logged only with a truncation ratio and type", truncation))
        # the sequence error mask drops samples from every loss figure
        figures = [
            Figure(x.name, x.definition, x.also, (*x.settings, _SEQ_THRESHOLD), x.same_as, x.source)
            for x in figures
        ]
        grpo = "nemo_rl/algorithms/grpo.py:compute_and_apply_seq_logprob_error_masking"
        error = "each sample's multiplicative probability error (the mean exp|Δ| over its tokens)"

        def g(name: str, definition: str, settings: tuple[str, ...] = ()) -> Figure:
            return Figure(name, definition, also=(_ALSO + name,), settings=settings, source=grpo)

        figures.append(g("max_seq_mult_prob_error", f"the largest of {error}"))
        figures.append(
            g(
                "num_masked_seqs_by_logprob_error",
                "the number of samples whose error exceeds seq_logprob_error_threshold (0 unset); "
                "the loss's figures then leave them out",
                (_SEQ_THRESHOLD,),
            )
        )
        if era >= 7:
            figures.append(g("mean_seq_mult_prob_error", f"the mean over samples of {error}"))
            figures.append(g("min_seq_mult_prob_error", f"the smallest of {error}"))
            for stat in ("max", "mean", "min"):
                figures.append(
                    g(
                        f"{stat}_seq_mult_prob_error_after_mask",
                        f"the {stat} of {error} over the samples the threshold keeps (0 if none)",
                        (_SEQ_THRESHOLD,),
                    )
                )
    return tuple(figures)


def _defaults(era: int) -> dict[str, Any]:
    out: dict[str, Any] = {_USE_IS: False, _RATIO: None, _SEQ: False, _TOKEN_LOSS: True}
    if era >= 5:
        out[_KL] = "k3"
    if era >= 6:
        out[_TYPE] = "tis" if era < 7 else None
        out[_MIN] = None
        out[_SEQ_THRESHOLD] = None
    return out


ERAS = (
    Era(
        since="0.4.0",
        commit="e582328b0dbc61d6c148a8ca5aa111737201412c",
        date="2025-10-29",
        change="gen_kl_error, policy_kl_error and js_divergence_error added beside token_mult_prob_error "
        "and sampling_importance_ratio (truncated importance sampling: a cap)",
        figures=_figures(4),
        compute=_compute(4),
        defaults=_defaults(4),
    ),
    Era(
        since="0.5.0",
        commit="e6adc776ef790c8e9fecf125e39658adfa5fa009",
        date="2025-11-04",
        change="gen_kl_error and policy_kl_error use reference_policy_kl_type (k1, k2, k3)",
        figures=_figures(5),
        compute=_compute(5),
        defaults=_defaults(5),
    ),
    Era(
        since="0.6.0",
        commit="2841fefb699a460cc4375fb2983b40c018ca76fe",
        date="2026-02-15",
        change="truncated_importance_sampling_type (tis, icepop, seq-mask-tis) and is_oob_ratio; grpo.py's "
        "sequence-level logprob errors and seq_logprob_error_threshold (14f9f38, 2026-02-13)",
        figures=_figures(6),
        compute=_compute(6),
        defaults=_defaults(6),
    ),
    Era(
        since="0.7.0",
        commit="126fbc33a752dd6d785822af01a04180fcea5f71",
        date="2026-06-25",
        change="is_oob_ratio summed correctly over micro-batches (37526df); mean/min and after-mask sequence "
        "errors (64be007); tis takes a lower bound; the "
        "truncation type defaults to none",
        figures=_figures(7),
        compute=_compute(7),
        defaults=_defaults(7),
    ),
)

FRAMEWORK = Framework("nemo-rl", "NVIDIA-NeMo/RL", ERAS)
