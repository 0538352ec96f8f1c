"""The runs page: every run with its status, latest figures, open alerts and remediation modes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from isoaudit.audit.control import ControlRecord
from isoaudit.audit.db.codec import read_one, readable
from isoaudit.audit.db.models import (
    OPEN_STATES,
    AlertRow,
    RunRow,
    SampleRow,
    StepResultRow,
)
from isoaudit.audit.db.reads.common import LIVE_WITHIN, SIDES, aware
from isoaudit.audit.db.store import Store
from isoaudit.audit.records import Manifest, utcnow
from sqlalchemy import func, select
from sqlalchemy.orm import Session


@dataclass(frozen=True)
class AppliedMode:
    """The remediation mode one side last reported in a manifest, and when."""

    side: str
    mode: str | None
    at: datetime | None


@dataclass(frozen=True)
class RunOverview:
    run_id: str
    project: str
    name: str
    started_at: datetime
    config: dict[str, Any]
    status: str  # "live" | "idle"
    last_step: int | None
    last_ingest_at: datetime | None
    kl_k3: float | None
    exact_match_fraction: float | None
    sparkline: list[tuple[int, float | None]]
    open_alerts: int
    control: ControlRecord
    applied: dict[str, AppliedMode]


def _latest_ingest(session: Session, run_id: str) -> tuple[int | None, datetime | None]:
    """The run's newest step with samples and when its latest sample arrived (index lookups only)."""
    last = session.scalar(select(func.max(SampleRow.step)).where(SampleRow.run_id == run_id))
    if last is None:
        return None, None
    at = session.scalar(
        select(func.max(SampleRow.created_at)).where(SampleRow.run_id == run_id, SampleRow.step == last)
    )
    return last, aware(at)


def applied_modes(manifests: Sequence[Manifest]) -> dict[str, AppliedMode]:
    """Each side's last reported remediation mode (manifests oldest first, as the store returns them)."""
    found = {side: AppliedMode(side, None, None) for side in SIDES}
    for manifest in manifests:
        found[manifest.side] = AppliedMode(manifest.side, manifest.runtime.remediation, manifest.created_at)
    return found


def run_status(last_ingest_at: datetime | None, now: datetime | None = None) -> str:
    """``live`` while records arrived within :data:`LIVE_WITHIN`, else ``idle``."""
    now = now or utcnow()
    return "live" if last_ingest_at is not None and now - last_ingest_at <= LIVE_WITHIN else "idle"


def _overview(store: Store, run: RunRow, open_alerts: int, spark: int, now: datetime) -> RunOverview:
    with store.sessions() as session:
        last_step, last_ingest = _latest_ingest(session, run.run_id)
        newest_first = session.execute(
            select(StepResultRow.step, StepResultRow.metrics)
            .where(StepResultRow.run_id == run.run_id)
            .order_by(StepResultRow.step.desc())
            .limit(spark)
        ).all()
    recent = newest_first[::-1]
    latest = recent[-1][1] if recent else {}
    return RunOverview(
        run_id=run.run_id,
        project=run.project,
        name=run.name,
        started_at=aware(run.started_at) or now,
        config=dict(run.config),
        status=run_status(last_ingest, now),
        last_step=last_step,
        last_ingest_at=last_ingest,
        kl_k3=latest.get("kl_k3"),
        exact_match_fraction=latest.get("exact_match_fraction"),
        sparkline=[(step, metrics.get("kl_k3")) for step, metrics in recent],
        open_alerts=open_alerts,
        control=store.get_control(run.run_id),
        applied=applied_modes(store.manifests(run.run_id)),
    )


def runs_overview(
    store: Store, *, project: str | None = None, spark: int = 50, now: datetime | None = None
) -> list[RunOverview]:
    """Every run, newest first, with what the runs page shows of it (a run whose stored row cannot
    be read back is left out, and logged)."""
    now = now or utcnow()
    query = select(RunRow).order_by(RunRow.started_at.desc(), RunRow.run_id)
    if project is not None:
        query = query.where(RunRow.project == project)
    open_query = (
        select(AlertRow.run_id, func.count()).where(AlertRow.state.in_(OPEN_STATES)).group_by(AlertRow.run_id)
    )
    with store.sessions() as session:
        runs = list(session.scalars(query))
        open_alerts = dict(session.execute(open_query).all())
    return readable(
        runs,
        lambda run: _overview(store, run, open_alerts.get(run.run_id, 0), spark, now),
        lambda run: f"run {run.run_id!r}",
    )


def run_overview(store: Store, run_id: str, *, now: datetime | None = None) -> RunOverview | None:
    """One run's overview (None if unknown); raises ``UnreadableRow`` if its stored row cannot be read."""
    with store.sessions() as session:
        run = session.get(RunRow, run_id)
        if run is None:
            return None
        n_open = session.scalar(
            select(func.count()).where(AlertRow.run_id == run_id, AlertRow.state.in_(OPEN_STATES))
        )
    return read_one(
        run, lambda row: _overview(store, row, int(n_open or 0), 50, now or utcnow()), f"run {run_id!r}"
    )
