"""Policy lag of a step and its figures sliced by lag (``kl_k3/lag_1``): what asynchronous RL is judged by.

A token's lag is the trainer's weight version minus the version that sampled it
(:mod:`audit.policy_lag`); the slices pool the tokens of each lag, as :mod:`audit.metrics.core`
pools a step's.
"""

from __future__ import annotations

import numpy as np
from isoaudit.audit.metrics.core import check_inputs, per_sample_stats, pooled_figures
from isoaudit.audit.metrics.keys import LAG_SLICED, lag_key

#: The marker of a token whose policy lag is unknown (versions that are not integers, or absent).
UNKNOWN_LAG = -(2**62)


def lag_metrics(
    trainer_lp: np.ndarray, rollout_lp: np.ndarray, offsets: np.ndarray, token_lag: np.ndarray
) -> dict[str, float]:
    """Policy lag per step (``policy_lag_{mean,max,min}`` over tokens whose lag is known, and
    ``off_policy_token_fraction`` of them with lag > 0), then :data:`LAG_SLICED` per lag as
    ``name/lag_L``: a sample counts toward each lag its tokens have. ``token_lag`` is int64 per token
    (the trainer's weight version minus the version that sampled it); -2**62 marks unknown."""
    t, r, o = check_inputs(trainer_lp, rollout_lp, offsets)
    lag = np.asarray(token_lag, dtype=np.int64)
    if lag.shape != t.shape:
        raise ValueError(f"token_lag: {lag.size} values for {t.size} tokens")
    known = lag != UNKNOWN_LAG
    out: dict[str, float] = {}
    if not known.any():
        return out
    out["policy_lag_mean"] = float(lag[known].mean())
    out["policy_lag_max"] = float(lag[known].max())
    out["policy_lag_min"] = float(lag[known].min())
    out["off_policy_token_fraction"] = float((lag[known] > 0).mean())
    sample_of = np.repeat(np.arange(o.size - 1), np.diff(o))
    for value in np.unique(lag[known]):
        pick = lag == value
        counts = np.bincount(sample_of[pick], minlength=o.size - 1)
        counts = counts[counts > 0]
        sliced = pooled_figures(per_sample_stats(t[pick], r[pick], np.r_[0, np.cumsum(counts)], 0.2))
        for name in LAG_SLICED:
            out[lag_key(name, int(value))] = sliced[name]
    return out
