"""``GET /healthz``: the process is up and the database answers at a known schema revision."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, status
from isoaudit.audit.api.deps import get_store
from isoaudit.audit.api.schemas import Health
from isoaudit.audit.db import Store, StoreUnavailable

router = APIRouter(tags=["service"])


@router.get(
    "/healthz", response_model=Health, responses={503: {"description": "the database does not answer"}}
)
def healthz(store: Annotated[Store, Depends(get_store)]) -> Health:
    try:
        revision = store.schema_revision()
    except StoreUnavailable as exc:
        cause = exc.__cause__ or exc
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, detail=f"database: {type(cause).__name__}"
        ) from exc
    return Health(status="ok", database=store.dialect, schema_revision=revision)
