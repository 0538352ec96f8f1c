"""Policy lag: how many weight versions behind the trainer each sampled token is.

Asynchronous RL samples with older weights on purpose, and with in-flight weight updates one sequence
spans several versions (``SampleLogprobs.weight_spans``). Lag needs an order, so it is measured where
weight versions are integers (steps); elsewhere it is unknown, never zero.
"""

from __future__ import annotations

import numpy as np
from isoaudit.audit.metrics import UNKNOWN_LAG
from isoaudit.audit.records import SampleLogprobs


def version_number(version: str | None) -> int | None:
    """A weight version as an integer step, when it is one."""
    if version is None:
        return None
    try:
        return int(version)
    except ValueError:
        return None


def sampling_versions(rollout: SampleLogprobs) -> list[tuple[int, int, str | None]]:
    """(start, end, version) of each span of the rollout's completion tokens."""
    n = rollout.logprobs.size
    spans: list[tuple[int, str | None]] = [
        (span.start, span.version) for span in rollout.weight_spans or []
    ] or [(0, rollout.weight_version)]
    ends = [start for start, _ in spans[1:]] + [n]
    return [(start, end, version) for (start, version), end in zip(spans, ends, strict=True)]


def token_lags(trainer: SampleLogprobs, rollout: SampleLogprobs) -> np.ndarray:
    """Per completion token: the trainer's weight version minus the version that sampled it
    (int64; UNKNOWN_LAG where either version is missing or not an integer)."""
    lags = np.full(rollout.logprobs.size, UNKNOWN_LAG, dtype=np.int64)
    trained = version_number(trainer.weight_version)
    if trained is None:
        return lags
    for start, end, version in sampling_versions(rollout):
        sampled = version_number(version)
        if sampled is not None:
            lags[start:end] = trained - sampled
    return lags
