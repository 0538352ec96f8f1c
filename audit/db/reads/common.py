"""What every view shares: the two sides, when a run counts as live, UTC timestamps."""

from __future__ import annotations

from datetime import datetime, timedelta

from isoaudit.audit.records import utcnow

SIDES = ("trainer", "rollout")

#: A run whose newest record is older than this is idle: its pages stop polling.
LIVE_WITHIN = timedelta(minutes=2)


def aware(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes of what were UTC ones."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=utcnow().tzinfo)
