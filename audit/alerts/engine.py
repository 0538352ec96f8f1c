"""The alert engine: after each step's comparison, move each applicable rule's alert on that run
through its states (``audit.alerts.evaluator``), store it, and tell the channels about firing and
resolved alerts unless a silence mutes them.

Plugs into the comparison worker as its step callback: ``ComparisonWorker(store, on_step=engine.evaluate)``.
State is derived from the stored step results, so evaluating the same step twice (a re-comparison,
a retry, a second worker) changes nothing and sends nothing twice: each notice is claimed by a
conditional UPDATE before it is sent. In the background (the service), webhook notices are written
to the durable outbox in that same transaction and delivered from there (``audit.alerts.outbox``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote

from isoaudit.audit.alerts.channels import Channel, DatabaseChannel, Delivery, Event, LogChannel, Notice
from isoaudit.audit.alerts.evaluator import Evaluation, State, evaluate_series, next_state, steps_needed
from isoaudit.audit.alerts.outbox import Outbox
from isoaudit.audit.alerts.rules import AlertRule, list_rule_rows, rule_from_row
from isoaudit.audit.alerts.silences import list_silences, matches
from isoaudit.audit.models import StepResultRow
from isoaudit.audit.records import utcnow
from isoaudit.audit.service_models import OPEN_STATES, AlertRow, NotificationRow, SilenceRow
from isoaudit.audit.store import Store
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

log = logging.getLogger("isoaudit.alerts")

#: Where the dashboard shows one step of a run, below its base URL.
DEFAULT_STEP_PATH = "/runs/{run_id}?step={step}"


@dataclass(frozen=True)
class Transition:
    rule: str
    run_id: str
    alert_id: int
    old: State
    new: State
    step: int
    value: float | None


def alert_labels(rule: AlertRule) -> dict[str, str]:
    return {**rule.labels, "alertname": rule.name, "severity": rule.severity, "metric": rule.metric}


class AlertEngine:
    """Evaluates rules for a run after each compared step and dispatches notices."""

    def __init__(
        self,
        store: Store,
        channels: Sequence[Channel] | None = None,
        *,
        dashboard_url: str = "http://localhost:8050",
        step_path: str = DEFAULT_STEP_PATH,
        now: Callable[[], datetime] = utcnow,
        deliver_in_background: bool = False,
        worker: str | None = None,
    ) -> None:
        """``deliver_in_background``: never hold up the comparison worker that evaluates. Channels
        that can be (webhooks: ``durable``) go into the durable outbox with the claim of the notice
        and are delivered by :meth:`start`'s threads, one per destination; the others (log,
        database) from one thread of the engine's own, in order. ``worker``: this process's name
        in the outbox's leases (default ``host:pid:nonce``)."""
        self.store = store
        self.deliver_in_background = deliver_in_background
        self._delivery: ThreadPoolExecutor | None = None  # started by the first background notice
        self.channels: list[Channel] = (
            list(channels) if channels is not None else [LogChannel(), DatabaseChannel()]
        )
        durable = [c for c in self.channels if getattr(c, "durable", False)] if deliver_in_background else []
        self.outbox = Outbox(store, durable, worker=worker, now=now) if durable else None  # type: ignore[arg-type]
        self._instant = [c for c in self.channels if c not in durable]
        self.dashboard_url = dashboard_url.rstrip("/")
        self.step_path = step_path
        self.now = now

    def start(self) -> AlertEngine:
        """Start delivering the outbox (notices pending from before a restart first). Only the
        process that compares calls it: an API replica without a worker delivers nothing."""
        if self.outbox is not None:
            self.outbox.start()
        return self

    def close(self) -> None:
        """Wait for notices still being delivered (background delivery only); what the outbox has
        not delivered stays there for the next start."""
        if self._delivery is not None:
            self._delivery.shutdown(wait=True)
            self._delivery = None
        if self.outbox is not None:
            self.outbox.stop()

    def step_url(self, run_id: str, step: int) -> str:
        """The dashboard page of one step of a run."""
        return self.dashboard_url + self.step_path.format(run_id=quote(run_id, safe=""), step=step)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self, run_id: str, step: int, metrics: Mapping[str, Any] | None = None) -> list[Transition]:
        """Bring every applicable rule's alert on ``run_id`` up to date with the latest compared step
        (``step``'s ``metrics`` as just computed). Returns the state changes made; never raises for a
        channel's failure."""
        project = self.store.run_project(run_id)
        if project is None:
            return []
        rules = [(row, rule_from_row(row)) for row in list_rule_rows(self.store, project) if row.enabled]
        if not rules:
            return []
        series = self._series(run_id, step, metrics, max(steps_needed(rule) for _, rule in rules))
        now = self.now()
        silences = list_silences(self.store, project, active_at=now)
        open_alerts = self._open_alerts(run_id)
        transitions: list[Transition] = []
        for row, rule in rules:
            evaluation = evaluate_series(rule, series[-steps_needed(rule) :])
            if evaluation is None:
                continue
            known = open_alerts.get(row.id)
            if known is None and next_state(rule, "inactive", evaluation) not in OPEN_STATES:
                continue  # none open and none opens (the common case): nothing to write or announce
            transition = self._advance(row.id, rule, run_id, evaluation, now)
            if transition is not None:
                transitions.append(transition)
                log.debug(
                    "alert %s on %s: %s -> %s at step %s",
                    rule.name,
                    run_id,
                    transition.old,
                    transition.new,
                    transition.step,
                )
            self._notify(row.id, rule, run_id, project, evaluation, transition, silences, now, known)
        return transitions

    def _open_alerts(self, run_id: str) -> dict[int, Any]:
        """The run's open alerts by rule id (id, state, firing_notified), read once per evaluation so
        a rule with nothing open costs no query of its own. A row another evaluator opens meanwhile
        is that evaluator's to announce."""
        query = select(AlertRow.rule_id, AlertRow.id, AlertRow.state, AlertRow.firing_notified).where(
            AlertRow.run_id == run_id, AlertRow.state.in_(OPEN_STATES)
        )
        with self.store.sessions() as session:
            return {row.rule_id: row for row in session.execute(query)}

    def _series(
        self, run_id: str, step: int, metrics: Mapping[str, Any] | None, limit: int
    ) -> list[tuple[int, Mapping[str, Any]]]:
        """The run's latest ``limit`` compared steps, oldest first, with ``step``'s fresh metrics."""
        query = (
            select(StepResultRow.step, StepResultRow.metrics)
            .where(StepResultRow.run_id == run_id)
            .order_by(StepResultRow.step.desc())
            .limit(limit)
        )
        with self.store.sessions() as session:
            by_step: dict[int, Mapping[str, Any]] = {s: m for s, m in session.execute(query)}
        if metrics is not None:
            by_step[step] = metrics
        return sorted(by_step.items())[-limit:]

    def _advance(
        self, rule_id: int, rule: AlertRule, run_id: str, evaluation: Evaluation, now: datetime
    ) -> Transition | None:
        """Apply the state machine to the open alert of (rule, run), in one transaction."""
        try:
            with self.store.sessions.begin() as session:
                query = select(AlertRow).where(
                    AlertRow.rule_id == rule_id, AlertRow.run_id == run_id, AlertRow.state.in_(OPEN_STATES)
                )
                if self.store.dialect == "postgresql":
                    query = query.with_for_update()
                alert = session.scalar(query)
                if alert is not None and evaluation.step < alert.last_step:
                    return None  # an older step than this alert has seen; the newer one decided already
                current: State = alert.state if alert is not None else "inactive"  # type: ignore[assignment]
                new = next_state(rule, current, evaluation)
                if alert is None:
                    if new not in OPEN_STATES:
                        return None
                    first = evaluation.first_breaching_step
                    first = evaluation.step if first is None else first
                    alert = AlertRow(
                        rule_id=rule_id,
                        run_id=run_id,
                        state=new,
                        severity=rule.severity,
                        labels=alert_labels(rule),
                        value=evaluation.value,
                        started_step=first,
                        last_step=evaluation.step,
                        started_at=now,
                        fired_step=evaluation.step if new == "firing" else None,
                        fired_at=now if new == "firing" else None,
                    )
                    session.add(alert)
                    session.flush()
                else:
                    alert.value = evaluation.value
                    alert.last_step = evaluation.step
                    alert.severity = rule.severity
                    alert.labels = alert_labels(rule)
                    if new == current:
                        return None
                    alert.state = new
                    if new == "firing":
                        alert.fired_step, alert.fired_at = evaluation.step, now
                    else:  # resolved, or back to inactive from pending
                        alert.resolved_step, alert.resolved_at = evaluation.step, now
                return Transition(
                    rule.name, run_id, alert.id, current, new, evaluation.step, evaluation.value
                )
        except IntegrityError:
            # Another evaluator opened this alert at the same moment: its transition stands.
            return None

    # ------------------------------------------------------------------ notification

    def _notify(
        self,
        rule_id: int,
        rule: AlertRule,
        run_id: str,
        project: str,
        evaluation: Evaluation,
        transition: Transition | None,
        silences: Sequence[SilenceRow],
        now: datetime,
        known: Any = None,
    ) -> None:
        """Announce a firing alert not yet announced, or a resolution of one that was; record muted
        transitions as silenced. Each announcement is claimed first, so it goes out once."""
        labels = alert_labels(rule)
        silenced = any(
            matches(s, project=project, rule=rule.name, run_id=run_id, labels=labels, at=now)
            for s in silences
        )
        if transition is not None and transition.new == "resolved":
            event: Event = "resolved"
            alert_id = transition.alert_id
            claim = (AlertRow.resolved_notified.is_(False), AlertRow.firing_notified.is_(True))
            column = "resolved_notified"
        else:
            # Announce a firing alert not announced yet: one that fired just now, or one that was
            # firing while silenced (``known``: the open alert as read before this evaluation).
            if transition is not None:
                alert_id = transition.alert_id if transition.new == "firing" else None
            elif known is not None and known.state == "firing" and not known.firing_notified:
                alert_id = known.id
            else:
                alert_id = None
            if alert_id is None:
                return
            event = "firing"
            claim = (AlertRow.firing_notified.is_(False),)
            column = "firing_notified"
        notice = Notice(
            event=event,
            alert_id=alert_id,
            rule=rule.name,
            run_id=run_id,
            project=project,
            step=evaluation.step,
            value=evaluation.value,
            condition=rule.condition(),
            severity=rule.severity,
            labels=labels,
            url=self.step_url(run_id, evaluation.step),
            description=rule.description,
        )
        if silenced:
            if transition is not None and transition.new in ("firing", "resolved"):
                self._record(
                    notice,
                    [Delivery("*", "stored", attempts=0, error="silenced", payload=notice.as_dict())],
                    "silenced",
                )
            return
        with self.store.sessions.begin() as session:
            table = AlertRow.__table__
            claim_stmt = update(table).where(table.c.id == alert_id, *claim).values({column: True})
            if session.execute(claim_stmt.returning(table.c.id)).first() is None:
                return  # announced already (by another evaluation), or never announced as firing
            if self.outbox is not None:
                self.outbox.enqueue(session, notice)  # committed with the claim, or not at all
        if not self._instant:
            return
        if self.deliver_in_background:
            if self._delivery is None:
                self._delivery = ThreadPoolExecutor(max_workers=1, thread_name_prefix="isoaudit-alerts")
            self._delivery.submit(self._deliver, notice)
        else:
            self._deliver(notice)

    def _deliver(self, notice: Notice) -> None:
        deliveries = []
        for channel in self._instant:
            try:
                deliveries.append(channel.send(notice))
            except Exception as exc:  # a channel that breaks its promise not to raise
                log.exception("alert channel %s failed", getattr(channel, "name", channel))
                deliveries.append(
                    Delivery(getattr(channel, "name", "?"), "failed", error=f"{type(exc).__name__}: {exc}")
                )
        self._record(notice, deliveries)

    def _record(self, notice: Notice, deliveries: Sequence[Delivery], status: str | None = None) -> None:
        with self.store.sessions.begin() as session:
            session.add_all(
                NotificationRow(
                    alert_id=notice.alert_id,
                    event=notice.event,
                    channel=delivery.channel,
                    status=status or delivery.status,
                    attempts=delivery.attempts,
                    error=delivery.error,
                    payload=delivery.payload,
                    created_at=self.now(),
                )
                for delivery in deliveries
            )


def rules_for(store: Store, project: str | None = None) -> list[AlertRule]:
    """The rules (as models) that apply to ``project``'s runs."""
    return [rule_from_row(row) for row in list_rule_rows(store, project)]
