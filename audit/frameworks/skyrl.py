"""SkyRL (NovaSky-AI/SkyRL): the rollout–trainer logprob figures its trainer logs after the policy's
forward pass over the whole training batch (``RayPPOTrainer.fwd_logprobs_values_reward``), token-wise
over the batch's loss-masked response tokens, ``torch.std`` (ddof=1) for the std.

Releases: the ``skyrl-train`` package (``skyrl_train-v*`` tags) up to 0.4.0, then the ``skyrl``
package from 0.1.0 (March 2026), whose numbers restart. A ``skyrl-train`` release is declared with
the local label ``+train`` (``skyrl==0.4.0+train``); a plain version is the ``skyrl`` package.
"""

from __future__ import annotations

import numpy as np
from isoaudit.audit.frameworks.base import (
    Era,
    Figure,
    Framework,
    Settings,
    StepTokens,
    parse_version,
    sample_std,
    token_mean,
)
from packaging.version import Version

_SOURCE = "skyrl/train/trainer.py:RayPPOTrainer.fwd_logprobs_values_reward"
_SOURCE_TRAIN = "skyrl-train/skyrl_train/trainer.py:RayPPOTrainer.fwd_logprobs_values_reward"
_P = "policy/"
_TRAIN = "train"  # the local label of a skyrl-train release


def _prob_diff(tokens: StepTokens, settings: Settings) -> dict[str, float]:
    ratio = np.abs(np.exp(-tokens.delta))  # exp(rollout − trainer)
    return {
        _P + "rollout_train_prob_diff_mean": token_mean(ratio),
        _P + "rollout_train_prob_diff_std": sample_std(ratio),
    }


def _abs_diff(tokens: StepTokens, settings: Settings) -> dict[str, float]:
    diff = np.abs(tokens.delta)
    return {
        _P + "rollout_train_logprobs_abs_diff_mean": token_mean(diff),
        _P + "rollout_train_logprobs_abs_diff_std": sample_std(diff),
    }


def _abs_diff_range(tokens: StepTokens, settings: Settings) -> dict[str, float]:
    diff = np.abs(tokens.delta)
    if diff.size == 0:
        return {}
    return {
        **_abs_diff(tokens, settings),
        _P + "rollout_train_logprobs_abs_diff_max": float(np.max(diff)),
        _P + "rollout_train_logprobs_abs_diff_min": float(np.min(diff)),
    }


def _fig(name: str, definition: str, source: str, same_as: str | None = None) -> Figure:
    return Figure(_P + name, definition, same_as=same_as, source=source)


_MEAN = "token mean of |rollout − trainer| logprob over the batch's loss-masked tokens"
_STD = "sample std (torch.std, ddof=1) of |rollout − trainer| logprob over the batch's loss-masked tokens"


def _abs_figures(source: str) -> tuple[Figure, ...]:
    return (
        _fig("rollout_train_logprobs_abs_diff_mean", _MEAN, source, "logprob_abs_diff_mean"),
        _fig("rollout_train_logprobs_abs_diff_std", _STD, source),
    )


_ERAS = (
    Era(
        since=f"0.2.0+{_TRAIN}",
        commit="81f2973f591df96353416051e679d1ef95b928fc",
        date="2025-08-14",
        change="skyrl-train: the rollout/trainer probability ratio exp(rollout − trainer), mean and std",
        figures=(
            _fig(
                "rollout_train_prob_diff_mean",
                "token mean of exp(rollout − trainer logprob) (a probability ratio, not a difference) over loss-masked tokens",
                _SOURCE_TRAIN,
            ),
            _fig(
                "rollout_train_prob_diff_std",
                "sample std (ddof=1) of exp(rollout − trainer logprob) over loss-masked tokens",
                _SOURCE_TRAIN,
            ),
        ),
        compute=_prob_diff,
    ),
    Era(
        since=f"0.4.0+{_TRAIN}",
        commit="b89e1199550d54d0761b6408589300df0a8faf28",
        date="2026-01-21",
        change="skyrl-train: |rollout − trainer| logprob replaces the probability ratio (renamed abs_diff)",
        figures=_abs_figures(_SOURCE_TRAIN),
        compute=_abs_diff,
    ),
    Era(
        since="0.1.0",
        commit="b89e1199550d54d0761b6408589300df0a8faf28",
        date="2026-01-21",
        change="the skyrl package (renamed from skyrl-train): figures as skyrl-train 0.4.0",
        figures=_abs_figures(_SOURCE),
        compute=_abs_diff,
    ),
    Era(
        since="0.3.0",
        commit="18f0ac7d7576a061be643c0b775621a8d4f6b547",
        date="2026-05-27",
        change="adds the max and min of |rollout − trainer| (none logged for a batch without tokens)",
        figures=(
            *_abs_figures(_SOURCE),
            _fig(
                "rollout_train_logprobs_abs_diff_max",
                "max of |rollout − trainer| logprob over the batch's loss-masked tokens",
                _SOURCE,
                "logprob_abs_diff_max",
            ),
            _fig(
                "rollout_train_logprobs_abs_diff_min",
                "min of |rollout − trainer| logprob over the batch's loss-masked tokens",
                _SOURCE,
            ),
        ),
        compute=_abs_diff_range,
    ),
)


class _SkyRL(Framework):
    """SkyRL's two release lines: ``skyrl-train`` (declared ``X.Y.Z+train``) and ``skyrl``."""

    def era(self, version: str | None = None) -> Era:
        if version is None:
            return self.head
        wanted = parse_version(version, f"{self.name} version")
        line = [e for e in self.eras if (Version(e.since).local == _TRAIN) == (wanted.local == _TRAIN)]
        precision = len(wanted.release)
        chosen: Era | None = None
        for era in line:
            if era.released and Version(era.since).release[:precision] <= wanted.release:
                chosen = era
        if chosen is None:
            package = "skyrl-train" if wanted.local == _TRAIN else "skyrl"
            raise ValueError(
                f"framework: {package} {version} is older than the oldest release isoaudit covers "
                f"({line[0].since})"
            )
        return chosen


FRAMEWORK = _SkyRL("skyrl", "NovaSky-AI/SkyRL", _ERAS)
