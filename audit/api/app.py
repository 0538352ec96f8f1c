"""The application factory: the store, authentication, routers, ``/metrics``, and in the background
the comparison worker with the alert engine (and the W&B / MLflow trackers, when configured) as its
per-step callback."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from isoaudit.audit import __version__
from isoaudit.audit.alerts import AlertEngine
from isoaudit.audit.alerts.setup import default_alert_engine, install_configured_rules
from isoaudit.audit.api.errors import install_error_handlers
from isoaudit.audit.api.limits import BodySizeLimit
from isoaudit.audit.api.routers import alerts, control, environment, health, ingest, metrics, runs
from isoaudit.audit.api.telemetry import Telemetry
from isoaudit.audit.db import Store
from isoaudit.audit.settings import Settings
from isoaudit.audit.trackers.setup import compose_steps, tracker_channels, worker_trackers
from prometheus_client import CollectorRegistry


def create_app(
    store: Store | None = None,
    settings: Settings | None = None,
    *,
    alert_engine: AlertEngine | None = None,
) -> FastAPI:
    """A ready app. Pass a ``store`` to share one (tests); otherwise one is opened from
    ``settings.database_url`` (SQLite migrates itself; a server database must have been upgraded with
    ``isoaudit db upgrade``) and closed on shutdown. On start-up it installs the alert rules and starts
    the comparison worker with ``alert_engine.evaluate`` as its per-step callback."""
    settings = settings or Settings.from_env()
    owns_store = store is None
    store = store or Store(settings.database_url, timeout_s=settings.database_timeout_s)
    trackers = worker_trackers(store) if settings.run_worker else None  # ISOAUDIT_WANDB_*, ISOAUDIT_MLFLOW_*
    alert_engine = alert_engine or default_alert_engine(store, settings, tracker_channels(trackers))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        install_configured_rules(app.state.store, settings)
        worker = None
        if settings.run_worker:
            from isoaudit.audit.worker import ComparisonWorker

            worker = ComparisonWorker(
                app.state.store,
                on_step=compose_steps(alert_engine.evaluate, trackers.on_step if trackers else None),
                interval=settings.worker_interval_s,
                lease_s=settings.worker_lease_s,
                processes=settings.worker_processes,
            ).start()
            alert_engine.start()  # the outbox goes out from where comparison runs
        app.state.worker = worker
        try:
            yield
        finally:
            if worker is not None:
                worker.stop()
            alert_engine.close()
            if trackers is not None:
                trackers.close()
            if owns_store:
                app.state.store.dispose()

    app = FastAPI(
        title="isoaudit",
        version=__version__,
        summary="Ingest, query and control API of isoaudit: train-rollout numerical mismatch of RL on LLMs.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.store = store
    app.state.alert_engine = alert_engine
    app.state.registry = CollectorRegistry()
    app.state.telemetry = Telemetry(app.state.registry)
    app.state.worker = None
    install_error_handlers(app)
    for router in (
        health.router,
        metrics.router,
        ingest.router,
        runs.router,
        environment.router,
        control.router,
        alerts.router,
    ):
        app.include_router(router)
    app.add_middleware(BodySizeLimit, max_body_bytes=settings.max_body_bytes)
    _document_batch(app)
    return app


def _document_batch(app: FastAPI) -> None:
    """``POST /v1/ingest`` reads its body by hand (one fast JSON parse of a large batch); put the Batch
    schema into the OpenAPI document so clients and schemathesis see it."""
    from fastapi.openapi.utils import get_openapi
    from isoaudit.audit.records import Batch

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            batch = Batch.model_json_schema(ref_template="#/components/schemas/{model}")
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components.update(batch.pop("$defs", {}))
            components["Batch"] = batch
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the schema is to replace app.openapi
