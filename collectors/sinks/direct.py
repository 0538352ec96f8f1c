"""Records straight into the database through :class:`audit.db.Store` (no service in between):
one process, or a few writers on PostgreSQL."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Unpack

from isoaudit.audit.db import Store, StoreConflict, StoreError, StoreUnavailable
from isoaudit.collectors.sinks.base import DeliveryError, Sink, SinkOptions, _Item
from pydantic import ValidationError


class SharedStore:
    """One lazily opened :class:`Store` for everything of a job that talks to one database (its
    sinks' worker threads, the control channel): opened on first use, so a database that is down
    when the job starts is just a destination that is down; :meth:`reset` after a lost connection."""

    def __init__(self, url: str) -> None:
        if not url:
            raise ValueError("db_url: empty; give a SQLAlchemy URL such as sqlite:///./isoaudit.db")
        self.url = url
        self._store: Store | None = None
        self._lock = threading.Lock()

    def get(self) -> Store:
        with self._lock:
            if self._store is None:
                self._store = Store(self.url)
            return self._store

    def reset(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.dispose()


class DirectSink(Sink):
    """Writes each batch with ``Store.ingest`` from the sink's worker thread.

    ``db_url``: a SQLAlchemy URL, or a :class:`SharedStore` shared with other sinks of the job.
    ``project``: the project the run belongs to. The store validates every record: a bad one is
    refused (counted ``rejected``, logged once naming its field), the rest of its batch stored.
    """

    def __init__(
        self,
        db_url: str | SharedStore,
        *,
        project: str = "default",
        spool_dir: str | Path | None = None,
        **options: Unpack[SinkOptions],
    ) -> None:
        self.shared = db_url if isinstance(db_url, SharedStore) else SharedStore(db_url)
        self._owns_store = not isinstance(db_url, SharedStore)
        self.db_url = self.shared.url
        self.project = project
        options.setdefault("name", "direct-sink")
        super().__init__(spool_dir=spool_dir, **options)

    def _deliver(self, item: _Item) -> int:
        try:
            store = self.shared.get()
        except StoreError as exc:  # e.g. a schema behind head: records wait until `isoaudit db upgrade`
            raise DeliveryError(str(exc), retry=True) from exc
        except OSError as exc:
            raise DeliveryError(str(exc).splitlines()[0], retry=True) from exc
        try:
            try:
                result = store.ingest(item.records, project=self.project)
            except StoreConflict:
                # Another writer (the other side of the job) stored one of these rows between our
                # check and our insert; the batch is idempotent, so once more skips it as a duplicate.
                result = store.ingest(item.records, project=self.project)
        except (StoreUnavailable, OSError) as exc:
            self.shared.reset()
            raise DeliveryError(str(exc).splitlines()[0], retry=True) from exc
        except (StoreError, ValidationError, ValueError) as exc:
            raise DeliveryError(str(exc), retry=False) from exc
        self._add("duplicates", sum(result.duplicates.values()))
        return self._rejected(result.rejected, item.records)

    def _close_destination(self) -> None:
        if self._owns_store:
            self.shared.reset()
