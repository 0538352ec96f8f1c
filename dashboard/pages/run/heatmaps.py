"""The heatmaps section: |Δ logprob| by step and response position (mean or max), and how many
samples first diverge in each region by step. A click on a cell opens a sample that cell names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dash
import dash_bootstrap_components as dbc
import plotly.graph_objects as go
from dash import Input, Output, Patch, html
from isoaudit.audit.db import reads
from isoaudit.audit.summaries import bin_label
from isoaudit.dashboard import context, data, figures
from isoaudit.dashboard.components import graph, inline_choice
from isoaudit.dashboard.pages.run import ids
from isoaudit.dashboard.pages.run.clicks import SampleAt, opens_clicked_sample, row_of
from isoaudit.dashboard.pages.run.state import LiveState, json_values
from isoaudit.dashboard.pages.run.triggers import on_page_event

#: The statistics of a position bin the heatmap can show (value: label).
POSITION_STATS = {"mean": "mean", "max": "max"}


def draw_position(points: Sequence[reads.StepPoint], stat: str) -> tuple[go.Figure, int]:
    """The step x position heatmap of ``points`` in full, and how many position bins it draws."""
    frame = data.position_frame(points, stat)
    return figures.position_heatmap(frame, stat), frame.shape[1]


def draw_divergence(points: Sequence[reads.StepPoint]) -> tuple[go.Figure, list[str]]:
    """The region x step heatmap of ``points`` in full, and the regions it draws (one row each)."""
    frame = data.divergence_frame(points)
    return figures.divergence_heatmap(frame), list(frame.columns)


def position_patch(points: Sequence[reads.StepPoint], state: LiveState) -> Patch | None:
    """Append one column per new step, or None when a step reaches past the drawn bins."""
    frame = data.position_frame(points, state.stat)
    if state.n_bins == 0 or frame.shape[1] > state.n_bins:
        return None
    frame = data.position_frame(points, state.stat, n_bins=state.n_bins)
    update = Patch()
    update["data"][0]["x"].extend(frame.index.to_list())
    columns = [figures.heatmap_column(list(frame.iloc[i].to_numpy(float))) for i in range(len(frame))]
    for b in range(state.n_bins):
        update["data"][0]["z"][b].extend(json_values([c[0][b] for c in columns]))
        update["data"][0]["text"][b].extend([c[1][b] for c in columns])
    return update


def divergence_patch(points: Sequence[reads.StepPoint], state: LiveState) -> Patch | None:
    """Append one column per new step, or None when a new region appears."""
    seen = {r for p in points for r in p.first_divergence}
    if not state.regions or not seen <= set(state.regions):
        return None if seen else Patch()
    frame = data.divergence_frame(points, state.regions)
    update = Patch()
    update["data"][0]["x"].extend(frame.index.to_list())
    for r, region in enumerate(state.regions):
        update["data"][0]["z"][r].extend([None if v == 0 else int(v) for v in frame[region]])
    return update


def section(position: go.Figure, divergence: go.Figure) -> dbc.Row:
    return dbc.Row(
        [
            dbc.Col(
                [
                    html.H5("|Δ logprob| by response position", className="d-inline me-3"),
                    inline_choice(ids.POSITION_STAT, POSITION_STATS, "mean", class_name="d-inline"),
                    graph(ids.POSITION, position),
                ],
                lg=6,
            ),
            dbc.Col(
                [html.H5("First divergence by region"), graph(ids.DIVERGENCE, divergence)],
                lg=6,
            ),
        ]
    )


def redraw_position(stat: str, state_json: dict[str, Any]) -> tuple[go.Figure, dict[str, Any]]:
    """The position heatmap drawn again with another statistic (mean or max) of each bin."""
    state = LiveState.from_json(state_json)
    points = reads.step_series(context.store(), state.run_id)
    figure, state.n_bins = draw_position(points, stat)
    state.stat = stat
    state.last_step = points[-1].step if points else None
    return figure, state.to_json()


def sample_at_position_cell(point: dict[str, Any], state: LiveState) -> SampleAt | None:
    """A cell of the position heatmap names the sample holding that bin's largest |Δ| at that step."""
    found = reads.step_point(context.store(), state.run_id, int(point["x"]))
    if found is None:
        return None
    labels = [bin_label(i) for i in range(len(found.position_bins.get("max_key", [])))]
    row = row_of(point, labels)
    return found.step, data.bin_sample(found, row) if row is not None else None


def sample_at_divergence_cell(point: dict[str, Any], state: LiveState) -> SampleAt | None:
    """A cell of the region heatmap names a sample whose first divergence is there."""
    row = row_of(point, [figures.safe(r) for r in state.regions])
    found = reads.step_point(context.store(), state.run_id, int(point["x"]))
    if row is None or found is None or not 0 <= row < len(state.regions):
        return None
    entry = found.first_divergence.get(state.regions[row])
    return found.step, entry["example"] if entry else None


position_click = opens_clicked_sample(sample_at_position_cell)
divergence_click = opens_clicked_sample(sample_at_divergence_cell)


def register(app: dash.Dash) -> None:
    for heatmap, open_sample in ((ids.POSITION, position_click), (ids.DIVERGENCE, divergence_click)):
        on_page_event(app, Output(ids.NAV, "href", allow_duplicate=True), Input(heatmap, "clickData"))(
            open_sample
        )
    on_page_event(
        app,
        Output(ids.POSITION, "figure", allow_duplicate=True),
        Output(ids.STATE, "data", allow_duplicate=True),
        Input(ids.POSITION_STAT, "value"),
    )(redraw_position)
