"""What ``/metrics`` reads at scrape time: each run's latest compared step with its metrics, the open
alerts, and how many samples wait for comparison; all runs, or one project's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from isoaudit.audit.db.alerts import OPEN_STATES, Alert, select_alerts
from isoaudit.audit.db.models import PendingComparisonRow, RunRow, StepResultRow
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker


@dataclass(frozen=True)
class LatestStep:
    """A run's latest compared step and its metrics."""

    run_id: str
    project: str
    step: int
    metrics: dict[str, Any]


@dataclass(frozen=True)
class Telemetry:
    """One scrape's reading of the store."""

    latest_steps: list[LatestStep]
    open_alerts: list[Alert]
    pending_comparisons: int


class TelemetryReads:
    """Reads :class:`Telemetry`, in one session so its parts agree."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def read(self, project: str | None = None) -> Telemetry:
        """The figures of every run, or of ``project``'s runs only."""
        latest = select(StepResultRow.run_id, func.max(StepResultRow.step).label("step")).group_by(
            StepResultRow.run_id
        )
        if project is not None:
            latest = latest.join(RunRow, RunRow.run_id == StepResultRow.run_id).where(
                RunRow.project == project
            )
        latest_sq = latest.subquery()
        steps = (
            select(StepResultRow.run_id, RunRow.project, StepResultRow.step, StepResultRow.metrics)
            .join(
                latest_sq,
                (latest_sq.c.run_id == StepResultRow.run_id) & (latest_sq.c.step == StepResultRow.step),
            )
            .join(RunRow, RunRow.run_id == StepResultRow.run_id)
        )
        queue = select(func.count()).select_from(PendingComparisonRow)
        if project is not None:
            queue = queue.join(RunRow, RunRow.run_id == PendingComparisonRow.run_id).where(
                RunRow.project == project
            )
        with self.sessions() as session:
            return Telemetry(
                latest_steps=[
                    LatestStep(run_id, run_project, step, dict(metrics or {}))
                    for run_id, run_project, step, metrics in session.execute(steps)
                ],
                open_alerts=select_alerts(session, project=project, states=OPEN_STATES, limit=None),
                pending_comparisons=int(session.scalar(queue) or 0),
            )
