"""Reading alerts and their notifications back: for the API, the dashboard and the CLI."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from isoaudit.audit.alerts.channels import attempts_of
from isoaudit.audit.db import Store
from isoaudit.audit.db.alerts import Alert, AlertRepository, StoredNotification


def list_alerts(
    store: Store,
    *,
    project: str | None = None,
    run_id: str | None = None,
    states: Sequence[str] | None = None,
    alert_id: int | None = None,
    limit: int = 1000,
) -> list[Alert]:
    """Alerts newest first, filtered by project (of the run), run, states or id."""
    return AlertRepository(store.sessions).list(
        project=project, run_id=run_id, states=states, alert_id=alert_id, limit=limit
    )


def get_alert(store: Store, alert_id: int) -> Alert | None:
    return AlertRepository(store.sessions).get(alert_id)


def notifications(store: Store, alert_id: int) -> list[StoredNotification]:
    """What each channel did with each transition of one alert, oldest first."""
    return AlertRepository(store.sessions).notifications(alert_id)


def delivery_attempts(notification: StoredNotification) -> list[dict[str, Any]]:
    """Each attempt the channel made for one notification, oldest first (a webhook records when,
    how long, what came back and the backoff that followed; other channels record none)."""
    return attempts_of(notification.payload)
