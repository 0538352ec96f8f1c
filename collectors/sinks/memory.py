"""A sink that keeps records in memory: tests, benchmarks, and notebooks that compare in-process.

It checks every record as the store would (:func:`isoaudit.audit.records.validate_record`): an invalid one
is refused and counted, the rest of its batch kept, and keeps a block of fingerprints as the
per-sample records it stands for, so what a test sees here is what would be stored.
"""

from __future__ import annotations

import threading
from typing import Any, Unpack

from isoaudit.audit.records import Record, RecordError, Rejection, expand_blocks, record_kind, validate_record
from isoaudit.collectors.sinks.base import Sink, SinkOptions, _Item


class MemorySink(Sink):
    """Delivered records accumulate in :attr:`records` (``keep=False`` only counts them);
    ``validate=False`` skips the store's checks (benchmarks of the collectors alone)."""

    def __init__(self, *, keep: bool = True, validate: bool = True, **options: Unpack[SinkOptions]) -> None:
        self.keep = keep
        self.validate = validate
        self.records: list[Record] = []
        self._lock = threading.Lock()
        options.setdefault("name", "memory-sink")
        super().__init__(**options)

    def _deliver(self, item: _Item) -> int:
        records, rejected = item.records, []
        if self.validate:
            kept: list[Record] = []
            for index, record in enumerate(records):
                try:
                    kept.append(validate_record(record))
                except RecordError as exc:
                    rejected.append(Rejection(index, record_kind(record), exc.field, str(exc)))
            records = kept
        if self.keep:  # as the store keeps them: a block as its per-sample records
            with self._lock:
                self.records.extend(expand_blocks(records))
        return self._rejected(rejected, item.records)

    def of_kind(self, kind: str) -> list[Any]:
        with self._lock:
            return [r for r in self.records if getattr(r, "kind", None) == kind]
