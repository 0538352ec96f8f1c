"""``GET /metrics``: Prometheus text exposition of the store's figures and the ingest counters; and
``GET /v1/metric-names``: every metric with its definition, parameters and framework aliases."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response, status
from isoaudit.audit.api.auth import Reader
from isoaudit.audit.api.deps import get_store
from isoaudit.audit.api.prometheus import StoreCollector
from isoaudit.audit.db import Store
from isoaudit.audit.metric_names import FRAMEWORKS, catalogue
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

router = APIRouter(tags=["service"])

FrameworkQuery = Annotated[
    list[str] | None,
    Query(
        description=f"also export the figures under these frameworks' names ({', '.join(FRAMEWORKS)})",
        json_schema_extra={"items": {"enum": list(FRAMEWORKS)}},
    ),
]


def _frameworks(framework: list[str] | None) -> tuple[str, ...]:
    unknown = [f for f in framework or [] if f not in FRAMEWORKS]
    if unknown:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            detail=f"framework: {unknown[0]!r} is not one of {', '.join(FRAMEWORKS)}",
        )
    return tuple(dict.fromkeys(framework or []))


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics",
    responses={200: {"content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}},
)
def metrics(
    request: Request,
    principal: Reader,
    store: Annotated[Store, Depends(get_store)],
    framework: FrameworkQuery = None,
) -> Response:
    """Latest mismatch metrics per run, open alerts, the comparison queue and ingest counters. A token
    limits the store's figures to its project; ``framework`` repeats them under that framework's names."""
    scoped = CollectorRegistry()
    project = principal.project if principal is not None else None
    scoped.register(StoreCollector(store, project, _frameworks(framework)))
    body = generate_latest(request.app.state.registry) + generate_latest(scoped)
    return Response(content=body, media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/metric-names", summary="Every metric: definition, parameters and framework aliases")
def metric_names(principal: Reader, framework: FrameworkQuery = None) -> list[dict[str, Any]]:
    """The alias registry (audit.metric_names); ``framework`` keeps the metrics those frameworks log."""
    rows = catalogue()
    wanted = _frameworks(framework)
    if wanted:
        rows = [r for r in rows if any(a["framework"] in wanted for a in r["aliases"])]
    return rows
