"""Step stats: the RL loop's own figures per step (``audit.records.StepStats``), so the dashboard can
set mismatch beside reward."""

from __future__ import annotations

from isoaudit.audit.db.codec import readable
from isoaudit.audit.db.engine import Part
from isoaudit.audit.db.models import StepStatsRow
from isoaudit.audit.records import StepStats
from sqlalchemy import select

__all__ = ["Steps"]

#: The figures StepStats names; any other stored figure is one of its ``extras``.
_NAMED = ("reward_mean", "reward_std", "entropy", "clip_fraction", "generation_s", "training_s")


class Steps(Part):
    """Reads of step stats (they are written by ``Store.ingest``)."""

    def step_stats(self, run_id: str, from_step: int = 0, to_step: int | None = None) -> list[StepStats]:
        """The run's step stats from ``from_step`` to ``to_step`` (inclusive), in step order (a stored
        row that cannot be read back is left out, and logged)."""
        query = select(StepStatsRow).where(StepStatsRow.run_id == run_id, StepStatsRow.step >= from_step)
        if to_step is not None:
            query = query.where(StepStatsRow.step <= to_step)
        with self.sessions() as session:
            return readable(
                session.scalars(query.order_by(StepStatsRow.step)),
                _step_stats,
                lambda row: f"step stats of run {row.run_id!r} step {row.step}",
            )


def _step_stats(row: StepStatsRow) -> StepStats:
    figures = dict(row.figures)
    given = {k: figures.pop(k) for k in _NAMED if k in figures}
    return StepStats(run_id=row.run_id, step=row.step, extras=figures, created_at=row.created_at, **given)
