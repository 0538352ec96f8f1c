"""Opening a database: URL → engine (SQLite in WAL mode, or a server with a pooled, pinged connection),
the session factory every part of the data layer shares, and the errors the data layer raises in
place of the driver's, so no caller above it needs to know SQLAlchemy."""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import msgspec
from isoaudit.audit.config import database_url
from isoaudit.audit.db.models import Base
from isoaudit.audit.db.types import register_tolerant_loaders
from sqlalchemy import Engine, Table, create_engine, event, make_url
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.orm import Session, sessionmaker

if TYPE_CHECKING:
    from sqlalchemy.engine.interfaces import DBAPIConnection
    from sqlalchemy.pool import ConnectionPoolEntry

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Part",
    "StoreConflict",
    "StoreError",
    "StoreUnavailable",
    "UNAVAILABLE_ERRORS",
    "make_engine",
    "redacted_url",
    "table_of",
    "translated_errors",
]

#: How long a statement waits for the database by default: SQLite's busy timeout (another writer
#: holds the lock) and PostgreSQL's connect timeout. The API passes its own, shorter one.
DEFAULT_TIMEOUT_S = 30.0


class StoreError(Exception):
    """A request the store refuses as a whole (nothing of it was stored)."""


class StoreUnavailable(StoreError):
    """The database did not answer (locked past its timeout, a connection cut, a server restarting or
    unreachable, the pool exhausted): the transaction rolled back, sending the same request again is safe."""


class StoreConflict(StoreError):
    """A write lost a race with a concurrent writer (the same row inserted at the same moment, a
    deadlock): the transaction rolled back; an idempotent write sent again skips what the other stored."""


#: Every exception that means "the database did not answer": :class:`StoreUnavailable` and the
#: driver's own, as raised through ``Store.sessions`` by repositories that use it directly.
UNAVAILABLE_ERRORS: tuple[type[Exception], ...] = (StoreUnavailable, OperationalError, PoolTimeout)


@contextmanager
def translated_errors() -> Iterator[None]:
    """Raise the driver's errors as the data layer's: connection failures as :class:`StoreUnavailable`,
    lost races as :class:`StoreConflict`, a refused statement as :class:`StoreError` (the original
    chained as ``__cause__``)."""
    try:
        yield
    except IntegrityError as exc:
        raise StoreConflict(_first_line(exc)) from exc
    except (OperationalError, PoolTimeout) as exc:
        raise StoreUnavailable(_first_line(exc)) from exc
    except DBAPIError as exc:  # the database refused a statement: sending it again would not help
        if exc.connection_invalidated:
            raise StoreUnavailable(_first_line(exc)) from exc
        raise StoreError(_first_line(exc)) from exc


def _first_line(exc: Exception) -> str:
    cause = getattr(exc, "orig", None) or exc
    return f"database: {type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"


def _sqlite_pragmas(timeout_s: float) -> Callable[[DBAPIConnection, ConnectionPoolEntry], None]:
    def connect(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout={int(timeout_s * 1000)}")
        # Switching a fresh file to WAL needs it to itself, and SQLite answers "locked" at once, busy
        # timeout or not, while another connection does the same (a job's sinks and its comparer
        # opening one new file): try again for up to the timeout.
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                cursor.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    return connect


_encode = msgspec.json.Encoder().encode


def json_text(value: Any) -> str:
    """The JSON text of a stored value (the engine's serializer of JSON columns): msgspec's encoder,
    ×5–10 the standard library's on a step's results; the standard library's ``json.dumps`` for a
    value msgspec does not take (numpy scalars, keys that are not text) or that holds a non-finite
    number (msgspec writes it as null, ``json.dumps`` as ``NaN``/``Infinity``, as before)."""
    try:
        text = _encode(value)
    except (TypeError, msgspec.EncodeError):
        return json.dumps(value)
    if b"null" in text and _nonfinite(value):
        return json.dumps(value)
    return text.decode()


def _nonfinite(value: Any) -> bool:
    """Whether a JSON value holds a NaN or an infinity (a walk without recursion: a step's results
    are tens of thousands of values, most of them in flat dicts)."""
    todo = [value]
    while todo:
        item = todo.pop()
        kind = type(item)
        if kind is dict:
            todo.extend(item.values())
        elif kind is float:
            if not math.isfinite(item):
                return True
        elif kind is list or kind is tuple:
            todo.extend(item)
        elif isinstance(item, float):
            if not math.isfinite(item):
                return True
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, list | tuple):
            todo.extend(item)
    return False


def make_engine(url: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> Engine:
    """An engine for ``url`` with the settings the store relies on: WAL, foreign keys and a busy
    timeout of ``timeout_s`` on SQLite; on a server, a connect timeout of ``timeout_s`` and a ping
    before a pooled connection is reused (a connection cut or a restarted server costs one failed
    request, then the pool heals by itself); on PostgreSQL with psycopg, timestamps Python cannot
    hold read as ``Unreadable`` rather than failing the query."""
    url = database_url(url)
    if url.startswith("sqlite"):
        engine = create_engine(url, json_serializer=json_text)
        event.listen(engine, "connect", _sqlite_pragmas(timeout_s))
        event.listen(engine, "checkin", _checkpoint_again)
        return engine
    connect_args = {"connect_timeout": max(1, round(timeout_s))} if url.startswith("postgresql") else {}
    engine = create_engine(url, connect_args=connect_args, pool_pre_ping=True, json_serializer=json_text)
    if engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg":
        event.listen(engine, "connect", _tolerant_loaders)
    return engine


#: SQLite's own threshold for a checkpoint at commit (pages of the write-ahead log).
WAL_AUTOCHECKPOINT_PAGES = 1000


def defer_wal_checkpoint(session: Session) -> None:
    """On SQLite, let this session's commit leave the write-ahead log as it is, however long (the
    commit that passes SQLite's threshold otherwise copies the whole log into the database file
    inside it): for writes on a latency path, whose owner checkpoints when idle
    (:meth:`~audit.db.store.Store.checkpoint`). The connection's own threshold comes back when it
    returns to the pool. Nothing on other databases."""
    connection = session.connection()
    if connection.dialect.name != "sqlite":
        return
    connection.exec_driver_sql("PRAGMA wal_autocheckpoint=0")
    connection.info["checkpoint_deferred"] = True


def _checkpoint_again(dbapi_connection: DBAPIConnection, record: ConnectionPoolEntry) -> None:
    """A connection back in the pool checkpoints at commit again (see :func:`defer_wal_checkpoint`)."""
    if record.info.pop("checkpoint_deferred", False):
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}")
        cursor.close()


def _tolerant_loaders(dbapi_connection: DBAPIConnection, _record: ConnectionPoolEntry) -> None:
    """A stored timestamp Python cannot hold reads as ``Unreadable`` (``audit.db.types``)."""
    register_tolerant_loaders(dbapi_connection)


def redacted_url(url: str) -> str:
    """``url`` without its password, for printing."""
    return make_url(url).render_as_string(hide_password=True)


class Part:
    """What every part of the store shares: its engine and the session factory over it."""

    engine: Engine
    sessions: sessionmaker[Session]

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    def _insert(self, model: type[Base]) -> postgresql.Insert | sqlite.Insert:
        """A Core INSERT into ``model``'s table with this dialect's ``ON CONFLICT`` clauses."""
        return (postgresql.insert if self.dialect == "postgresql" else sqlite.insert)(table_of(model))


def table_of(model: type[Base]) -> Table:
    """The Core table of an ORM model (what bulk statements take, so they stay Core ones)."""
    table = model.__table__
    assert isinstance(table, Table)
    return table
