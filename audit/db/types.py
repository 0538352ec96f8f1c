"""Column types whose stored values always come back.

Records are bounded at the boundary (``audit.records``: timestamps in UTC years 1970..9999), so
isoaudit never writes a value its database cannot give back. A row written some other way (by hand,
by another tool, before a bound existed) may still hold one: a PostgreSQL timestamp before year 1
or ``infinity``, an SQLite text that is no timestamp. The driver would fail the whole query on it,
and one such row would fail every listing it is part of. Here such a value comes back as
:class:`Unreadable` in its column's place instead, so the read fails that row alone
(:func:`audit.db.codec.readable`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import DateTime
from sqlalchemy.types import TypeDecorator

if TYPE_CHECKING:
    from sqlalchemy.engine.interfaces import Dialect


@dataclass(frozen=True)
class Unreadable:
    """A stored value the driver could not turn into Python: its column's type and why."""

    type: str
    reason: str

    def __str__(self) -> str:
        return f"unreadable {self.type} ({self.reason})"


class UtcDateTime(TypeDecorator[datetime]):
    """``DateTime(timezone=True)`` that writes UTC (an aware value is moved to UTC, so SQLite's text
    holds UTC too) and reads a stored text that is no timestamp as :class:`Unreadable`."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is not None:
            try:
                return value.astimezone(UTC)
            except OverflowError:  # outside Python's years once in UTC: stored as given
                return value
        return value

    def result_processor(self, dialect: Dialect, coltype: object) -> Callable[[Any], Any] | None:
        inner = super().result_processor(dialect, coltype)
        if inner is None:
            return None

        def process(value: Any) -> Any:
            try:
                return inner(value)
            except (ValueError, TypeError, OverflowError) as exc:
                return Unreadable("timestamp", f"{value!r}: {exc}")

        return process


def register_tolerant_loaders(connection: Any) -> None:
    """Make a psycopg connection give back PostgreSQL timestamps Python cannot hold (before year 1,
    after 9999, ``infinity``) as :class:`Unreadable` rather than fail the query
    (``connection``: a ``psycopg.Connection``, as SQLAlchemy's ``connect`` event hands it)."""
    from psycopg import DataError
    from psycopg.adapt import Loader
    from psycopg.pq import Format

    for name in ("timestamptz", "timestamp"):
        oid = connection.adapters.types[name].oid
        for fmt in (Format.TEXT, Format.BINARY):
            base = connection.adapters.get_loader(oid, fmt)
            if base is None or getattr(base, "tolerant", False):
                continue

            class Tolerant(Loader):
                tolerant = True
                inner: type[Loader] = base
                type_name = name

                def __init__(self, oid: int, context: Any = None) -> None:
                    super().__init__(oid, context)
                    self._inner = self.inner(oid, context)

                def load(self, data: Any) -> Any:
                    try:
                        return self._inner.load(data)
                    except DataError as exc:
                        return Unreadable(self.type_name, str(exc))

            Tolerant.format = fmt
            connection.adapters.register_loader(oid, Tolerant)
