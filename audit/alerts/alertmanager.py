"""Prometheus Alertmanager as a notice channel: each notice becomes an alert of Alertmanager's API v2
(``POST /api/v2/alerts``, a list of ``postableAlert``), so isoaudit's alerts are routed, grouped,
silenced and inhibited there beside every other alert of a deployment.

Alertmanager keeps an alert active until its ``endsAt``. A firing notice therefore carries an
``endsAt`` a few re-post intervals ahead and is posted again every ``repost_s`` while the alert fires
(the outbox does it: ``audit.alerts.outbox``), as Prometheus re-sends its firing alerts; the
resolution carries the moment it resolved, which Alertmanager marks resolved at once. Should isoaudit
stop, the alert ends in Alertmanager by itself ``ends_after_s`` after the last post.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from isoaudit.audit.alerts.channels import HttpChannel, Notice

#: Where Alertmanager takes alerts, below its base URL.
ALERTS_PATH = "/api/v2/alerts"
#: The labels isoaudit sets on every alert; a rule's own labels of these names give way.
IDENTITY_LABELS = ("alertname", "run", "project", "severity")


def rfc3339(moment: datetime) -> str:
    """``moment`` in UTC as RFC 3339 with milliseconds (``2024-05-01T12:00:00.000Z``)."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def postable_alert(notice: Notice, now: datetime, ends_after_s: float) -> dict[str, Any]:
    """One ``postableAlert`` for ``notice`` posted at ``now``: labels identify the alert (the rule's
    own labels, valid Prometheus label names as rules are validated, then ``alertname`` = the rule, ``run``, ``project`` and ``severity``, which win);
    annotations describe it (``summary``, ``description``, ``first_divergence``, ``dashboard_url``,
    ``value``, ``step``). A firing alert ends ``ends_after_s`` after ``now`` unless posted again; a
    resolution ends when the alert resolved."""
    labels = {key: str(value) for key, value in notice.labels.items() if str(value)}
    labels.update(alertname=notice.rule, run=notice.run_id, project=notice.project, severity=notice.severity)
    value = "no data" if notice.value is None else f"{notice.value:.6g}"
    annotations = {
        "summary": notice.headline(),
        "description": notice.description
        or f"{notice.condition} on run {notice.run_id}: {value} at step {notice.step}",
        "dashboard_url": notice.url,
        "value": value,
        "step": str(notice.step),
        "condition": notice.condition,
    }
    if notice.first_divergence() is not None:
        annotations["first_divergence"] = str(notice.first_divergence())
    starts = notice.fired_at or now
    if notice.event == "resolved":
        ends = max(notice.resolved_at or now, starts)
    else:
        ends = max(now, starts) + timedelta(seconds=ends_after_s)
    return {
        "labels": labels,
        "annotations": annotations,
        "startsAt": rfc3339(starts),
        "endsAt": rfc3339(ends),
        "generatorURL": notice.url,
    }


def alerts_url(base_url: str) -> str:
    """The alerts endpoint of the Alertmanager at ``base_url`` (a URL that names it already stays)."""
    base = base_url.rstrip("/")
    return base if base.endswith(ALERTS_PATH) else base + ALERTS_PATH


class AlertmanagerChannel(HttpChannel):
    """Posts notices to the Alertmanager at ``base_url`` (``http://alertmanager:9093``), with
    :class:`HttpChannel`'s retries and through the same durable outbox as the webhook. While an
    alert fires the outbox posts it again every ``repost_s``; each post keeps it active for
    ``ends_after_s`` (default four re-post intervals, as Prometheus does). Sent synchronously (an
    engine that does not deliver in the background), a firing alert is posted once and ends in
    Alertmanager ``ends_after_s`` later."""

    default_name = "alertmanager"

    def __init__(
        self,
        base_url: str,
        *,
        repost_s: float = 60.0,
        ends_after_s: float | None = None,
        attempts: int = 8,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        timeout_s: float = 5.0,
        name: str | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        if repost_s <= 0:
            raise ValueError(f"repost_s: must be > 0, got {repost_s}")
        ends_after_s = 4 * repost_s if ends_after_s is None else ends_after_s
        if ends_after_s <= repost_s:
            raise ValueError(
                f"ends_after_s: must exceed repost_s={repost_s} (the alert would end between posts), "
                f"got {ends_after_s}"
            )
        super().__init__(
            alerts_url(base_url),
            attempts=attempts,
            backoff_s=backoff_s,
            backoff_max_s=backoff_max_s,
            timeout_s=timeout_s,
            name=name,
            client=client,
        )
        self.repost_s = repost_s
        self.ends_after_s = ends_after_s

    def payload(self, notice: Notice, now: datetime) -> dict[str, Any]:
        """``{"alerts": [postableAlert]}``: the recorded form (a notification's payload is an object)."""
        return {"alerts": [postable_alert(notice, now, self.ends_after_s)]}

    def body(self, payload: dict[str, Any]) -> Any:
        """The list of alerts Alertmanager's API takes."""
        return payload["alerts"]
