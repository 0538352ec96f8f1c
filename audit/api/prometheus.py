"""``/metrics`` content: the latest mismatch metrics of each run, open alerts and the pending
comparison queue, read from the store at scrape time (so every replica reports the same figures),
plus the process's own ingest counters (``audit.api.telemetry``).

Metric names follow ``audit.metrics``: ``kl_k3`` is exported as ``isoaudit_kl_k3{run_id, project,
length="all"}``, and its length-bucketed variant ``kl_k3/len_0_256`` as the same family with
``length="0_256"``; a lag slice ``kl_k3/lag_1`` as ``isoaudit_kl_k3_by_lag{lag="1"}``; a threshold
figure ``tis_mean[cap=3]`` as ``isoaudit_tis_mean{params="cap=3"}`` (its defaults spelled out too).
Asked for a framework (``/metrics?framework=verl``), the same values are exported again under that
framework's own names (``verl_rollout_corr_k3_kl``), so its dashboards and alerts keep working. Open
alerts appear as ``isoaudit_alerts{alertname, run_id, project, severity, state}`` = 1, in the manner
of Prometheus's own ``ALERTS``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from isoaudit.audit.db import Store
from isoaudit.audit.db.telemetry import TelemetryReads
from isoaudit.audit.metric_names import Alias, definition, framework_aliases
from isoaudit.audit.metrics import PARAMETRIC, parse_lag_key, parse_variant
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_INVALID = re.compile(r"[^a-zA-Z0-9_]")


def family_name(metric: str) -> tuple[str, str]:
    """(Prometheus family name, length label) of an ``audit.metrics`` name."""
    base, _, bucket = metric.partition("/len_")
    return "isoaudit_" + _INVALID.sub("_", base), bucket or "all"


def _sanitize(name: str) -> str:
    return _INVALID.sub("_", name)


def _series(name: str) -> tuple[str, str, str, str] | None:
    """(family, help text, extra label name, its value) of a stored metric key."""
    lag = parse_lag_key(name)
    if lag is not None:
        return f"isoaudit_{lag[0]}_by_lag", definition(lag[0]) + " (per policy lag)", "lag", str(lag[1])
    if "[" in name or name in PARAMETRIC:
        try:
            base, params = parse_variant(name)
        except ValueError:
            return None
        shown = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
        return f"isoaudit_{base}", PARAMETRIC[base].description, "params", shown
    family, length = family_name(name)
    base = name.partition("/len_")[0]
    try:
        help_text = definition(base)
    except ValueError:
        help_text = base
    return family, help_text, "length", length


class StoreCollector(Collector):
    """Reads the store on each scrape; ``project`` limits it to one project's runs; ``frameworks``
    adds each framework's names for the same figures."""

    def __init__(self, store: Store, project: str | None = None, frameworks: tuple[str, ...] = ()) -> None:
        self.reads = TelemetryReads(store.sessions)
        self.project = project
        self.aliases: list[Alias] = [a for f in frameworks for a in framework_aliases(f)]

    def collect(self) -> Iterator[Metric]:
        reading = self.reads.read(self.project)
        last_step = GaugeMetricFamily(
            "isoaudit_last_compared_step",
            "The latest compared step of each run.",
            labels=["run_id", "project"],
        )
        families: dict[str, GaugeMetricFamily] = {}
        for latest in reading.latest_steps:
            run_id, project = latest.run_id, latest.project
            last_step.add_metric([run_id, project], float(latest.step))
            numbers = _numbers(latest.metrics)
            for name, value in sorted(numbers.items()):
                series = _series(name)
                if series is None:
                    continue
                family, help_text, label, label_value = series
                if family not in families:
                    families[family] = GaugeMetricFamily(
                        family, f"{help_text} (latest compared step)", labels=["run_id", "project", label]
                    )
                families[family].add_metric([run_id, project, label_value], value)
            for alias in self.aliases:
                if alias.key not in numbers:
                    continue
                family = _sanitize(f"{alias.framework}_{alias.name}")
                if family not in families:
                    families[family] = GaugeMetricFamily(
                        family,
                        f"{alias.framework}'s {alias.name} = isoaudit {alias.key}: {definition(alias.key)}",
                        labels=["run_id", "project"],
                    )
                families[family].add_metric([run_id, project], numbers[alias.key])
        yield last_step
        yield from families.values()

        open_alerts = GaugeMetricFamily(
            "isoaudit_alerts",
            "Open alerts (1 per pending or firing alert).",
            labels=["alertname", "run_id", "project", "severity", "state"],
        )
        for alert in reading.open_alerts:
            open_alerts.add_metric(
                [alert.rule, alert.run_id, alert.project, alert.severity, alert.state], 1.0
            )
        yield open_alerts
        yield GaugeMetricFamily(
            "isoaudit_pending_comparisons",
            "Samples queued for comparison.",
            value=float(reading.pending_comparisons),
        )


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """Numeric values only; NaN (no data) is left out rather than exported."""
    out = {}
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            continue
        out[name] = float(value)
    return out
