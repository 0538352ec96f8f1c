"""``GET/PUT /v1/runs/{run_id}/control``: the remediation mode a run's collectors should apply."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Path, status
from isoaudit.audit.api.auth import ReadableRun, Writer, can_see
from isoaudit.audit.api.deps import get_store
from isoaudit.audit.api.schemas import Control, ControlUpdate
from isoaudit.audit.control import StaleControlVersion
from isoaudit.audit.db import Store
from isoaudit.audit.records import RunId

router = APIRouter(prefix="/v1/runs", tags=["control"])


def control_of(store: Store, run_id: str) -> Control:
    """The run's desired mode as the API shows it (here and in every ingest reply)."""
    return store.get_control(run_id)


@router.get("/{run_id}/control", response_model=Control, summary="The run's desired remediation mode")
def get_control(run_id: ReadableRun, store: Annotated[Store, Depends(get_store)]) -> Control:
    return control_of(store, run_id)


@router.put(
    "/{run_id}/control",
    response_model=Control,
    summary="Set the run's desired remediation mode",
    responses={
        409: {"description": "version is not the current one; the body's detail has the current state"}
    },
)
def put_control(
    run_id: Annotated[RunId, Path(description="the client-chosen run id")],
    update: ControlUpdate,
    principal: Writer,
    store: Annotated[Store, Depends(get_store)],
) -> Control:
    """Give the version you read: it is bumped on success; a stale one gets 409 and changes nothing.
    Collectors switch at their next step boundary (DESIGN.md, "Remediation")."""
    project = store.run_project(run_id)
    if project is None or not can_see(principal, project):
        raise HTTPException(status.HTTP_404_NOT_FOUND, detail=f"run_id: no run {run_id!r}")
    try:
        state = store.set_control(
            run_id, update.mode, update.version, updated_by=f"token:{principal.token_id}"
        )
    except StaleControlVersion as exc:
        current = exc.current
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            detail={
                "msg": f"version: {update.version} is stale; the current version is {current.version}",
                "current": {"mode": current.mode, "version": current.version},
            },
        ) from exc
    return state
