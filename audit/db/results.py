"""Comparison results: each compared sample's verdict, each compared step's figures and the dashboard's
summary of it, saved together from one :class:`audit.compare.StepOutcome` per step."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from typing import Any, TypeVar

from isoaudit.audit.compare import StepOutcome
from isoaudit.audit.db.engine import Part, defer_wal_checkpoint, table_of
from isoaudit.audit.db.ingest import copy_rows, driver_of
from isoaudit.audit.db.models import (
    Base,
    FingerprintRow,
    PendingComparisonRow,
    SampleResultRow,
    SampleRow,
    StepResultRow,
    StepSummaryRow,
)
from isoaudit.audit.db.queue import StepClaim, release
from isoaudit.audit.db.runs import MAX_PAGE
from isoaudit.audit.records import utcnow
from isoaudit.audit.summaries import StepFacts, StepSummary, Verdict
from sqlalchemy import Table, delete, func, insert, select, tuple_
from sqlalchemy.orm import Session

__all__ = ["Results", "SampleResult", "StepResult"]

StepKey = tuple[str, int]


@dataclass(frozen=True)
class SampleResult:
    """The comparator's verdict on one sample present on both sides."""

    run_id: str
    step: int
    sample_key: str
    n_tokens: int
    metrics: dict[str, Any]
    diagnosis: str
    diagnosis_detail: dict[str, Any]
    first_divergence_region: str | None
    first_divergence_position: int | None
    grid: dict[str, Any]
    computed_at: datetime


@dataclass(frozen=True)
class StepResult:
    """Token-weighted figures of one step over its compared samples, for timelines and alerts;
    ``revision``: how many times it was compared, ``compared_by``: the worker that did it last."""

    run_id: str
    step: int
    n_samples: int
    metrics: dict[str, Any]
    diagnoses: dict[str, Any]
    computed_at: datetime
    revision: int
    compared_by: str | None


Typed = TypeVar("Typed", SampleResult, StepResult)


def _typed(kind: type[Typed], row: Base) -> Typed:
    return kind(**{f.name: getattr(row, f.name) for f in fields(kind)})


class Results(Part):
    """Writes and reads of comparison results."""

    def save_outcomes(
        self,
        worker: str,
        claims: Sequence[StepClaim],
        outcomes: Sequence[StepOutcome],
        arrived: Mapping[StepKey, datetime] | None = None,
    ) -> set[StepKey]:
        """In one transaction: release ``worker``'s claims and, for the steps it still held (a claim
        retaken after its lease ran out belongs to the other worker now), replace their sample
        results, step results (counting the step's revision) and summaries, and clear the samples
        compared from the queue (those queued again after the claim read them stay). Returns the
        steps saved; nothing is written for the others. ``arrived``: when each step's latest sample was
        stored, as its samples were read (:meth:`~audit.db.records.Records.samples_and_arrivals`);
        read here for the others. On SQLite the commit leaves the write-ahead log to the worker's
        idle checkpoint (:meth:`~audit.db.store.Store.checkpoint`)."""
        with self.sessions.begin() as session:
            defer_wal_checkpoint(session)
            facts = _step_facts(session, [(o.run_id, o.step) for o in outcomes], arrived or {})
            held = release(session, worker, [(c.run_id, c.step) for c in claims])
            mine = [o for o in outcomes if (o.run_id, o.step) in held]
            if not mine:
                return held
            revisions = {
                (run, step): revision
                for run, step, revision in session.execute(
                    select(StepResultRow.run_id, StepResultRow.step, StepResultRow.revision).where(
                        tuple_(StepResultRow.run_id, StepResultRow.step).in_(sorted(held))
                    )
                )
            }
            self._replace_results(
                session,
                [row for o in mine for row in o.sample_results()],
                [
                    {
                        "run_id": o.run_id,
                        "step": o.step,
                        **o.step_result(facts[(o.run_id, o.step)]),
                        "compared_by": worker,
                        "revision": revisions.get((o.run_id, o.step), 0) + 1,
                    }
                    for o in mine
                ],
            )
            _replace_summaries(session, [o.summary(facts[(o.run_id, o.step)]) for o in mine])
            for claim in claims:  # one statement per step: each has its own cut-off time
                if (claim.run_id, claim.step) in held and claim.sample_keys:
                    session.execute(
                        delete(PendingComparisonRow).where(
                            PendingComparisonRow.run_id == claim.run_id,
                            PendingComparisonRow.step == claim.step,
                            PendingComparisonRow.sample_key.in_(claim.sample_keys),
                            PendingComparisonRow.queued_at <= claim.read_at,
                        )
                    )
        return held

    def save_comparison(
        self,
        sample_results: Sequence[dict[str, Any]],
        step_results: Sequence[dict[str, Any]],
        done: Sequence[tuple[str, int, str]],
        queued_before: datetime | None = None,
    ) -> None:
        """Replace the results of the given samples and steps (``sample_results`` / ``step_results``
        rows) and clear them from the queue, in one transaction. Entries queued again after
        ``queued_before`` (new records arrived meanwhile) stay queued."""
        with self.sessions.begin() as session:
            self._replace_results(session, sample_results, step_results)
            if done:
                cleared = delete(PendingComparisonRow).where(
                    tuple_(
                        PendingComparisonRow.run_id,
                        PendingComparisonRow.step,
                        PendingComparisonRow.sample_key,
                    ).in_(list(done))
                )
                if queued_before is not None:
                    cleared = cleared.where(PendingComparisonRow.queued_at <= queued_before)
                session.execute(cleared)

    def _replace_results(
        self, session: Session, samples: Sequence[dict[str, Any]], steps: Sequence[dict[str, Any]]
    ) -> None:
        now = utcnow()
        if samples:  # one statement per step: its keys as one list, not a list of tuples
            by_step: dict[StepKey, list[str]] = {}
            for r in samples:
                by_step.setdefault((r["run_id"], r["step"]), []).append(r["sample_key"])
            for (run, step), keys in by_step.items():
                session.execute(
                    delete(SampleResultRow).where(
                        SampleResultRow.run_id == run,
                        SampleResultRow.step == step,
                        SampleResultRow.sample_key.in_(keys),
                    )
                )
            rows = [{**r, "computed_at": now} for r in samples]
            if self.dialect == "postgresql":  # a step's results at COPY speed, as ingest stores records
                with driver_of(session).cursor() as cursor:
                    table = table_of(SampleResultRow)
                    copy_rows(cursor, table, table.name, list(rows[0]), rows)
            else:
                _insert_processed(session, table_of(SampleResultRow), rows)
        if steps:
            columns = (StepResultRow.run_id, StepResultRow.step)
            session.execute(
                delete(StepResultRow).where(tuple_(*columns).in_([(r["run_id"], r["step"]) for r in steps]))
            )
            session.execute(self._insert(StepResultRow), [{**r, "computed_at": now} for r in steps])

    def sample_results(
        self,
        run_id: str,
        step: int | None = None,
        *,
        diagnosis: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[SampleResult]:
        """Compared samples by step then key (only ``step``'s, only those with ``diagnosis``, when
        given); one page of ``limit`` (at most :data:`~audit.db.runs.MAX_PAGE`) from ``offset`` when
        ``limit`` is given."""
        if diagnosis is not None and "\x00" in diagnosis:
            return []  # matches no stored value, and PostgreSQL refuses NUL in a text parameter
        query = select(SampleResultRow).where(SampleResultRow.run_id == run_id)
        if step is not None:
            query = query.where(SampleResultRow.step == step)
        if diagnosis is not None:
            query = query.where(SampleResultRow.diagnosis == diagnosis)
        query = query.order_by(SampleResultRow.step, SampleResultRow.sample_key)
        if limit is not None:
            query = query.limit(min(limit, MAX_PAGE)).offset(offset)
        with self.sessions() as session:
            return [_typed(SampleResult, row) for row in session.scalars(query)]

    def step_results(
        self,
        run_id: str,
        from_step: int | None = None,
        to_step: int | None = None,
        *,
        only: Collection[int] | None = None,
    ) -> list[StepResult]:
        """Compared steps in order (only ``from_step``..``to_step``, inclusive, and only the steps
        ``only`` names, when given)."""
        query = select(StepResultRow).where(StepResultRow.run_id == run_id)
        if only is not None:
            query = query.where(StepResultRow.step.in_(sorted(only)))
        if from_step is not None:
            query = query.where(StepResultRow.step >= from_step)
        if to_step is not None:
            query = query.where(StepResultRow.step <= to_step)
        with self.sessions() as session:
            return [_typed(StepResult, row) for row in session.scalars(query.order_by(StepResultRow.step))]

    def compared_steps(self, run_id: str) -> int:
        """How many steps of a run have results."""
        query = select(func.count()).select_from(StepResultRow).where(StepResultRow.run_id == run_id)
        with self.sessions() as session:
            return int(session.scalar(query) or 0)

    def compared_keys(self, run_id: str, step: int) -> list[str]:
        """The sample keys of a step that have results."""
        with self.sessions() as session:
            return list(
                session.scalars(
                    select(SampleResultRow.sample_key).where(
                        SampleResultRow.run_id == run_id, SampleResultRow.step == step
                    )
                )
            )

    def step_facts(self, steps: Sequence[StepKey]) -> dict[StepKey, StepFacts]:
        """What the store knows of each step besides its pairs (stored verdicts, fingerprinted
        samples, latest arrival), in three queries."""
        with self.sessions() as session:
            return _step_facts(session, steps)

    def save_summaries(self, summaries: Sequence[StepSummary]) -> None:
        """Replace the steps' summaries (idempotent: summarizing a step again rewrites the same row)."""
        with self.sessions.begin() as session:
            _replace_summaries(session, summaries)

    def unsummarized_steps(self, limit: int) -> list[StepKey]:
        """Compared steps without a summary (compared before migration 0004 added them), oldest first."""
        query = (
            select(StepResultRow.run_id, StepResultRow.step)
            .outerjoin(
                StepSummaryRow,
                (StepSummaryRow.run_id == StepResultRow.run_id) & (StepSummaryRow.step == StepResultRow.step),
            )
            .where(StepSummaryRow.step.is_(None))
            .order_by(StepResultRow.run_id, StepResultRow.step)
            .limit(limit)
        )
        with self.sessions() as session:
            return [(run_id, step) for run_id, step in session.execute(query)]


def _insert_processed(session: Session, table: Table, rows: list[dict[str, Any]]) -> None:
    """``rows`` into ``table`` by the driver's ``executemany``, each column's values made by its
    type's bind processor (JSON text, UTC times) a column at a time: an ORM or Core executemany
    builds every row's parameters itself, most of the time of a step's 512 results on SQLite."""
    connection = session.connection()
    dialect = connection.dialect
    names = list(rows[0])
    columns: list[list[Any]] = []
    for name in names:
        values = [row[name] for row in rows]
        process = table.c[name].type.dialect_impl(dialect).bind_processor(dialect)
        columns.append([process(v) for v in values] if process is not None else values)
    marks = ", ".join(["?"] * len(names))
    quoted = ", ".join(dialect.identifier_preparer.quote(name) for name in names)
    connection.exec_driver_sql(
        f"INSERT INTO {table.name} ({quoted}) VALUES ({marks})", list(zip(*columns, strict=True))
    )


def _replace_summaries(session: Session, summaries: Sequence[StepSummary]) -> None:
    if not summaries:
        return
    key = tuple_(StepSummaryRow.run_id, StepSummaryRow.step)
    session.execute(delete(StepSummaryRow).where(key.in_([(s.run_id, s.step) for s in summaries])))
    now = utcnow()
    session.execute(insert(table_of(StepSummaryRow)), [{**asdict(s), "computed_at": now} for s in summaries])


def _step_facts(
    session: Session, steps: Sequence[StepKey], arrived: Mapping[StepKey, datetime] | None = None
) -> dict[StepKey, StepFacts]:
    if not steps:
        return {}
    wanted = tuple_(SampleResultRow.run_id, SampleResultRow.step).in_(list(steps))
    verdicts: dict[StepKey, list[Verdict]] = {(run, step): [] for run, step in steps}
    query = select(
        SampleResultRow.run_id,
        SampleResultRow.step,
        SampleResultRow.sample_key,
        SampleResultRow.diagnosis,
        SampleResultRow.first_divergence_region,
    ).where(wanted)
    for run, step, key, diagnosis, region in session.execute(query):
        verdicts[(run, step)].append(Verdict(key, diagnosis, region))
    printed = {
        (run, step): n
        for run, step, n in session.execute(
            select(
                FingerprintRow.run_id,
                FingerprintRow.step,
                func.count(func.distinct(FingerprintRow.sample_key)),
            )
            .where(tuple_(FingerprintRow.run_id, FingerprintRow.step).in_(list(steps)))
            .group_by(FingerprintRow.run_id, FingerprintRow.step)
        )
    }
    ingested = {key: at for key, at in (arrived or {}).items() if key in verdicts}
    unknown = [key for key in steps if key not in ingested]
    if unknown:
        ingested |= {
            (run, step): at
            for run, step, at in session.execute(
                select(SampleRow.run_id, SampleRow.step, func.max(SampleRow.created_at))
                .where(tuple_(SampleRow.run_id, SampleRow.step).in_(unknown))
                .group_by(SampleRow.run_id, SampleRow.step)
            )
        }
    return {key: StepFacts(verdicts[key], int(printed.get(key, 0)), ingested.get(key)) for key in verdicts}
