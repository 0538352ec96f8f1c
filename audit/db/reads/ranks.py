"""What each rank of each side sent: the run page's rank table and ``GET /v1/runs/{id}/ranks``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from isoaudit.audit.db.models import (
    ManifestRow,
    SampleRow,
)
from isoaudit.audit.db.reads.common import aware
from isoaudit.audit.db.store import Store
from sqlalchemy import func, select

#: A rank this many steps behind the newest step its side sent has stopped sending (one step behind
#: is a rank still finishing the step).
STOPPED_AFTER_STEPS = 2


@dataclass(frozen=True)
class RankActivity:
    """What one rank of one side sent: samples, steps, the newest step and when it last sent, how far
    behind the side's newest step it is, and the processes its manifests name (``host:pid/rank``).
    ``rank`` is None for samples sent without one (a single-process job)."""

    side: str
    rank: int | None
    samples: int
    steps: int
    first_step: int
    last_step: int
    last_seen: datetime | None
    steps_behind: int
    processes: list[str]

    @property
    def stopped(self) -> bool:
        return self.steps_behind >= STOPPED_AFTER_STEPS


def _process_rank(process: str) -> int | None:
    """The rank at the end of a manifest's ``process`` (``host:pid/rank``), or None."""
    _, sep, tail = process.rpartition("/")
    return int(tail) if sep and tail.isdigit() else None


def rank_activity(store: Store, run_id: str) -> list[RankActivity]:
    """Per (side, rank), sorted: the counters the run page and ``GET /v1/runs/{id}/ranks`` show
    (one grouped query over the run's sample rows, and the run's manifests' process names)."""
    query = (
        select(
            SampleRow.side,
            SampleRow.rank,
            func.count(),
            func.count(func.distinct(SampleRow.step)),
            func.min(SampleRow.step),
            func.max(SampleRow.step),
            func.max(SampleRow.created_at),
        )
        .where(SampleRow.run_id == run_id)
        .group_by(SampleRow.side, SampleRow.rank)
    )
    processes = select(ManifestRow.side, ManifestRow.process).where(ManifestRow.run_id == run_id).distinct()
    with store.sessions() as session:
        rows = session.execute(query).all()
        named: dict[tuple[str, int | None], set[str]] = {}
        for side, process in session.execute(processes):
            named.setdefault((side, _process_rank(process or "")), set()).add(process)
    newest = {side: max(row[5] for row in rows if row[0] == side) for side in {row[0] for row in rows}}
    out = [
        RankActivity(
            side=side,
            rank=rank,
            samples=int(n),
            steps=int(n_steps),
            first_step=int(first),
            last_step=int(last),
            last_seen=aware(seen),
            steps_behind=int(newest[side] - last),
            processes=sorted(named.get((side, rank), set())),
        )
        for side, rank, n, n_steps, first, last, seen in rows
    ]
    return sorted(out, key=lambda r: (r.side, -1 if r.rank is None else r.rank))


def rank_series(store: Store, run_id: str, from_step: int = 0) -> list[tuple[int, str, int | None, int]]:
    """(step, side, rank, samples) from ``from_step`` on, in step order: what each rank sent per step."""
    query = (
        select(SampleRow.step, SampleRow.side, SampleRow.rank, func.count())
        .where(SampleRow.run_id == run_id, SampleRow.step >= from_step)
        .group_by(SampleRow.step, SampleRow.side, SampleRow.rank)
        .order_by(SampleRow.step, SampleRow.side, SampleRow.rank)
    )
    with store.sessions() as session:
        return [(int(step), side, rank, int(n)) for step, side, rank, n in session.execute(query)]
