"""The service's own counters (ingest requests, records, latency) for ``/metrics``.

Each app gets its own registry, so several apps in one process (tests) never share or collide.
"""

from __future__ import annotations

from isoaudit.audit.db import IngestResult
from prometheus_client import CollectorRegistry, Counter, Histogram


class Telemetry:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "isoaudit_ingest_requests", "Ingest requests by HTTP status.", ["status"], registry=registry
        )
        self.records = Counter(
            "isoaudit_ingest_records",
            "Records received by ingest, by kind and outcome (stored, duplicate or rejected).",
            ["kind", "outcome"],
            registry=registry,
        )
        self.latency = Histogram(
            "isoaudit_ingest_duration_seconds",
            "Time to validate and store one accepted batch.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )

    def record_ingest(self, result: IngestResult, seconds: float) -> None:
        self.requests.labels(status="200").inc()
        for kind, n in result.stored.items():
            self.records.labels(kind=kind, outcome="stored").inc(n)
        for kind, n in result.duplicates.items():
            self.records.labels(kind=kind, outcome="duplicate").inc(n)
        for rejection in result.rejected:
            self.records.labels(kind=rejection.kind, outcome="rejected").inc()
        self.latency.observe(seconds)

    def record_rejected(self, status: int) -> None:
        self.requests.labels(status=str(status)).inc()
