"""Where alert notices go: the log, a Slack-compatible webhook, and the database.

A channel never raises: it returns a :class:`Delivery` saying what happened (sent, or failed with the
error after its retries), and the engine records that in ``alert_notifications``. Alerting must not
break comparison, and a dead webhook must not stop the other channels.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx

Event = Literal["firing", "resolved"]
log = logging.getLogger("isoaudit.alerts")

_COLORS = {"critical": "#d92b2b", "warning": "#e8a33d", "info": "#3b7dd8", "resolved": "#2eb67d"}


@dataclass(frozen=True)
class Notice:
    """One transition of one alert, with everything a message needs."""

    event: Event
    alert_id: int
    rule: str
    run_id: str
    project: str
    step: int
    value: float | None
    condition: str
    severity: str
    labels: dict[str, str]
    url: str
    description: str = ""

    def headline(self) -> str:
        value = "no data" if self.value is None else f"{self.value:.6g}"
        state = "FIRING" if self.event == "firing" else "RESOLVED"
        return f"[{state}] {self.rule} ({self.severity}) on run {self.run_id} at step {self.step}: {self.condition}, value {value}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "event": self.event,
            "alert_id": self.alert_id,
            "rule": self.rule,
            "run_id": self.run_id,
            "project": self.project,
            "step": self.step,
            "value": self.value,
            "condition": self.condition,
            "severity": self.severity,
            "labels": self.labels,
            "url": self.url,
        }


@dataclass
class Delivery:
    channel: str
    status: Literal["sent", "failed", "stored"]
    attempts: int = 1
    error: str | None = None
    payload: dict[str, Any] = field(default_factory=dict)


class Channel(Protocol):
    name: str

    def send(self, notice: Notice) -> Delivery: ...


class LogChannel:
    """Notices as log lines on ``isoaudit.alerts`` (warning when firing, info when resolved)."""

    name = "log"

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or log

    def send(self, notice: Notice) -> Delivery:
        level = logging.WARNING if notice.event == "firing" else logging.INFO
        self.logger.log(level, "%s %s", notice.headline(), notice.url)
        return Delivery(self.name, "sent", payload={"message": notice.headline()})


class DatabaseChannel:
    """The durable record: the notice itself goes into ``alert_notifications`` (the engine writes it),
    readable through ``GET /v1/alerts/{id}/notifications`` and by the dashboard."""

    name = "database"

    def send(self, notice: Notice) -> Delivery:
        return Delivery(self.name, "stored", attempts=0, payload=notice.as_dict())


def slack_payload(notice: Notice) -> dict[str, Any]:
    """A Slack incoming-webhook message (``text`` plus an attachment linking to the step's dashboard
    page); the ``isoaudit`` key carries the same facts for machine receivers."""
    color = (
        _COLORS["resolved"]
        if notice.event == "resolved"
        else _COLORS.get(notice.severity, _COLORS["warning"])
    )
    fields = [
        {"title": "Run", "value": notice.run_id, "short": True},
        {"title": "Step", "value": str(notice.step), "short": True},
        {"title": "Condition", "value": notice.condition, "short": True},
        {
            "title": "Value",
            "value": "no data" if notice.value is None else f"{notice.value:.6g}",
            "short": True,
        },
    ]
    fields += [{"title": key, "value": value, "short": True} for key, value in sorted(notice.labels.items())]
    return {
        "text": f"{notice.headline()} <{notice.url}|open step {notice.step}>",
        "attachments": [
            {
                "fallback": notice.headline(),
                "color": color,
                "title": f"{notice.rule} {notice.event} on {notice.run_id}",
                "title_link": notice.url,
                "text": notice.description,
                "fields": fields,
                "footer": "isoaudit",
            }
        ],
        "isoaudit": notice.as_dict(),
    }


class WebhookChannel:
    """POSTs :func:`slack_payload` to ``url``; retries transport errors, 429 and 5xx with exponential
    backoff (``backoff_s``, doubled per attempt, at most ``attempts`` tries); never raises."""

    def __init__(
        self,
        url: str,
        *,
        attempts: int = 4,
        backoff_s: float = 0.5,
        timeout_s: float = 5.0,
        name: str = "webhook",
        client: httpx.Client | None = None,
    ) -> None:
        self.url = url
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.name = name
        self._client = client

    def send(self, notice: Notice) -> Delivery:
        payload = slack_payload(notice)
        error = "not attempted"
        for attempt in range(1, self.attempts + 1):
            try:
                client = self._client or httpx.Client(timeout=self.timeout_s)
                try:
                    response = client.post(self.url, json=payload)
                finally:
                    if self._client is None:
                        client.close()
                if response.is_success:
                    return Delivery(self.name, "sent", attempts=attempt, payload=payload)
                error = f"HTTP {response.status_code}: {response.text[:200]}"
                if response.status_code != 429 and response.status_code < 500:
                    break  # the receiver refuses this message; repeating it will not help
            except Exception as exc:  # transport errors, bad URLs: recorded, never raised
                error = f"{type(exc).__name__}: {exc}"
            if attempt < self.attempts:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
        log.error("webhook %s failed for alert %s (%s): %s", self.name, notice.alert_id, notice.event, error)
        return Delivery(self.name, "failed", attempts=attempt, error=error, payload=payload)
