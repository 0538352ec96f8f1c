"""Where alert notices go: the log, the database, and HTTP receivers: a Slack-compatible webhook
here, Alertmanager (``audit.alerts.alertmanager``) on the same :class:`HttpChannel` base.

A channel never raises: it returns a :class:`Delivery` saying what happened (sent, or failed with the
error after its retries, and every attempt it made), and the engine records that in
``alert_notifications``. Alerting must not break comparison, and a dead webhook must not stop the
other channels.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, ClassVar, Literal, Protocol

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
    #: When the alert started firing, and (a resolution) when it resolved.
    fired_at: datetime | None = None
    resolved_at: datetime | None = None
    #: The step's first diverging region and the position in it (None where it cannot be located).
    first_divergence_region: str | None = None
    first_divergence_position: int | None = None

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
            "fired_at": _iso(self.fired_at),
            "resolved_at": _iso(self.resolved_at),
            "first_divergence": self.first_divergence(),
        }

    def first_divergence(self) -> str | None:
        """Where the step first diverges, as a reader says it (``layers.3.mlp at position 17``)."""
        if self.first_divergence_region is None:
            return None
        if self.first_divergence_position is None:
            return self.first_divergence_region
        return f"{self.first_divergence_region} at position {self.first_divergence_position}"

    def to_record(self) -> dict[str, Any]:
        """The notice as JSON-safe values, for the outbox's row (:meth:`from_record` reads it back)."""
        record = dataclasses.asdict(self)
        record["fired_at"], record["resolved_at"] = _iso(self.fired_at), _iso(self.resolved_at)
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Notice:
        """The notice :meth:`to_record` wrote (fields a row written by an older version lacks keep
        their defaults)."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in record.items() if k in known}
        for key in ("fired_at", "resolved_at"):
            if isinstance(values.get(key), str):
                values[key] = datetime.fromisoformat(values[key])
        return cls(**values)


def _iso(moment: datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


@dataclass
class Delivery:
    """What a channel did with one notice. ``payload``: what was sent, and (a webhook) under
    ``delivery_attempts`` each attempt: when, how long it took, what came back, how long it then
    waited (:func:`attempts_of` reads it back)."""

    channel: str
    status: Literal["sent", "failed", "stored"]
    attempts: int = 1
    error: str | None = None
    payload: dict[str, Any] = field(default_factory=dict)


#: The key of a stored notification's payload that lists each delivery attempt.
ATTEMPTS_KEY = "delivery_attempts"


def attempts_of(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Each attempt a channel made, oldest first: ``attempt``, ``at`` (UTC, ISO 8601), ``took_s``,
    ``outcome`` (``sent``, ``HTTP 503: ...``, ``ReadTimeout: ...``) and ``wait_s`` (the backoff that
    followed; absent after the last)."""
    return list(payload.get(ATTEMPTS_KEY) or [])


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
    if notice.first_divergence() is not None:
        fields.append({"title": "First divergence", "value": notice.first_divergence(), "short": False})
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


class HttpChannel:
    """POSTs a JSON body built from each notice to ``url``; subclasses say what the body is
    (:meth:`payload`, :meth:`body`). Transport errors (refused, reset, timed out after
    ``timeout_s``), 429 and 5xx are retried with exponential backoff: ``backoff_s``, doubled per
    attempt up to ``backoff_max_s``, at most ``attempts`` tries, so one notice gives up after at
    most :attr:`give_up_after_s`. Other 4xx and unusable URLs are not retried (repeating cannot help).
    Every attempt is recorded in the delivery; never raises. Run it off the comparison worker
    (``AlertEngine(deliver_in_background=True)``, as the service does): it sleeps between attempts.
    """

    #: Delivered from the durable outbox (``audit.alerts.outbox``) when the engine runs in the background.
    durable: ClassVar[bool] = True
    #: Seconds between re-posts of a firing alert by the outbox (None: each notice is sent once).
    repost_s: float | None = None
    #: The channel's name unless the constructor is given one (several destinations: ``webhook-2``).
    default_name: ClassVar[str] = "http"

    def __init__(
        self,
        url: str,
        *,
        attempts: int = 8,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        timeout_s: float = 5.0,
        name: str | None = None,
        client: httpx.Client | None = None,
    ) -> None:
        if backoff_s < 0 or backoff_max_s < backoff_s:
            raise ValueError(f"backoff_s: must be in [0, backoff_max_s={backoff_max_s}], got {backoff_s}")
        self.url = url
        self.attempts = max(1, attempts)
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.timeout_s = timeout_s
        self.name = name or self.default_name
        self._client = client

    def payload(self, notice: Notice, now: datetime) -> dict[str, Any]:
        """What this channel sends for ``notice`` at ``now``, as recorded with the notification."""
        raise NotImplementedError

    def body(self, payload: dict[str, Any]) -> Any:
        """The JSON body POSTed for ``payload`` (the payload itself, unless a receiver wants another shape)."""
        return payload

    def wait_s(self, attempt: int) -> float:
        """The backoff after failed attempt number ``attempt`` (1-based)."""
        return min(self.backoff_max_s, self.backoff_s * 2 ** (attempt - 1))

    @property
    def give_up_after_s(self) -> float:
        """The bound on one notice's delivery: every attempt timing out, every backoff waited."""
        return self.attempts * self.timeout_s + sum(self.wait_s(a) for a in range(1, self.attempts))

    @property
    def destination(self) -> str:
        """A digest of the URL that names this destination in the outbox (a webhook URL is a secret)."""
        return hashlib.sha256(self.url.encode()).hexdigest()[:16]

    def attempt(self, payload: dict[str, Any]) -> tuple[str, bool]:
        """POST once: ``("sent", False)``, or the error and whether it is worth trying again
        (transport errors, 429, 5xx); never raises."""
        try:
            client = self._client or httpx.Client(timeout=self.timeout_s)
            try:
                response = client.post(self.url, json=self.body(payload))
            finally:
                if self._client is None:
                    client.close()
            if response.is_success:
                return "sent", False
            error = f"HTTP {response.status_code}: {response.text[:200]}"
            return error, response.status_code == 429 or response.status_code >= 500
        except Exception as exc:  # transport errors, bad URLs: recorded, never raised
            # Refused, reset, timed out: may pass. A URL httpx cannot use never will.
            retry = isinstance(exc, httpx.TransportError) and not isinstance(exc, httpx.UnsupportedProtocol)
            return f"{type(exc).__name__}: {exc}", retry

    def send(self, notice: Notice) -> Delivery:
        """Deliver with every retry in line (sleeping between attempts): for engines that deliver
        synchronously; the service delivers from the outbox instead, one attempt at a time."""
        payload = self.payload(notice, datetime.now(UTC))
        record: list[dict[str, Any]] = []
        error = "not attempted"
        for attempt in range(1, self.attempts + 1):
            at, started = datetime.now(UTC), time.monotonic()
            outcome, retry = self.attempt(payload)
            record.append(attempt_record(attempt, at, started, outcome))
            if outcome == "sent":
                return Delivery(self.name, "sent", attempt, None, {**payload, ATTEMPTS_KEY: record})
            error = outcome
            if not retry or attempt == self.attempts:
                break  # refused as such (repeating will not help), or out of attempts
            record[-1]["wait_s"] = self.wait_s(attempt)
            time.sleep(record[-1]["wait_s"])
        log.error(
            "%s gave up on alert %s (%s) after %d attempts: %s",
            self.name,
            notice.alert_id,
            notice.event,
            attempt,
            error,
        )
        return Delivery(self.name, "failed", attempt, error, {**payload, ATTEMPTS_KEY: record})


class WebhookChannel(HttpChannel):
    """POSTs :func:`slack_payload` to a Slack-compatible incoming webhook, with :class:`HttpChannel`'s
    retries."""

    default_name = "webhook"

    def payload(self, notice: Notice, now: datetime) -> dict[str, Any]:
        return slack_payload(notice)


def attempt_record(attempt: int, at: datetime, started: float, outcome: str) -> dict[str, Any]:
    return {
        "attempt": attempt,
        "at": at.isoformat(),
        "took_s": round(time.monotonic() - started, 4),
        "outcome": outcome,
    }
