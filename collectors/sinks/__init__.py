"""Sinks carry records from a collector to the store (:class:`DirectSink`) or the service
(:class:`HttpSink`), off the training thread, never raising into it."""

from collectors.sinks.base import Control, DeliveryError, Sink, SinkCounters
from collectors.sinks.direct import DirectSink
from collectors.sinks.http import HttpSink
from collectors.sinks.memory import MemorySink
from collectors.sinks.spool import Spool

__all__ = [
    "Control",
    "DeliveryError",
    "DirectSink",
    "HttpSink",
    "MemorySink",
    "Sink",
    "SinkCounters",
    "Spool",
]
