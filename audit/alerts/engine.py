"""The alert engine: after each step's comparison, move each applicable rule's alert on that run
through its states (``audit.alerts.evaluator``), store it, and tell the channels about firing and
resolved alerts unless a silence mutes them.

Plugs into the comparison worker as its step callback: ``ComparisonWorker(store, on_step=engine.evaluate)``.
State is derived from the stored step results, so evaluating the same step twice (a re-comparison,
a retry, a second worker) changes nothing and sends nothing twice: each notice is claimed by a
conditional UPDATE before it is sent. In the background (the service), the notices of HTTP channels
(webhooks, Alertmanager) are written to the durable outbox in that same transaction and delivered
from there (``audit.alerts.outbox``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any
from urllib.parse import quote

from isoaudit.audit.alerts.channels import Channel, DatabaseChannel, Delivery, Event, LogChannel, Notice
from isoaudit.audit.alerts.evaluator import (
    Evaluation,
    breaching_steps,
    evaluate_series,
    next_state,
    steps_needed,
)
from isoaudit.audit.alerts.outbox import Outbox, OutboxChannel, is_durable
from isoaudit.audit.alerts.rules import AlertRule, list_rule_rows, rule_from_row
from isoaudit.audit.alerts.silences import list_silences, matches
from isoaudit.audit.db import Store
from isoaudit.audit.db.alerts import OPEN_STATES, Alert, AlertRepository, AlertState, Notification, Silence
from isoaudit.audit.db.telemetry import RuleBreaches
from isoaudit.audit.records import utcnow

log = logging.getLogger("isoaudit.alerts")

#: Where the dashboard shows one step of a run, below its base URL.
DEFAULT_STEP_PATH = "/runs/{run_id}?step={step}"


@dataclass(frozen=True)
class Transition:
    """A state change of one rule's alert on one run, as :meth:`AlertEngine.evaluate` made it."""

    rule: str
    run_id: str
    alert_id: int
    old: AlertState
    new: AlertState
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
        that can be (webhooks, Alertmanager: ``durable``) go into the durable outbox with the claim of the notice
        and are delivered by :meth:`start`'s threads, one per destination; the others (log,
        database) from one thread of the engine's own, in order. ``worker``: this process's name
        in the outbox's leases (default ``host:pid:nonce``)."""
        self.store = store
        self.deliver_in_background = deliver_in_background
        self._delivery: ThreadPoolExecutor | None = None  # started by the first background notice
        self.channels: list[Channel] = (
            list(channels) if channels is not None else [LogChannel(), DatabaseChannel()]
        )
        durable: list[OutboxChannel] = (
            [c for c in self.channels if is_durable(c)] if deliver_in_background else []
        )
        self.outbox = Outbox(store, durable, worker=worker, now=now) if durable else None
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

    @cached_property
    def alerts(self) -> AlertRepository:
        """The alert rows' repository, opened on first use (building a step's URL needs no store)."""
        return AlertRepository(self.store.sessions)

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
        # The run's open alerts, read once per evaluation so a rule with nothing open costs no query
        # of its own. A row another evaluator opens meanwhile is that evaluator's to announce.
        open_alerts = self.alerts.open_alerts(run_id)
        transitions: list[Transition] = []
        # The rules over their threshold at this step, counted by /metrics between two scrapes.
        RuleBreaches(self.store.sessions).record(
            run_id, [(row.id, s) for row, rule in rules for s in breaching_steps(rule, series, step)]
        )
        for row, rule in rules:
            evaluation = evaluate_series(rule, series[-steps_needed(rule) :])
            if evaluation is None:
                continue
            known = open_alerts.get(rule.name)
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

    def _series(
        self, run_id: str, step: int, metrics: Mapping[str, Any] | None, limit: int
    ) -> list[tuple[int, Mapping[str, Any]]]:
        """The run's latest ``limit`` compared steps, oldest first, with ``step``'s fresh metrics."""
        by_step: dict[int, Mapping[str, Any]] = dict(self.alerts.recent_metrics(run_id, limit))
        if metrics is not None:
            by_step[step] = metrics
        return sorted(by_step.items())[-limit:]

    def _advance(
        self, rule_id: int, rule: AlertRule, run_id: str, evaluation: Evaluation, now: datetime
    ) -> Transition | None:
        """Apply the state machine to the open alert of (rule, run), in one transaction."""
        first = evaluation.first_breaching_step
        change = self.alerts.advance(
            rule_id,
            run_id,
            step=evaluation.step,
            value=evaluation.value,
            first_step=evaluation.step if first is None else first,
            severity=rule.severity,
            labels=alert_labels(rule),
            now=now,
            decide=lambda current: next_state(rule, current, evaluation),
        )
        if change is None:
            return None
        return Transition(
            rule.name, run_id, change.alert_id, change.old, change.new, evaluation.step, evaluation.value
        )

    # ------------------------------------------------------------------ notification

    def _notify(
        self,
        rule_id: int,
        rule: AlertRule,
        run_id: str,
        project: str,
        evaluation: Evaluation,
        transition: Transition | None,
        silences: Sequence[Silence],
        now: datetime,
        known: Alert | None = None,
    ) -> None:
        """Announce a firing alert not yet announced, or a resolution of one that was; record muted
        transitions as silenced. Each announcement is claimed first, so it goes out once."""
        labels = alert_labels(rule)
        silenced = any(
            matches(s, project=project, rule=rule.name, run_id=run_id, labels=labels, at=now)
            for s in silences
        )
        alert_id: int | None
        fired_at = known.fired_at if known is not None else None
        if transition is not None and transition.new == "resolved":
            event: Event = "resolved"
            alert_id = transition.alert_id
        else:
            # Announce a firing alert not announced yet: one that fired just now, or one that was
            # firing while silenced (``known``: the open alert as read before this evaluation).
            if transition is not None:
                alert_id = transition.alert_id if transition.new == "firing" else None
                fired_at = now
            elif known is not None and known.state == "firing" and not known.firing_notified:
                alert_id = known.id
            else:
                alert_id = None
            if alert_id is None:
                return
            event = "firing"
        region, position = self._first_divergence(run_id, evaluation.step)
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
            fired_at=fired_at,
            resolved_at=now if event == "resolved" else None,
            first_divergence_region=region,
            first_divergence_position=position,
        )
        if silenced:
            if transition is not None and transition.new in ("firing", "resolved"):
                self._record(
                    notice,
                    [Delivery("*", "stored", attempts=0, error="silenced", payload=notice.as_dict())],
                    silenced=True,
                )
            return
        queued = self.outbox.entries(notice) if self.outbox is not None else []
        if not self.alerts.claim_announcement(alert_id, event, queued, now=self.now()):
            return  # announced already (by another evaluation), or never announced as firing
        if not self._instant:
            return
        if self.deliver_in_background:
            if self._delivery is None:
                self._delivery = ThreadPoolExecutor(max_workers=1, thread_name_prefix="isoaudit-alerts")
            self._delivery.submit(self._deliver, notice)
        else:
            self._deliver(notice)

    def _first_divergence(self, run_id: str, step: int) -> tuple[str | None, int | None]:
        """The step's first diverging region and position, as its comparison stored them (the
        earliest over its samples); None where the step has none (no fingerprints, or no divergence)."""
        found = self.store.step_results(run_id, only=[step])
        first = found[0].diagnoses.get("first_divergence") if found else None
        if not isinstance(first, Mapping) or first.get("region") is None:
            return None, None
        position = first.get("position")
        return str(first["region"]), int(position) if isinstance(position, int) else None

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

    def _record(self, notice: Notice, deliveries: Sequence[Delivery], *, silenced: bool = False) -> None:
        """Keep what each channel did with ``notice`` (``silenced``: nothing was sent, a silence muted it)."""
        self.alerts.record(
            [
                Notification(
                    alert_id=notice.alert_id,
                    event=notice.event,
                    channel=delivery.channel,
                    status="silenced" if silenced else delivery.status,
                    attempts=delivery.attempts,
                    error=delivery.error,
                    payload=delivery.payload,
                    created_at=self.now(),
                )
                for delivery in deliveries
            ]
        )


def rules_for(store: Store, project: str | None = None) -> list[AlertRule]:
    """The rules (as models) that apply to ``project``'s runs."""
    return [rule_from_row(row) for row in list_rule_rows(store, project)]
