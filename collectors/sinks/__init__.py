"""Sinks carry records from a collector to the store (:class:`DirectSink`) or the service
(:class:`HttpSink`), off the training thread, never raising into it.

Imported lazily: a process that only posts over HTTP (a vLLM worker, say) never imports SQLAlchemy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from isoaudit.collectors.lazy import lazy_attributes

if TYPE_CHECKING:
    from isoaudit.collectors.sinks.base import DeliveryError, Sink, SinkCounters, SinkOptions
    from isoaudit.collectors.sinks.direct import DirectSink, SharedStore
    from isoaudit.collectors.sinks.http import HttpSink
    from isoaudit.collectors.sinks.memory import MemorySink
    from isoaudit.collectors.sinks.spool import Spool

_WHERE = {
    "SinkOptions": "base",
    "SharedStore": "direct",
    "DeliveryError": "base",
    "Sink": "base",
    "SinkCounters": "base",
    "DirectSink": "direct",
    "HttpSink": "http",
    "MemorySink": "memory",
    "Spool": "spool",
}

__all__ = [
    "DeliveryError",
    "DirectSink",
    "HttpSink",
    "MemorySink",
    "SharedStore",
    "Sink",
    "SinkCounters",
    "SinkOptions",
    "Spool",
]


__getattr__ = lazy_attributes(__name__, _WHERE)
