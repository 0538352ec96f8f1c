"""``GET /v1/runs/{run_id}/environment-diff``: what changed in the environment and the runtime facts,
key by key with old → new, as ``isoaudit diff`` says it (``audit.db.reads.environment``): against
another run or step the caller may see (``against=RUN[@STEP]``), between the two sides
(``sides=true``), or since each side's previous manifest."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, status
from isoaudit.audit.api.auth import ReadableRun, Reader, can_see
from isoaudit.audit.api.deps import get_store
from isoaudit.audit.db import Store
from isoaudit.audit.db.reads.environment import Point, UnknownPoint, environment_diff
from isoaudit.audit.records import RUN_ID_PATTERN, Step
from pydantic import BaseModel, Field

router = APIRouter(prefix="/v1/runs", tags=["runs"])

StoreDep = Annotated[Store, Depends(get_store)]


class ChangeOut(BaseModel):
    group: str = Field(description="versions, backends, flags, env or runtime")
    key: str
    old: Any = Field(description="the value in the first manifest (null: unset)")
    new: Any = Field(description="the value in the second manifest (null: unset)")


class SideDiffOut(BaseModel):
    title: str = Field(description="'trainer', 'rollout' or 'trainer → rollout'")
    old: str = Field(description="where the first manifest was read")
    new: str = Field(description="where the second manifest was read")
    changes: dict[str, list[ChangeOut]] = Field(description="group -> changed keys, groups in order")
    unrecorded: list[str] = Field(description="'old'/'new': a manifest missing or without an environment")


class EnvironmentDiffOut(BaseModel):
    diffs: list[SideDiffOut]
    n_changes: int


@router.get(
    "/{run_id}/environment-diff",
    response_model=EnvironmentDiffOut,
    summary="What changed in the environment (versions, backends, flags, pins, runtime facts)",
)
def environment_changes(
    run_id: ReadableRun,
    principal: Reader,
    store: StoreDep,
    step: Annotated[
        Step | None, Query(description="read this run at this step (default: its latest manifests)")
    ] = None,
    against: Annotated[
        str | None, Query(max_length=200, description="compare with this run, or RUN@STEP")
    ] = None,
    sides: Annotated[bool, Query(description="compare the trainer with the rollout")] = False,
) -> EnvironmentDiffOut:
    try:
        other = Point.parse(against) if against is not None else None
        if other is not None and not re.fullmatch(RUN_ID_PATTERN, other.run_id):
            raise ValueError(f"{other.run_id!r} is not a run id (pattern {RUN_ID_PATTERN})")
    except ValueError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, detail=f"against: {exc}") from None
    if other is not None:
        project = store.run_project(other.run_id)
        if project is None or not can_see(principal, project):
            raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"against: no run {other.run_id!r}")
    try:
        report = environment_diff(store, Point(run_id, step), other, sides=sides)
    except UnknownPoint as exc:  # the field that named it: the other run, or this run's step
        field = "against" if other is not None and exc.point == other else "step"
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"{field}: {exc}") from None
    except ValueError as exc:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, detail=f"sides: {exc}") from None
    return EnvironmentDiffOut.model_validate(report.as_dict())
