"""The store: transactional, idempotent ingest of records and the queries the comparator, the API and
the dashboard need. SQLite (WAL) by default, PostgreSQL for multi-writer deployments.

Ingest never waits on the comparator: it stores records and marks the samples they touch as pending,
and the comparison worker (``audit.worker``) picks them up.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import numpy as np
from isoaudit.audit.arrays import from_bytes, to_bytes
from isoaudit.audit.config import database_url
from isoaudit.audit.models import (
    ComparisonClaimRow,
    FingerprintRow,
    ManifestRow,
    PendingComparisonRow,
    RunRow,
    SampleResultRow,
    SampleRow,
    StepResultRow,
    StepStatsRow,
)
from isoaudit.audit.records import (
    Manifest,
    Record,
    RecordError,
    RegionFingerprints,
    Rejection,
    Run,
    SampleLogprobs,
    Side,
    StepStats,
    WeightSpan,
    record_kind,
    utcnow,
    validate_record,
)
from isoaudit.audit.routing import routes_columns, routes_from_columns
from isoaudit.audit.service_models import REMEDIATION_MODES, ControlState, RunControlRow, StaleControlVersion
from sqlalchemy import Engine, create_engine, delete, event, func, select, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

__all__ = [
    "ForbiddenRun",
    "IngestResult",
    "Rejection",
    "RunSummary",
    "StepClaim",
    "StepSummary",
    "Store",
    "StoreError",
]


class StoreError(Exception):
    """A request the store refuses as a whole (nothing of it was stored)."""


class ForbiddenRun(StoreError):
    """A record names a run that belongs to another project."""


@dataclass
class IngestResult:
    """What one batch did, per record kind: stored, already there (``duplicates``), and refused
    (``rejected``, one :class:`Rejection` per record, naming its index in the batch and the field)."""

    stored: Counter[str] = field(default_factory=Counter)
    duplicates: Counter[str] = field(default_factory=Counter)
    pending: int = 0
    rejected: list[Rejection] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    """The runs the stored records name (sorted); not in :meth:`as_dict`, the API answers with their
    control state instead."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "stored": dict(self.stored),
            "duplicates": dict(self.duplicates),
            "pending": self.pending,
            "rejected": [r.as_dict() for r in self.rejected],
        }


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    project: str
    name: str
    started_at: datetime
    config: dict[str, Any]
    n_steps: int
    last_step: int | None


@dataclass(frozen=True)
class StepClaim:
    """A step a comparison worker holds (``Store.claim_steps``): the samples of it ready to compare,
    and when they were read (samples queued again after that stay queued)."""

    run_id: str
    step: int
    sample_keys: list[str]
    read_at: datetime


@dataclass(frozen=True)
class StepSummary:
    step: int
    trainer_samples: int
    rollout_samples: int
    compared_samples: int


#: How long a statement waits for the database by default: SQLite's busy timeout (another writer
#: holds the lock) and PostgreSQL's connect timeout. The API passes its own, shorter one.
DEFAULT_TIMEOUT_S = 30.0


def _sqlite_pragmas(timeout_s: float) -> Any:
    def connect(dbapi_connection: Any, _record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
        cursor.close()

    return connect


def make_engine(url: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> Engine:
    """An engine for ``url`` with the settings the store relies on: WAL, foreign keys and a busy
    timeout of ``timeout_s`` on SQLite; on a server, a connect timeout of ``timeout_s`` and a ping
    before a pooled connection is reused (a connection cut or a restarted server costs one failed
    request, then the pool heals by itself)."""
    url = database_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(url, **kwargs)
        event.listen(engine, "connect", _sqlite_pragmas(timeout_s))
        return engine
    connect_args = kwargs.pop("connect_args", {})
    if url.startswith("postgresql"):
        connect_args.setdefault("connect_timeout", max(1, round(timeout_s)))
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(url, connect_args=connect_args, **kwargs)


def _sample_row(record: SampleLogprobs) -> dict[str, Any]:
    has_topk = record.topk_ids is not None and record.topk_logprobs is not None
    return {
        "run_id": record.run_id,
        "step": record.step,
        "side": record.side,
        "sample_key": record.sample_key,
        "weight_version": record.weight_version,
        "prompt_len": record.prompt_len,
        "n_tokens": int(record.token_ids.size),
        "temperature": record.temperature,
        "top_k": record.top_k,
        "top_p": record.top_p,
        "min_p": record.min_p,
        "weight_spans": [span.model_dump() for span in record.weight_spans] if record.weight_spans else None,
        "semantics": record.semantics,
        "token_ids": to_bytes(record.token_ids.astype(np.int32, copy=False)),
        "logprobs": to_bytes(record.logprobs.astype(np.float32, copy=False)),
        "topk": int(record.topk_ids.shape[1]) if has_topk else None,
        "topk_ids": to_bytes(record.topk_ids) if has_topk else None,
        "topk_logprobs": to_bytes(record.topk_logprobs) if has_topk else None,
        "path": dict(record.path) or None,
        "rank": record.rank,
        **routes_columns(record.routes),
        "created_at": utcnow(),
    }


def _sample_record(row: SampleRow) -> SampleLogprobs:
    n_completion = row.n_tokens - row.prompt_len
    topk = None
    if row.topk is not None and row.topk_ids is not None and row.topk_logprobs is not None:
        topk = (
            from_bytes(row.topk_ids, "<i4", (n_completion, row.topk)),
            from_bytes(row.topk_logprobs, "<f4", (n_completion, row.topk)),
        )
    # Stored rows were validated on the way in: construct without re-validating (the comparator's hot path).
    return SampleLogprobs.model_construct(
        run_id=row.run_id,
        step=row.step,
        side=row.side,
        sample_key=row.sample_key,
        weight_version=row.weight_version,
        prompt_len=row.prompt_len,
        token_ids=from_bytes(row.token_ids, "<i4"),
        logprobs=from_bytes(row.logprobs, "<f4"),
        temperature=row.temperature,
        top_k=row.top_k,
        top_p=row.top_p,
        min_p=row.min_p,
        weight_spans=[WeightSpan.model_construct(**span) for span in row.weight_spans]
        if row.weight_spans
        else None,
        semantics=row.semantics,
        topk_ids=topk[0] if topk else None,
        topk_logprobs=topk[1] if topk else None,
        path=row.path or {},
        rank=row.rank,
        routes=routes_from_columns(row.routes, row.routes_data),
    )


def _fingerprint_row(record: RegionFingerprints) -> dict[str, Any]:
    rows = int(record.positions.size)
    return {
        "run_id": record.run_id,
        "step": record.step,
        "sample_key": record.sample_key,
        "side": record.side,
        "case": record.case,
        "region": record.region,
        "forward_index": record.forward_index,
        "n_rows": rows,
        "ladder_bits": list(record.ladder_bits),
        "sketch_dim": int(record.sketch.shape[1]) if record.sketch.ndim == 2 and rows else 0,
        "positions": to_bytes(record.positions),
        "digest": to_bytes(record.digest),
        "ladder": to_bytes(record.ladder),
        "sketch": to_bytes(record.sketch),
        "l2": to_bytes(record.l2),
        "maxabs": to_bytes(record.maxabs),
        "created_at": utcnow(),
    }


def _fingerprint_record(row: FingerprintRow) -> RegionFingerprints:
    n, rungs = row.n_rows, len(row.ladder_bits)
    return RegionFingerprints.model_construct(
        run_id=row.run_id,
        step=row.step,
        side=row.side,
        case=row.case,
        sample_key=row.sample_key,
        region=row.region,
        forward_index=row.forward_index,
        positions=from_bytes(row.positions, "<i4"),
        digest=from_bytes(row.digest, "<u8"),
        ladder_bits=list(row.ladder_bits),
        ladder=from_bytes(row.ladder, "<u8", (n, rungs)),
        sketch=from_bytes(row.sketch, "<f4", (n, row.sketch_dim)),
        l2=from_bytes(row.l2, "<f4"),
        maxabs=from_bytes(row.maxabs, "<f4"),
    )


class Store:
    """All reads and writes of isoaudit's database go through here."""

    def __init__(
        self,
        url: str | None = None,
        *,
        upgrade: bool | None = None,
        engine: Engine | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        """Open the store at ``url`` (``ISOAUDIT_DATABASE_URL``, else the embedded SQLite file).

        ``upgrade=None``: an SQLite database brings its own schema up to date (the embedded default
        needs no set-up step); any other database is left alone, and one whose schema is behind is
        refused with :class:`StoreError` saying to run ``isoaudit db upgrade`` (a shared server is
        migrated once, on purpose, not by whichever client connects first). ``True`` upgrades any
        database; ``False`` upgrades none. ``timeout_s``: how long a statement waits for a locked
        SQLite file or a PostgreSQL connection before failing (see :func:`make_engine`)."""
        from isoaudit.audit.migrate import ensure_schema

        self.engine = engine or make_engine(url, timeout_s=timeout_s)
        ensure_schema(self.engine, may_upgrade=self.dialect == "sqlite" if upgrade is None else upgrade)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def dispose(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------------ ingest

    def _insert(self, table: Any) -> Any:
        return (postgresql.insert if self.dialect == "postgresql" else sqlite.insert)(table)

    def ingest(self, records: Iterable[Record | dict[str, Any]], *, project: str = "default") -> IngestResult:
        """Validate every record, however it was built (dicts, validated models, ``model_construct``'ed
        ones), then store the valid ones in one transaction. An invalid record is refused by name
        (``result.rejected``) and the rest of its batch is still stored. Records already stored are
        skipped, so a retried batch stores nothing twice. A record naming another project's run
        refuses the whole batch (:class:`ForbiddenRun`): that is a caller's mistake, not bad data."""
        result = IngestResult()
        batch: list[Run | Manifest | SampleLogprobs | RegionFingerprints | StepStats] = []
        for index, item in enumerate(records):
            try:
                batch.append(validate_record(item))
            except RecordError as exc:
                result.rejected.append(Rejection(index, record_kind(item), exc.field, str(exc)))
        if not batch:
            return result
        result.runs = sorted({r.run_id for r in batch})
        runs = [r for r in batch if isinstance(r, Run)]
        manifests = [r for r in batch if isinstance(r, Manifest)]
        samples = [r for r in batch if isinstance(r, SampleLogprobs)]
        prints = [r for r in batch if isinstance(r, RegionFingerprints)]
        stats = [r for r in batch if isinstance(r, StepStats)]
        with self.sessions.begin() as session:
            self._ensure_runs(session, runs, {r.run_id for r in batch}, project, result)
            if manifests:
                rows = [
                    {
                        "run_id": m.run_id,
                        "side": m.side,
                        "case": m.case,
                        "process": m.process,
                        "content_hash": m.content_hash(),
                        "created_at": m.created_at,
                        "body": m.model_dump(mode="json"),
                    }
                    for m in manifests
                ]
                self._insert_new(session, ManifestRow, rows, "manifest", result, returning=("id",))
            if stats:
                rows = [
                    {"run_id": r.run_id, "step": r.step, "figures": r.figures(), "created_at": r.created_at}
                    for r in stats
                ]
                self._insert_new(
                    session, StepStatsRow, rows, "step_stats", result, returning=("run_id", "step")
                )
            touched: set[tuple[str, int, str]] = set()
            if samples:
                touched |= self._insert_new(
                    session, SampleRow, [_sample_row(s) for s in samples], "sample", result
                )
            if prints:
                touched |= self._insert_new(
                    session, FingerprintRow, [_fingerprint_row(p) for p in prints], "fingerprints", result
                )
            if touched:
                stmt = self._insert(PendingComparisonRow.__table__)
                stmt = stmt.on_conflict_do_update(
                    index_elements=["run_id", "step", "sample_key"],
                    set_={"queued_at": stmt.excluded.queued_at},
                )
                now = utcnow()
                session.execute(
                    stmt, [{"run_id": r, "step": s, "sample_key": k, "queued_at": now} for r, s, k in touched]
                )
                result.pending = len(touched)
        return result

    def _ensure_runs(
        self, session: Session, runs: Sequence[Run], run_ids: set[str], project: str, result: IngestResult
    ) -> None:
        existing = dict(
            session.execute(select(RunRow.run_id, RunRow.project).where(RunRow.run_id.in_(run_ids))).all()
        )
        foreign = sorted(rid for rid, owner in existing.items() if owner != project)
        if foreign:
            raise ForbiddenRun(f"run_id: {', '.join(foreign)} belongs to another project")
        explicit = {r.run_id: r for r in runs}  # the last of a run's records in the batch wins
        result.duplicates["run"] += len(runs) - len(explicit)
        # New runs go in with "do nothing on conflict": a trainer and an engine in two processes often
        # register the same run at the same moment, and the one that loses must not fail its batch.
        new = [
            # every row carries the same keys: a bulk insert of rows with differing keys fails
            {"run_id": rid, "project": project, "name": rid, "started_at": utcnow(), "config": {}}
            if rid not in explicit
            else {
                "run_id": rid,
                "project": project,
                "name": explicit[rid].name,
                "started_at": explicit[rid].started_at,
                "config": explicit[rid].config,
            }
            for rid in sorted(run_ids - set(existing))
        ]
        inserted: set[str] = set()
        if new:
            table = RunRow.__table__
            stmt = self._insert(table).on_conflict_do_nothing().returning(table.c.run_id)
            inserted = {row[0] for row in session.execute(stmt, new)}
        raced = {row["run_id"] for row in new} - inserted  # another writer created them just now
        if raced:
            owners = session.execute(select(RunRow.run_id, RunRow.project).where(RunRow.run_id.in_(raced)))
            foreign = sorted(rid for rid, owner in owners if owner != project)
            if foreign:
                raise ForbiddenRun(f"run_id: {', '.join(foreign)} belongs to another project")
        if inserted & set(explicit):
            result.stored["run"] += len(inserted & set(explicit))
        for run in explicit.values():
            if run.run_id in inserted:
                continue
            row = session.get(RunRow, run.run_id)
            assert row is not None
            if (row.name, row.config) == (run.name, run.config):
                result.duplicates["run"] += 1
                continue
            row.name, row.started_at, row.config = run.name, run.started_at, run.config
            result.stored["run"] += 1
        session.flush()

    def _insert_new(
        self,
        session: Session,
        model: Any,
        rows: list[dict[str, Any]],
        kind: str,
        result: IngestResult,
        returning: Sequence[str] = ("run_id", "step", "sample_key"),
    ) -> set[tuple[Any, ...]]:
        """Insert the rows not already stored; return the ``returning`` columns of those inserted."""
        table = model.__table__
        stmt = self._insert(table).on_conflict_do_nothing().returning(*(table.c[c] for c in returning))
        inserted = [tuple(row) for row in session.execute(stmt, rows)]
        result.stored[kind] += len(inserted)
        result.duplicates[kind] += len(rows) - len(inserted)
        return set(inserted)

    # ------------------------------------------------------------------ queries

    def list_runs(self, project: str | None = None) -> list[RunSummary]:
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
        )
        if project is not None:
            query = query.where(RunRow.project == project)
        with self.sessions() as session:
            return [
                RunSummary(row.run_id, row.project, row.name, row.started_at, row.config, n or 0, last)
                for row, n, last in session.execute(query)
            ]

    def get_run(self, run_id: str) -> RunSummary | None:
        """One run's summary (None if unknown)."""
        steps = select(func.count(func.distinct(SampleRow.step)), func.max(SampleRow.step)).where(
            SampleRow.run_id == run_id
        )
        with self.sessions() as session:
            row = session.get(RunRow, run_id)
            if row is None:
                return None
            n, last = session.execute(steps).one()
        return RunSummary(row.run_id, row.project, row.name, row.started_at, row.config, n or 0, last)

    def run_project(self, run_id: str) -> str | None:
        with self.sessions() as session:
            return session.scalar(select(RunRow.project).where(RunRow.run_id == run_id))

    def run_config(self, run_id: str) -> dict[str, Any] | None:
        """The run's free-form config (one row, no counts: cheap enough for every compared step)."""
        with self.sessions() as session:
            return session.scalar(select(RunRow.config).where(RunRow.run_id == run_id))

    def steps(self, run_id: str) -> list[StepSummary]:
        counts = (
            select(SampleRow.step, SampleRow.side, func.count())
            .where(SampleRow.run_id == run_id)
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
            StepSummary(step, sides.get("trainer", 0), sides.get("rollout", 0), done.get(step, 0))
            for step, sides in sorted(by_step.items())
        ]

    def samples(
        self,
        run_id: str,
        step: int,
        *,
        side: Side | None = None,
        sample_keys: Sequence[str] | None = None,
    ) -> list[SampleLogprobs]:
        query = select(SampleRow).where(SampleRow.run_id == run_id, SampleRow.step == step)
        if side is not None:
            query = query.where(SampleRow.side == side)
        if sample_keys is not None:
            query = query.where(SampleRow.sample_key.in_(list(sample_keys)))
        with self.sessions() as session:
            return [
                _sample_record(row)
                for row in session.scalars(query.order_by(SampleRow.sample_key, SampleRow.side))
            ]

    def sample_pair(
        self, run_id: str, step: int, sample_key: str
    ) -> tuple[SampleLogprobs | None, SampleLogprobs | None]:
        """(trainer, rollout) records of one sample; ``None`` for a side not yet stored."""
        found = {s.side: s for s in self.samples(run_id, step, sample_keys=[sample_key])}
        return found.get("trainer"), found.get("rollout")

    def fingerprints(
        self, run_id: str, step: int, sample_keys: Sequence[str] | None = None, *, side: Side | None = None
    ) -> list[RegionFingerprints]:
        query = select(FingerprintRow).where(FingerprintRow.run_id == run_id, FingerprintRow.step == step)
        if sample_keys is not None:
            query = query.where(FingerprintRow.sample_key.in_(list(sample_keys)))
        if side is not None:
            query = query.where(FingerprintRow.side == side)
        with self.sessions() as session:
            return [_fingerprint_record(row) for row in session.scalars(query.order_by(FingerprintRow.id))]

    def manifests(self, run_id: str, side: Side | None = None) -> list[Manifest]:
        """Manifests in the order they were recorded (latest last)."""
        query = select(ManifestRow.body).where(ManifestRow.run_id == run_id)
        if side is not None:
            query = query.where(ManifestRow.side == side)
        with self.sessions() as session:
            bodies = session.scalars(query.order_by(ManifestRow.created_at, ManifestRow.id)).all()
        return [Manifest.model_validate(body) for body in bodies]

    # ------------------------------------------------------------------ comparison queue and results

    def _ready(self, *where: Any) -> Any:
        """Queued samples whose two sides are both stored: a join from the queue into the samples'
        (run, step, key) index, so its cost follows the queue, not the size of the store."""
        return (
            select(
                PendingComparisonRow.run_id,
                PendingComparisonRow.step,
                PendingComparisonRow.sample_key,
                PendingComparisonRow.queued_at,
            )
            .join(
                SampleRow,
                (SampleRow.run_id == PendingComparisonRow.run_id)
                & (SampleRow.step == PendingComparisonRow.step)
                & (SampleRow.sample_key == PendingComparisonRow.sample_key),
            )
            .where(*where)
            .group_by(
                PendingComparisonRow.run_id,
                PendingComparisonRow.step,
                PendingComparisonRow.sample_key,
                PendingComparisonRow.queued_at,
            )
            .having(func.count(func.distinct(SampleRow.side)) == 2)
        )

    def pending(self, limit: int = 10_000) -> list[tuple[str, int, str]]:
        """Samples queued for comparison whose two sides are both stored, oldest first."""
        ready = self._ready().subquery()
        query = (
            select(ready.c.run_id, ready.c.step, ready.c.sample_key).order_by(ready.c.queued_at).limit(limit)
        )
        with self.sessions() as session:
            return [tuple(row) for row in session.execute(query)]

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
        sides = (
            select(head, func.count(func.distinct(SampleRow.side)).label("sides"))
            .join(
                SampleRow,
                (SampleRow.run_id == head.c.run_id)
                & (SampleRow.step == head.c.step)
                & (SampleRow.sample_key == head.c.sample_key),
                isouter=True,
            )
            .group_by(head.c.run_id, head.c.step, head.c.sample_key, head.c.queued_at)
        )
        with self.sessions.begin() as session:
            rows = session.execute(sides).all()
            by_step: dict[tuple[str, int], list[Any]] = {}
            waiting = []
            for run, step, key, queued_at, n_sides in rows:
                if n_sides == 2:
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
            wanted, total = [], 0
            for (run, step), times in sorted(by_step.items(), key=lambda item: (min(item[1]), item[0])):
                if wanted and total + len(times) > max_pairs:
                    break
                wanted.append({"run_id": run, "step": step})
                total += len(times)
            if not wanted:
                return []
            wanted.sort(key=lambda w: (w["run_id"], w["step"]))  # one lock order for every worker
            table = ComparisonClaimRow.__table__
            lease = {"worker": worker, "claimed_at": now, "leased_until": now + timedelta(seconds=lease_s)}
            stmt = self._insert(table)
            stmt = stmt.on_conflict_do_update(
                index_elements=["run_id", "step"],
                set_={c: stmt.excluded[c] for c in lease},
                where=table.c.leased_until <= stmt.excluded.claimed_at,
            ).returning(table.c.run_id, table.c.step)
            claimed = {tuple(row) for row in session.execute(stmt, [{**w, **lease} for w in wanted])}
        if not claimed:
            return []
        read_at = utcnow()
        keys: dict[tuple[str, int], list[str]] = {step: [] for step in claimed}
        query = self._ready(
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
            self._release(session, worker, [(c.run_id, c.step) for c in claims])

    def _release(
        self, session: Session, worker: str, steps: Sequence[tuple[str, int]]
    ) -> set[tuple[str, int]]:
        table = ComparisonClaimRow.__table__
        stmt = (
            delete(table)
            .where(table.c.worker == worker, tuple_(table.c.run_id, table.c.step).in_(list(steps)))
            .returning(table.c.run_id, table.c.step)
        )
        return {tuple(row) for row in session.execute(stmt)}  # type: ignore[misc]

    def samples_of_steps(
        self, steps: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], list[SampleLogprobs]]:
        """Every stored sample of the given (run, step)s, in one query."""
        out: dict[tuple[str, int], list[SampleLogprobs]] = {tuple(s): [] for s in steps}  # type: ignore[misc]
        if not steps:
            return out
        query = (
            select(SampleRow)
            .where(tuple_(SampleRow.run_id, SampleRow.step).in_(list(steps)))
            .order_by(SampleRow.run_id, SampleRow.step, SampleRow.sample_key, SampleRow.side)
        )
        with self.sessions() as session:
            for row in session.scalars(query):
                out[(row.run_id, row.step)].append(_sample_record(row))
        return out

    def fingerprints_of_steps(
        self, steps: Sequence[tuple[str, int]]
    ) -> dict[tuple[str, int], list[RegionFingerprints]]:
        """Every stored fingerprint record of the given (run, step)s, in one query (recorded order)."""
        out: dict[tuple[str, int], list[RegionFingerprints]] = {tuple(s): [] for s in steps}  # type: ignore[misc]
        if not steps:
            return out
        query = (
            select(FingerprintRow)
            .where(tuple_(FingerprintRow.run_id, FingerprintRow.step).in_(list(steps)))
            .order_by(FingerprintRow.id)
        )
        with self.sessions() as session:
            for row in session.scalars(query):
                out[(row.run_id, row.step)].append(_fingerprint_record(row))
        return out

    def save_claimed(
        self,
        session: Session,
        worker: str,
        claims: Sequence[StepClaim],
        sample_results: Sequence[dict[str, Any]],
        step_results: Sequence[dict[str, Any]],
    ) -> set[tuple[str, int]]:
        """Within the caller's transaction: release ``worker``'s claims and, for the steps it still
        held (a claim retaken after its lease ran out belongs to the other worker now), replace their
        results, count the step's revision, and clear the samples compared from the queue (those
        re-queued after the claim read them stay). Returns the steps saved; the caller writes
        nothing else for the others."""
        held = self._release(session, worker, [(c.run_id, c.step) for c in claims])
        if not held:
            return held
        mine = [c for c in claims if (c.run_id, c.step) in held]
        samples = [r for r in sample_results if (r["run_id"], r["step"]) in held]
        steps = [r for r in step_results if (r["run_id"], r["step"]) in held]
        step_key = tuple_(StepResultRow.run_id, StepResultRow.step)
        revisions = dict(
            ((run, step), revision)
            for run, step, revision in session.execute(
                select(StepResultRow.run_id, StepResultRow.step, StepResultRow.revision).where(
                    step_key.in_(sorted(held))
                )
            )
        )
        now = utcnow()
        if samples:
            key = tuple_(SampleResultRow.run_id, SampleResultRow.step, SampleResultRow.sample_key)
            session.execute(
                delete(SampleResultRow).where(
                    key.in_([(r["run_id"], r["step"], r["sample_key"]) for r in samples])
                )
            )
            session.execute(
                self._insert(SampleResultRow.__table__), [{**r, "computed_at": now} for r in samples]
            )
        if steps:
            session.execute(
                delete(StepResultRow).where(step_key.in_([(r["run_id"], r["step"]) for r in steps]))
            )
            rows = [
                {
                    **r,
                    "computed_at": now,
                    "compared_by": worker,
                    "revision": revisions.get((r["run_id"], r["step"]), 0) + 1,
                }
                for r in steps
            ]
            session.execute(self._insert(StepResultRow.__table__), rows)
        for claim in mine:  # one statement per step: each has its own cut-off time
            if claim.sample_keys:
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
        """Replace the results of the given samples and steps and clear them from the queue, in one
        transaction. Entries re-queued after ``queued_before`` (new records arrived meanwhile) stay queued."""
        with self.sessions.begin() as session:
            for model, rows, keys in (
                (SampleResultRow, sample_results, ("run_id", "step", "sample_key")),
                (StepResultRow, step_results, ("run_id", "step")),
            ):
                if not rows:
                    continue
                columns = [getattr(model, k) for k in keys]
                session.execute(
                    delete(model).where(tuple_(*columns).in_([tuple(r[k] for k in keys) for r in rows]))
                )
                session.execute(self._insert(model.__table__), [{**r, "computed_at": utcnow()} for r in rows])
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

    def sample_results(self, run_id: str, step: int | None = None) -> list[SampleResultRow]:
        query = select(SampleResultRow).where(SampleResultRow.run_id == run_id)
        if step is not None:
            query = query.where(SampleResultRow.step == step)
        with self.sessions() as session:
            return list(session.scalars(query.order_by(SampleResultRow.step, SampleResultRow.sample_key)))

    def step_results(self, run_id: str) -> list[StepResultRow]:
        with self.sessions() as session:
            return list(
                session.scalars(
                    select(StepResultRow).where(StepResultRow.run_id == run_id).order_by(StepResultRow.step)
                )
            )

    def compared_keys(self, run_id: str, step: int) -> list[str]:
        with self.sessions() as session:
            return list(
                session.scalars(
                    select(SampleResultRow.sample_key).where(
                        SampleResultRow.run_id == run_id, SampleResultRow.step == step
                    )
                )
            )

    # ------------------------------------------------------------------ remediation control (issue 6)

    def step_stats(self, run_id: str, from_step: int = 0, to_step: int | None = None) -> list[StepStats]:
        """The RL loop's own figures per step (``StepStats`` records), in step order."""
        query = select(StepStatsRow).where(StepStatsRow.run_id == run_id, StepStatsRow.step >= from_step)
        if to_step is not None:
            query = query.where(StepStatsRow.step <= to_step)
        with self.sessions() as session:
            rows = session.scalars(query.order_by(StepStatsRow.step)).all()
        named = ("reward_mean", "reward_std", "entropy", "clip_fraction", "generation_s", "training_s")
        out = []
        for row in rows:
            figures = dict(row.figures)
            given = {k: figures.pop(k) for k in named if k in figures}
            out.append(
                StepStats(
                    run_id=row.run_id, step=row.step, extras=figures, created_at=row.created_at, **given
                )
            )
        return out

    def get_control(self, run_id: str) -> ControlState:
        """The run's desired remediation mode (``native`` at version 0 until someone sets it)."""
        with self.sessions() as session:
            row = session.get(RunControlRow, run_id)
        if row is None:
            return ControlState(run_id=run_id, mode="native", version=0)
        return ControlState(row.run_id, row.mode, row.version, row.updated_at, row.updated_by)

    def set_control(self, run_id: str, mode: str, version: int, *, updated_by: str = "") -> ControlState:
        """Set the desired mode if ``version`` is the current one (optimistic concurrency), bumping it;
        raise :class:`StaleControlVersion` otherwise. The run must exist."""
        if mode not in REMEDIATION_MODES:
            raise ValueError(f"mode: {mode!r} is not one of {', '.join(REMEDIATION_MODES)}")
        now = utcnow()
        values = {"mode": mode, "version": version + 1, "updated_at": now, "updated_by": updated_by}
        with self.sessions.begin() as session:
            if version == 0:
                stmt = (
                    self._insert(RunControlRow.__table__)
                    .values(run_id=run_id, **values)
                    .on_conflict_do_nothing()
                )
            else:
                stmt = (
                    update(RunControlRow.__table__)
                    .where(RunControlRow.run_id == run_id, RunControlRow.version == version)
                    .values(**values)
                )
            # RETURNING, not rowcount: drivers disagree on the rowcount of an INSERT .. ON CONFLICT.
            changed = session.execute(stmt.returning(RunControlRow.__table__.c.run_id)).first() is not None
        if not changed:
            raise StaleControlVersion(self.get_control(run_id))
        return ControlState(run_id, mode, version + 1, now, updated_by)
