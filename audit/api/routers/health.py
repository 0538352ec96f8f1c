"""``GET /healthz``: the process is up and the database answers at a known schema revision."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, status
from isoaudit.audit.api.deps import get_store
from isoaudit.audit.api.schemas import Health
from isoaudit.audit.store import Store
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

router = APIRouter(tags=["service"])


@router.get(
    "/healthz", response_model=Health, responses={503: {"description": "the database does not answer"}}
)
def healthz(store: Annotated[Store, Depends(get_store)]) -> Health:
    from alembic.runtime.migration import MigrationContext

    try:
        with store.engine.connect() as connection:
            connection.execute(text("SELECT 1"))
            revision = MigrationContext.configure(connection).get_current_revision()
    except SQLAlchemyError as exc:
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, detail=f"database: {type(exc).__name__}"
        ) from exc
    return Health(status="ok", database=store.dialect, schema_revision=revision)
