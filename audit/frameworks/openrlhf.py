"""OpenRLHF (OpenRLHF/OpenRLHF): the one train–rollout mismatch figure its PPO actor logs, ``vllm_kl``
(``openrlhf/models/loss.py: PolicyLoss.forward``), and how its trainer reduces it over processes
(``openrlhf/trainer/ray/ppo_actor.py: ppo_train``).

``vllm_kl`` exists only with the vLLM importance-sampling correction on and the PPO policy loss
(GSPO logs none); its value does not depend on the correction's type or thresholds. OpenRLHF's
``old_log_probs`` are the trainer's logprobs of the sampled tokens before the update, its
``rollout_log_probs`` vLLM's."""

from __future__ import annotations

import numpy as np
from isoaudit.audit.frameworks.base import Era, Figure, Framework, Settings, StepTokens

_SOURCE = "openrlhf/models/loss.py:PolicyLoss.forward"
_ALSO = ("train/vllm_kl",)


def _logged(settings: Settings, enable: str, loss_type: str) -> bool:
    """Whether ``PolicyLoss`` returns a ``vllm_kl`` under these settings."""
    return bool(settings.get(enable)) and settings.get(loss_type) == "ppo"


def _rank_means(tokens: StepTokens) -> dict[str, float]:
    """Each process's token mean of (rollout − trainer), then their plain mean: ``ppo_train``
    all-reduces each process's ``status`` with op="mean"."""
    parts = tokens.per_rank()
    return {"vllm_kl": float(np.mean([-p.mean_of("d") for p in parts]))}


def _token_weighted(tokens: StepTokens) -> dict[str, float]:
    """Each process's token mean weighted by its action tokens over all processes: the global
    token mean of (rollout − trainer)."""
    return {"vllm_kl": -tokens.mean_of("d")}


def _flat_settings(tokens: StepTokens, settings: Settings) -> dict[str, float]:
    if not _logged(settings, "enable_vllm_is_correction", "policy_loss_type"):
        return {}
    return _rank_means(tokens)


def _flat_settings_weighted(tokens: StepTokens, settings: Settings) -> dict[str, float]:
    if not _logged(settings, "enable_vllm_is_correction", "policy_loss_type"):
        return {}
    return _token_weighted(tokens)


def _dotted_settings(tokens: StepTokens, settings: Settings) -> dict[str, float]:
    if not _logged(settings, "algo.advantage.is_correction_enable", "actor.policy_loss_type"):
        return {}
    return _token_weighted(tokens)


def _figure(definition: str, settings: tuple[str, ...], same_as: str | None = None) -> Figure:
    return Figure("vllm_kl", definition, also=_ALSO, settings=settings, same_as=same_as, source=_SOURCE)


_FLAT = ("enable_vllm_is_correction", "policy_loss_type")
_DOTTED = ("algo.advantage.is_correction_enable", "actor.policy_loss_type")

ERAS = (
    Era(
        since="0.8.9",
        commit="756087acdf2cd49e13540fd3501c5b5a618bacdc",
        date="2025-08-06",
        change="vllm_kl logged with the vLLM off-policy correction (--enable_vllm_is_correction)",
        figures=(
            _figure(
                "token mean of (rollout − trainer) logprob over each process's action tokens, then the "
                "mean over processes (only with enable_vllm_is_correction and policy_loss_type ppo)",
                _FLAT,
            ),
        ),
        compute=_flat_settings,
        defaults={"enable_vllm_is_correction": False, "policy_loss_type": "ppo"},
    ),
    Era(
        since="0.9.8",
        commit="9c5d2600263a7a2b48784e1dd508f5e53ced5cea",
        date="2026-03-25",
        change="scalar metrics reduced over processes weighted by their action tokens (a global token mean)",
        figures=(
            _figure(
                "token mean of (rollout − trainer) logprob over all action tokens of the step (only with "
                "enable_vllm_is_correction and policy_loss_type ppo)",
                _FLAT,
                same_as="kl_k1",
            ),
        ),
        compute=_flat_settings_weighted,
        defaults={"enable_vllm_is_correction": False, "policy_loss_type": "ppo"},
    ),
    Era(
        since="0.10.2",
        commit="ed62d0e20dea08397251eba5e010ee9dabc4d048",
        date="2026-04-19",
        change="settings renamed to the dotted config hierarchy (algo.advantage.is_correction_enable, "
        "actor.policy_loss_type)",
        figures=(
            _figure(
                "token mean of (rollout − trainer) logprob over all action tokens of the step (only with "
                "algo.advantage.is_correction_enable and actor.policy_loss_type ppo)",
                _DOTTED,
                same_as="kl_k1",
            ),
        ),
        compute=_dotted_settings,
        defaults={"algo.advantage.is_correction_enable": False, "actor.policy_loss_type": "ppo"},
    ),
)

FRAMEWORK = Framework("openrlhf", "OpenRLHF/OpenRLHF", ERAS)
