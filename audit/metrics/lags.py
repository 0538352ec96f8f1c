"""Policy lag of a step and its figures sliced by lag (``kl_k3/lag_1``): what asynchronous RL is judged by.

A token's lag (its staleness) is the trainer's weight version minus the version that sampled it
(:mod:`audit.policy_lag`); with in-flight weight updates one sample's tokens carry several lags. The
step's staleness is reported two ways, since they differ exactly when long samples are staler:

* token-weighted, ``policy_lag_mean``: the mean over tokens whose lag is known (a long sample
  counts by its tokens, as a token-mean loss weighs it);
* sample-weighted, ``policy_lag_sample_mean``: the mean over samples of each sample's token-mean
  lag (a sequence-mean loss weighs every sample alike);

with ``policy_lag_sample_max_mean`` (the mean over samples of the lag of each one's oldest tokens,
the version that began it: how AReaL-style staleness bounds count a sample),
``mixed_version_sample_fraction`` (samples whose tokens were sampled by more than one version) and,
per lag, ``token_fraction/lag_L`` (the share of tokens with a known lag that are ``L`` behind). The
slices pool the tokens of each lag, as :mod:`audit.metrics.core` pools a step's.
"""

from __future__ import annotations

import numpy as np
from isoaudit.audit.metrics.core import check_inputs, per_sample_stats, pooled_figures
from isoaudit.audit.metrics.keys import LAG_SLICED, lag_key

#: The marker of a token whose policy lag is unknown (versions that are not integers, or absent).
UNKNOWN_LAG = -(2**62)

#: The staleness figures :func:`lag_metrics` adds beside ``policy_lag_{mean,max,min}`` and
#: ``off_policy_token_fraction``, with their one-line definitions.
STALENESS_DESCRIPTIONS: dict[str, str] = {
    "policy_lag_sample_mean": "mean over samples of each sample's mean token lag (sample-weighted staleness; "
    "policy_lag_mean is token-weighted)",
    "policy_lag_sample_max_mean": "mean over samples of each sample's max token lag: the staleness of the "
    "version that began it",
    "mixed_version_sample_fraction": "fraction of samples whose tokens were sampled by more than one weight "
    "version (in-flight updates)",
}


def lag_metrics(
    trainer_lp: np.ndarray, rollout_lp: np.ndarray, offsets: np.ndarray, token_lag: np.ndarray
) -> dict[str, float]:
    """Policy lag per step (``policy_lag_{mean,max,min}`` over tokens whose lag is known,
    ``off_policy_token_fraction`` of them with lag > 0, and :data:`STALENESS_DESCRIPTIONS` over the
    samples with a known lag), then :data:`LAG_SLICED` per lag as ``name/lag_L``: a sample counts
    toward each lag its tokens have. ``token_lag`` is int64 per token (the trainer's weight version
    minus the version that sampled it); -2**62 marks unknown."""
    t, r, o = check_inputs(trainer_lp, rollout_lp, offsets)
    lag = np.asarray(token_lag, dtype=np.int64)
    if lag.shape != t.shape:
        raise ValueError(f"token_lag: {lag.size} values for {t.size} tokens")
    known = lag != UNKNOWN_LAG
    out: dict[str, float] = {}
    if not known.any():
        return out
    known_lag = lag[known]
    out["policy_lag_mean"] = float(known_lag.mean())
    out["policy_lag_max"] = float(known_lag.max())
    out["policy_lag_min"] = float(known_lag.min())
    out["off_policy_token_fraction"] = float((known_lag > 0).mean())
    sample_of = np.repeat(np.arange(o.size - 1), np.diff(o))
    out.update(_per_sample_staleness(sample_of[known], known_lag))
    for value in np.unique(known_lag):
        pick = lag == value
        counts = np.bincount(sample_of[pick], minlength=o.size - 1)
        counts = counts[counts > 0]
        sliced = pooled_figures(
            per_sample_stats(t[pick], r[pick], np.r_[0, np.cumsum(counts)], 0.2), total_tokens=known_lag.size
        )
        for name in LAG_SLICED:
            out[lag_key(name, int(value))] = sliced[name]
    return out


def _per_sample_staleness(sample: np.ndarray, lag: np.ndarray) -> dict[str, float]:
    """:data:`STALENESS_DESCRIPTIONS` from the known tokens' sample indices (ascending) and lags."""
    starts = np.flatnonzero(np.r_[True, sample[1:] != sample[:-1]])
    counts = np.diff(np.r_[starts, sample.size])
    mean = np.add.reduceat(lag.astype(np.float64), starts) / counts
    oldest = np.maximum.reduceat(lag, starts)
    newest = np.minimum.reduceat(lag, starts)
    return {
        "policy_lag_sample_mean": float(mean.mean()),
        "policy_lag_sample_max_mean": float(oldest.mean()),
        "mixed_version_sample_fraction": float((oldest != newest).mean()),
    }
