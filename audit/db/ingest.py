"""Ingest: validate records and store them in one transaction, idempotently, queueing the samples they
touch for comparison. Ingest never waits on the comparator (``audit.worker`` drains the queue)."""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from isoaudit.audit.db.codec import fingerprint_row, sample_row
from isoaudit.audit.db.engine import Part, StoreError, json_text, table_of, translated_errors
from isoaudit.audit.db.models import (
    Base,
    FingerprintRow,
    ManifestRow,
    PendingComparisonRow,
    RunRow,
    SampleRow,
    StepStatsRow,
)
from isoaudit.audit.db.types import Unreadable
from isoaudit.audit.records import (
    Manifest,
    Record,
    RecordError,
    RecordOfAnyKind,
    RegionFingerprints,
    RegionFingerprintsBlock,
    Rejection,
    Run,
    SampleLogprobs,
    StepStats,
    record_kind,
    utcnow,
    validate_record,
)
from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    Integer,
    LargeBinary,
    String,
    TypeDecorator,
    UniqueConstraint,
    select,
)
from sqlalchemy.orm import Session
from sqlalchemy.types import TypeEngine

__all__ = ["ForbiddenRun", "Ingest", "IngestResult"]


class ForbiddenRun(StoreError):
    """A record names a run that belongs to another project."""


@dataclass
class IngestResult:
    """What one batch did, per record kind: stored, already there (``duplicates``), and refused
    (``rejected``, one :class:`Rejection` per record, naming its index in the batch and the field).
    A fingerprints block is kept as the per-sample records it stands for, counted under
    ``fingerprints``, one per sample."""

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


class Ingest(Part):
    """The store's write path for records."""

    def ingest(self, records: Iterable[Record | dict[str, Any]], *, project: str = "default") -> IngestResult:
        """Validate every record, however it was built (dicts, validated models, ``model_construct``'ed
        ones), then store the valid ones in one transaction. An invalid record is refused by name
        (``result.rejected``) and the rest of its batch is still stored. Records already stored are
        skipped, so a retried batch stores nothing twice. A record naming another project's run
        refuses the whole batch (:class:`ForbiddenRun`): that is a caller's mistake, not bad data. A
        database that does not answer raises :class:`StoreUnavailable`, a race lost to a concurrent
        writer :class:`StoreConflict`; nothing of the batch is stored then, and sending it again is safe."""
        result = IngestResult()
        batch: list[RecordOfAnyKind] = []
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
        for block in batch:  # a collector's columnar form, kept as the records it stands for
            if isinstance(block, RegionFingerprintsBlock):
                prints += block.samples()
        stats = [r for r in batch if isinstance(r, StepStats)]
        with translated_errors(), self.sessions.begin() as session:
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
            # The arrays go in by binary COPY on PostgreSQL, by a bulk INSERT elsewhere.
            insert_arrays = self._copy_new if self.dialect == "postgresql" else self._insert_new
            touched: set[tuple[str, int, str]] = set()
            if samples:
                touched |= insert_arrays(
                    session, SampleRow, [sample_row(s) for s in samples], "sample", result
                )
            if prints:
                touched |= insert_arrays(
                    session, FingerprintRow, [fingerprint_row(p) for p in prints], "fingerprints", result
                )
            if touched:
                stmt = self._insert(PendingComparisonRow)
                stmt = stmt.on_conflict_do_update(
                    index_elements=["run_id", "step", "sample_key"],
                    set_={"queued_at": stmt.excluded.queued_at},
                )
                now = utcnow()
                # in key order: two replicas queueing one step's trainer and rollout batches at once
                # lock the same rows in the same order (a set's order differs between processes:
                # opposite orders deadlock)
                session.execute(
                    stmt,
                    [
                        {"run_id": r, "step": s, "sample_key": k, "queued_at": now}
                        for r, s, k in sorted(touched)
                    ],
                )
                result.pending = len(touched)
        return result

    def _ensure_runs(
        self, session: Session, runs: Sequence[Run], run_ids: set[str], project: str, result: IngestResult
    ) -> None:
        existing: dict[str, str] = {
            run_id: owner
            for run_id, owner in session.execute(
                select(RunRow.run_id, RunRow.project).where(RunRow.run_id.in_(run_ids))
            )
        }
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
            stmt = self._insert(RunRow).on_conflict_do_nothing().returning(RunRow.run_id)
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
            if (row.name, row.config) == (run.name, run.config) and not isinstance(
                row.started_at, Unreadable
            ):
                result.duplicates["run"] += 1
                continue
            row.name, row.started_at, row.config = run.name, run.started_at, run.config
            result.stored["run"] += 1
        session.flush()

    def _insert_new(
        self,
        session: Session,
        model: type[Base],
        rows: list[dict[str, Any]],
        kind: str,
        result: IngestResult,
        returning: Sequence[str] = ("run_id", "step", "sample_key"),
    ) -> set[tuple[Any, ...]]:
        """Insert the rows not already stored; return the ``returning`` columns of those inserted."""
        columns = table_of(model).c
        stmt = self._insert(model).on_conflict_do_nothing().returning(*(columns[c] for c in returning))
        inserted = [tuple(row) for row in session.execute(stmt, rows)]
        result.stored[kind] += len(inserted)
        result.duplicates[kind] += len(rows) - len(inserted)
        return set(inserted)

    def _copy_new(
        self,
        session: Session,
        model: type[Base],
        rows: list[dict[str, Any]],
        kind: str,
        result: IngestResult,
        returning: Sequence[str] = ("run_id", "step", "sample_key"),
    ) -> set[tuple[Any, ...]]:
        """:meth:`_insert_new` on PostgreSQL at COPY speed. When none of the batch's keys is stored
        yet (one indexed existence query; the common case) and the batch holds each key once, the
        rows go by ``COPY ... FROM STDIN (FORMAT BINARY)`` straight into the table, inside a
        savepoint. Otherwise, or when that COPY meets a key a concurrent writer committed meanwhile
        (a unique violation: the savepoint is rolled back), they go through :meth:`_copy_staged`,
        which skips the stored ones; either way a retried batch stores nothing twice and two writers
        racing on one key store it once."""
        from psycopg import errors  # the PostgreSQL extra's driver, there whenever this runs

        table = table_of(model)
        names = list(rows[0])  # codec rows all carry the same keys
        key = _identity(table)
        keys = [tuple(row[c] for c in key) for row in rows]
        driver = driver_of(session)
        if len(set(keys)) == len(keys) and not self._any_stored(driver, table, key, keys):
            with driver.cursor() as cursor:
                cursor.execute("SAVEPOINT isoaudit_copy")
                try:
                    copy_rows(cursor, table, table.name, names, rows)
                except errors.UniqueViolation:  # a writer stored one of these keys just now
                    cursor.execute("ROLLBACK TO SAVEPOINT isoaudit_copy")
                else:
                    cursor.execute("RELEASE SAVEPOINT isoaudit_copy")
                    result.stored[kind] += len(rows)
                    result.duplicates[kind] += 0  # the answer names the kind, as the other path's does
                    return {tuple(row[c] for c in returning) for row in rows}
        return self._copy_staged(session, table, names, rows, kind, result, returning)

    @staticmethod
    def _any_stored(driver: Any, table: Any, key: Sequence[str], keys: list[tuple[Any, ...]]) -> bool:
        """Whether any of ``keys`` (values of the ``key`` columns) is stored: one query on the
        table's unique index, naming the batch's runs so it reads only their partitions."""
        columns = ", ".join(f'"{c}"' for c in key)
        arrays = ", ".join(f"%s::{_copy_type(table.c[c].type)}[]" for c in key)
        runs = sorted({k[key.index("run_id")] for k in keys})
        with driver.cursor() as cursor:
            cursor.execute(
                f"SELECT 1 FROM {table.name} WHERE run_id = ANY(%s::varchar[]) "
                f"AND ({columns}) IN (SELECT * FROM unnest({arrays})) LIMIT 1",
                [runs, *(list(column) for column in zip(*keys, strict=True))],
            )
            return cursor.fetchone() is not None

    def _copy_staged(
        self,
        session: Session,
        table: Any,
        names: list[str],
        rows: list[dict[str, Any]],
        kind: str,
        result: IngestResult,
        returning: Sequence[str],
    ) -> set[tuple[Any, ...]]:
        """The rows by binary COPY into a staging table, then one ``INSERT ... SELECT ... ON CONFLICT
        DO NOTHING`` moves those not already stored. The staging table is a temporary one of this
        connection (no WAL), emptied at every commit, named after the columns it holds."""
        columns = ", ".join(f'"{name}"' for name in names)
        staging = f"isoaudit_staging_{table.name}_{zlib.crc32(columns.encode()):08x}"
        pooled = session.connection().connection
        staged: set[str] = pooled.info.setdefault("isoaudit_staging", set())
        with driver_of(session).cursor() as cursor:
            cursor.execute(
                f"CREATE TEMP TABLE IF NOT EXISTS {staging} ON COMMIT DELETE ROWS AS "
                f"SELECT {columns} FROM {table.name} WITH NO DATA"
            )
            if staging not in staged:  # arrays pass through uncompressed: staging is read once
                binary = [f'ALTER COLUMN "{n}" SET STORAGE EXTERNAL' for n in names if _is_binary(table, n)]
                cursor.execute(f"ALTER TABLE {staging} {', '.join(binary)}")
                staged.add(staging)
            copy_rows(cursor, table, staging, names, rows)
            cursor.execute(
                f"INSERT INTO {table.name} ({columns}) SELECT {columns} FROM {staging} "
                f"ON CONFLICT DO NOTHING RETURNING {', '.join(returning)}"
            )
            inserted = [tuple(row) for row in cursor.fetchall()]
            cursor.execute(f"TRUNCATE {staging}")  # a second batch in this transaction starts empty
        result.stored[kind] += len(inserted)
        result.duplicates[kind] += len(rows) - len(inserted)
        return set(inserted)


def driver_of(session: Session) -> Any:
    """The psycopg connection under ``session``'s transaction."""
    driver = session.connection().connection.driver_connection
    assert driver is not None  # a session's connection is checked out, so open
    return driver


def _identity(table: Any) -> tuple[str, ...]:
    """The columns of ``table``'s unique identity constraint (what ``ON CONFLICT`` skips on)."""
    for constraint in table.constraints:
        if isinstance(constraint, UniqueConstraint):
            return tuple(column.name for column in constraint.columns)
    raise TypeError(f"{table.name}: no unique identity constraint")


def copy_rows(cursor: Any, table: Any, target: str, names: list[str], rows: list[dict[str, Any]]) -> None:
    """``rows`` (``names`` columns of ``table``) into ``target`` by one binary ``COPY ... FROM STDIN``
    (JSON columns as the engine writes them, :func:`~audit.db.engine.json_text`)."""
    from psycopg.types.json import Json

    json_columns = {name for name in names if isinstance(table.c[name].type, JSON)}
    columns = ", ".join(f'"{name}"' for name in names)
    with cursor.copy(f"COPY {target} ({columns}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types([_copy_type(table.c[name].type) for name in names])
        for row in rows:
            copy.write_row([Json(row[n], dumps=json_text) if n in json_columns else row[n] for n in names])


def _is_binary(table: Any, name: str) -> bool:
    return isinstance(table.c[name].type, LargeBinary)


def _copy_type(column_type: TypeEngine[Any]) -> str:
    """The PostgreSQL type a binary COPY sends a column's values as (it must match the column's)."""
    if isinstance(column_type, TypeDecorator):
        column_type = column_type.impl_instance
    for kind, name in _COPY_TYPES:
        if isinstance(column_type, kind):
            return name
    raise TypeError(f"{column_type!r}: no binary COPY type for this column type")


#: SQLAlchemy column type -> the PostgreSQL type name binary COPY uses (most specific first).
_COPY_TYPES: tuple[tuple[type[TypeEngine[Any]], str], ...] = (
    (BigInteger, "int8"),
    (Integer, "int4"),
    (Float, "float8"),
    (LargeBinary, "bytea"),
    (JSON, "json"),
    (DateTime, "timestamptz"),
    (String, "varchar"),
)
