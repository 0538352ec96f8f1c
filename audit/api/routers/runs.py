"""Read endpoints of runs and their comparison results: steps, per-step metrics, samples, divergences."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, HTTPException, Path, Query, status
from isoaudit.audit.api.auth import ReadableRun, Reader
from isoaudit.audit.api.deps import get_store
from isoaudit.audit.api.routers.control import control_of
from isoaudit.audit.api.schemas import (
    DivergenceOut,
    RunOut,
    SampleResultOut,
    StepMetricsOut,
    StepOut,
    StepStatsOut,
)
from isoaudit.audit.db import MAX_OFFSET, MAX_PAGE, Store
from isoaudit.audit.db.reads import STOPPED_AFTER_STEPS, rank_activity
from isoaudit.audit.records import Step
from pydantic import BaseModel, Field

router = APIRouter(prefix="/v1/runs", tags=["runs"])

#: The store a route reads, from the application (FastAPI's shared ``Annotated`` dependency).
StoreDep = Annotated[Store, Depends(get_store)]
#: One page of a list: at most ``limit`` items (capped at the data layer's MAX_PAGE), from ``offset`` on.
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description=f"items per page (at most {MAX_PAGE})")]
Offset = Annotated[int, Query(ge=0, le=MAX_OFFSET, description="items to skip (the previous pages')")]

Model = TypeVar("Model", bound=BaseModel)


def from_attributes(model: type[Model], source: object, **fields: object) -> Model:
    """``model`` from ``source``'s attributes of the same names (a stored row, a query's result),
    and ``fields`` for those the response names or shapes differently."""
    taken = {
        name: getattr(source, name)
        for name in model.model_fields
        if name not in fields and hasattr(source, name)
    }
    return model(**taken, **fields)


def finite_or_none(metrics: dict[str, Any]) -> dict[str, float | None]:
    """Metric values for JSON: NaN ("no data") and infinities become null, non-numbers are dropped."""
    out: dict[str, float | None] = {}
    for name, value in metrics.items():
        if value is None:
            out[name] = None
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[name] = float(value) if math.isfinite(value) else None
    return out


@router.get("", response_model=list[RunOut], summary="Runs visible to the caller, newest first")
def list_runs(
    principal: Reader, store: StoreDep, limit: Limit = MAX_PAGE, offset: Offset = 0
) -> list[RunOut]:
    project = principal.project if principal is not None else None
    return [RunOut(**run.__dict__) for run in store.list_runs(project, limit=limit, offset=offset)]


@router.get("/{run_id}", response_model=RunOut, summary="One run, with its desired remediation mode")
def get_run(run_id: ReadableRun, store: StoreDep) -> RunOut:
    summary = store.get_run(run_id)
    if summary is None:  # deleted between the check and here
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"run_id: no run {run_id!r}")
    return RunOut(**summary.__dict__, control=control_of(store, run_id))


@router.get("/{run_id}/steps", response_model=list[StepOut], summary="Samples stored and compared per step")
def list_steps(run_id: ReadableRun, store: StoreDep) -> list[StepOut]:
    return [StepOut(**step.__dict__) for step in store.steps(run_id)]


@router.get(
    "/{run_id}/step-stats",
    response_model=list[StepStatsOut],
    summary="The RL loop's own figures per step (reward, entropy, clip fraction, phase times)",
)
def step_stats(
    run_id: ReadableRun,
    store: StoreDep,
    from_step: Annotated[Step, Query(description="first step (inclusive)")] = 0,
    to_step: Annotated[Step | None, Query(description="last step (inclusive)")] = None,
) -> list[StepStatsOut]:
    return [
        from_attributes(StepStatsOut, s, figures=s.figures())
        for s in store.step_stats(run_id, from_step, to_step)
    ]


@router.get(
    "/{run_id}/metrics", response_model=list[StepMetricsOut], summary="Mismatch metrics per compared step"
)
def step_metrics(
    run_id: ReadableRun,
    store: StoreDep,
    names: Annotated[list[str] | None, Query(description="only these metrics (e.g. kl_k3)")] = None,
    from_step: Annotated[Step | None, Query(description="first step (inclusive)")] = None,
    to_step: Annotated[Step | None, Query(description="last step (inclusive)")] = None,
) -> list[StepMetricsOut]:
    out = []
    for row in store.step_results(run_id, from_step, to_step):
        metrics = finite_or_none(row.metrics)
        if names:
            metrics = {name: metrics[name] for name in names if name in metrics}
        out.append(from_attributes(StepMetricsOut, row, metrics=metrics))
    return out


@router.get(
    "/{run_id}/steps/{step}/samples",
    response_model=list[SampleResultOut],
    summary="The comparator's verdict on each compared sample of a step",
)
def step_samples(
    run_id: ReadableRun,
    step: Step,
    store: StoreDep,
    include_grid: Annotated[bool, Query(description="include the region x position grid (large)")] = False,
    diagnosis: Annotated[
        str | None, Query(max_length=32, description="only samples with this diagnosis")
    ] = None,
    limit: Limit = MAX_PAGE,
    offset: Offset = 0,
) -> list[SampleResultOut]:
    """One page of the step's samples, by sample key."""
    return [
        from_attributes(
            SampleResultOut, row, metrics=finite_or_none(row.metrics), grid=row.grid if include_grid else None
        )
        for row in store.sample_results(run_id, step, diagnosis=diagnosis, limit=limit, offset=offset)
    ]


@router.get(
    "/{run_id}/divergences",
    response_model=list[DivergenceOut],
    summary="Samples whose sides diverge: where first, and the diagnosis",
)
def divergences(
    run_id: ReadableRun,
    store: StoreDep,
    step: Annotated[Step | None, Query(description="only this step")] = None,
) -> list[DivergenceOut]:
    """A sample diverges when the comparator found a first divergence or diagnosed anything but
    ``clean``."""
    return [
        from_attributes(
            DivergenceOut, row, region=row.first_divergence_region, position=row.first_divergence_position
        )
        for row in store.sample_results(run_id, step)
        if row.first_divergence_region is not None or row.diagnosis != "clean"
    ]


class RankOut(BaseModel):
    """What one rank of one side sent (``rank`` null: samples sent without a rank)."""

    side: str
    rank: int | None
    samples: int = Field(description="samples this rank sent for the run")
    steps: int = Field(description="distinct steps it sent samples for")
    first_step: int
    last_step: int
    last_seen: datetime | None = Field(description="when its newest sample was stored")
    steps_behind: int = Field(description="the side's newest step minus this rank's")
    stopped: bool = Field(description=f"{STOPPED_AFTER_STEPS} or more steps behind: it stopped sending")
    processes: list[str] = Field(description="host:pid/rank of the processes its manifests name")


@router.get(
    "/{run_id}/ranks",
    response_model=list[RankOut],
    summary="Per-rank counters of each side: samples, steps, newest step, and whether a rank stopped sending",
)
def ranks(run_id: ReadableRun, store: StoreDep) -> list[RankOut]:
    return [from_attributes(RankOut, r) for r in rank_activity(store, run_id)]


# ---------------------------------------------------------------------- MoE routing


class RoutingLayerOut(BaseModel):
    layer: int = Field(description="decoder layer index of the MoE layer")
    tokens: int = Field(description="tokens routed on both sides")
    set_agreement: float | None = Field(description="fraction of tokens whose top-k expert sets agree")
    flip_rate: float | None = Field(description="fraction of router decisions the other side did not make")
    jaccard_mean: float | None = Field(description="mean Jaccard index of the two expert sets")
    flipped_tokens: int
    first_flips: int = Field(description="tokens whose routing first flips in this layer")
    example: str | None = Field(description="the sample with the most flips in this layer")


class RoutingStepOut(BaseModel):
    step: int
    metrics: dict[str, float | None] = Field(description="the step's routing_* metrics")
    layers: list[RoutingLayerOut]
    replayed: int | None = Field(description="tokens whose routes the trainer replayed (R3); null: no replay")
    missing_routes: int = Field(description="tokens the trainer routed itself although replay was on")
    missing_examples: list[dict[str, Any]] = Field(description="samples with missing routes, and where")


@router.get(
    "/{run_id}/routing",
    response_model=list[RoutingStepOut],
    summary="MoE routing agreement per compared step and layer (flips, Jaccard, first flips, replay)",
)
def routing(
    run_id: ReadableRun,
    store: StoreDep,
    after_step: Annotated[Step | None, Query(description="only steps after this one")] = None,
) -> list[RoutingStepOut]:
    from isoaudit.audit.db.reads import routing_series

    return [
        from_attributes(
            RoutingStepOut,
            point,
            metrics=finite_or_none(point.metrics),
            layers=[from_attributes(RoutingLayerOut, layer) for layer in point.layers],
            missing_routes=point.missing,
        )
        for point in routing_series(store, run_id, after_step=after_step)
    ]


class SampleRoutingOut(BaseModel):
    layers: list[int] = Field(description="MoE layers routed on both sides")
    positions: list[int] = Field(description="absolute positions routed on both sides")
    prompt_len: int
    trainer: list[list[list[int]]] = Field(description="[position][layer][slot] experts the trainer chose")
    rollout: list[list[list[int]]] = Field(description="[position][layer][slot] experts the rollout chose")
    first_flip_layer: list[int] = Field(
        description="per position, the first MoE layer whose set differs (-1: none)"
    )
    replayed: list[int] | None = Field(description="per position, 1 where the trainer replayed the route")


@router.get(
    "/{run_id}/steps/{step}/samples/{sample_key}/routing",
    response_model=SampleRoutingOut,
    summary="One sample's routing on both sides, per token and MoE layer",
)
def sample_routing(
    run_id: ReadableRun,
    step: Step,
    sample_key: Annotated[str, Path(pattern=r"^[0-9a-f]{32}$")],
    store: StoreDep,
) -> SampleRoutingOut:
    from isoaudit.audit.db.reads import sample_routing as read

    found = read(store, run_id, step, sample_key)
    if found is None:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            detail=f"sample_key: no routes on both sides for sample {sample_key} at step {step} of run {run_id!r}",
        )
    return from_attributes(
        SampleRoutingOut,
        found,
        positions=found.positions.tolist(),
        trainer=found.trainer.tolist(),
        rollout=found.rollout.tolist(),
        first_flip_layer=found.first_flip.tolist(),
        replayed=found.replayed.tolist() if found.replayed is not None else None,
    )
