"""Bounded storage: each project's retention policy (``retention_policies``), what its runs hold on
disk per run and per step, and applying the policy.

A policy prunes only what grows with tokens, and only in steps that are compared and have nothing
queued or claimed: sample records (their token and logprob arrays) stored more than ``raw_days``
days ago, and, in steps more than ``fingerprint_steps`` behind a run's newest compared step, the
fingerprints of samples judged ``clean`` but one (the step's clean control). Comparison results
(``sample_results``, ``step_results``), the dashboard's ``step_summaries``, step stats, manifests and
alerts are never touched: every figure, verdict, first divergence and alert stays as the comparison
left it. Workers apply the policies (:meth:`Retention.apply_due_retention`), taking turns through
``applied_at``; ``isoaudit retention apply`` applies them at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from isoaudit.audit.db.alerts import utc
from isoaudit.audit.db.engine import Part, table_of, translated_errors
from isoaudit.audit.db.models import (
    ComparisonClaimRow,
    FingerprintRow,
    PendingComparisonRow,
    RetentionPolicyRow,
    RunRow,
    SampleResultRow,
    SampleRow,
    StepResultRow,
)
from isoaudit.audit.records import utcnow
from sqlalchemy import ColumnElement, and_, delete, exists, func, literal, or_, select, update
from sqlalchemy.orm import aliased

__all__ = ["DiskUse", "Retention", "RetentionOutcome", "RetentionPolicy", "StepDiskUse"]

#: How often a worker asks whether a policy is due (each ask is one UPDATE).
CHECK_EVERY_S = 60.0
#: How often each project's policy is applied by the workers.
APPLY_EVERY_S = 3600.0

_SAMPLE_ARRAYS = ("token_ids", "logprobs", "topk_ids", "topk_logprobs", "routes_data", "dist_sketch")
_FINGERPRINT_ARRAYS = ("positions", "digest", "ladder", "sketch", "l2", "maxabs")


@dataclass(frozen=True)
class RetentionPolicy:
    """One project's policy; None keeps that kind of data for ever (a project without a stored
    policy keeps everything)."""

    project: str
    raw_days: int | None = None
    fingerprint_steps: int | None = None
    updated_at: datetime | None = None
    applied_at: datetime | None = None


@dataclass(frozen=True)
class DiskUse:
    """What one run holds: its sample records and fingerprint records, with the bytes their arrays
    take as stored (PostgreSQL: ``pg_column_size``, after compression; SQLite: the blobs' length)."""

    run_id: str
    project: str
    steps: int
    samples: int
    sample_bytes: int
    fingerprints: int
    fingerprint_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.sample_bytes + self.fingerprint_bytes

    @property
    def bytes_per_step(self) -> float:
        return self.total_bytes / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class StepDiskUse:
    """What one step of a run holds (see :class:`DiskUse`)."""

    step: int
    samples: int
    sample_bytes: int
    fingerprints: int
    fingerprint_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.sample_bytes + self.fingerprint_bytes


@dataclass(frozen=True)
class RetentionOutcome:
    """What applying one project's policy removed, and its runs' stored bytes before and after."""

    project: str
    samples_deleted: int
    fingerprints_deleted: int
    bytes_before: int
    bytes_after: int

    @property
    def bytes_freed(self) -> int:
        return self.bytes_before - self.bytes_after


def _policy(row: RetentionPolicyRow) -> RetentionPolicy:
    return RetentionPolicy(
        row.project,
        row.raw_days,
        row.fingerprint_steps,
        utc(row.updated_at),
        None if row.applied_at is None else utc(row.applied_at),
    )


def _check_limit(name: str, value: int | None) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{name}: must be 0 or more (or unset, to keep for ever), got {value}")


class Retention(Part):
    """Retention policies, disk use, and pruning by policy."""

    _next_check = 0.0

    def _bytes(self, table: Any, names: tuple[str, ...]) -> ColumnElement[Any]:
        size = func.pg_column_size if self.dialect == "postgresql" else func.length
        return func.coalesce(
            func.sum(sum((func.coalesce(size(table.c[n]), 0) for n in names), literal(0))), 0
        )

    def retention_policies(self) -> list[RetentionPolicy]:
        """Every stored policy, by project."""
        with self.sessions() as session:
            rows = session.scalars(select(RetentionPolicyRow).order_by(RetentionPolicyRow.project))
            return [_policy(row) for row in rows]

    def retention_policy(self, project: str) -> RetentionPolicy:
        """``project``'s policy (keep everything, if none is stored)."""
        with self.sessions() as session:
            row = session.get(RetentionPolicyRow, project)
            return RetentionPolicy(project) if row is None else _policy(row)

    def set_retention_policy(
        self, project: str, *, raw_days: int | None, fingerprint_steps: int | None
    ) -> RetentionPolicy:
        """Store ``project``'s policy (both limits as given: None keeps that kind for ever)."""
        _check_limit("raw_days", raw_days)
        _check_limit("fingerprint_steps", fingerprint_steps)
        with translated_errors(), self.sessions.begin() as session:
            row = session.get(RetentionPolicyRow, project) or RetentionPolicyRow(project=project)
            row.raw_days, row.fingerprint_steps, row.updated_at = raw_days, fingerprint_steps, utcnow()
            session.add(row)
            session.flush()
            return _policy(row)

    def disk_use(self, *, project: str | None = None, run_id: str | None = None) -> list[DiskUse]:
        """Per run (of ``project``, or the one ``run_id``, or all): records and stored bytes."""
        samples, prints = table_of(SampleRow), table_of(FingerprintRow)
        s = (
            select(
                samples.c.run_id,
                func.count(func.distinct(samples.c.step)).label("steps"),
                func.count().label("n"),
                self._bytes(samples, _SAMPLE_ARRAYS).label("bytes"),
            )
            .group_by(samples.c.run_id)
            .subquery()
        )
        f = (
            select(
                prints.c.run_id,
                func.count().label("n"),
                self._bytes(prints, _FINGERPRINT_ARRAYS).label("bytes"),
            )
            .group_by(prints.c.run_id)
            .subquery()
        )
        results = (
            select(StepResultRow.run_id, func.count().label("steps"))
            .group_by(StepResultRow.run_id)
            .subquery()
        )
        query = (
            select(
                RunRow.run_id,
                RunRow.project,
                func.max(func.coalesce(s.c.steps, 0), func.coalesce(results.c.steps, 0))
                if self.dialect == "sqlite"
                else func.greatest(func.coalesce(s.c.steps, 0), func.coalesce(results.c.steps, 0)),
                func.coalesce(s.c.n, 0),
                func.coalesce(s.c.bytes, 0),
                func.coalesce(f.c.n, 0),
                func.coalesce(f.c.bytes, 0),
            )
            .outerjoin(s, s.c.run_id == RunRow.run_id)
            .outerjoin(f, f.c.run_id == RunRow.run_id)
            .outerjoin(results, results.c.run_id == RunRow.run_id)
            .order_by(RunRow.run_id)
        )
        if project is not None:
            query = query.where(RunRow.project == project)
        if run_id is not None:
            query = query.where(RunRow.run_id == run_id)
        with translated_errors(), self.sessions() as session:
            return [DiskUse(*(r[:2]), *(int(v) for v in r[2:])) for r in session.execute(query)]

    def step_disk_use(self, run_id: str) -> list[StepDiskUse]:
        """Per step of ``run_id`` that holds sample or fingerprint records: records and stored bytes."""
        samples, prints = table_of(SampleRow), table_of(FingerprintRow)
        per_step: dict[int, list[int]] = {}
        with translated_errors(), self.sessions() as session:
            for offset, table, names in ((0, samples, _SAMPLE_ARRAYS), (2, prints, _FINGERPRINT_ARRAYS)):
                query = (
                    select(table.c.step, func.count(), self._bytes(table, names))
                    .where(table.c.run_id == run_id)
                    .group_by(table.c.step)
                )
                for step, n, size in session.execute(query):
                    counts = per_step.setdefault(int(step), [0, 0, 0, 0])
                    counts[offset], counts[offset + 1] = int(n), int(size)
        return [StepDiskUse(step, *counts) for step, counts in sorted(per_step.items())]

    def apply_retention(self, project: str, *, now: datetime | None = None) -> RetentionOutcome:
        """Apply ``project``'s stored policy now (see the module's docstring for what it removes)."""
        policy = self.retention_policy(project)
        before = sum(use.total_bytes for use in self.disk_use(project=project))
        runs = select(RunRow.run_id).where(RunRow.project == project)
        deleted_samples = deleted_prints = 0
        with translated_errors(), self.sessions.begin() as session:
            if policy.raw_days is not None:
                cutoff = (now or utcnow()) - timedelta(days=policy.raw_days)
                table = table_of(SampleRow)
                result = session.execute(
                    delete(table).where(
                        table.c.run_id.in_(runs), table.c.created_at < cutoff, _compared(table)
                    )
                )
                deleted_samples = int(result.rowcount or 0)  # type: ignore[attr-defined]
            if policy.fingerprint_steps is not None:
                table = table_of(FingerprintRow)
                other = aliased(FingerprintRow)
                control = (
                    select(func.min(other.sample_key))
                    .where(other.run_id == table.c.run_id, other.step == table.c.step, _clean(other))
                    .scalar_subquery()
                )
                newest = (
                    select(func.max(StepResultRow.step))
                    .where(StepResultRow.run_id == table.c.run_id)
                    .scalar_subquery()
                )
                result = session.execute(
                    delete(table).where(
                        table.c.run_id.in_(runs),
                        table.c.step <= newest - policy.fingerprint_steps,
                        _compared(table),
                        _clean(table.c),
                        table.c.sample_key != control,
                    )
                )
                deleted_prints = int(result.rowcount or 0)  # type: ignore[attr-defined]
        after = sum(use.total_bytes for use in self.disk_use(project=project))
        return RetentionOutcome(project, deleted_samples, deleted_prints, before, after)

    def apply_due_retention(self, *, every_s: float = APPLY_EVERY_S) -> list[RetentionOutcome]:
        """The worker's call: apply each policy last applied more than ``every_s`` ago, claiming it
        first (a conditional UPDATE of ``applied_at``), so workers sharing the database take turns.
        Asks the database at most once a :data:`CHECK_EVERY_S` per store."""
        if time.monotonic() < self._next_check:
            return []
        self._next_check = time.monotonic() + CHECK_EVERY_S
        now = utcnow()
        table = table_of(RetentionPolicyRow)
        claim = (
            update(table)
            .where(
                or_(table.c.raw_days.is_not(None), table.c.fingerprint_steps.is_not(None)),
                or_(table.c.applied_at.is_(None), table.c.applied_at < now - timedelta(seconds=every_s)),
            )
            .values(applied_at=now)
            .returning(table.c.project)
        )
        with translated_errors(), self.sessions.begin() as session:
            projects = sorted(session.scalars(claim))
        return [self.apply_retention(project, now=now) for project in projects]


def _compared(table: Any) -> ColumnElement[bool]:
    """Rows of steps that are compared, with nothing of theirs queued or being compared."""
    same_step = (StepResultRow.run_id == table.c.run_id, StepResultRow.step == table.c.step)
    return and_(
        exists().where(*same_step),
        ~exists().where(
            PendingComparisonRow.run_id == table.c.run_id, PendingComparisonRow.step == table.c.step
        ),
        ~exists().where(ComparisonClaimRow.run_id == table.c.run_id, ComparisonClaimRow.step == table.c.step),
    )


def _clean(columns: Any) -> ColumnElement[bool]:
    """Fingerprints of a sample the comparison judged ``clean``."""
    return exists().where(
        SampleResultRow.run_id == columns.run_id,
        SampleResultRow.step == columns.step,
        SampleResultRow.sample_key == columns.sample_key,
        SampleResultRow.diagnosis == "clean",
    )
