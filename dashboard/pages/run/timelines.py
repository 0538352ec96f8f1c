"""The timelines section: each step metric over the steps, with the rules' thresholds, the steps
during which an alert was firing and the remediation switches drawn on them."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd
import plotly.graph_objects as go
from dash import Patch, html
from dash.development.base_component import Component
from isoaudit.audit.db import Store, reads
from isoaudit.dashboard import data, figures
from isoaudit.dashboard.components import graph
from isoaudit.dashboard.pages.run import ids
from isoaudit.dashboard.pages.run.state import json_values


def annotation_frames(
    store: Store, run_id: str, last_step: int | None
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The timelines' thresholds (rules), firing intervals (alerts, open ones up to ``last_step``)
    and remediation switches (manifests) as frames."""
    rules = reads.run_rules(store, run_id)
    alerts = reads.alerts_view(store, run_id=run_id)
    intervals = data.alert_intervals_frame(alerts.open + alerts.resolved, rules, last_step)
    changes = data.mode_changes_frame(reads.mode_changes(store, run_id))
    return data.thresholds_frame(rules), intervals, changes


def draw(store: Store, run_id: str, points: Sequence[reads.StepPoint]) -> tuple[go.Figure, list[int]]:
    """The timelines of ``points`` in full, and the panels they draw on a log axis."""
    frame = data.timeline_frame(points)
    last = points[-1].step if points else None
    return figures.timelines(frame, *annotation_frames(store, run_id, last)), figures.log_panels(frame)


def patch(
    store: Store, run_id: str, points: Sequence[reads.StepPoint], log_rows: Sequence[int]
) -> Patch | None:
    """Append ``points`` (at least one) to every timeline trace (traces are in
    ``data.TIMELINE_METRICS`` order) and replace the thresholds, firing intervals and mode switches
    (a firing interval grows with every step). None when a value of a panel drawn on a log axis is 0
    or less (remediation reaches exact zeros): redraw it on a linear one."""
    frame = data.timeline_frame(points)
    log_metrics = [m for row in log_rows for m in data.TIMELINE_PANELS[row - 1][1]]
    if any((frame[m] <= 0).any() for m in log_metrics):
        return None
    shapes, notes = figures.timeline_decorations(*annotation_frames(store, run_id, points[-1].step), log_rows)
    update = Patch()
    update["layout"]["shapes"] = shapes
    update["layout"]["annotations"] = figures.timeline_titles() + notes
    steps = frame.index.to_list()
    for i, metric in enumerate(data.TIMELINE_METRICS):
        update["data"][i]["x"].extend(steps)
        update["data"][i]["y"].extend(json_values(frame[metric].to_list()))
    return update


def section(figure: go.Figure) -> list[Component]:
    return [html.H5("Step metrics"), graph(ids.TIMELINES, figure)]
