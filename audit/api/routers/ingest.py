"""``POST /v1/ingest`` and ``POST /v1/runs``: records in, each checked, the valid ones stored in one
transaction, idempotent."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, HTTPException, Request, status
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from isoaudit.audit.api.auth import Writer
from isoaudit.audit.api.deps import get_settings, get_store, get_telemetry
from isoaudit.audit.api.errors import request_validation_error
from isoaudit.audit.api.routers.control import control_of
from isoaudit.audit.api.schemas import Control, IngestResponse, RunOut
from isoaudit.audit.api.telemetry import Telemetry
from isoaudit.audit.db import ForbiddenRun, IngestResult, Store, StoreConflict, StoreUnavailable
from isoaudit.audit.records import Batch, BatchShape, Run
from isoaudit.audit.settings import Settings
from pydantic import ValidationError

router = APIRouter(prefix="/v1", tags=["ingest"])
log = logging.getLogger("isoaudit.api")
T = TypeVar("T")


def _with_retries(deadline_s: float, attempts: int, action: Callable[[], T]) -> T:
    """Run a transaction again when it lost a race with a concurrent writer (two clients creating the
    same run, SQLite's single writer, a PostgreSQL deadlock) or the database did not answer (locked,
    a connection cut: the pool replaces it), for up to ``attempts`` tries within ``deadline_s``
    seconds; the last error propagates (:class:`StoreUnavailable` becomes 503). Safe because ingest is
    idempotent and each attempt is one transaction that either committed or left nothing behind."""
    deadline = time.monotonic() + deadline_s
    for attempt in range(attempts):
        try:
            return action()
        except (StoreConflict, StoreUnavailable) as exc:
            delay = min(0.01 * 2**attempt, 0.5)
            if attempt == attempts - 1 or time.monotonic() + delay > deadline:
                raise
            log.debug("ingest attempt %d failed (%s); retrying", attempt + 1, exc)
            time.sleep(delay)
    raise AssertionError("unreachable")


def store_records(
    store: Store, settings: Settings, records: Iterable[Any], project: str
) -> tuple[IngestResult, dict[str, Control]]:
    """Store records for ``project`` (each checked; the invalid ones come back in ``rejected``) and
    read back the desired mode of each run the stored records name. A database that stays
    unavailable through the retries raises StoreUnavailable, which the app answers with 503
    (``audit.api.errors``): the client keeps the batch and sends it again."""
    records = list(records)
    try:
        result = _with_retries(
            settings.database_timeout_s,
            settings.ingest_retries,
            lambda: store.ingest(records, project=project),
        )
    except ForbiddenRun as exc:
        raise HTTPException(status.HTTP_403_FORBIDDEN, detail=str(exc)) from exc
    return result, {run_id: control_of(store, run_id) for run_id in result.runs}


def batch_records(body: bytes) -> list[Any]:
    """The records of a request body. A valid batch is parsed in one pass; if any record in it is
    invalid, the body only has to be a batch at all (an object with a list ``records``) and the
    records go to the store raw, to be checked one by one (so the valid ones are still stored).
    A body that is not a batch raises FastAPI's 422 naming the field."""
    try:
        return list(Batch.model_validate_json(body).records)
    except ValidationError:
        pass
    try:
        return BatchShape.model_validate_json(body).records
    except ValidationError as exc:
        raise request_validation_error(exc) from exc


_BATCH_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Batch"}}},
    }
}


@router.post(
    "/ingest",
    response_model=IngestResponse,
    openapi_extra=_BATCH_BODY,
    summary="Store a batch of records of any kind",
    responses={
        401: {"description": "no or wrong token"},
        403: {"description": "a run of another project"},
        413: {"description": "body over the size limit"},
        422: {"description": "the body is not a batch; loc names the field (invalid records: see rejected)"},
        503: {"description": "the database is unavailable; nothing was stored, retry"},
    },
)
async def ingest(
    request: Request,
    principal: Writer,
    store: Annotated[Store, Depends(get_store)],
    settings: Annotated[Settings, Depends(get_settings)],
    telemetry: Annotated[Telemetry, Depends(get_telemetry)],
) -> IngestResponse:
    """Check every record and store the valid ones in one transaction; each invalid record is named
    in ``rejected`` (index, kind, field, message) and nothing of it is stored. Records already stored
    (a retried batch) are counted as duplicates, never stored twice. A body that is not a batch at
    all gets 422 naming the field. The reply carries each run's desired remediation mode."""
    started = time.perf_counter()
    body = await request.body()

    def work() -> IngestResponse:
        result, controls = store_records(store, settings, batch_records(body), principal.project)
        telemetry.record_ingest(principal.project, result, time.perf_counter() - started)
        if result.rejected:
            first = result.rejected[0]
            log.info(
                "ingest: %d record(s) of project %s refused; first: #%d %s",
                len(result.rejected),
                principal.project,
                first.index,
                first.message,
            )
        return IngestResponse(
            **result.as_dict(),
            control=next(iter(controls.values())) if len(controls) == 1 else None,
            controls=controls,
        )

    try:
        return await run_in_threadpool(work)
    except HTTPException as exc:
        telemetry.record_rejected(principal.project, exc.status_code)
        raise
    except RequestValidationError:
        telemetry.record_rejected(principal.project, status.HTTP_422_UNPROCESSABLE_CONTENT)
        raise
    except StoreUnavailable:
        telemetry.record_rejected(principal.project, status.HTTP_503_SERVICE_UNAVAILABLE)
        raise


@router.post(
    "/runs",
    response_model=RunOut,
    status_code=status.HTTP_201_CREATED,
    summary="Register a run (or update its name and config)",
    responses={401: {"description": "no or wrong token"}, 403: {"description": "a run of another project"}},
)
def create_run(
    run: Run,
    principal: Writer,
    store: Annotated[Store, Depends(get_store)],
    settings: Annotated[Settings, Depends(get_settings)],
) -> RunOut:
    """Idempotent: posting the same run again changes nothing."""
    result, controls = store_records(store, settings, [run], principal.project)
    if result.rejected:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            detail=[
                {"loc": ["body", r.field], "msg": r.message, "type": "value_error"} for r in result.rejected
            ],
        )
    summary = store.get_run(run.run_id)
    assert summary is not None
    return RunOut(**summary.__dict__, control=controls[run.run_id])
