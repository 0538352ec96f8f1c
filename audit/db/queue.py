"""The comparison queue: samples whose records changed since they were last compared, the leases
under which comparison workers claim whole steps of them (so each step is compared by one worker, and
a dead worker's steps are retaken when its lease runs out), and the backlog: what waits, and whether
any worker is attending to it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from isoaudit.audit.db.engine import Part, table_of
from isoaudit.audit.db.models import ComparisonClaimRow, PendingComparisonRow, SampleRow, StepResultRow
from isoaudit.audit.records import utcnow
from sqlalchemy import ColumnElement, Exists, Select, delete, exists, func, select, tuple_, update
from sqlalchemy.orm import Session

__all__ = ["Backlog", "Queue", "StepClaim", "release"]


@dataclass(frozen=True)
class Backlog:
    """Samples ready to compare (both sides stored) that no worker has compared yet: how many, in
    how many steps and runs, and when the longest-waiting of them was queued."""

    samples: int = 0
    steps: int = 0
    runs: int = 0
    oldest: datetime | None = None

    def __bool__(self) -> bool:
        return self.samples > 0


@dataclass(frozen=True)
class StepClaim:
    """A step a comparison worker holds (``Store.claim_steps``): the samples of it ready to compare,
    and when they were read (samples queued again after that stay queued)."""

    run_id: str
    step: int
    sample_keys: list[str]
    read_at: datetime


class Queue(Part):
    """The comparison worker's queue and claims."""

    @staticmethod
    def _ready(*where: ColumnElement[bool]) -> Select[str, int, str, datetime]:
        """Queued samples whose two sides are both stored: for each queued row, one lookup per side
        in the samples' unique (run, step, side, key) index, so its cost follows the queue, not the
        size of the store or of the step."""
        pending = PendingComparisonRow
        return select(pending.run_id, pending.step, pending.sample_key, pending.queued_at).where(
            _stored("trainer", pending), _stored("rollout", pending), *where
        )

    def pending(self, limit: int = 10_000) -> list[tuple[str, int, str]]:
        """Samples queued for comparison whose two sides are both stored, oldest first."""
        ready = self._ready().subquery()
        query = (
            select(ready.c.run_id, ready.c.step, ready.c.sample_key).order_by(ready.c.queued_at).limit(limit)
        )
        with self.sessions() as session:
            return [(run, step, key) for run, step, key in session.execute(query)]

    def backlog(self, run_id: str | None = None, *, queued_before: datetime | None = None) -> Backlog:
        """The samples ready to compare (only ``run_id``'s if given; only those queued before
        ``queued_before`` if given)."""
        where: list[ColumnElement[bool]] = []
        if run_id is not None:
            where.append(PendingComparisonRow.run_id == run_id)
        if queued_before is not None:
            where.append(PendingComparisonRow.queued_at < queued_before)
        return self._backlog(where)

    def stalled_backlog(self, after_s: float, run_id: str | None = None) -> Backlog:
        """The ready samples no comparison worker is attending to (only ``run_id``'s if given): queued
        more than ``after_s`` seconds ago, of runs none of whose steps was compared in that time, while
        no worker holds a live claim anywhere (a worker busy with an older backlog holds one). Empty
        while any worker compares; what a page shows to say that nothing will compare these steps."""
        now = utcnow()
        cutoff = now - timedelta(seconds=after_s)
        with self.sessions() as session:
            if session.scalar(select(exists().where(ComparisonClaimRow.leased_until > now))):
                return Backlog()
        recent = (
            select(StepResultRow.run_id)
            .where(StepResultRow.run_id == PendingComparisonRow.run_id, StepResultRow.computed_at >= cutoff)
            .exists()
        )
        where = [PendingComparisonRow.queued_at < cutoff, ~recent]
        if run_id is not None:
            where.append(PendingComparisonRow.run_id == run_id)
        return self._backlog(where)

    def _backlog(self, where: Sequence[ColumnElement[bool]]) -> Backlog:
        ready = self._ready(*where).subquery()
        steps = (
            select(
                ready.c.run_id,
                func.count().label("samples"),
                func.min(ready.c.queued_at).label("oldest"),
            )
            .group_by(ready.c.run_id, ready.c.step)
            .subquery()
        )
        totals = select(
            func.coalesce(func.sum(steps.c.samples), 0),
            func.count(),
            func.count(func.distinct(steps.c.run_id)),
            func.min(steps.c.oldest),
        )
        with self.sessions() as session:
            samples, n_steps, runs, oldest = session.execute(totals).one()
        if oldest is not None and oldest.tzinfo is None:  # SQLite hands timestamps back without their zone
            oldest = oldest.replace(tzinfo=UTC)
        return Backlog(int(samples), int(n_steps), int(runs), oldest)

    def claim_steps(
        self, worker: str, *, lease_s: float, max_pairs: int = 1024, run_id: str | None = None
    ) -> list[StepClaim]:
        """Claim the oldest queued steps that have samples ready on both sides and that no other
        worker holds: up to ``max_pairs`` queued samples in all (at least one step), each leased to
        ``worker`` for ``lease_s`` seconds. A step whose lease ran out (its worker died) is claimed
        again. Each claim lists every ready sample of its step and the time they were read, so what
        arrives later stays queued. Claims are taken by an upsert that only replaces an expired
        lease, so two workers racing for one step cannot both get it, on PostgreSQL or SQLite."""
        now = utcnow()
        window = 4 * max_pairs
        pending = PendingComparisonRow
        held = select(ComparisonClaimRow.run_id).where(
            ComparisonClaimRow.run_id == pending.run_id,
            ComparisonClaimRow.step == pending.step,
            ComparisonClaimRow.leased_until > now,
        )
        # Only the head of the queue is checked for both sides (a narrow scan of the queue, then
        # index lookups of its rows), so a claim costs the same however long the backlog grows.
        head = (
            select(pending.run_id, pending.step, pending.sample_key, pending.queued_at)
            .where(~held.exists(), *([pending.run_id == run_id] if run_id is not None else []))
            .order_by(pending.queued_at)
            .limit(window)
            .subquery()
        )
        sides = select(
            head, _stored("trainer", head.c).label("trainer"), _stored("rollout", head.c).label("rollout")
        )
        with self.sessions.begin() as session:
            rows = session.execute(sides).all()
            by_step: dict[tuple[str, int], list[datetime]] = {}
            waiting = []
            for run, step, key, queued_at, trainer, rollout in rows:
                if trainer and rollout:
                    by_step.setdefault((run, step), []).append(queued_at)
                else:
                    waiting.append((run, step, key))
            if len(rows) == window and waiting:
                # A full head holding samples whose other side has not come: send them to the back,
                # or a run that never sends one side would block the queue behind it.
                session.execute(
                    update(pending)
                    .where(tuple_(pending.run_id, pending.step, pending.sample_key).in_(waiting))
                    .values(queued_at=now)
                )
            wanted: list[dict[str, str | int]] = []
            total = 0
            for (run, step), times in sorted(by_step.items(), key=lambda item: (min(item[1]), item[0])):
                if wanted and total + len(times) > max_pairs:
                    break
                wanted.append({"run_id": run, "step": step})
                total += len(times)
            if not wanted:
                return []
            wanted.sort(key=lambda w: (w["run_id"], w["step"]))  # one lock order for every worker
            lease = {"worker": worker, "claimed_at": now, "leased_until": now + timedelta(seconds=lease_s)}
            insert = self._insert(ComparisonClaimRow)
            take = insert.on_conflict_do_update(
                index_elements=["run_id", "step"],
                set_={c: insert.excluded[c] for c in lease},
                where=ComparisonClaimRow.leased_until <= insert.excluded.claimed_at,
            ).returning(ComparisonClaimRow.run_id, ComparisonClaimRow.step)
            claimed = {(run, step) for run, step in session.execute(take, [{**w, **lease} for w in wanted])}
        if not claimed:
            return []
        read_at = utcnow()
        keys: dict[tuple[str, int], list[str]] = {step: [] for step in claimed}
        query = Queue._ready(
            tuple_(PendingComparisonRow.run_id, PendingComparisonRow.step).in_(sorted(claimed))
        ).order_by(PendingComparisonRow.run_id, PendingComparisonRow.step, PendingComparisonRow.sample_key)
        with self.sessions() as session:
            for run, step, key, _ in session.execute(query):
                keys[(run, step)].append(key)
        return [StepClaim(run, step, keys[(run, step)], read_at) for run, step in sorted(claimed)]

    def release_claims(self, worker: str, claims: Sequence[StepClaim]) -> None:
        """Give claims back without results (the worker is stopping, or a step had nothing ready)."""
        if not claims:
            return
        with self.sessions.begin() as session:
            release(session, worker, [(c.run_id, c.step) for c in claims])


def _stored(side: str, queued: Any) -> Exists:
    """Whether ``side``'s record of a queued sample (``queued``: columns ``run_id``, ``step``,
    ``sample_key``) is stored: one lookup in the samples' unique (run, step, side, key) index."""
    return exists().where(
        SampleRow.run_id == queued.run_id,
        SampleRow.step == queued.step,
        SampleRow.side == side,
        SampleRow.sample_key == queued.sample_key,
    )


def release(session: Session, worker: str, steps: Sequence[tuple[str, int]]) -> set[tuple[str, int]]:
    """Within ``session``'s transaction: delete ``worker``'s claims of ``steps``; return the steps it
    still held (a claim retaken after its lease ran out belongs to another worker now)."""
    claims = table_of(ComparisonClaimRow)
    stmt = (
        delete(claims)
        .where(claims.c.worker == worker, tuple_(claims.c.run_id, claims.c.step).in_(list(steps)))
        .returning(claims.c.run_id, claims.c.step)
    )
    return {(run, step) for run, step in session.execute(stmt)}
