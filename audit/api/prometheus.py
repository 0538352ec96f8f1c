"""``/metrics`` content, read from the store at scrape time (so every replica reports the same
figures, and they survive a restart), following Prometheus' naming conventions.

Only runs compared within the active window (``Settings.metrics_active_window_s``) are exported: a
finished or idle run drops out once its last comparison is older than the window, so the series
count follows the runs in flight, never the runs ever recorded. Every run series carries
``run_id`` and ``project``; a project's token sees its own project's series alone.

Per run in the window:

- the latest compared step's figures, as gauges named after ``audit.metrics``: ``kl_k3`` as
  ``isoaudit_kl_k3{length="all"}``, its length bucket ``kl_k3/len_0_256`` as ``length="0_256"``; a
  lag slice ``kl_k3/lag_1`` as ``isoaudit_kl_k3_by_lag{lag="1"}``; a threshold figure
  ``tis_mean[cap=3]`` as ``isoaudit_tis_mean{params="cap=3"}``. Fractions are ``_ratio``
  (``exact_match_fraction`` -> ``isoaudit_exact_match_ratio``) and counts carry their unit
  (``bitwise_mismatch_count`` -> ``isoaudit_bitwise_mismatch_tokens``): :func:`prometheus_stem`;
- ``isoaudit_last_compared_step`` and ``isoaudit_last_compared_timestamp_seconds`` (unix time);
- counters that catch what happens between two scrapes: ``isoaudit_compared_steps_total``,
  ``isoaudit_steps_over_threshold_total{isoaudit_rule}`` (compared steps at which the rule's
  condition held) and ``isoaudit_alerts_fired_total{isoaudit_rule}``;
- ``isoaudit_run_info{name, engine, framework, remediation_desired, remediation_applied} 1``;
- ``isoaudit_alerts{isoaudit_rule, severity, state} 1`` per pending or firing alert. The rule is
  ``isoaudit_rule``, never ``alertname``, which a Prometheus alerting rule overwrites with its own.

And ``isoaudit_comparison_queue_samples{project}`` and ``isoaudit_build_info{version}``. Asked for a
framework (``/metrics?framework=verl``), the run figures are exported again under that framework's
own names (``verl_rollout_corr_k3_kl``), so its dashboards and alerts keep working.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

from isoaudit.audit import __version__
from isoaudit.audit.db import Store
from isoaudit.audit.db.telemetry import RunFigures, TelemetryReads
from isoaudit.audit.metric_names import Alias, definition, framework_aliases, is_framework_key, lookup
from isoaudit.audit.metrics import PARAMETRIC, parse_lag_key, parse_variant
from isoaudit.audit.records import utcnow
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

_INVALID = re.compile(r"[^a-zA-Z0-9_]")

#: Figures whose ``audit.metrics`` name lacks a unit (or has a reserved suffix) in Prometheus terms.
_RENAMED = {
    "bitwise_mismatch_count": "bitwise_mismatch_tokens",
    "n_tokens": "compared_tokens",
    "n_finite": "finite_tokens",
    "n_nonfinite": "nonfinite_tokens",
    "n_samples": "compared_samples",
    "is_clipfrac": "is_clip_ratio",
}
#: Unit suffixes that stay last (a lag slice's ``_by_lag`` goes before them).
_UNITS = ("_ratio", "_tokens", "_samples")

#: How long after its last comparison a run stays in ``/metrics`` unless told otherwise.
DEFAULT_WINDOW = timedelta(hours=1)


def _sanitize(name: str) -> str:
    return _INVALID.sub("_", name)


def prometheus_stem(metric: str) -> str:
    """The Prometheus name (without ``isoaudit_``) of an ``audit.metrics`` figure: a unit where the
    figure counts something, and ``_ratio`` for each fraction (``is_fraction_high`` -> ``is_high_ratio``)."""
    name = _RENAMED.get(metric, _sanitize(metric))
    parts = name.split("_")
    if "fraction" in parts:
        name = "_".join(p for p in parts if p != "fraction") + "_ratio"
    return name


def _by_lag(stem: str) -> str:
    for unit in _UNITS:
        if stem.endswith(unit):
            return f"{stem[: -len(unit)]}_by_lag{unit}"
    return f"{stem}_by_lag"


def _series(name: str) -> tuple[str, str, str, str] | None:
    """(family, help text, extra label name, its value) of a stored metric key."""
    lag = parse_lag_key(name)
    if lag is not None:
        family = "isoaudit_" + _by_lag(prometheus_stem(lag[0]))
        return family, definition(lag[0]) + " (per policy lag)", "lag", str(lag[1])
    if "[" in name or name in PARAMETRIC:
        try:
            base, params = parse_variant(name)
        except ValueError:
            return None
        shown = ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
        return "isoaudit_" + prometheus_stem(base), PARAMETRIC[base].description, "params", shown
    base, _, bucket = name.partition("/len_")
    try:
        help_text = definition(base)
    except ValueError:
        help_text = base
    return "isoaudit_" + prometheus_stem(base), help_text, "length", bucket or "all"


def _engine_and_framework(run: RunFigures) -> tuple[str, str]:
    """The rollout engine and the training framework of a run: what its collectors reported in their
    latest manifests (``runtime.framework`` of each side), else the run's ``config`` (``engine``,
    ``framework``); empty when neither says."""
    engine = run.runtimes.get("rollout", {}).get("framework") or run.config.get("engine") or ""
    framework = run.config.get("framework") or run.runtimes.get("trainer", {}).get("framework") or ""
    return str(engine), str(framework)


def applied_mode(run: RunFigures) -> str:
    """The remediation mode the run's sides report running: the mode when they agree, ``mixed`` when
    they do not, ``unknown`` when no manifest says."""
    modes = {runtime.get("remediation") for runtime in run.runtimes.values()} - {None}
    if not modes:
        return "unknown"
    return str(modes.pop()) if len(modes) == 1 else "mixed"


class StoreCollector(Collector):
    """Reads the store on each scrape. ``project`` limits it to one project's runs; ``frameworks``
    adds each framework's names for the same figures; ``window``: how long after its last
    comparison a run is exported (None: every run ever compared, the unbounded export)."""

    def __init__(
        self,
        store: Store,
        project: str | None = None,
        frameworks: tuple[str, ...] = (),
        *,
        window: timedelta | None = DEFAULT_WINDOW,
        now: datetime | None = None,
    ) -> None:
        self.reads = TelemetryReads(store.sessions)
        self.project = project
        self.aliases: list[Alias] = [a for f in frameworks for a in framework_aliases(f)]
        self.window = window
        self.now = now

    def collect(self) -> Iterator[Metric]:
        since = None if self.window is None else (self.now or utcnow()) - self.window
        reading = self.reads.read(self.project, since=since)
        run_labels = ["run_id", "project"]
        rule_labels = ["run_id", "project", "isoaudit_rule"]
        last_step = GaugeMetricFamily(
            "isoaudit_last_compared_step", "The latest compared step of each run.", labels=run_labels
        )
        last_time = GaugeMetricFamily(
            "isoaudit_last_compared_timestamp_seconds",
            "When each run was last compared (unix time); a run drops out of /metrics once this is "
            "older than the active window.",
            labels=run_labels,
        )
        compared = CounterMetricFamily(
            "isoaudit_compared_steps", "Steps of each run compared so far.", labels=run_labels
        )
        info = InfoMetricFamily(
            "isoaudit_run",
            "Each run: its name, rollout engine, training framework, and the remediation mode desired "
            "(the control record) and applied (what its sides report).",
            labels=run_labels,
        )
        families: dict[str, GaugeMetricFamily] = {}
        label_of: dict[str, str] = {}  # each figure family's own label (length, lag or params)
        for run in reading.runs:
            ids = [run.run_id, run.project]
            last_step.add_metric(ids, float(run.step))
            last_time.add_metric(ids, run.last_compared_at.timestamp())
            compared.add_metric(ids, float(run.compared_steps))
            engine, framework = _engine_and_framework(run)
            info.add_metric(
                ids,
                {
                    "name": run.name,
                    "engine": engine,
                    "framework": framework,
                    "remediation_desired": run.desired_mode,
                    "remediation_applied": applied_mode(run),
                },
            )
            self._figures(families, label_of, run)
        yield from (last_step, last_time, compared, info)
        yield from families.values()

        over = CounterMetricFamily(
            "isoaudit_steps_over_threshold",
            "Compared steps of each run at which an alert rule's condition held (its window value past "
            "its threshold), per rule.",
            labels=rule_labels,
        )
        for count in reading.breaching_steps:
            over.add_metric([count.run_id, count.project, count.rule], float(count.count))
        fired = CounterMetricFamily(
            "isoaudit_alerts_fired", "Alerts of each run that fired, per rule.", labels=rule_labels
        )
        for count in reading.fired_alerts:
            fired.add_metric([count.run_id, count.project, count.rule], float(count.count))
        open_alerts = GaugeMetricFamily(
            "isoaudit_alerts",
            "Open alerts of the runs in the window: 1 per pending or firing alert (the rule in "
            "isoaudit_rule).",
            labels=["isoaudit_rule", "run_id", "project", "severity", "state"],
        )
        for alert in reading.open_alerts:
            open_alerts.add_metric(
                [alert.rule, alert.run_id, alert.project, alert.severity, alert.state], 1.0
            )
        queue = GaugeMetricFamily(
            "isoaudit_comparison_queue_samples", "Samples waiting for comparison.", labels=["project"]
        )
        queued = dict(reading.pending_comparisons)
        for project in {r.project for r in reading.runs} | ({self.project} if self.project else set()):
            queued.setdefault(project, 0)
        for project, n in sorted(queued.items()):
            queue.add_metric([project], float(n))
        yield from (over, fired, open_alerts, queue)
        yield InfoMetricFamily(
            "isoaudit_build", "The isoaudit version serving.", value={"version": __version__}
        )

    def _figures(
        self, families: dict[str, GaugeMetricFamily], label_of: dict[str, str], run: RunFigures
    ) -> None:
        """Add the latest compared step's figures of ``run`` (and their framework names) to ``families``
        (``label_of``: the label that tells each family's figures apart)."""
        numbers = _numbers(run.metrics)
        for name, value in sorted(numbers.items()):
            if is_framework_key(name):
                continue  # exported under the framework's own names, when asked (below)
            series = _series(name)
            if series is None:
                continue
            family, help_text, label, label_value = series
            if family not in families:
                families[family] = GaugeMetricFamily(
                    family, f"{help_text} (latest compared step)", labels=["run_id", "project", label]
                )
                label_of[family] = label
            if label_of[family] != label:
                continue  # one family, one set of labels: a figure that would mix them stays out
            families[family].add_metric([run.run_id, run.project, label_value], value)
        for alias in self.aliases:
            value = lookup(numbers, alias.key)
            if value is None:
                continue
            family = _sanitize(f"{alias.framework}_{alias.name}")
            if family not in families:
                families[family] = GaugeMetricFamily(
                    family,
                    f"{alias.framework}'s {alias.name}, as its own code computes it: {alias.note}",
                    labels=["run_id", "project"],
                )
            families[family].add_metric([run.run_id, run.project], value)


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """Numeric values only; NaN (no data) is left out rather than exported."""
    out = {}
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            continue
        out[name] = float(value)
    return out
