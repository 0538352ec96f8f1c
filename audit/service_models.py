"""ORM tables of the service (issue 6): API tokens, each run's desired remediation mode, alert rules,
alerts, silences and the notifications sent about alerts. Mirrored by ``migrations/versions/0002_*``.

Kept apart from ``audit.models`` (the records and comparison results) because they describe who may
talk to the service and what it told people, not what the two sides computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from isoaudit.audit.models import Base, RowId
from isoaudit.audit.records import utcnow
from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column

#: States of an alert that is still open (at most one per rule and run).
OPEN_STATES = ("pending", "firing")


class ApiTokenRow(Base):
    """A bearer token of one project. Only a SHA-256 of the secret is kept; ``token_id`` (public, part
    of the token) finds the row so the secret is then compared in constant time."""

    __tablename__ = "api_tokens"

    token_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project: Mapped[str] = mapped_column(String(128), index=True)
    name: Mapped[str] = mapped_column(String(256), default="")
    secret_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column()


class RunControlRow(Base):
    """The remediation mode a run's collectors should apply, versioned for optimistic updates."""

    __tablename__ = "run_controls"

    run_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True
    )
    mode: Mapped[str] = mapped_column(String(16), default="native")
    version: Mapped[int] = mapped_column(Integer, default=0)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_by: Mapped[str] = mapped_column(String(256), default="")


class AlertRuleRow(Base):
    """One alert rule (DESIGN.md, "Alerts"). ``project`` NULL means it applies to every project's runs."""

    __tablename__ = "alert_rules"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    project: Mapped[str | None] = mapped_column(String(128), index=True)
    metric: Mapped[str] = mapped_column(String(128))
    comparison: Mapped[str] = mapped_column(String(2))
    threshold: Mapped[float] = mapped_column(Float)
    window_steps: Mapped[int] = mapped_column(Integer, default=1)
    aggregation: Mapped[str] = mapped_column(String(8), default="last")
    for_steps: Mapped[int] = mapped_column(Integer, default=0)
    keep_firing_for: Mapped[int] = mapped_column(Integer, default=0)
    severity: Mapped[str] = mapped_column(String(16), default="warning")
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    description: Mapped[str] = mapped_column(Text, default="")
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    source: Mapped[str] = mapped_column(String(16), default="api")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow)


class AlertRow(Base):
    """One episode of a rule on a run: pending, then firing, then resolved (or back to inactive when it
    cleared before firing). The partial unique index keeps one open alert per (rule, run)."""

    __tablename__ = "alerts"
    __table_args__ = (
        Index(
            "uq_alerts_open_rule_run",
            "rule_id",
            "run_id",
            unique=True,
            sqlite_where=text("state IN ('pending', 'firing')"),
            postgresql_where=text("state IN ('pending', 'firing')"),
        ),
        Index("ix_alerts_run_state", "run_id", "state"),
    )

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    rule_id: Mapped[int] = mapped_column(RowId, ForeignKey("alert_rules.id", ondelete="CASCADE"))
    run_id: Mapped[str] = mapped_column(String(128), ForeignKey("runs.run_id", ondelete="CASCADE"))
    state: Mapped[str] = mapped_column(String(16))
    severity: Mapped[str] = mapped_column(String(16))
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    value: Mapped[float | None] = mapped_column(Float)
    started_step: Mapped[int] = mapped_column(BigInteger)
    fired_step: Mapped[int | None] = mapped_column(BigInteger)
    resolved_step: Mapped[int | None] = mapped_column(BigInteger)
    last_step: Mapped[int] = mapped_column(BigInteger)
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    fired_at: Mapped[datetime | None] = mapped_column()
    resolved_at: Mapped[datetime | None] = mapped_column()
    firing_notified: Mapped[bool] = mapped_column(Boolean, default=False)
    resolved_notified: Mapped[bool] = mapped_column(Boolean, default=False)


class SilenceRow(Base):
    """Suppresses notifications (not state changes) of matching alerts until ``ends_at``. A NULL
    matcher matches anything; ``labels`` must all be present on the alert with equal values."""

    __tablename__ = "silences"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    project: Mapped[str | None] = mapped_column(String(128), index=True)
    rule_name: Mapped[str | None] = mapped_column(String(128))
    run_id: Mapped[str | None] = mapped_column(String(128))
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    starts_at: Mapped[datetime] = mapped_column(default=utcnow)
    ends_at: Mapped[datetime] = mapped_column()
    created_by: Mapped[str] = mapped_column(String(256), default="")
    comment: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class NotificationRow(Base):
    """What each channel did with one alert transition: sent, failed (with the error) or silenced."""

    __tablename__ = "alert_notifications"

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    alert_id: Mapped[int] = mapped_column(RowId, ForeignKey("alerts.id", ondelete="CASCADE"), index=True)
    event: Mapped[str] = mapped_column(String(16))
    channel: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    payload: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class NoticeOutboxRow(Base):
    """A notice waiting for (or done with) one destination: written in the transaction that claims
    the announcement, delivered by the worker's thread for that destination, so a notice survives a
    restart and one slow destination holds up no other. ``destination``: a digest of the URL (the
    URL itself is a secret and stays in the configuration); ``attempts_log``: each attempt made."""

    __tablename__ = "alert_outbox"
    __table_args__ = (Index("ix_alert_outbox_destination_status", "destination", "status", "id"),)

    id: Mapped[int] = mapped_column(RowId, primary_key=True, autoincrement=True)
    alert_id: Mapped[int] = mapped_column(RowId, ForeignKey("alerts.id", ondelete="CASCADE"))
    event: Mapped[str] = mapped_column(String(16))
    channel: Mapped[str] = mapped_column(String(64))
    destination: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), default="pending")
    notice: Mapped[dict[str, Any]] = mapped_column(default=dict)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    attempts_log: Mapped[list[Any]] = mapped_column(default=list)
    next_attempt_at: Mapped[datetime] = mapped_column(default=utcnow)
    claimed_by: Mapped[str | None] = mapped_column(String(128))
    claimed_until: Mapped[datetime | None] = mapped_column()
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


REMEDIATION_MODES = ("native", "invariant")


@dataclass(frozen=True)
class ControlState:
    """A run's desired remediation mode; ``version`` 0 means nobody has set it yet (``native``)."""

    run_id: str
    mode: str
    version: int
    updated_at: datetime | None = None
    updated_by: str = ""


class StaleControlVersion(Exception):
    """An update named a version other than the current one (someone else changed it first)."""

    def __init__(self, current: ControlState) -> None:
        super().__init__(f"version: {current.run_id} is at version {current.version}, not the one given")
        self.current = current
