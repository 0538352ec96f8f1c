"""Stored records read back as the validated models they were stored from (``audit.records``): the
samples and fingerprints of a step (or of many, for the comparison worker) and a run's manifests. A
stored row that cannot be read back is left out (and logged: ``audit.db.codec.readable``)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from isoaudit.audit.db.codec import fingerprint_record, readable, rows_of, sample_record
from isoaudit.audit.db.engine import Part, table_of
from isoaudit.audit.db.models import FingerprintRow, ManifestRow, SampleRow
from isoaudit.audit.records import Manifest, RegionFingerprints, SampleLogprobs, Side
from sqlalchemy import select, tuple_

__all__ = ["Records"]

StepKey = tuple[str, int]


class Records(Part):
    """Reads of stored records."""

    def samples(
        self,
        run_id: str,
        step: int,
        *,
        side: Side | None = None,
        sample_keys: Sequence[str] | None = None,
    ) -> list[SampleLogprobs]:
        """A step's samples by key then side (only ``side``'s, only ``sample_keys``, when given)."""
        query = select(SampleRow).where(SampleRow.run_id == run_id, SampleRow.step == step)
        if side is not None:
            query = query.where(SampleRow.side == side)
        if sample_keys is not None:
            query = query.where(SampleRow.sample_key.in_(list(sample_keys)))
        with self.sessions() as session:
            return readable(
                session.scalars(query.order_by(SampleRow.sample_key, SampleRow.side)),
                sample_record,
                _sample_name,
            )

    def sample_pair(
        self, run_id: str, step: int, sample_key: str
    ) -> tuple[SampleLogprobs | None, SampleLogprobs | None]:
        """(trainer, rollout) records of one sample; ``None`` for a side not yet stored."""
        found = {s.side: s for s in self.samples(run_id, step, sample_keys=[sample_key])}
        return found.get("trainer"), found.get("rollout")

    def fingerprints(
        self, run_id: str, step: int, sample_keys: Sequence[str] | None = None, *, side: Side | None = None
    ) -> list[RegionFingerprints]:
        """A step's fingerprint records in the order they were stored."""
        query = select(FingerprintRow).where(FingerprintRow.run_id == run_id, FingerprintRow.step == step)
        if sample_keys is not None:
            query = query.where(FingerprintRow.sample_key.in_(list(sample_keys)))
        if side is not None:
            query = query.where(FingerprintRow.side == side)
        with self.sessions() as session:
            return readable(
                session.scalars(query.order_by(FingerprintRow.id)), fingerprint_record, _fingerprint_name
            )

    def manifests(self, run_id: str, side: Side | None = None) -> list[Manifest]:
        """Manifests in the order they were recorded (latest last)."""
        query = select(ManifestRow.id, ManifestRow.body).where(ManifestRow.run_id == run_id)
        if side is not None:
            query = query.where(ManifestRow.side == side)
        with self.sessions() as session:
            rows = session.execute(query.order_by(ManifestRow.created_at, ManifestRow.id)).all()
        return readable(
            rows,
            lambda row: Manifest.model_validate(row[1]),
            lambda row: f"manifest #{row[0]} of run {run_id!r}",
        )

    def samples_of_steps(self, steps: Sequence[StepKey]) -> dict[StepKey, list[SampleLogprobs]]:
        """Every stored sample of the given (run, step)s, in one query."""
        return self.samples_and_arrivals(steps)[0]

    def samples_and_arrivals(
        self, steps: Sequence[StepKey]
    ) -> tuple[dict[StepKey, list[SampleLogprobs]], dict[StepKey, datetime]]:
        """:meth:`samples_of_steps`, and when each step's latest sample was stored (from the same
        rows: the summary's ``ingested_at`` without a query of its own; a step whose stored times
        do not all read is left out)."""
        out: dict[StepKey, list[SampleLogprobs]] = {(run, step): [] for run, step in steps}
        if not steps:
            return out, {}
        table = table_of(SampleRow)
        # Ordered here, not in SQL: SQLite would sort the rows with their arrays.
        query = select(table).where(tuple_(table.c.run_id, table.c.step).in_(list(steps)))
        with self.sessions() as session:
            rows = sorted(rows_of(session, query), key=lambda r: (r.run_id, r.step, r.sample_key, r.side))
        arrived: dict[StepKey, datetime] = {}
        unreadable: set[StepKey] = set()
        for row in rows:
            key, at = (row.run_id, row.step), row.created_at
            if not isinstance(at, datetime):
                unreadable.add(key)
            elif key not in arrived or at > arrived[key]:
                arrived[key] = at
        for record in readable(rows, sample_record, _sample_name):
            out[(record.run_id, record.step)].append(record)
        return out, {key: at for key, at in arrived.items() if key not in unreadable}

    def fingerprints_of_steps(self, steps: Sequence[StepKey]) -> dict[StepKey, list[RegionFingerprints]]:
        """Every stored fingerprint record of the given (run, step)s, in one query (recorded order)."""
        out: dict[StepKey, list[RegionFingerprints]] = {(run, step): [] for run, step in steps}
        if not steps:
            return out
        table = table_of(FingerprintRow)
        # Ordered here, not in SQL: SQLite would sort the rows with their arrays (x2-4 the read).
        query = select(table).where(tuple_(table.c.run_id, table.c.step).in_(list(steps)))
        with self.sessions() as session:
            rows = sorted(rows_of(session, query), key=lambda row: row.id)
        for record in readable(rows, fingerprint_record, _fingerprint_name):
            out[(record.run_id, record.step)].append(record)
        return out


def _sample_name(row: SampleRow) -> str:
    return f"sample {row.sample_key!r} ({row.side}) of run {row.run_id!r} step {row.step}"


def _fingerprint_name(row: FingerprintRow) -> str:
    return f"fingerprints #{row.id} of run {row.run_id!r} step {row.step}"
