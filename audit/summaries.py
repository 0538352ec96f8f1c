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


#: The reductions :func:`position_bins_of` reads from a step's blocks (audit.metrics.blocks).
POSITION_REDUCTIONS: tuple[tuple[tuple[str, tuple[int, ...]], str], ...] = tuple(
    ((how, tuple(int(e) for e in POSITION_BIN_EDGES)), "abs_d") for how in ("segment_sum", "segment_max")
)


def position_bins(pairs: Sequence[tuple[SampleLogprobs, SampleLogprobs]]) -> dict[str, list[Any]]:
    """|Δ logprob| per response-position bin over all tokens of ``pairs``: ``count`` (finite tokens),
    ``mean``, ``max`` and ``max_key`` (the sample holding the max) per bin, up to the last bin any
    sample reaches. Non-finite Δ (a -inf logprob) is left out; an empty bin has ``None``.

    Each sample's tokens fill its bins in runs (segments: a sample's part of one bin), found from
    the samples' lengths and the bin edges alone; with every Δ finite, a bin's count is the sum of
    its segments' lengths, its sum that of its segments' sums (each a ``reduceat`` over its tokens,
    the segments then in token order) and its maximum the largest of its segments'."""
    lengths = np.array([t.logprobs.size for t, _ in pairs], dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return {"count": [], "mean": [], "max": [], "max_key": []}
    with np.errstate(invalid="ignore"):  # float64 arithmetic, as (t - r) of the widened arrays
        delta = np.subtract(
            np.concatenate([t.logprobs for t, _ in pairs]),
            np.concatenate([r.logprobs for _, r in pairs]),
            dtype=np.float64,
        )
    np.abs(delta, out=delta)
    seg_bin, seg_sample, seg_start, seg_len = _segments(lengths)
    keys = [t.sample_key for t, _ in pairs]
    finite = np.isfinite(delta)
    if finite.all():
        segment_sums = np.add.reduceat(delta, seg_start)
        return _binned(
            seg_bin, seg_sample, seg_len, segment_sums, np.maximum.reduceat(delta, seg_start), keys
        )
    n_bins = int(seg_bin.max()) + 1
    owner = np.repeat(seg_sample, seg_len)[finite]
    bins = np.repeat(seg_bin, seg_len)[finite]
    delta = delta[finite]
    count = np.bincount(bins, minlength=n_bins)
    sums = np.bincount(bins, weights=delta, minlength=n_bins)
    runs = _runs(bins, delta, owner)
    maxima, max_key = _bin_maxima(*runs, n_bins, keys)
    means = [float(s / c) if c else None for s, c in zip(sums, count, strict=True)]
    return {"count": count.tolist(), "mean": means, "max": maxima, "max_key": max_key}


def position_bins_of(
    lengths: np.ndarray, segment_sums: np.ndarray, segment_maxima: np.ndarray, keys: list[str | None]
) -> dict[str, list[Any]]:
    """:func:`position_bins` of a step whose every Δ is finite, from its samples' ``lengths`` and
    each segment's sum and maximum of |Δ| (the blocks' :data:`POSITION_REDUCTIONS`)."""
    if int(lengths.sum()) == 0:
        return {"count": [], "mean": [], "max": [], "max_key": []}
    seg_bin, seg_sample, _, seg_len = _segments(lengths)
    return _binned(seg_bin, seg_sample, seg_len, segment_sums, segment_maxima, keys)


def _binned(
    seg_bin: np.ndarray,
    seg_sample: np.ndarray,
    seg_len: np.ndarray,
    seg_sum: np.ndarray,
    seg_max: np.ndarray,
    keys: list[str | None],
) -> dict[str, list[Any]]:
    """The bins of every token finite, from their segments' lengths, sums and maxima."""
    n_bins = int(seg_bin.max()) + 1
    count = np.bincount(seg_bin, weights=seg_len, minlength=n_bins).astype(np.int64)
    sums = np.bincount(seg_bin, weights=seg_sum, minlength=n_bins)
    maxima, max_key = _bin_maxima(seg_max, seg_bin, seg_sample, n_bins, keys)
    means = [float(s / c) if c else None for s, c in zip(sums, count, strict=True)]
    return {"count": count.tolist(), "mean": means, "max": maxima, "max_key": max_key}


def _segments(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The samples' tokens cut at the bin edges, in token order: each segment's bin, sample, first
    token (in the concatenated tokens) and length."""
    reached = np.where(lengths > 0, np.searchsorted(POSITION_BIN_EDGES, lengths - 1, side="right"), 0)
    firsts = np.cumsum(reached) - reached
    seg_sample = np.repeat(np.arange(lengths.size), reached)
    seg_bin = np.arange(int(reached.sum())) - np.repeat(firsts, reached)
    ends = np.append(POSITION_BIN_EDGES[1:], np.iinfo(np.int64).max)
    low = POSITION_BIN_EDGES[seg_bin]
    high = np.minimum(ends[seg_bin], lengths[seg_sample])
    seg_start = (np.cumsum(lengths) - lengths)[seg_sample] + low
    return seg_bin, seg_sample, seg_start, high - low


def _runs(
    bins: np.ndarray, delta: np.ndarray, owner: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(maximum, bin, sample) of each run of tokens of one sample in one bin."""
    runs = np.flatnonzero(np.r_[True, (bins[1:] != bins[:-1]) | (owner[1:] != owner[:-1])])
    return np.maximum.reduceat(delta, runs), bins[runs], owner[runs]


def _bin_maxima(
    run_max: np.ndarray, run_bin: np.ndarray, run_owner: np.ndarray, n_bins: int, keys: list[str | None]
) -> tuple[list[float | None], list[str | None]]:
    """Each bin's largest |Δ| and the sample holding it (of tied samples, the last), from the runs'
    maxima: a bin's is the largest of its runs'."""
    maxima: list[float | None] = [None] * n_bins
    max_key: list[str | None] = [None] * n_bins
    if not run_max.size:
        return maxima, max_key
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
    bins: dict[str, list[Any]] | None = None,
) -> StepSummary:
    """The summary of a step: ``pairs`` are all its samples stored on both sides (in step order),
    ``verdicts`` every compared sample's, ``routing`` the step's routing aggregate; ``bins`` its
    :func:`position_bins` when measured already."""
    return StepSummary(
        run_id=run_id,
        step=step,
        n_samples=len(pairs),
        n_tokens=int(sum(t.logprobs.size for t, _ in pairs)),
        position_bins=position_bins(pairs) if bins is None else bins,
        first_divergence=first_divergence_counts(verdicts),
        n_fingerprinted=int(facts.fingerprinted or 0),
        diagnoses=dict(sorted(Counter(v.diagnosis for v in verdicts).items())),
        ingested_at=facts.ingested_at,
        routing=routing,
    )
