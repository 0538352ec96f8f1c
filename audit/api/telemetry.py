"""The service's own counters (ingest requests, records, latency) for ``/metrics``, each labelled
with the project whose token sent the request, so a project's token reads its own figures alone.

Each app gets its own registry, so several apps in one process (tests) never share or collide.
"""

from __future__ import annotations

from collections.abc import Iterator

from isoaudit.audit.db import IngestResult
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import Metric
from prometheus_client.registry import Collector


class Telemetry:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.requests = Counter(
            "isoaudit_ingest_requests",
            "Ingest requests by project and HTTP status.",
            ["project", "status"],
            registry=registry,
        )
        self.records = Counter(
            "isoaudit_ingest_records",
            "Records received by ingest, by project, kind and outcome (stored, duplicate or rejected).",
            ["project", "kind", "outcome"],
            registry=registry,
        )
        self.latency = Histogram(
            "isoaudit_ingest_duration_seconds",
            "Time to validate and store one accepted batch, by project.",
            ["project"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )

    def record_ingest(self, project: str, result: IngestResult, seconds: float) -> None:
        self.requests.labels(project=project, status="200").inc()
        for kind, n in result.stored.items():
            self.records.labels(project=project, kind=kind, outcome="stored").inc(n)
        for kind, n in result.duplicates.items():
            self.records.labels(project=project, kind=kind, outcome="duplicate").inc(n)
        for rejection in result.rejected:
            self.records.labels(project=project, kind=rejection.kind, outcome="rejected").inc()
        self.latency.labels(project=project).observe(seconds)

    def record_rejected(self, project: str, status: int) -> None:
        self.requests.labels(project=project, status=str(status)).inc()

    def scoped(self, project: str | None) -> Collector:
        """The counters as a collector: every project's (``None``), or ``project``'s samples only."""
        return _ProjectSamples(self.registry, project)


class _ProjectSamples(Collector):
    """The families of ``registry`` with only the samples labelled ``project`` (all of them for None);
    a family with none left stays, empty, so the exposition names the same families for every token."""

    def __init__(self, registry: CollectorRegistry, project: str | None) -> None:
        self.registry = registry
        self.project = project

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if self.project is None:
                yield family
                continue
            scoped = Metric(family.name, family.documentation, family.type, family.unit)
            scoped.samples = [s for s in family.samples if s.labels.get("project") == self.project]
            yield scoped
