"""The store: the one door into isoaudit's database. SQLite (WAL) by default, PostgreSQL for
multi-writer deployments."""

from __future__ import annotations

from isoaudit.audit.db.control import Control
from isoaudit.audit.db.engine import DEFAULT_TIMEOUT_S, StoreUnavailable, make_engine, translated_errors
from isoaudit.audit.db.ingest import Ingest
from isoaudit.audit.db.queue import Queue
from isoaudit.audit.db.records import Records
from isoaudit.audit.db.results import Results
from isoaudit.audit.db.retention import Retention
from isoaudit.audit.db.runs import Runs
from isoaudit.audit.db.schema import current_revision, ensure_schema
from isoaudit.audit.db.steps import Steps
from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import sessionmaker
from sqlalchemy.pool import SingletonThreadPool, StaticPool

__all__ = ["Store"]


class Store(Ingest, Runs, Records, Queue, Results, Control, Steps, Retention):
    """All reads and writes of isoaudit's database, one part per concern (each in its own module of
    ``audit.db``): ingest, runs, stored records, the comparison queue, results, control records,
    step stats and retention. ``sessions`` (a ``sessionmaker``) is there for the data layer's repositories that
    take it (alerts, tokens, telemetry)."""

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
        SQLite file or a PostgreSQL connection before failing (see :func:`make_engine`). A database
        that cannot be reached raises :class:`StoreUnavailable`."""
        self.engine = engine or make_engine(url, timeout_s=timeout_s)
        with translated_errors():
            ensure_schema(self.engine, may_upgrade=self.dialect == "sqlite" if upgrade is None else upgrade)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def printable_url(self) -> str:
        """The database's URL with its password hidden (for messages and commands shown to people)."""
        return self.engine.url.render_as_string(hide_password=True)

    @property
    def threads_share_the_database(self) -> bool:
        """Whether another thread's connection sees this one's database (not so for an in-memory
        SQLite database, one per connection)."""
        return not isinstance(self.engine.pool, SingletonThreadPool | StaticPool)

    def schema_revision(self) -> str | None:
        """Ask the database for its schema revision (a health check: raises
        :class:`StoreUnavailable` when it does not answer)."""
        try:
            with self.engine.connect() as connection:
                connection.execute(text("SELECT 1"))
            return current_revision(self.engine)
        except SQLAlchemyError as exc:
            raise StoreUnavailable(f"database: {type(exc).__name__}") from exc

    def checkpoint(self) -> None:
        """On SQLite, copy what the write-ahead log holds into the database file as far as no reader
        needs it (a passive checkpoint: it waits on no one); for a writer that defers its
        checkpoints to idle time (:func:`~audit.db.engine.defer_wal_checkpoint`). Nothing on other
        databases."""
        if self.dialect == "sqlite":
            with translated_errors(), self.engine.connect() as connection:
                connection.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")

    def dispose(self) -> None:
        """Close the pooled connections."""
        self.engine.dispose()
