"""TRL (huggingface/trl): the vLLM importance-sampling figures ``GRPOTrainer`` logs when it corrects for
the rollout–trainer mismatch (``trl/trainer/grpo_trainer.py: GRPOTrainer._generate_and_score_completions``).

Each process computes its figures over its own completions; the logged value is the reduction of the
gathered per-process values (``accelerator.gather``): a mean of per-process means, a max of maxes, a
min of mins. The importance-sampling ratio is ``exp`` of the per-token (``token_*`` modes) or
per-sequence summed (``sequence_*`` modes) logprob difference, with no clamp before ``exp``; ``*_truncate``
modes clamp it to the bounds, ``*_mask`` modes set it to 0 outside them. Figures are logged only with
vLLM generation and ``vllm_importance_sampling_correction`` on.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from isoaudit.audit.frameworks.base import Era, Figure, Framework, Settings, StepTokens

_SOURCE = "trl/trainer/grpo_trainer.py:GRPOTrainer._generate_and_score_completions"
_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
_DIFF = "sampling/sampling_logp_difference/"
_RATIO = "sampling/importance_sampling_ratio/"


def _bounds(settings: Settings, era_16: bool) -> tuple[float | None, float | None]:
    """(lower, upper) bound of the ratio: the cap alone before 1.6.0; later clip_min/clip_max, with the
    deprecated cap overriding clip_max when set (GRPOConfig.__post_init__)."""
    if not era_16:
        return None, float(settings["vllm_importance_sampling_cap"])
    upper = settings.get("vllm_importance_sampling_clip_max")
    if settings.get("vllm_importance_sampling_cap") is not None:
        upper = settings["vllm_importance_sampling_cap"]
    lower = settings.get("vllm_importance_sampling_clip_min")
    return (
        None if lower is None else float(lower),
        None if upper is None else float(upper),
    )


def _ratios(
    part: StepTokens, mode: str, lower: float | None, upper: float | None, era_16: bool
) -> np.ndarray:
    """One process's importance-sampling ratios as its metric block flattens them: per sequence (every
    sequence, 1 for one with no tokens) or per masked-in token."""
    if mode.startswith("sequence"):
        ratio = np.exp(part.delta_sums)
    else:
        ratio = part.exp_delta
    if mode.endswith("truncate"):
        if lower is not None:
            ratio = np.maximum(ratio, lower)
        if upper is not None:
            ratio = np.minimum(ratio, upper)
    elif era_16:
        lo = -math.inf if lower is None else lower
        hi = math.inf if upper is None else upper
        ratio = np.where((ratio < lo) | (ratio > hi), 0.0, ratio)
    else:
        ratio = np.where(ratio > upper, 0.0, ratio)
    return ratio


def _compute(era_16: bool) -> Callable[[StepTokens, Settings], dict[str, float]]:
    def figures(tokens: StepTokens, settings: Settings) -> dict[str, float]:
        if not settings.get("vllm_importance_sampling_correction", True):
            return {}
        mode = settings["vllm_importance_sampling_mode"]
        if mode not in _MODES:
            return {}  # GRPOTrainer raises on an unknown mode: nothing is logged
        lower, upper = _bounds(settings, era_16)
        if era_16 and (
            (mode.endswith("truncate") and lower is None and upper is None)
            or (lower is not None and upper is not None and lower >= upper)
        ):
            return {}  # GRPOConfig refuses these bounds
        diff_mean, diff_max, r_min, r_mean, r_max = [], [], [], [], []
        for part in tokens.per_rank():
            diff_mean.append(part.mean_of("abs_d") if part.n_tokens else 0.0)
            diff_max.append(part.blocks.max("abs_d") if part.n_tokens else 0.0)
            flat = _ratios(part, mode, lower, upper, era_16)
            r_min.append(float(np.min(flat)) if flat.size else 0.0)
            r_mean.append(float(np.mean(flat)) if flat.size else 0.0)
            r_max.append(float(np.max(flat)) if flat.size else 0.0)
        with np.errstate(all="ignore"):
            return {
                _DIFF + "mean": float(np.mean(diff_mean)),
                _DIFF + "max": float(np.max(diff_max)),
                _RATIO + "min": float(np.nanmin(r_min)) if not np.all(np.isnan(r_min)) else math.nan,
                _RATIO + "mean": float(np.nanmean(r_mean)) if not np.all(np.isnan(r_mean)) else math.nan,
                _RATIO + "max": float(np.nanmax(r_max)) if not np.all(np.isnan(r_max)) else math.nan,
            }

    return figures


def _figures(bound_settings: tuple[str, ...], bounds_text: str) -> tuple[Figure, ...]:
    ratio_settings = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode", *bound_settings)
    gate = ("vllm_importance_sampling_correction",)
    ratio = (
        "the importance-sampling ratio exp(Σ Δ) per sequence (sequence_* modes, every sequence of the "
        "process) or exp(Δ) per masked-in token (token_* modes), no clamp before exp, " + bounds_text
    )
    return (
        Figure(
            _DIFF + "mean",
            "mean over processes of each process's token mean of |trainer − rollout| logprob (0 for a process with no tokens)",
            also=("train/" + _DIFF + "mean",),
            settings=gate,
            source=_SOURCE,
        ),
        Figure(
            _DIFF + "max",
            "max over processes of each process's max |trainer − rollout| logprob over masked-in tokens",
            also=("train/" + _DIFF + "max",),
            settings=gate,
            same_as="logprob_abs_diff_max",
            source=_SOURCE,
        ),
        Figure(
            _RATIO + "min",
            f"min over processes (NaN-ignoring) of each process's min of {ratio}",
            also=("train/" + _RATIO + "min",),
            settings=ratio_settings,
            source=_SOURCE,
        ),
        Figure(
            _RATIO + "mean",
            f"mean over processes (NaN-ignoring) of each process's mean of {ratio}",
            also=("train/" + _RATIO + "mean",),
            settings=ratio_settings,
            source=_SOURCE,
        ),
        Figure(
            _RATIO + "max",
            f"max over processes (NaN-ignoring) of each process's max of {ratio}",
            also=("train/" + _RATIO + "max",),
            settings=ratio_settings,
            source=_SOURCE,
        ),
    )


_CAP = Era(
    since="0.26.0",
    commit="eb76389980509421a3de995865e09ffd44087163",
    date="2025-11-30",
    change="sequence-level and masking modes (vllm_importance_sampling_mode, default sequence_mask) with one cap",
    figures=_figures(
        ("vllm_importance_sampling_cap",),
        "*_truncate modes clamp it at vllm_importance_sampling_cap, *_mask modes set it to 0 above the cap",
    ),
    compute=_compute(era_16=False),
    defaults={
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "sequence_mask",
        "vllm_importance_sampling_cap": 3.0,
    },
)

_CLIP = Era(
    since="1.6.0",
    commit="0bef672084e4bb287aa41db8c0b007ad4df305ac",
    date="2026-06-11",
    change="two-sided bounds: vllm_importance_sampling_clip_min/clip_max (the cap a deprecated alias of clip_max)",
    figures=_figures(
        (
            "vllm_importance_sampling_clip_min",
            "vllm_importance_sampling_clip_max",
            "vllm_importance_sampling_cap",
        ),
        "*_truncate modes clamp it to [clip_min, clip_max], *_mask modes set it to 0 outside them "
        "(an unset bound does not bound; a set cap replaces clip_max)",
    ),
    compute=_compute(era_16=True),
    defaults={
        "vllm_importance_sampling_correction": True,
        "vllm_importance_sampling_mode": "sequence_mask",
        "vllm_importance_sampling_clip_min": None,
        "vllm_importance_sampling_clip_max": 3.0,
        "vllm_importance_sampling_cap": None,
    },
)

FRAMEWORK = Framework("trl", "huggingface/trl", (_CAP, _CLIP))
