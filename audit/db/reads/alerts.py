"""The alerts page: open and resolved alerts, the rules that apply, the silences."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from isoaudit.audit.alerts.history import AlertView, list_alerts
from isoaudit.audit.alerts.rules import AlertRule, list_rule_rows, rule_from_row
from isoaudit.audit.alerts.silences import list_silences
from isoaudit.audit.db.models import (
    OPEN_STATES,
    SilenceRow,
)
from isoaudit.audit.db.reads.common import aware
from isoaudit.audit.db.store import Store


@dataclass(frozen=True)
class SilenceView:
    """One silence: what it matches (None: anything) and when it holds."""

    id: int
    project: str | None
    rule: str | None
    run_id: str | None
    labels: dict[str, Any]
    starts_at: datetime
    ends_at: datetime
    created_by: str
    comment: str

    def active(self, now: datetime) -> bool:
        return self.starts_at <= now < self.ends_at

    @classmethod
    def of(cls, row: SilenceRow) -> SilenceView:
        return cls(
            row.id,
            row.project,
            row.rule_name,
            row.run_id,
            dict(row.labels),
            aware(row.starts_at) or row.starts_at,
            aware(row.ends_at) or row.ends_at,
            row.created_by,
            row.comment,
        )


@dataclass(frozen=True)
class AlertsView:
    open: list[AlertView]
    resolved: list[AlertView]
    rules: list[AlertRule]
    silences: list[SilenceView]


def alerts_view(store: Store, *, run_id: str | None = None, limit: int = 500) -> AlertsView:
    """Open and resolved alerts (newest first), the rules and the silences."""
    alerts = list_alerts(store, run_id=run_id, limit=limit)
    project = store.run_project(run_id) if run_id is not None else None
    rules = [rule_from_row(row) for row in list_rule_rows(store, project)]
    return AlertsView(
        open=[a for a in alerts if a.state in OPEN_STATES],
        resolved=[a for a in alerts if a.state not in OPEN_STATES],
        rules=rules,
        silences=[SilenceView.of(row) for row in list_silences(store, project)],
    )


def run_rules(store: Store, run_id: str) -> list[AlertRule]:
    """The enabled rules that apply to a run (its project's and the global ones)."""
    project = store.run_project(run_id)
    return [rule_from_row(row) for row in list_rule_rows(store, project) if row.enabled]
