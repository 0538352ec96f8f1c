"""Runs: what is stored of each run (its registration, how many steps it has sent) and each step's
counts of samples per side and compared."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from isoaudit.audit.db.codec import read_one, readable
from isoaudit.audit.db.engine import Part
from isoaudit.audit.db.models import RunRow, SampleResultRow, SampleRow
from sqlalchemy import func, select

__all__ = ["MAX_OFFSET", "MAX_PAGE", "RunSummary", "Runs", "StepCounts"]

#: The most rows one page of a list read returns (the API's ``limit`` is capped here).
MAX_PAGE = 1000
#: The largest ``offset`` a list read takes: what a BIGINT holds, with room to spare.
MAX_OFFSET = 2**62


@dataclass(frozen=True)
class RunSummary:
    """A run as registered, with the number of steps it has samples of and the newest one."""

    run_id: str
    project: str
    name: str
    started_at: datetime
    config: dict[str, Any]
    n_steps: int
    last_step: int | None


@dataclass(frozen=True)
class StepCounts:
    """One step's samples per side and how many of them are compared."""

    step: int
    trainer_samples: int
    rollout_samples: int
    compared_samples: int


def _summary(row: RunRow, n: int | None, last: int | None) -> RunSummary:
    return RunSummary(row.run_id, row.project, row.name, row.started_at, dict(row.config), n or 0, last)


class Runs(Part):
    """Reads of runs and their steps' counts."""

    def list_runs(
        self, project: str | None = None, *, limit: int = MAX_PAGE, offset: int = 0
    ) -> list[RunSummary]:
        """Runs newest first (only ``project``'s when given), one page: ``limit`` (at most
        :data:`MAX_PAGE`) from ``offset`` on. A run whose stored row cannot be read is left out
        (and logged)."""
        steps = (
            select(
                SampleRow.run_id,
                func.count(func.distinct(SampleRow.step)).label("n"),
                func.max(SampleRow.step).label("last"),
            )
            .group_by(SampleRow.run_id)
            .subquery()
        )
        query = (
            select(RunRow, steps.c.n, steps.c.last)
            .outerjoin(steps, steps.c.run_id == RunRow.run_id)
            .order_by(RunRow.started_at.desc(), RunRow.run_id)
            .limit(min(limit, MAX_PAGE))
            .offset(offset)
        )
        if project is not None:
            query = query.where(RunRow.project == project)
        with self.sessions() as session:
            return readable(
                session.execute(query),
                lambda found: _summary(found[0], found[1], found[2]),
                lambda found: f"run {found[0].run_id!r}",
            )

    def get_run(self, run_id: str) -> RunSummary | None:
        """One run's summary (None if unknown); raises ``UnreadableRow`` if its stored row cannot be read."""
        steps = select(func.count(func.distinct(SampleRow.step)), func.max(SampleRow.step)).where(
            SampleRow.run_id == run_id
        )
        with self.sessions() as session:
            row = session.get(RunRow, run_id)
            if row is None:
                return None
            n, last = session.execute(steps).one()
            return read_one(row, lambda run: _summary(run, n, last), f"run {run_id!r}")

    def run_project(self, run_id: str) -> str | None:
        """The project a run belongs to (None if unknown)."""
        with self.sessions() as session:
            return session.scalar(select(RunRow.project).where(RunRow.run_id == run_id))

    def run_config(self, run_id: str) -> dict[str, Any] | None:
        """The run's free-form config (one row, no counts: cheap enough for every compared step)."""
        with self.sessions() as session:
            return session.scalar(select(RunRow.config).where(RunRow.run_id == run_id))

    def steps(
        self, run_id: str, from_step: int | None = None, to_step: int | None = None
    ) -> list[StepCounts]:
        """Each step's counts, in step order (only ``from_step``..``to_step``, inclusive, when given)."""
        bounds = []
        if from_step is not None:
            bounds.append(SampleRow.step >= from_step)
        if to_step is not None:
            bounds.append(SampleRow.step <= to_step)
        counts = (
            select(SampleRow.step, SampleRow.side, func.count())
            .where(SampleRow.run_id == run_id, *bounds)
            .group_by(SampleRow.step, SampleRow.side)
        )
        compared = (
            select(SampleResultRow.step, func.count())
            .where(SampleResultRow.run_id == run_id)
            .group_by(SampleResultRow.step)
        )
        with self.sessions() as session:
            by_step: dict[int, dict[str, int]] = {}
            for step, side, n in session.execute(counts):
                by_step.setdefault(step, {})[side] = n
            done = dict(session.execute(compared).all())
        return [
            StepCounts(step, sides.get("trainer", 0), sides.get("rollout", 0), done.get(step, 0))
            for step, sides in sorted(by_step.items())
        ]
