"""Alert rules, alerts, silences, notifications and the notice outbox in the database: every read
and write of their rows, handed back as typed, frozen rows built inside the session (never ORM
objects), so the alerting code above holds no SQL of its own.

One repository per table family, each built on the store's ``sessionmaker``:
:class:`RuleRepository`, :class:`AlertRepository` (alerts, their notifications and the claim of an
announcement), :class:`SilenceRepository` and :class:`OutboxRepository`.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from isoaudit.audit.db.models import (
    OPEN_STATES,
    AlertRow,
    AlertRuleRow,
    NoticeOutboxRow,
    NotificationRow,
    RunRow,
    SilenceRow,
    StepResultRow,
)
from isoaudit.audit.records import utcnow
from pydantic import Field
from sqlalchemy import delete, func, or_, select, true, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.sql.dml import ReturningDelete, ReturningUpdate

__all__ = [
    "OPEN_STATES",
    "PENDING",
    "REPOST",
    "Alert",
    "AlertChange",
    "AlertRepository",
    "AlertState",
    "Notification",
    "OutboxEntry",
    "OutboxRepository",
    "QueuedNotice",
    "RuleDefinition",
    "RuleRepository",
    "Silence",
    "SilenceRepository",
    "StoredNotification",
    "StoredRule",
    "utc",
]

#: Where an alert stands; ``inactive`` is never stored (no open alert), it is what none open means.
AlertState = Literal["inactive", "pending", "firing", "resolved"]
#: The two announcements an alert makes.
NoticeEvent = Literal["firing", "resolved"]


def utc(moment: datetime) -> datetime:
    """``moment`` with its zone: SQLite hands timestamps back without one; they were written in UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


def _utc_or_none(moment: datetime | None) -> datetime | None:
    return None if moment is None else utc(moment)


# ---------------------------------------------------------------------- rules


@dataclass(frozen=True)
class RuleDefinition:
    """What a rule says, as stored (``window_steps``: the window; ``project`` None: every project)."""

    name: str
    project: str | None
    metric: str
    comparison: str
    threshold: float
    window_steps: int
    aggregation: str
    for_steps: int
    keep_firing_for: int
    severity: str
    labels: dict[str, str]
    description: str
    enabled: bool


@dataclass(frozen=True)
class StoredRule(RuleDefinition):
    """A rule as kept: its definition, where it came from (``default``, ``yaml``, ``api``) and when."""

    id: int
    source: str
    created_at: datetime
    updated_at: datetime


def _definition_values(rule: RuleDefinition) -> dict[str, Any]:
    """The columns of a definition (the name included), for an insert or an update."""
    return {field.name: getattr(rule, field.name) for field in fields(RuleDefinition)}


def _stored_rule(row: AlertRuleRow) -> StoredRule:
    return StoredRule(
        **{field.name: getattr(row, field.name) for field in fields(RuleDefinition)},
        id=row.id,
        source=row.source,
        created_at=utc(row.created_at),
        updated_at=utc(row.updated_at),
    )


class RuleRepository:
    """Alert rules by name (names are unique across projects)."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def save(self, rule: RuleDefinition, source: str) -> StoredRule:
        """Create the rule, or replace the definition of the one of that name."""
        with self.sessions.begin() as session:
            row = session.scalar(select(AlertRuleRow).where(AlertRuleRow.name == rule.name))
            values = _definition_values(rule)
            if row is None:
                row = AlertRuleRow(source=source, **values)
                session.add(row)
            else:
                for key, value in values.items():
                    setattr(row, key, value)
                row.source = source
                row.updated_at = utcnow()
            session.flush()
            return _stored_rule(row)

    def get(self, name: str) -> StoredRule | None:
        with self.sessions() as session:
            row = session.scalar(select(AlertRuleRow).where(AlertRuleRow.name == name))
            return None if row is None else _stored_rule(row)

    def list(self, project: str | None = None, *, include_global: bool = True) -> builtins.list[StoredRule]:
        """Rules of ``project`` (and the global ones), or every rule when ``project`` is None; by name."""
        query = select(AlertRuleRow).order_by(AlertRuleRow.name)
        if project is not None:
            scope = AlertRuleRow.project == project
            query = query.where(or_(scope, AlertRuleRow.project.is_(None)) if include_global else scope)
        with self.sessions() as session:
            return [_stored_rule(row) for row in session.scalars(query)]

    def delete(self, name: str) -> bool:
        """Delete a rule and (by cascade) its alerts; False if there is none of that name."""
        with self.sessions.begin() as session:
            row = session.scalar(select(AlertRuleRow).where(AlertRuleRow.name == name))
            if row is None:
                return False
            session.delete(row)
            return True


# ---------------------------------------------------------------------- alerts


@dataclass(frozen=True)
class Alert:
    """One episode of a rule on a run: the alert row everywhere it is read (the engine, the API's
    response, the dashboard, the CLI). ``project`` is the project of the alert's run, kept for
    access checks and never serialised (a reader only ever sees its own project's alerts)."""

    id: int
    rule: str
    run_id: str
    project: Annotated[str, Field(exclude=True)]
    state: AlertState
    severity: str
    labels: dict[str, str]
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


@dataclass(frozen=True)
class AlertChange:
    """A state change of an alert, made by :meth:`AlertRepository.advance`."""

    alert_id: int
    old: AlertState
    new: AlertState


@dataclass(frozen=True)
class Notification:
    """What one channel did with one announcement of an alert (``payload``: what it sent, and each
    attempt it made)."""

    alert_id: int
    event: NoticeEvent
    channel: str
    status: Literal["sent", "failed", "stored", "silenced"]
    attempts: int
    error: str | None
    payload: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class StoredNotification(Notification):
    """A notification as kept, with its id."""

    id: int


@dataclass(frozen=True)
class OutboxEntry:
    """A notice to be delivered to one destination (``notice``: the notice's fields)."""

    alert_id: int
    event: NoticeEvent
    channel: str
    destination: str
    notice: dict[str, Any]


@dataclass(frozen=True)
class QueuedNotice(OutboxEntry):
    """A notice in the outbox, taken for delivery: the attempts made so far and their record;
    ``repost``: a firing alert's periodic re-post (its notice was delivered already)."""

    id: int
    attempts: int
    attempts_log: list[dict[str, Any]]
    repost: bool = False


#: ``alert_outbox.status`` of a notice to deliver, and of a firing alert's standing re-post (one per
#: alert and destination, for channels that post firing alerts again until they resolve).
PENDING, REPOST = "pending", "repost"


def select_alerts(
    session: Session,
    *,
    project: str | None = None,
    run_id: str | None = None,
    states: Sequence[str] | None = None,
    alert_id: int | None = None,
    limit: int | None = 1000,
) -> list[Alert]:
    """Alerts newest first, filtered by project (of the run), run, states or id, read in ``session``
    (for readers of this data layer that read alerts beside other rows in one session)."""
    query = (
        select(AlertRow, AlertRuleRow.name, RunRow.project)
        .join(AlertRuleRow, AlertRuleRow.id == AlertRow.rule_id)
        .join(RunRow, RunRow.run_id == AlertRow.run_id)
        .order_by(AlertRow.id.desc())
    )
    if project is not None:
        query = query.where(RunRow.project == project)
    if run_id is not None:
        query = query.where(AlertRow.run_id == run_id)
    if states:
        query = query.where(AlertRow.state.in_(list(states)))
    if alert_id is not None:
        query = query.where(AlertRow.id == alert_id)
    if limit is not None:
        query = query.limit(limit)
    return [
        Alert(
            id=a.id,
            rule=rule,
            run_id=a.run_id,
            project=run_project,
            state=a.state,  # type: ignore[arg-type]  # the column holds only AlertState values
            severity=a.severity,
            labels=dict(a.labels),
            value=a.value,
            started_step=a.started_step,
            fired_step=a.fired_step,
            resolved_step=a.resolved_step,
            last_step=a.last_step,
            started_at=utc(a.started_at),
            fired_at=_utc_or_none(a.fired_at),
            resolved_at=_utc_or_none(a.resolved_at),
            firing_notified=a.firing_notified,
            resolved_notified=a.resolved_notified,
        )
        for a, rule, run_project in session.execute(query)
    ]


class AlertRepository:
    """Alerts (one open per rule and run), the announcements claimed for them, and their notifications."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def list(
        self,
        *,
        project: str | None = None,
        run_id: str | None = None,
        states: Sequence[str] | None = None,
        alert_id: int | None = None,
        limit: int | None = 1000,
    ) -> builtins.list[Alert]:
        """Alerts newest first, filtered by project (of the run), run, states or id."""
        with self.sessions() as session:
            return select_alerts(
                session, project=project, run_id=run_id, states=states, alert_id=alert_id, limit=limit
            )

    def get(self, alert_id: int) -> Alert | None:
        found = self.list(alert_id=alert_id, limit=1)
        return found[0] if found else None

    def open_alerts(self, run_id: str) -> dict[str, Alert]:
        """The run's open (pending or firing) alerts by rule name, in one query."""
        return {alert.rule: alert for alert in self.list(run_id=run_id, states=OPEN_STATES, limit=None)}

    def recent_metrics(self, run_id: str, limit: int) -> dict[int, dict[str, Any]]:
        """The metrics of the run's latest ``limit`` compared steps, by step: what rules evaluate."""
        query = (
            select(StepResultRow.step, StepResultRow.metrics)
            .where(StepResultRow.run_id == run_id)
            .order_by(StepResultRow.step.desc())
            .limit(limit)
        )
        with self.sessions() as session:
            return {step: metrics for step, metrics in session.execute(query)}

    def advance(
        self,
        rule_id: int,
        run_id: str,
        *,
        step: int,
        value: float | None,
        first_step: int,
        severity: str,
        labels: dict[str, str],
        now: datetime,
        decide: Callable[[AlertState], AlertState],
    ) -> AlertChange | None:
        """Move the open alert of (rule, run) to ``decide(its state)`` at ``step``, in one transaction
        holding its row (``inactive`` when none is open; one is opened, from ``first_step``, when
        the new state is open). The alert's latest value, step, severity and labels are kept either
        way. None when nothing changed: no new state, a step older than the alert has seen, or
        another evaluator opening this alert at the same moment (its change stands)."""
        query = (
            select(AlertRow)
            .where(AlertRow.rule_id == rule_id, AlertRow.run_id == run_id, AlertRow.state.in_(OPEN_STATES))
            .with_for_update()  # PostgreSQL holds the row; SQLite's one writer needs no lock
        )
        try:
            with self.sessions.begin() as session:
                alert = session.scalar(query)
                if alert is not None and step < alert.last_step:
                    return None  # an older step than this alert has seen; the newer one decided already
                current: AlertState = alert.state if alert is not None else "inactive"  # type: ignore[assignment]  # the column holds only AlertState values
                new = decide(current)
                if alert is None:
                    if new not in OPEN_STATES:
                        return None
                    alert = AlertRow(
                        rule_id=rule_id,
                        run_id=run_id,
                        state=new,
                        severity=severity,
                        labels=labels,
                        value=value,
                        started_step=first_step,
                        last_step=step,
                        started_at=now,
                        fired_step=step if new == "firing" else None,
                        fired_at=now if new == "firing" else None,
                    )
                    session.add(alert)
                    session.flush()
                else:
                    alert.value = value
                    alert.last_step = step
                    alert.severity = severity
                    alert.labels = labels
                    if new == current:
                        return None
                    alert.state = new
                    if new == "firing":
                        alert.fired_step, alert.fired_at = step, now
                    else:  # resolved, or back to inactive from pending
                        alert.resolved_step, alert.resolved_at = step, now
                return AlertChange(alert.id, current, new)
        except IntegrityError:
            return None  # another evaluator opened this alert at the same moment

    def claim_announcement(
        self, alert_id: int, event: NoticeEvent, outbox: Sequence[OutboxEntry], *, now: datetime
    ) -> bool:
        """Claim the right to announce ``event`` of an alert, once: a firing not yet announced, or a
        resolution of an alert whose firing was. The ``outbox`` entries are queued in the same
        transaction (both commit, or neither). False when it is announced already (by another
        evaluation), or is a resolution never announced as firing."""
        if event == "resolved":
            claim = [AlertRow.resolved_notified.is_(False), AlertRow.firing_notified.is_(True)]
            flag = "resolved_notified"
        else:
            claim = [AlertRow.firing_notified.is_(False)]
            flag = "firing_notified"
        statement = (
            update(AlertRow)
            .where(AlertRow.id == alert_id, *claim)
            .values({flag: True})
            .execution_options(synchronize_session=False)
        )
        with self.sessions.begin() as session:
            if session.execute(statement.returning(AlertRow.id)).first() is None:
                return False
            session.add_all(
                NoticeOutboxRow(
                    **asdict(entry),
                    status=PENDING,
                    attempts=0,
                    attempts_log=[],
                    next_attempt_at=now,
                    created_at=now,
                )
                for entry in outbox
            )
            return True

    def record(self, notifications: Sequence[Notification]) -> None:
        """Keep what the channels did with an announcement."""
        with self.sessions.begin() as session:
            session.add_all(NotificationRow(**asdict(n)) for n in notifications)

    def notifications(self, alert_id: int) -> builtins.list[StoredNotification]:
        """What each channel did with each announcement of one alert, oldest first."""
        query = (
            select(NotificationRow).where(NotificationRow.alert_id == alert_id).order_by(NotificationRow.id)
        )
        with self.sessions() as session:
            return [
                StoredNotification(
                    id=n.id,
                    alert_id=n.alert_id,
                    event=n.event,  # type: ignore[arg-type]  # the column holds only NoticeEvent values
                    channel=n.channel,
                    status=n.status,  # type: ignore[arg-type]  # the column holds only these statuses
                    attempts=n.attempts,
                    error=n.error,
                    payload=dict(n.payload or {}),
                    created_at=utc(n.created_at),
                )
                for n in session.scalars(query)
            ]


# ---------------------------------------------------------------------- silences


@dataclass(frozen=True)
class Silence:
    """A silence: what it matches (None: anything; ``rule`` a rule's name; ``labels`` must all be on
    the alert) and when it holds. The silence row everywhere it is read (the engine, the API's
    response, the dashboard)."""

    id: int
    project: str | None
    rule: str | None
    run_id: str | None
    labels: dict[str, str]
    starts_at: datetime
    ends_at: datetime
    created_by: str
    comment: str

    def active(self, now: datetime) -> bool:
        """Whether it holds at ``now``."""
        return self.starts_at <= now < self.ends_at


def _silence(row: SilenceRow) -> Silence:
    return Silence(
        id=row.id,
        project=row.project,
        rule=row.rule_name,
        run_id=row.run_id,
        labels=dict(row.labels),
        starts_at=utc(row.starts_at),
        ends_at=utc(row.ends_at),
        created_by=row.created_by,
        comment=row.comment,
    )


class SilenceRepository:
    """Silences, kept after they end (for the record)."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def create(
        self,
        *,
        project: str | None,
        rule: str | None,
        run_id: str | None,
        labels: dict[str, str],
        starts_at: datetime,
        ends_at: datetime,
        created_by: str,
        comment: str,
    ) -> Silence:
        row = SilenceRow(
            project=project,
            rule_name=rule,
            run_id=run_id,
            labels=dict(labels),
            starts_at=starts_at,
            ends_at=ends_at,
            created_by=created_by,
            comment=comment,
        )
        with self.sessions.begin() as session:
            session.add(row)
            session.flush()
            return _silence(row)

    def list(
        self, project: str | None = None, *, active_at: datetime | None = None
    ) -> builtins.list[Silence]:
        """Silences of ``project`` (and global ones; all when None), latest ending first, optionally
        only those in force at ``active_at``."""
        query = select(SilenceRow).order_by(SilenceRow.ends_at.desc(), SilenceRow.id)
        if project is not None:
            query = query.where(or_(SilenceRow.project == project, SilenceRow.project.is_(None)))
        if active_at is not None:
            query = query.where(SilenceRow.starts_at <= active_at, SilenceRow.ends_at > active_at)
        with self.sessions() as session:
            return [_silence(row) for row in session.scalars(query)]

    def get(self, silence_id: int) -> Silence | None:
        with self.sessions() as session:
            row = session.get(SilenceRow, silence_id)
            return None if row is None else _silence(row)

    def expire(self, silence_id: int, now: datetime) -> bool:
        """End a silence at ``now`` (or at its start, if that is later); False if there is none."""
        with self.sessions.begin() as session:
            row = session.get(SilenceRow, silence_id)
            if row is None:
                return False
            if utc(row.ends_at) > now:
                row.ends_at = max(now, utc(row.starts_at))
            return True


# ---------------------------------------------------------------------- the outbox


class OutboxRepository:
    """The durable outbox (``alert_outbox``): notices per destination, taken under a lease, in order,
    and the standing re-posts of firing alerts (taken when due, never holding up the notices)."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def count(self, destination: str | None = None, *, status: str = PENDING) -> int:
        """Notices not yet delivered (or given up on), for one destination or all (``status``
        ``repost``: the firing alerts re-posted instead)."""
        query = select(func.count()).select_from(NoticeOutboxRow).where(NoticeOutboxRow.status == status)
        if destination is not None:
            query = query.where(NoticeOutboxRow.destination == destination)
        with self.sessions() as session:
            return int(session.scalar(query) or 0)

    def count_elsewhere(self, destinations: Collection[str]) -> int:
        """Notices waiting for a destination not among ``destinations``."""
        query = (
            select(func.count())
            .select_from(NoticeOutboxRow)
            .where(
                NoticeOutboxRow.status == PENDING,
                NoticeOutboxRow.destination.not_in(destinations) if destinations else true(),
            )
        )
        with self.sessions() as session:
            return int(session.scalar(query) or 0)

    def take(
        self, destination: str, worker: str, *, now: datetime, lease_until: datetime
    ) -> QueuedNotice | datetime | None:
        """Lease the oldest notice of ``destination`` to ``worker`` until ``lease_until`` (re-posts
        count only once due): the notice; or, when it is not due yet, when it is due; or None when
        there is none, or another worker holds it (the rest wait behind it: in order). A re-post of
        an alert that no longer fires, or whose resolution was announced, is dropped on the way (one
        in flight at another worker holds the rest back until it is done: a resolution never
        overtakes it)."""
        unclaimed = or_(NoticeOutboxRow.claimed_until.is_(None), NoticeOutboxRow.claimed_until < now)
        with self.sessions.begin() as session:
            while True:
                head = session.execute(
                    select(NoticeOutboxRow.id, NoticeOutboxRow.next_attempt_at, NoticeOutboxRow.status)
                    .where(
                        NoticeOutboxRow.destination == destination,
                        or_(NoticeOutboxRow.status != REPOST, NoticeOutboxRow.next_attempt_at <= now),
                    )
                    .order_by(NoticeOutboxRow.id)
                    .limit(1)
                ).first()
                if head is None:
                    return None
                due = utc(head.next_attempt_at)
                if due > now:
                    return due
                if head.status != REPOST or self._still_firing(session, head.id):
                    break
                dropped = session.execute(
                    delete(NoticeOutboxRow)
                    .where(NoticeOutboxRow.id == head.id, unclaimed)
                    .returning(NoticeOutboxRow.id)
                    .execution_options(synchronize_session=False)
                ).first()
                if dropped is None:
                    return None
            taken = session.execute(
                update(NoticeOutboxRow)
                .where(NoticeOutboxRow.id == head.id, unclaimed)
                .values(claimed_by=worker, claimed_until=lease_until)
                .returning(NoticeOutboxRow.id)
                .execution_options(synchronize_session=False)
            ).first()
            if taken is None:
                return None
            row = session.get_one(NoticeOutboxRow, head.id)
            return QueuedNotice(
                id=row.id,
                alert_id=row.alert_id,
                event=row.event,  # type: ignore[arg-type]  # the column holds only NoticeEvent values
                channel=row.channel,
                destination=row.destination,
                notice=dict(row.notice),
                attempts=row.attempts,
                attempts_log=list(row.attempts_log),
                repost=row.status == REPOST,
            )

    @staticmethod
    def _still_firing(session: Session, notice_id: int) -> bool:
        """Whether the alert of the re-post ``notice_id`` fires and its resolution is not announced."""
        found = session.execute(
            select(AlertRow.id)
            .join(NoticeOutboxRow, NoticeOutboxRow.alert_id == AlertRow.id)
            .where(
                NoticeOutboxRow.id == notice_id,
                AlertRow.state == "firing",
                AlertRow.resolved_notified.is_(False),
            )
        ).first()
        return found is not None

    def retry_later(
        self,
        notice_id: int,
        worker: str,
        *,
        attempts: int,
        attempts_log: builtins.list[dict[str, Any]],
        at: datetime,
    ) -> None:
        """Give a leased notice back to wait for its next attempt at ``at``."""
        with self.sessions.begin() as session:
            session.execute(
                update(NoticeOutboxRow)
                .where(NoticeOutboxRow.id == notice_id, NoticeOutboxRow.claimed_by == worker)
                .values(
                    attempts=attempts,
                    attempts_log=attempts_log,
                    next_attempt_at=at,
                    claimed_by=None,
                    claimed_until=None,
                )
                .execution_options(synchronize_session=False)
            )

    def finish(
        self, notice_id: int, worker: str, outcome: Notification | None, *, repost_at: datetime | None = None
    ) -> bool:
        """Done with a leased notice, in one transaction: keep its ``outcome`` (None: a re-post,
        which records nothing) and remove it, or (``repost_at``) keep it as the alert's re-post, due
        then. Delivered once. False (nothing kept) when the lease ran out and another worker took
        the notice: its outcome stands."""
        mine = (NoticeOutboxRow.id == notice_id, NoticeOutboxRow.claimed_by == worker)
        statement: ReturningDelete[tuple[int]] | ReturningUpdate[tuple[int]]
        if repost_at is None:
            statement = delete(NoticeOutboxRow).where(*mine).returning(NoticeOutboxRow.id)
        else:
            statement = (
                update(NoticeOutboxRow)
                .where(*mine)
                .values(
                    status=REPOST,
                    attempts=0,
                    attempts_log=[],
                    next_attempt_at=repost_at,
                    claimed_by=None,
                    claimed_until=None,
                )
                .returning(NoticeOutboxRow.id)
            )
        with self.sessions.begin() as session:
            done = session.execute(statement.execution_options(synchronize_session=False)).first()
            if done is None:
                return False
            if outcome is not None:
                session.add(NotificationRow(**asdict(outcome)))
            return True
