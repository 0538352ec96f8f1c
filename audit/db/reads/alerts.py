"""The alerts page: open and resolved alerts, the rules that apply, the silences."""

from __future__ import annotations

from dataclasses import dataclass

from isoaudit.audit.alerts.history import list_alerts
from isoaudit.audit.alerts.rules import AlertRule, list_rule_rows, rule_from_row
from isoaudit.audit.alerts.silences import list_silences
from isoaudit.audit.db.alerts import Alert, Silence
from isoaudit.audit.db.models import OPEN_STATES
from isoaudit.audit.db.store import Store


@dataclass(frozen=True)
class AlertsView:
    open: list[Alert]
    resolved: list[Alert]
    rules: list[AlertRule]
    silences: list[Silence]


def alerts_view(store: Store, *, run_id: str | None = None, limit: int = 500) -> AlertsView:
    """Open and resolved alerts (newest first), the rules and the silences."""
    alerts = list_alerts(store, run_id=run_id, limit=limit)
    project = store.run_project(run_id) if run_id is not None else None
    rules = [rule_from_row(row) for row in list_rule_rows(store, project)]
    return AlertsView(
        open=[a for a in alerts if a.state in OPEN_STATES],
        resolved=[a for a in alerts if a.state not in OPEN_STATES],
        rules=rules,
        silences=list_silences(store, project),
    )


def run_rules(store: Store, run_id: str) -> list[AlertRule]:
    """The enabled rules that apply to a run (its project's and the global ones)."""
    project = store.run_project(run_id)
    return [rule_from_row(row) for row in list_rule_rows(store, project) if row.enabled]
