"""The comparator: from both sides' records of a sample to token deltas, the region x position grid
(:mod:`isoaudit.audit.grid`), its first divergence and the diagnosis, and from a step's samples to
its outcome (DESIGN.md, "Comparator")."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from isoaudit.audit.diagnosis import Diagnosis, diagnose
from isoaudit.audit.distribution import distribution_metrics, step_distribution_metrics
from isoaudit.audit.distribution import explain as explain_distribution
from isoaudit.audit.environment import EVIDENCE_KEY as CHANGES
from isoaudit.audit.frameworks import Declaration, StepTokens, framework_figures
from isoaudit.audit.frameworks.base import STANDARD as FRAMEWORK_REDUCTIONS
from isoaudit.audit.grid import Cell, RegionGrid, compare_fingerprints
from isoaudit.audit.metric_names import required_variants
from isoaudit.audit.metrics import (
    UNKNOWN_LAG,
    lag_metrics,
    sample_and_step_metrics,
    sample_metrics,
    step_metrics,
    topk_entropy,
)
from isoaudit.audit.metrics.blocks import TokenBlocks, idle_threads
from isoaudit.audit.policy_lag import token_lags, version_number
from isoaudit.audit.records import Manifest, OffPolicy, RegionFingerprints, SampleLogprobs
from isoaudit.audit.regions import parse_region_key, region_order
from isoaudit.audit.routing import (
    RoutingComparison,
    compare_sample_routes,
    explain,
    step_routing,
    step_routing_metrics,
)
from isoaudit.audit.summaries import (
    POSITION_REDUCTIONS,
    StepFacts,
    StepSummary,
    Verdict,
    position_bins_of,
    summarize,
)


@dataclass
class SampleComparison:
    run_id: str
    step: int
    sample_key: str
    metrics: dict[str, Any]
    grid: RegionGrid | None
    diagnosis: Diagnosis
    routing: RoutingComparison | None = None
    #: The step figures computed in the same pass as this sample's metrics (shared by the step's samples).
    step_figures: StepFigures | None = field(default=None, repr=False, compare=False)

    @property
    def first_divergence(self) -> Cell | None:
        return self.grid.first_divergence if self.grid is not None else None

    def result_row(self) -> dict[str, Any]:
        """The ``sample_results`` row of this comparison."""
        first = self.first_divergence
        return {
            "run_id": self.run_id,
            "step": self.step,
            "sample_key": self.sample_key,
            "n_tokens": int(self.metrics["n_tokens"]),
            "metrics": _json_floats(self.metrics),
            "diagnosis": self.diagnosis.kind,
            "diagnosis_detail": self.diagnosis.as_dict(),
            "first_divergence_region": first[0] if first else None,
            "first_divergence_position": first[1] if first else None,
            "grid": self.grid.to_json() if self.grid is not None else {},
        }


def _json_floats(values: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN/inf: store them as None (and ints as ints). ``math.isfinite``, not numpy's:
    a step's results hold tens of thousands of scalars, and numpy's per-call cost was most of it."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        kind = type(value)
        if kind is float:  # the usual case, first
            out[key] = value if math.isfinite(value) else None
            continue
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, float) and not math.isfinite(value):
            value = None
        out[key] = value
    return out


def _offsets(lengths: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


def check_pair(trainer: SampleLogprobs, rollout: SampleLogprobs) -> None:
    """Both records must describe the same sampled tokens; anything else is a pairing bug upstream."""
    if trainer.sample_key != rollout.sample_key:
        raise ValueError(f"sample_key: trainer {trainer.sample_key} != rollout {rollout.sample_key}")
    if trainer.prompt_len != rollout.prompt_len or not np.array_equal(trainer.token_ids, rollout.token_ids):
        raise ValueError(f"token_ids: the two sides of sample {trainer.sample_key} hold different tokens")


def _entropies(samples: Sequence[SampleLogprobs]) -> np.ndarray | None:
    """Per-token top-k entropy of one side's samples, NaN where a sample recorded no top-k."""
    if all(s.topk_logprobs is None for s in samples):
        return None
    return np.concatenate(
        [
            topk_entropy(s.topk_logprobs) if s.topk_logprobs is not None else np.full(s.logprobs.size, np.nan)
            for s in samples
        ]
    )


Pair = tuple[SampleLogprobs, SampleLogprobs]
#: Both sides' fingerprint records of each fingerprinted sample, by sample_key.
Fingerprints = dict[str, tuple[Sequence[RegionFingerprints], Sequence[RegionFingerprints]]]


@dataclass(frozen=True)
class ComparedPrints:
    """Fingerprint records by sample_key with each key's grid already compared (the worker does it
    on the thread that reads them, beside the token pass): :func:`compare_samples` takes the grids
    as they are."""

    records: Fingerprints
    grids: dict[str, RegionGrid | None]

    @classmethod
    def of(cls, records: Fingerprints) -> ComparedPrints:
        """The records with their grids; a key whose grid fails is left to :func:`compare_samples`,
        which raises for its step (so that one bad step fails alone, as without)."""
        grids: dict[str, RegionGrid | None] = {}
        for key, sides in records.items():
            try:
                grids[key] = compare_fingerprints(*sides)
            except Exception:  # noqa: BLE001, S112 — compared again, and raised, on the comparison's path
                continue
        return cls(records, grids)


def in_step_order(pairs: Sequence[Pair]) -> list[Pair]:
    """A step's pairs by sample_key: the order its figures are summed in, so that they do not depend
    on the order a caller happens to hold the samples in (float sums do)."""
    return sorted(pairs, key=lambda pair: pair[0].sample_key or "")


@dataclass(frozen=True)
class StepFigures:
    """The step metrics of ``pairs`` (in :func:`in_step_order`), computed in the same pass over the
    tokens as their per-sample metrics, so that :func:`step_summary` need not go over them again."""

    pairs: tuple[Pair, ...]
    clip_eps: float
    #: every definition of audit.metrics, the threshold variants aliases read, policy lag and lag slices
    metrics: dict[str, float]
    #: the step's per-token reductions (audit.metrics.blocks), the frameworks' among them
    blocks: TokenBlocks | None = None

    def covers(self, pairs: Sequence[Pair], clip_eps: float) -> bool:
        """Whether these are the figures of exactly ``pairs`` (the same records) at ``clip_eps``."""
        return (
            self.clip_eps == clip_eps
            and len(self.pairs) == len(pairs)
            and all(a[0] is b[0] and a[1] is b[1] for a, b in zip(self.pairs, pairs, strict=True))
        )


@dataclass(frozen=True)
class _Tokens:
    """The concatenated logprobs of some pairs, as audit.metrics takes them."""

    trainer: np.ndarray
    rollout: np.ndarray
    offsets: np.ndarray
    entropies: tuple[np.ndarray | None, np.ndarray | None]

    @classmethod
    def of(cls, pairs: Sequence[Pair]) -> _Tokens:
        return cls(
            np.concatenate([t.logprobs for t, _ in pairs]) if pairs else np.zeros(0, np.float32),
            np.concatenate([r.logprobs for _, r in pairs]) if pairs else np.zeros(0, np.float32),
            _offsets([t.logprobs.size for t, _ in pairs]),
            (_entropies([t for t, _ in pairs]), _entropies([r for _, r in pairs])),
        )


def framework_tokens(pairs: Sequence[Pair], blocks: TokenBlocks | None = None) -> StepTokens:
    """A step's pairs as the frameworks' figures take them: logprobs, the trainer's advantage (the
    rollout's where the trainer recorded none) and the trainer's rank of each sample. ``blocks``:
    the step's reductions measured already (over these pairs' concatenated logprobs)."""
    advantages = [t.advantage if t.advantage is not None else r.advantage for t, r in pairs]
    ranks = [t.rank if t.rank is not None else r.rank for t, r in pairs]
    if blocks is not None:
        return StepTokens.over(blocks, advantages=advantages, ranks=ranks)
    return StepTokens.of(
        [t.logprobs for t, _ in pairs], [r.logprobs for _, r in pairs], advantages=advantages, ranks=ranks
    )


def _lags(pairs: Sequence[Pair]) -> list[np.ndarray]:
    """Each pair's token lags (audit.policy_lag.token_lags); none when no trainer side names an
    integer weight version, where every lag is unknown."""
    if all(version_number(t.weight_version) is None for t, _ in pairs):
        return []
    return [token_lags(t, r) for t, r in pairs]


def _with_lags(rows: list[dict[str, Any]], lags: list[np.ndarray]) -> list[dict[str, Any]]:
    """Each sample's metrics with its policy lag range (where its tokens' lags are known)."""
    if not lags:  # no lag known
        return rows
    for row, sample_lags in zip(rows, lags, strict=True):
        known = sample_lags[sample_lags != UNKNOWN_LAG]
        if known.size:
            row["policy_lag_max"], row["policy_lag_min"] = int(known.max()), int(known.min())
    return rows


def _with_lag_figures(metrics: dict[str, float], tokens: _Tokens, lags: list[np.ndarray]) -> dict[str, float]:
    """A step's figures with its policy lag and the lag slices (audit.metrics.lag_metrics)."""
    if lags:
        metrics.update(lag_metrics(tokens.trainer, tokens.rollout, tokens.offsets, np.concatenate(lags)))
    return metrics


def _step_metrics(tokens: _Tokens, lags: list[np.ndarray], clip_eps: float) -> dict[str, float]:
    """A step's figures when its per-sample metrics were not measured with them."""
    metrics = step_metrics(
        tokens.trainer,
        tokens.rollout,
        tokens.offsets,
        clip_eps=clip_eps,
        entropies=tokens.entropies,
        variants=required_variants(),
    )
    return _with_lag_figures(metrics, tokens, lags)


def _measure_step(
    pairs: Sequence[Pair], clip_eps: float, threads: int
) -> tuple[list[dict[str, Any]], StepFigures]:
    """One pass over a step's tokens (``pairs`` in :func:`in_step_order`) on ``threads`` threads:
    each sample's metrics (policy lag included) and the step's figures."""
    tokens = _Tokens.of(pairs)
    blocks = TokenBlocks(tokens.trainer, tokens.rollout, tokens.offsets)
    frame, metrics = sample_and_step_metrics(
        tokens.trainer,
        tokens.rollout,
        tokens.offsets,
        clip_eps=clip_eps,
        entropies=tokens.entropies,
        variants=required_variants(),
        blocks=blocks,
        # the frameworks' figures of StepOutcome.of and the dashboard's position bins, in the same pass
        also=[*FRAMEWORK_REDUCTIONS, *POSITION_REDUCTIONS],
        threads=threads,
    )
    lags = _lags(pairs)
    figures = StepFigures(tuple(pairs), clip_eps, _with_lag_figures(metrics, tokens, lags), blocks)
    return _with_lags(_rows(frame), lags), figures


def _rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """``frame.to_dict("records")``, the same Python scalars, a column at a time (×3 pandas' on a
    step's 512 samples of 70 metrics)."""
    columns = [str(c) for c in frame.columns]
    values = [frame[c].to_numpy().tolist() for c in frame.columns]
    return [dict(zip(columns, row, strict=True)) for row in zip(*values, strict=True)]


def _measure_samples(pairs: Sequence[Pair], clip_eps: float) -> list[dict[str, Any]]:
    """Each sample's metrics (policy lag included), over many steps' pairs in one frame."""
    tokens = _Tokens.of(pairs)
    frame = sample_metrics(
        tokens.trainer, tokens.rollout, tokens.offsets, clip_eps=clip_eps, entropies=tokens.entropies
    )
    return _with_lags(_rows(frame), _lags(pairs))


#: Completion tokens from which a step's samples are measured with its figures in one pass, handed on
#: to :func:`step_summary`. Below it a second pass costs less than a pandas frame per step (x2.3 on
#: 40 steps of 8 x 384 tokens), so small steps' samples share one frame and their figures are
#: computed by ``step_summary``.
ONE_PASS_TOKENS = 1 << 16


def compare_samples(
    pairs: Sequence[Pair],
    fingerprints: Fingerprints | ComparedPrints | Callable[[], Fingerprints | ComparedPrints] | None = None,
    manifests: tuple[Sequence[Manifest], Sequence[Manifest]] = ((), ()),
    *,
    clip_eps: float = 0.2,
    policy: OffPolicy | None = None,
    threads: int | None = None,
) -> list[SampleComparison]:
    """Compare many (trainer, rollout) pairs at once, of one step or several: token metrics
    vectorised (a step of :data:`ONE_PASS_TOKENS` or more with its figures, handed on to
    :func:`step_summary`), grids for the samples that have fingerprints (keyed by sample_key, or
    :class:`ComparedPrints` with their grids; or a function returning either, called once the
    tokens are measured), then a diagnosis of each. ``policy`` is the run's declared off-policy
    design (``off_policy_of(run.config)``). ``threads``: the token pass's (default: the idle cores,
    :func:`~audit.metrics.blocks.idle_threads`). Results come in the order of ``pairs``."""
    if not pairs:
        return []
    for trainer, rollout in pairs:
        check_pair(trainer, rollout)
    steps: dict[tuple[str, int], list[int]] = defaultdict(list)
    for index, (trainer, _) in enumerate(pairs):
        steps[(trainer.run_id, trainer.step)].append(index)
    measured: dict[int, tuple[dict[str, Any], StepFigures | None]] = {}
    small: list[int] = []
    for indices in steps.values():
        if sum(pairs[i][0].logprobs.size for i in indices) < ONE_PASS_TOKENS:
            small += indices
            continue
        ordered = sorted(indices, key=lambda i: pairs[i][0].sample_key or "")  # as in_step_order
        rows, figures = _measure_step(
            [pairs[i] for i in ordered], clip_eps, idle_threads() if threads is None else threads
        )
        measured.update((i, (row, figures)) for i, row in zip(ordered, rows, strict=True))
    if small:
        rows = _measure_samples([pairs[i] for i in small], clip_eps)
        measured.update((i, (row, None)) for i, row in zip(small, rows, strict=True))
    if callable(fingerprints):  # read meanwhile (the worker's fingerprint read overlaps the token pass)
        fingerprints = fingerprints()
    if not isinstance(fingerprints, ComparedPrints):
        fingerprints = ComparedPrints(fingerprints or {}, {})
    results = []
    for index, (trainer, rollout) in enumerate(pairs):
        assert trainer.sample_key is not None  # set by validation (audit.records), compared by check_pair
        metrics, shared = measured[index]
        prints = fingerprints.records.get(trainer.sample_key, ((), ()))
        key = trainer.sample_key
        grid = fingerprints.grids[key] if key in fingerprints.grids else compare_fingerprints(*prints)
        diagnosis = diagnose(
            trainer, rollout, metrics, grid, manifests[0], manifests[1], prints, policy=policy
        )
        # MoE: routing agreement, and whether a routing flip explains the gap (audit.routing).
        metrics.update(distribution_metrics(trainer, rollout))  # top-k and sketch (fingerprinted steps)
        diagnosis = explain_distribution(diagnosis, metrics)
        routing = compare_sample_routes(trainer, rollout)
        if routing is not None:
            metrics.update(routing.metrics())
            diagnosis = explain(diagnosis, routing, trainer, rollout)
        results.append(
            SampleComparison(
                trainer.run_id, trainer.step, trainer.sample_key, metrics, grid, diagnosis, routing, shared
            )
        )
    return results


def compare_sample(
    trainer: SampleLogprobs,
    rollout: SampleLogprobs,
    trainer_prints: Sequence[RegionFingerprints] = (),
    rollout_prints: Sequence[RegionFingerprints] = (),
    trainer_manifests: Sequence[Manifest] = (),
    rollout_manifests: Sequence[Manifest] = (),
    *,
    clip_eps: float = 0.2,
) -> SampleComparison:
    """Compare one sample present on both sides."""
    assert trainer.sample_key is not None  # set by validation (audit.records)
    [result] = compare_samples(
        [(trainer, rollout)],
        {trainer.sample_key: (trainer_prints, rollout_prints)},
        (trainer_manifests, rollout_manifests),
        clip_eps=clip_eps,
    )
    return result


@dataclass(frozen=True)
class StepOutcome:
    """What comparing one step found, computed once: its pairs (every sample stored on both sides, in
    :func:`in_step_order`), the samples compared now, the step's figures (every definition of
    audit.metrics, the threshold variants framework aliases read, policy lag and lag slices, the
    ``routing_*`` figures) and its MoE routing aggregate. The stored per-sample results
    (:meth:`sample_results`), the step's result (:meth:`step_result`) and the dashboard's summary
    (:meth:`summary`) are projections of it."""

    run_id: str
    step: int
    pairs: tuple[Pair, ...]
    comparisons: tuple[SampleComparison, ...]
    #: JSON-safe: NaN and infinities are None
    metrics: dict[str, Any]
    #: audit.routing.step_routing of the pairs (None for a dense model)
    routing: dict[str, Any] | None
    #: the dashboard's position bins, when measured with the step's figures
    bins: dict[str, list[Any]] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def of(
        cls,
        pairs: Sequence[Pair],
        comparisons: Sequence[SampleComparison],
        *,
        clip_eps: float = 0.2,
        framework: Declaration | None = None,
    ) -> StepOutcome:
        """The outcome of a step whose samples ``pairs`` are, ``comparisons`` those compared now. When
        ``comparisons`` were made of exactly ``pairs`` by one :func:`compare_samples` call, its
        figures are taken, not computed again; routes compared there are not compared again.
        ``framework``: what the run declares it runs under (``declaration_of(run.config)``): its
        figures follow that release and its settings (audit.frameworks)."""
        ordered = in_step_order(pairs)
        handed_on = next((c.step_figures for c in comparisons if c.step_figures is not None), None)
        blocks = None
        if handed_on is not None and handed_on.covers(ordered, clip_eps):
            metrics = dict(handed_on.metrics)
            blocks = handed_on.blocks
        else:
            metrics = _step_metrics(_Tokens.of(ordered), _lags(ordered), clip_eps)
        if ordered:
            metrics.update(framework_figures(framework_tokens(ordered, blocks), framework))
            metrics.update(step_distribution_metrics(ordered))
        routing = None
        if pairs:
            compared = {c.sample_key: c.routing for c in comparisons if c.routing is not None}
            routing = step_routing(ordered, compared)
            metrics.update(step_routing_metrics(routing))
        first = ordered[0][0] if ordered else None
        return cls(
            run_id=first.run_id if first is not None else "",
            step=first.step if first is not None else 0,
            pairs=tuple(ordered),
            comparisons=tuple(comparisons),
            metrics=_json_floats(metrics),
            routing=routing,
            bins=_position_bins(ordered, blocks),
        )

    def verdicts(self) -> list[Verdict]:
        """The verdicts of the samples compared now."""
        return [
            Verdict(c.sample_key, c.diagnosis.kind, c.first_divergence[0] if c.first_divergence else None)
            for c in self.comparisons
        ]

    def sample_results(self) -> list[dict[str, Any]]:
        """The ``sample_results`` rows of the samples compared now."""
        return [c.result_row() for c in self.comparisons]

    def step_result(self, facts: StepFacts | None = None) -> dict[str, Any]:
        """The ``step_results`` fields: ``n_samples``, ``metrics`` and ``diagnoses`` (a count of each
        diagnosis, over the samples compared now and, given the store's ``facts``, those compared
        before; and the earliest first divergence of the samples compared now)."""
        counts = Counter(v.diagnosis for v in self.all_verdicts(facts))
        diagnoses: dict[str, Any] = {"counts": dict(sorted(counts.items()))}
        first = [c.first_divergence for c in self.comparisons if c.first_divergence is not None]
        if first:
            region, position = min(
                first, key=lambda cell: (region_order(parse_region_key(cell[0])[0]), cell[1])
            )
            diagnoses["first_divergence"] = {"region": region, "position": position}
        changed = next(
            (c.diagnosis.evidence[CHANGES] for c in self.comparisons if CHANGES in c.diagnosis.evidence), None
        )
        if changed is not None:  # what changed since the last clean step (audit.since_clean)
            diagnoses[CHANGES] = changed
        return {"n_samples": len(self.pairs), "metrics": self.metrics, "diagnoses": diagnoses}

    def summary(self, facts: StepFacts) -> StepSummary:
        """The dashboard's summary of the step (``audit.summaries``)."""
        return summarize(
            self.run_id, self.step, self.pairs, self.all_verdicts(facts), facts, self.routing, self.bins
        )

    def all_verdicts(self, facts: StepFacts | None) -> list[Verdict]:
        """The verdicts of the samples compared now, then the stored ones of the step's other samples."""
        fresh = self.verdicts()
        if facts is None:
            return fresh
        new = {v.sample_key for v in fresh}
        return fresh + [v for v in facts.verdicts if v.sample_key not in new]


def _position_bins(pairs: Sequence[Pair], blocks: TokenBlocks | None) -> dict[str, list[Any]] | None:
    """The step's position bins from its blocks' segment reductions (None: to compute from the
    pairs, where a Δ is not finite or nothing was measured)."""
    if blocks is None or not blocks.all_finite:
        return None
    sums, maxima = (blocks.get(how, key) for how, key in POSITION_REDUCTIONS)
    return position_bins_of(blocks.lengths, sums, maxima, [t.sample_key for t, _ in pairs])


def step_summary(
    pairs: Sequence[Pair],
    comparisons: Sequence[SampleComparison],
    *,
    clip_eps: float = 0.2,
    framework: Declaration | None = None,
) -> dict[str, Any]:
    """The ``step_results`` fields of one step (:meth:`StepOutcome.step_result` of
    :meth:`StepOutcome.of`), for a caller that holds no stored verdicts."""
    return StepOutcome.of(pairs, comparisons, clip_eps=clip_eps, framework=framework).step_result()
