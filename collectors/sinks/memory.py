"""A sink that keeps records in memory: tests, benchmarks, and notebooks that compare in-process."""

from __future__ import annotations

import threading
from typing import Any, Unpack

from audit.records import Record
from collectors.sinks.base import Sink, SinkOptions, _Item


class MemorySink(Sink):
    """Delivered records accumulate in :attr:`records` (``keep=False`` only counts them)."""

    def __init__(self, *, keep: bool = True, **options: Unpack[SinkOptions]) -> None:
        self.keep = keep
        self.records: list[Record] = []
        self._lock = threading.Lock()
        options.setdefault("name", "memory-sink")
        super().__init__(**options)

    def _deliver(self, item: _Item) -> None:
        if self.keep:
            with self._lock:
                self.records.extend(item.records)

    def of_kind(self, kind: str) -> list[Any]:
        with self._lock:
            return [r for r in self.records if getattr(r, "kind", None) == kind]
