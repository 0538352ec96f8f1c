"""Silences: mute notifications of matching alerts for a while. Alerts still change state and are
stored; only the log and webhook stay quiet. A firing alert whose notice was silenced is announced
once the silence expires, if it is still firing then."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta

from isoaudit.audit.db import Store
from isoaudit.audit.db.alerts import Silence, SilenceRepository
from isoaudit.audit.records import AwareTimestamp, RunId, utc_timestamp, utcnow
from pydantic import BaseModel, ConfigDict, Field, model_validator


class SilenceSpec(BaseModel):
    """What to silence and until when. Unset matchers match anything; ``labels`` must all be on the
    alert (its rule's labels plus ``alertname``, ``severity``, ``metric``)."""

    model_config = ConfigDict(extra="forbid")

    rule: str | None = Field(default=None, max_length=128, description="rule name")
    run_id: RunId | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    starts_at: AwareTimestamp | None = Field(default=None, description="default: now")
    ends_at: AwareTimestamp | None = Field(default=None, description="give ends_at or duration_s")
    duration_s: float | None = Field(
        default=None, gt=0, le=10 * 365 * 86400, description="seconds from starts_at"
    )
    comment: str = Field(default="", max_length=2000)

    @model_validator(mode="after")
    def _one_end(self) -> SilenceSpec:
        if (self.ends_at is None) == (self.duration_s is None):
            raise ValueError("ends_at or duration_s: give exactly one")
        return self

    def window(self, now: datetime) -> tuple[datetime, datetime]:
        starts = self.starts_at or now
        try:
            ends = self.ends_at or utc_timestamp(starts + timedelta(seconds=self.duration_s or 0))
        except (OverflowError, ValueError):
            raise ValueError("ends_at: starts_at + duration_s lies past the year 9999") from None
        if ends <= starts:
            raise ValueError("ends_at: must be after starts_at")
        return starts, ends


def create_silence(
    store: Store, spec: SilenceSpec, *, project: str | None, created_by: str = "", now: datetime | None = None
) -> Silence:
    starts, ends = spec.window(now or utcnow())
    return SilenceRepository(store.sessions).create(
        project=project,
        rule=spec.rule,
        run_id=spec.run_id,
        labels=spec.labels,
        starts_at=starts,
        ends_at=ends,
        created_by=created_by,
        comment=spec.comment,
    )


def list_silences(
    store: Store, project: str | None = None, *, active_at: datetime | None = None
) -> list[Silence]:
    """Silences of ``project`` (and global ones; all when None), optionally only those active at a time."""
    return SilenceRepository(store.sessions).list(project, active_at=active_at)


def get_silence(store: Store, silence_id: int) -> Silence | None:
    return SilenceRepository(store.sessions).get(silence_id)


def expire_silence(store: Store, silence_id: int, now: datetime | None = None) -> bool:
    """End a silence now (kept for the record). False if there is no such silence."""
    return SilenceRepository(store.sessions).expire(silence_id, now or utcnow())


def matches(
    silence: Silence, *, project: str, rule: str, run_id: str, labels: Mapping[str, str], at: datetime
) -> bool:
    """Whether ``silence`` mutes an alert of ``rule`` on ``run_id`` with ``labels`` at time ``at``."""
    if not silence.active(at):
        return False
    if silence.project is not None and silence.project != project:
        return False
    if silence.rule is not None and silence.rule != rule:
        return False
    if silence.run_id is not None and silence.run_id != run_id:
        return False
    return all(labels.get(key) == value for key, value in silence.labels.items())
