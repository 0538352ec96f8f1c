"""Sinks carry records from a collector to the store (:class:`DirectSink`) or the service
(:class:`HttpSink`), off the training thread, never raising into it.

Imported lazily: a process that only posts over HTTP (a vLLM worker, say) never imports SQLAlchemy.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collectors.sinks.base import DeliveryError, Sink, SinkCounters, SinkOptions
    from collectors.sinks.direct import DirectSink, SharedStore
    from collectors.sinks.http import HttpSink
    from collectors.sinks.memory import MemorySink
    from collectors.sinks.spool import Spool

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


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'collectors.sinks' has no attribute {name!r}")
    return getattr(import_module(f"collectors.sinks.{_WHERE[name]}"), name)
