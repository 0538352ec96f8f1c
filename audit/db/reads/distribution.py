"""One sample's full-distribution comparison per position, for its page: where the two sides'
distributions part (:mod:`isoaudit.audit.distribution`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from isoaudit.audit.db.store import Store
from isoaudit.audit.distribution import position_distances


@dataclass(frozen=True)
class SampleDistribution:
    """Per completion position (index i is completion token i): the top-k comparison, TV and KL on
    the union, the sketch's Hellinger estimate (NaN without sketches), and the two flags."""

    prompt_len: int
    k: int
    overlap: np.ndarray
    rank_agreement: np.ndarray
    tv: np.ndarray
    kl: np.ndarray
    hellinger: np.ndarray
    sampled_equal: np.ndarray
    differs: np.ndarray


def sample_distribution(store: Store, run_id: str, step: int, sample_key: str) -> SampleDistribution | None:
    """Both sides' distributions of one sample compared per position (None when a side is not
    stored or recorded no top-k): reads that sample's two records only."""
    trainer, rollout = store.sample_pair(run_id, step, sample_key)
    if trainer is None or rollout is None:
        return None
    found = position_distances(trainer, rollout)
    if found is None:
        return None
    return SampleDistribution(
        prompt_len=trainer.prompt_len,
        k=found.k,
        overlap=found.overlap,
        rank_agreement=found.rank_agreement,
        tv=found.tv,
        kl=found.kl,
        hellinger=found.hellinger,
        sampled_equal=found.sampled_equal,
        differs=found.differs,
    )
