"""``GET /metrics``: Prometheus text exposition of the store's figures and the ingest counters."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from audit.api.auth import Reader
from audit.api.deps import get_store
from audit.api.prometheus import StoreCollector
from audit.store import Store

router = APIRouter(tags=["service"])


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics",
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
)
def metrics(request: Request, principal: Reader, store: Annotated[Store, Depends(get_store)]) -> Response:
    """Latest mismatch metrics per run, open alerts, the comparison queue and ingest counters. A token
    limits the store's figures to its project."""
    scoped = CollectorRegistry()
    scoped.register(StoreCollector(store, principal.project if principal is not None else None))
    body = generate_latest(request.app.state.registry) + generate_latest(scoped)
    return Response(content=body, media_type=CONTENT_TYPE_LATEST)
