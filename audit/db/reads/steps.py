"""A run's compared steps (metrics and the dashboard's summaries), a step's sample verdicts, and one
sample in full (the only view that reads token arrays: that sample's two)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np
from isoaudit.audit.db.models import (
    SampleResultRow,
    StepResultRow,
    StepSummaryRow,
)
from isoaudit.audit.db.reads.common import aware
from isoaudit.audit.db.runs import MAX_PAGE
from isoaudit.audit.db.store import Store
from isoaudit.audit.grid import RegionGrid
from sqlalchemy import func, select


@dataclass(frozen=True)
class StepPoint:
    """One compared step: its metrics (``step_results``) and its aggregates (``step_summaries``)."""

    step: int
    n_samples: int
    metrics: dict[str, Any]
    position_bins: dict[str, list[Any]] = field(default_factory=dict)
    first_divergence: dict[str, dict[str, Any]] = field(default_factory=dict)
    diagnoses: dict[str, int] = field(default_factory=dict)
    n_fingerprinted: int = 0
    ingested_at: datetime | None = None


def step_series(
    store: Store, run_id: str, *, after_step: int | None = None, step: int | None = None
) -> list[StepPoint]:
    """The run's compared steps in order (only those after ``after_step``, for a live update, or
    only ``step``)."""
    query = (
        select(StepResultRow.step, StepResultRow.n_samples, StepResultRow.metrics, StepSummaryRow)
        .outerjoin(
            StepSummaryRow,
            (StepSummaryRow.run_id == StepResultRow.run_id) & (StepSummaryRow.step == StepResultRow.step),
        )
        .where(StepResultRow.run_id == run_id)
        .order_by(StepResultRow.step)
    )
    if after_step is not None:
        query = query.where(StepResultRow.step > after_step)
    if step is not None:
        query = query.where(StepResultRow.step == step)
    with store.sessions() as session:
        rows = session.execute(query).all()
    points = []
    for number, n_samples, metrics, summary in rows:
        if summary is None:
            points.append(StepPoint(number, n_samples, dict(metrics)))
            continue
        points.append(
            StepPoint(
                number,
                n_samples,
                dict(metrics),
                dict(summary.position_bins),
                dict(summary.first_divergence),
                dict(summary.diagnoses),
                summary.n_fingerprinted,
                aware(summary.ingested_at),
            )
        )
    return points


def step_point(store: Store, run_id: str, step: int) -> StepPoint | None:
    """One compared step (None if not compared)."""
    found = step_series(store, run_id, step=step)
    return found[0] if found else None


def last_compared_step(store: Store, run_id: str) -> int | None:
    with store.sessions() as session:
        return session.scalar(select(func.max(StepResultRow.step)).where(StepResultRow.run_id == run_id))


@dataclass(frozen=True)
class SampleVerdict:
    """One row of a step's sample table."""

    sample_key: str
    n_tokens: int
    abs_diff_mean: float | None
    abs_diff_max: float | None
    kl_k3: float | None
    exact_match_fraction: float | None
    first_divergence_region: str | None
    first_divergence_position: int | None
    diagnosis: str


def step_samples(
    store: Store, run_id: str, step: int, *, limit: int = MAX_PAGE, offset: int = 0
) -> list[SampleVerdict]:
    """The compared samples of one step by key (verdicts only: no grid, no arrays), one page:
    ``limit`` (at most :data:`~audit.db.runs.MAX_PAGE`) from ``offset`` on."""
    query = (
        select(
            SampleResultRow.sample_key,
            SampleResultRow.n_tokens,
            SampleResultRow.metrics,
            SampleResultRow.first_divergence_region,
            SampleResultRow.first_divergence_position,
            SampleResultRow.diagnosis,
        )
        .where(SampleResultRow.run_id == run_id, SampleResultRow.step == step)
        .order_by(SampleResultRow.sample_key)
        .limit(min(limit, MAX_PAGE))
        .offset(offset)
    )
    with store.sessions() as session:
        rows = session.execute(query).all()
    return [
        SampleVerdict(
            key,
            n_tokens,
            metrics.get("logprob_abs_diff_mean"),
            metrics.get("logprob_abs_diff_max"),
            metrics.get("kl_k3"),
            metrics.get("exact_match_fraction"),
            region,
            position,
            diagnosis,
        )
        for key, n_tokens, metrics, region, position, diagnosis in rows
    ]


@dataclass(frozen=True)
class SampleDetail:
    """Everything the sample page shows. ``delta`` = trainer − rollout per completion token."""

    run_id: str
    step: int
    sample_key: str
    prompt_len: int
    completion_ids: np.ndarray
    trainer_logprobs: np.ndarray
    rollout_logprobs: np.ndarray
    delta: np.ndarray
    metrics: dict[str, Any]
    diagnosis: str
    sentence: str
    evidence: dict[str, Any]
    grid: RegionGrid | None
    first_divergence: tuple[str, int] | None


def sample_detail(store: Store, run_id: str, step: int, sample_key: str) -> SampleDetail | None:
    """One compared sample (None until both sides are stored and compared)."""
    with store.sessions() as session:
        result = session.get(SampleResultRow, (run_id, step, sample_key))
    if result is None:
        return None
    trainer, rollout = store.sample_pair(run_id, step, sample_key)
    if trainer is None or rollout is None:
        return None
    with np.errstate(invalid="ignore"):
        delta = trainer.logprobs.astype(np.float64) - rollout.logprobs.astype(np.float64)
    detail = dict(result.diagnosis_detail)
    first = (
        (result.first_divergence_region, int(result.first_divergence_position))
        if result.first_divergence_region is not None and result.first_divergence_position is not None
        else None
    )
    return SampleDetail(
        run_id=run_id,
        step=step,
        sample_key=sample_key,
        prompt_len=trainer.prompt_len,
        completion_ids=trainer.completion_ids.copy(),
        trainer_logprobs=trainer.logprobs,
        rollout_logprobs=rollout.logprobs,
        delta=delta,
        metrics=dict(result.metrics),
        diagnosis=result.diagnosis,
        sentence=str(detail.get("sentence", "")),
        evidence=dict(detail.get("evidence", {})),
        grid=RegionGrid.from_json(result.grid) if result.grid else None,
        first_divergence=first,
    )
