"""Tinker (thinking-machines-lab/tinker-cookbook): the sampler–trainer KL estimates its RL loop logs
(``tinker_cookbook/rl/metrics.py: compute_kl_sample_train``), pooled over the action tokens of
every datum of the batch."""

from __future__ import annotations

from isoaudit.audit.frameworks.base import Era, Figure, Framework, Settings, StepTokens

_SOURCE = "tinker_cookbook/rl/metrics.py:compute_kl_sample_train"


def _figures(tokens: StepTokens, settings: Settings) -> dict[str, float]:
    # sampling − training is −Δ: its sum is −ΣΔ and its square Δ², exactly
    return {
        "kl_sample_train_v1": -tokens.mean_of("d"),
        "kl_sample_train_v2": 0.5 * tokens.mean_of("d_sq"),
        "entropy": -tokens.mean_of("r"),
    }


_ERA = Era(
    since="0.1.0",
    commit="f77a8a3fbfa2bc86b73fcbc1aef2491995b6b68d",
    date="2025-09-30",
    change="first release (compute_kl_sample_train unchanged since the first commit)",
    figures=(
        Figure(
            "kl_sample_train_v1",
            "token mean of (sampling − training) logprob over action tokens (k1)",
            also=("optim/kl_sample_train_v1",),
            same_as="kl_k1",
            source=_SOURCE,
        ),
        Figure(
            "kl_sample_train_v2",
            "half the token mean of the squared logprob difference (k2)",
            also=("optim/kl_sample_train_v2",),
            same_as="kl_k2",
            source=_SOURCE,
        ),
        Figure(
            "entropy",
            "minus the token mean of the sampling logprobs (the sampler's entropy estimate)",
            also=("optim/entropy",),
            source=_SOURCE,
        ),
    ),
    compute=_figures,
)

FRAMEWORK = Framework("tinker", "thinking-machines-lab/tinker-cookbook", (_ERA,))
