"""Reading alerts and their notifications back: for the API, the dashboard and ``/metrics``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from isoaudit.audit.alerts.channels import attempts_of
from isoaudit.audit.models import RunRow
from isoaudit.audit.service_models import AlertRow, AlertRuleRow, NotificationRow
from isoaudit.audit.store import Store
from sqlalchemy import select


@dataclass(frozen=True)
class AlertView:
    id: int
    rule: str
    run_id: str
    project: str
    state: str
    severity: str
    labels: dict[str, Any]
    value: float | None
    started_step: int
    fired_step: int | None
    resolved_step: int | None
    last_step: int
    started_at: datetime
    fired_at: datetime | None
    resolved_at: datetime | None
    firing_notified: bool
    resolved_notified: bool


def list_alerts(
    store: Store,
    *,
    project: str | None = None,
    run_id: str | None = None,
    states: Sequence[str] | None = None,
    alert_id: int | None = None,
    limit: int = 1000,
) -> list[AlertView]:
    """Alerts newest first, filtered by project (of the run), run, states or id."""
    query = (
        select(AlertRow, AlertRuleRow.name, RunRow.project)
        .join(AlertRuleRow, AlertRuleRow.id == AlertRow.rule_id)
        .join(RunRow, RunRow.run_id == AlertRow.run_id)
        .order_by(AlertRow.id.desc())
        .limit(limit)
    )
    if project is not None:
        query = query.where(RunRow.project == project)
    if run_id is not None:
        query = query.where(AlertRow.run_id == run_id)
    if states:
        query = query.where(AlertRow.state.in_(list(states)))
    if alert_id is not None:
        query = query.where(AlertRow.id == alert_id)
    with store.sessions() as session:
        rows = session.execute(query).all()
    return [
        AlertView(
            id=a.id,
            rule=name,
            run_id=a.run_id,
            project=proj,
            state=a.state,
            severity=a.severity,
            labels=dict(a.labels),
            value=a.value,
            started_step=a.started_step,
            fired_step=a.fired_step,
            resolved_step=a.resolved_step,
            last_step=a.last_step,
            started_at=a.started_at,
            fired_at=a.fired_at,
            resolved_at=a.resolved_at,
            firing_notified=a.firing_notified,
            resolved_notified=a.resolved_notified,
        )
        for a, name, proj in rows
    ]


def get_alert(store: Store, alert_id: int) -> AlertView | None:
    found = list_alerts(store, alert_id=alert_id, limit=1)
    return found[0] if found else None


def notifications(store: Store, alert_id: int) -> list[NotificationRow]:
    """What each channel did with each transition of one alert, oldest first."""
    query = select(NotificationRow).where(NotificationRow.alert_id == alert_id).order_by(NotificationRow.id)
    with store.sessions() as session:
        return list(session.scalars(query))


def delivery_attempts(notification: NotificationRow) -> list[dict[str, Any]]:
    """Each attempt the channel made for one notification, oldest first (a webhook records when,
    how long, what came back and the backoff that followed; other channels record none)."""
    return attempts_of(notification.payload or {})
