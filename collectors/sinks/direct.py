"""Records straight into the database through :class:`audit.store.Store` (no service in between):
one process, or a few writers on PostgreSQL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError
from sqlalchemy.exc import DBAPIError, OperationalError

from audit.store import Store, StoreError
from collectors.sinks.base import DeliveryError, Sink, _Item


class DirectSink(Sink):
    """Writes each batch with ``Store.ingest`` from the sink's worker thread.

    The store is opened (and migrated) lazily in that thread, so a database that is down at attach
    time is just a destination that is down: records spool (with ``spool_dir``) and arrive later.
    """

    def __init__(
        self, db_url: str, *, project: str = "default", spool_dir: str | Path | None = None, **options: Any
    ) -> None:
        if not db_url:
            raise ValueError("db_url: empty; give a SQLAlchemy URL such as sqlite:///./isoaudit.db")
        self.db_url = db_url
        self.project = project
        self._store: Store | None = None
        super().__init__(spool_dir=spool_dir, name=options.pop("name", "direct-sink"), **options)

    def _deliver(self, item: _Item) -> None:
        try:
            if self._store is None:
                self._store = Store(self.db_url)
            result = self._store.ingest(item.records, project=self.project)
        except (OperationalError, OSError) as exc:
            self._reset()
            raise DeliveryError(str(exc).splitlines()[0], retry=True) from exc
        except DBAPIError as exc:
            retry = bool(exc.connection_invalidated)
            if retry:
                self._reset()
            raise DeliveryError(str(exc).splitlines()[0], retry=retry) from exc
        except (StoreError, ValidationError, ValueError) as exc:
            raise DeliveryError(str(exc), retry=False) from exc
        self._add("duplicates", sum(result.duplicates.values()))

    def _reset(self) -> None:
        if self._store is not None:
            try:
                self._store.dispose()
            finally:
                self._store = None

    def _close_destination(self) -> None:
        self._reset()
