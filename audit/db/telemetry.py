"""What ``/metrics`` reads at scrape time, and the rule breaches it counts.

A scrape reads the runs compared within a window (one range scan of ``ix_step_results_computed_at``,
so the work and the series do not grow with the runs recorded before it), then, for those runs
only, by their keys: the latest compared step and its metrics, how many steps were compared, the
desired and the reported remediation modes, the open alerts, the steps at which each rule's
condition held and the alerts that fired; plus the comparison queue per project. ``since=None``
reads every run ever compared (what the bench measures beside the window).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from isoaudit.audit.db.models import (
    OPEN_STATES,
    AlertRow,
    AlertRuleRow,
    ManifestRow,
    PendingComparisonRow,
    RuleBreachRow,
    RunControlRow,
    RunRow,
    StepResultRow,
)
from isoaudit.audit.records import utcnow
from sqlalchemy import Select, func, select, tuple_
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

__all__ = ["OpenAlert", "RuleBreaches", "RuleCount", "RunFigures", "Telemetry", "TelemetryReads"]


#: The upper end of the window's range (no comparison is later).
_END_OF_TIME = datetime(9999, 12, 31, tzinfo=UTC)


def _aware(moment: datetime) -> datetime:
    """SQLite hands timestamps back without their zone; they were written in UTC."""
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@dataclass(frozen=True)
class RunFigures:
    """One run compared within the window: its latest compared step and what describes the run.
    ``runtimes``: the ``runtime`` facts of each side's latest manifest (``trainer``, ``rollout``)."""

    run_id: str
    project: str
    name: str
    config: dict[str, Any]
    last_compared_at: datetime
    step: int
    metrics: dict[str, Any]
    compared_steps: int
    desired_mode: str
    runtimes: dict[str, dict[str, Any]]


@dataclass(frozen=True)
class OpenAlert:
    """A pending or firing alert of a run in the window."""

    rule: str
    run_id: str
    project: str
    severity: str
    state: str


@dataclass(frozen=True)
class RuleCount:
    """A count per run and rule (breaching steps, fired alerts)."""

    run_id: str
    project: str
    rule: str
    count: int


@dataclass(frozen=True)
class Telemetry:
    """One scrape's reading of the store."""

    runs: list[RunFigures]
    open_alerts: list[OpenAlert]
    breaching_steps: list[RuleCount]
    fired_alerts: list[RuleCount]
    pending_comparisons: dict[str, int]


class TelemetryReads:
    """Reads :class:`Telemetry`, in one session."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def read(self, project: str | None = None, *, since: datetime | None = None) -> Telemetry:
        """The figures of the runs (``project``'s only, when given) compared at or after ``since``;
        of every run ever compared when ``since`` is None."""
        with self.sessions() as session:
            active = _active_runs(session, project, since)
            ids = list(active)
            projects = {run_id: row[0] for run_id, row in active.items()}
            rules = _applicable_rules(session, projects)
            return Telemetry(
                runs=_run_figures(session, active),
                open_alerts=_open_alerts(session, ids, projects),
                breaching_steps=_counts(
                    session,
                    rules,
                    select(RuleBreachRow.run_id, AlertRuleRow.name, func.count())
                    .join(AlertRuleRow, AlertRuleRow.id == RuleBreachRow.rule_id)
                    .where(RuleBreachRow.run_id.in_(ids))
                    .group_by(RuleBreachRow.run_id, AlertRuleRow.name),
                    projects,
                ),
                fired_alerts=_counts(
                    session,
                    rules,
                    select(AlertRow.run_id, AlertRuleRow.name, func.count())
                    .join(AlertRuleRow, AlertRuleRow.id == AlertRow.rule_id)
                    .where(AlertRow.run_id.in_(ids), AlertRow.fired_step.is_not(None))
                    .group_by(AlertRow.run_id, AlertRuleRow.name),
                    projects,
                ),
                pending_comparisons=_pending(session, project),
            )


def _active_runs(
    session: Session, project: str | None, since: datetime | None
) -> dict[str, tuple[str, str, dict[str, Any], datetime]]:
    """run id -> (project, name, config, last compared at) of the runs compared at or after ``since``."""
    recent = select(StepResultRow.run_id, func.max(StepResultRow.computed_at).label("last"))
    if since is not None:
        # Bounded on both sides: SQLite, without statistics, judges a one-sided range too wide and
        # walks the primary key in run_id order instead (every step ever compared); a two-sided one
        # it reads from ix_step_results_computed_at.
        recent = recent.where(StepResultRow.computed_at.between(since, _END_OF_TIME))
    recent_sq = recent.group_by(StepResultRow.run_id).subquery()
    query = select(RunRow.run_id, RunRow.project, RunRow.name, RunRow.config, recent_sq.c.last).join(
        recent_sq, recent_sq.c.run_id == RunRow.run_id
    )
    if project is not None:
        query = query.where(RunRow.project == project)
    return {
        run_id: (run_project, name, dict(config or {}), _aware(last))
        for run_id, run_project, name, config, last in session.execute(query.order_by(RunRow.run_id))
    }


def _run_figures(
    session: Session, active: dict[str, tuple[str, str, dict[str, Any], datetime]]
) -> list[RunFigures]:
    ids = list(active)
    if not ids:
        return []
    latest = {
        run_id: (step, n)
        for run_id, step, n in session.execute(
            select(StepResultRow.run_id, func.max(StepResultRow.step), func.count())
            .where(StepResultRow.run_id.in_(ids))
            .group_by(StepResultRow.run_id)
        )
    }
    pairs = [(run_id, step) for run_id, (step, _) in latest.items()]
    metrics = {
        run_id: dict(values or {})
        for run_id, values in session.execute(
            select(StepResultRow.run_id, StepResultRow.metrics).where(
                tuple_(StepResultRow.run_id, StepResultRow.step).in_(pairs)
            )
        )
    }
    modes = dict(
        session.execute(
            select(RunControlRow.run_id, RunControlRow.mode).where(RunControlRow.run_id.in_(ids))
        ).all()
    )
    newest = (
        select(func.max(ManifestRow.id))
        .where(ManifestRow.run_id.in_(ids))
        .group_by(ManifestRow.run_id, ManifestRow.side)
    )
    runtimes: dict[str, dict[str, dict[str, Any]]] = {run_id: {} for run_id in ids}
    for run_id, side, body in session.execute(
        select(ManifestRow.run_id, ManifestRow.side, ManifestRow.body).where(ManifestRow.id.in_(newest))
    ):
        runtimes[run_id][side] = dict((body or {}).get("runtime") or {})
    return [
        RunFigures(
            run_id=run_id,
            project=run_project,
            name=name,
            config=config,
            last_compared_at=last,
            step=int(latest[run_id][0]),
            metrics=metrics.get(run_id, {}),
            compared_steps=int(latest[run_id][1]),
            desired_mode=modes.get(run_id, "native"),
            runtimes=runtimes[run_id],
        )
        for run_id, (run_project, name, config, last) in active.items()
        if run_id in latest
    ]


def _open_alerts(session: Session, ids: Sequence[str], projects: dict[str, str]) -> list[OpenAlert]:
    query = (
        select(AlertRuleRow.name, AlertRow.run_id, AlertRow.severity, AlertRow.state)
        .join(AlertRuleRow, AlertRuleRow.id == AlertRow.rule_id)
        .where(AlertRow.run_id.in_(list(ids)), AlertRow.state.in_(OPEN_STATES))
        .order_by(AlertRow.run_id, AlertRuleRow.name)
    )
    return [
        OpenAlert(rule, run_id, projects[run_id], severity, state)
        for rule, run_id, severity, state in session.execute(query)
    ]


def _applicable_rules(session: Session, projects: dict[str, str]) -> set[tuple[str, str]]:
    """(run id, rule name) of every enabled rule that applies to each run (its project's, the global ones)."""
    if not projects:
        return set()
    query = select(AlertRuleRow.name, AlertRuleRow.project).where(AlertRuleRow.enabled.is_(True))
    rules = list(session.execute(query))
    return {
        (run_id, name)
        for run_id, run_project in projects.items()
        for name, project in rules
        if project is None or project == run_project
    }


def _counts(
    session: Session,
    rules: set[tuple[str, str]],
    query: Select[str, str, int],
    projects: dict[str, str],
) -> list[RuleCount]:
    """The counts ``query`` finds per (run, rule), and 0 for each applicable rule it finds none of (a
    counter exported from 0 on, so its first increase counts in Prometheus' ``increase()``)."""
    counts = dict.fromkeys(rules, 0)
    counts.update({(run_id, rule): int(n) for run_id, rule, n in session.execute(query)})
    return [RuleCount(run_id, projects[run_id], rule, n) for (run_id, rule), n in sorted(counts.items())]


def _pending(session: Session, project: str | None) -> dict[str, int]:
    """Samples queued for comparison, per project (``project``'s alone when given)."""
    query = (
        select(RunRow.project, func.count())
        .select_from(PendingComparisonRow)
        .join(RunRow, RunRow.run_id == PendingComparisonRow.run_id)
        .group_by(RunRow.project)
    )
    if project is not None:
        query = query.where(RunRow.project == project)
    return {name: int(n) for name, n in session.execute(query)}


class RuleBreaches:
    """The compared steps at which a rule's condition held, one row per (run, rule, step): recording
    one again (a step evaluated twice, by a retry or a second worker) changes nothing."""

    def __init__(self, sessions: sessionmaker[Session]) -> None:
        self.sessions = sessions

    def record(self, run_id: str, breaches: Iterable[tuple[int, int]]) -> None:
        """Record that each (rule id, step) of ``breaches`` breached on ``run_id``."""
        now = utcnow()
        rows = [
            {"run_id": run_id, "rule_id": rule_id, "step": step, "recorded_at": now}
            for rule_id, step in breaches
        ]
        if not rows:
            return
        with self.sessions.begin() as session:
            dialect = session.get_bind().dialect.name
            insert = (postgresql.insert if dialect == "postgresql" else sqlite.insert)(RuleBreachRow)
            session.execute(insert.on_conflict_do_nothing(), rows)
