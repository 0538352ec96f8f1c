"""``GET /metrics``: Prometheus text exposition of the store's figures (the runs compared within the
active window) and the ingest counters, scoped to the token's project; and
``GET /v1/metric-names``: every metric with its definition, parameters and framework aliases."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Response, status
from isoaudit.audit.api.auth import Reader
from isoaudit.audit.api.deps import get_settings, get_store, get_telemetry
from isoaudit.audit.api.prometheus import StoreCollector
from isoaudit.audit.api.telemetry import Telemetry
from isoaudit.audit.db import Store
from isoaudit.audit.metric_names import FRAMEWORKS, catalogue
from isoaudit.audit.settings import Settings
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
    principal: Reader,
    store: Annotated[Store, Depends(get_store)],
    settings: Annotated[Settings, Depends(get_settings)],
    telemetry: Annotated[Telemetry, Depends(get_telemetry)],
    framework: FrameworkQuery = None,
) -> Response:
    """The runs compared within the active window (``ISOAUDIT_METRICS_ACTIVE_WINDOW_S``): each one's
    latest figures, counters, run info and open alerts; the comparison queue, the ingest counters and
    the build. A token limits every series to its project; ``framework`` repeats the figures under
    that framework's names."""
    project = principal.project if principal is not None else None
    window = timedelta(seconds=settings.metrics_active_window_s)
    scoped = CollectorRegistry()
    scoped.register(telemetry.scoped(project))
    scoped.register(StoreCollector(store, project, _frameworks(framework), window=window))
    return Response(content=generate_latest(scoped), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/metric-names", summary="Every metric: definition, parameters and framework aliases")
def metric_names(principal: Reader, framework: FrameworkQuery = None) -> list[dict[str, Any]]:
    """The alias registry (audit.metric_names); ``framework`` keeps the metrics those frameworks log."""
    rows = catalogue()
    wanted = _frameworks(framework)
    if wanted:
        rows = [r for r in rows if any(a["framework"] in wanted for a in r["aliases"])]
    return rows
