"""The control record of each run (``audit.control``): read it, and change it under optimistic
concurrency (an update names the version it read)."""

from __future__ import annotations

from isoaudit.audit.control import REMEDIATION_MODES, ControlRecord, StaleControlVersion
from isoaudit.audit.db.engine import Part, table_of
from isoaudit.audit.db.models import RunControlRow
from isoaudit.audit.records import utcnow
from sqlalchemy import update

__all__ = ["Control"]


class Control(Part):
    """Reads and writes of the runs' control records."""

    def get_control(self, run_id: str) -> ControlRecord:
        """The run's desired remediation mode (``native`` at version 0 until someone sets it)."""
        with self.sessions() as session:
            row = session.get(RunControlRow, run_id)
            if row is None:
                return ControlRecord(mode="native", version=0)
            return ControlRecord.model_validate(row, from_attributes=True)

    def set_control(self, run_id: str, mode: str, version: int, *, updated_by: str = "") -> ControlRecord:
        """Set the desired mode (one of :data:`~audit.control.REMEDIATION_MODES`, else ValueError) if
        ``version`` is the current one, bumping it; raise :class:`~audit.control.StaleControlVersion`
        otherwise. The run must exist."""
        if mode not in REMEDIATION_MODES:
            raise ValueError(f"mode: {mode!r} is not one of {', '.join(REMEDIATION_MODES)}")
        record = ControlRecord.model_validate(
            {"mode": mode, "version": version + 1, "updated_at": utcnow(), "updated_by": updated_by}
        )
        values = record.model_dump()
        table = table_of(RunControlRow)
        # RETURNING, not rowcount: drivers disagree on the rowcount of an INSERT .. ON CONFLICT.
        with self.sessions.begin() as session:
            if version == 0:
                insert = self._insert(RunControlRow).values(run_id=run_id, **values).on_conflict_do_nothing()
                changed = session.execute(insert.returning(table.c.run_id)).first() is not None
            else:
                where = (table.c.run_id == run_id) & (table.c.version == version)
                bump = update(table).where(where).values(**values).returning(table.c.run_id)
                changed = session.execute(bump).first() is not None
        if not changed:
            raise StaleControlVersion(run_id, self.get_control(run_id))
        return record
