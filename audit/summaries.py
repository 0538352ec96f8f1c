"""Per-step aggregates for the dashboard, computed once when the worker compares a step.

A page must never scan token arrays: a run of 1,000 steps x 256 samples x 1,024 tokens holds half a
billion logprobs. What the run page draws is therefore reduced here, at comparison time, to a few
hundred numbers per step and stored in ``step_summaries``:

* |Δ logprob| per **response-position bin**, mean and max, and the sample holding each bin's max (so
  a click on a heatmap cell opens that sample). The bin edges are fixed (:data:`POSITION_BIN_EDGES`)
  so every step's bins line up whatever its lengths: 16 tokens wide up to 256, then coarser.
* how many samples first diverge in each **region**, with one example sample per region;
* the **diagnosis** counts of the step's compared samples;
* when the step's latest record arrived (to place manifest changes, e.g. a remediation switch, on
  the step axis);
* for an MoE model, the **routing** agreement per layer (:func:`audit.routing.step_routing`): the
  run page's layer x step heatmap of routing flips.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import numpy as np
from isoaudit.audit.records import SampleLogprobs


def _edges() -> np.ndarray:
    """Bin starts: width 16 to 256, 64 to 1,024, 256 to 4,096, 1,024 to 16,384, 4,096 to 65,536,
    then one open-ended bin."""
    parts = [np.arange(0, 256, 16)]
    for start, stop, width in ((256, 1024, 64), (1024, 4096, 256), (4096, 16384, 1024), (16384, 65536, 4096)):
        parts.append(np.arange(start, stop, width))
    parts.append(np.array([65536]))
    return np.concatenate(parts).astype(np.int64)


#: Start (inclusive) of each response-position bin; bin i covers [edges[i], edges[i + 1]).
POSITION_BIN_EDGES: np.ndarray = _edges()


def bin_label(index: int) -> str:
    """``"0–15"``, ``"256–319"``, ``"65536+"``: the positions bin ``index`` covers."""
    start = int(POSITION_BIN_EDGES[index])
    if index + 1 >= POSITION_BIN_EDGES.size:
        return f"{start}+"
    return f"{start}–{int(POSITION_BIN_EDGES[index + 1]) - 1}"


@dataclass(frozen=True)
class Verdict:
    """What the step summary needs of one compared sample."""

    sample_key: str
    diagnosis: str
    first_region: str | None


def position_bins(pairs: Sequence[tuple[SampleLogprobs, SampleLogprobs]]) -> dict[str, list[Any]]:
    """|Δ logprob| per response-position bin over all tokens of ``pairs``: ``count`` (finite tokens),
    ``mean``, ``max`` and ``max_key`` (the sample holding the max) per bin, up to the last bin any
    sample reaches. Non-finite Δ (a -inf logprob) is left out; an empty bin has ``None``."""
    lengths = np.array([t.logprobs.size for t, _ in pairs], dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return {"count": [], "mean": [], "max": [], "max_key": []}
    trainer = np.concatenate([t.logprobs for t, _ in pairs]).astype(np.float64)
    rollout = np.concatenate([r.logprobs for _, r in pairs]).astype(np.float64)
    with np.errstate(invalid="ignore"):
        delta = np.abs(trainer - rollout)
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = np.arange(total, dtype=np.int64) - starts
    owner = np.repeat(np.arange(lengths.size), lengths)
    bins = np.searchsorted(POSITION_BIN_EDGES, positions, side="right") - 1
    n_bins = int(bins.max()) + 1
    finite = np.isfinite(delta)
    bins, delta, owner = bins[finite], delta[finite], owner[finite]
    count = np.bincount(bins, minlength=n_bins)
    sums = np.bincount(bins, weights=delta, minlength=n_bins)
    maxima, max_key = _bin_maxima(bins, delta, owner, n_bins, [t.sample_key for t, _ in pairs])
    means = [float(s / c) if c else None for s, c in zip(sums, count, strict=True)]
    return {"count": count.tolist(), "mean": means, "max": maxima, "max_key": max_key}


def _bin_maxima(
    bins: np.ndarray, delta: np.ndarray, owner: np.ndarray, n_bins: int, keys: list[str | None]
) -> tuple[list[float | None], list[str | None]]:
    """Each bin's largest |Δ| and the sample holding it (of tied samples, the last), in linear time:
    a sample's tokens fill its bins in runs, so each run's maximum is one ``reduceat``, and a bin's
    is the largest of its runs'."""
    maxima: list[float | None] = [None] * n_bins
    max_key: list[str | None] = [None] * n_bins
    if not bins.size:
        return maxima, max_key
    runs = np.flatnonzero(np.r_[True, (bins[1:] != bins[:-1]) | (owner[1:] != owner[:-1])])
    run_max, run_bin, run_owner = np.maximum.reduceat(delta, runs), bins[runs], owner[runs]
    best = np.full(n_bins, -np.inf)
    np.maximum.at(best, run_bin, run_max)
    holds = run_max == best[run_bin]
    winner = np.full(n_bins, -1, dtype=np.int64)
    np.maximum.at(winner, run_bin[holds], run_owner[holds])
    for b in np.flatnonzero(winner >= 0):
        maxima[b], max_key[b] = float(best[b]), keys[int(winner[b])]
    return maxima, max_key


def first_divergence_counts(outcomes: Sequence[Verdict]) -> dict[str, dict[str, Any]]:
    """{region: {"count", "example"}} over the samples whose first divergence lies in that region."""
    found: dict[str, dict[str, Any]] = {}
    for outcome in sorted(outcomes, key=lambda o: o.sample_key):
        if outcome.first_region is None:
            continue
        entry = found.setdefault(outcome.first_region, {"count": 0, "example": outcome.sample_key})
        entry["count"] += 1
    return found


@dataclass(frozen=True)
class StepFacts:
    """What the store knows of a step besides the pairs compared now: the stored verdicts of its
    samples, how many samples have fingerprints, when its latest sample arrived."""

    verdicts: list[Verdict]
    fingerprinted: int
    ingested_at: datetime | None


@dataclass(frozen=True)
class StepSummary:
    """One compared step as the dashboard draws it (the ``step_summaries`` row)."""

    run_id: str
    step: int
    n_samples: int
    n_tokens: int
    #: {"count", "mean", "max", "max_key"}: one entry per bin of :data:`POSITION_BIN_EDGES`
    position_bins: dict[str, list[Any]]
    #: {region label: {"count": n, "example": sample_key}}
    first_divergence: dict[str, dict[str, Any]]
    n_fingerprinted: int
    #: {diagnosis kind: number of samples}
    diagnoses: dict[str, int]
    ingested_at: datetime | None
    #: audit.routing.step_routing (None for a dense model)
    routing: dict[str, Any] | None


def summarize(
    run_id: str,
    step: int,
    pairs: Sequence[tuple[SampleLogprobs, SampleLogprobs]],
    verdicts: Sequence[Verdict],
    facts: StepFacts,
    routing: dict[str, Any] | None,
) -> StepSummary:
    """The summary of a step: ``pairs`` are all its samples stored on both sides (in step order),
    ``verdicts`` every compared sample's, ``routing`` the step's routing aggregate."""
    return StepSummary(
        run_id=run_id,
        step=step,
        n_samples=len(pairs),
        n_tokens=int(sum(t.logprobs.size for t, _ in pairs)),
        position_bins=position_bins(pairs),
        first_divergence=first_divergence_counts(verdicts),
        n_fingerprinted=int(facts.fingerprinted or 0),
        diagnoses=dict(sorted(Counter(v.diagnosis for v in verdicts).items())),
        ingested_at=facts.ingested_at,
        routing=routing,
    )
