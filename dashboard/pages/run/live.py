"""The run page's step figures (timelines, the two heatmaps, the diagnosis bars), drawn in full
when the page opens and, while the run is being written, brought up to date at each tick: the steps
compared since the last tick are appended as ``dash.Patch`` operations on the figures already in
the browser, and a figure whose shape changed (a wider position range, a new region or diagnosis
kind, a log panel reaching zero) is drawn again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import dash
import plotly.graph_objects as go
from dash import Output, Patch, no_update
from isoaudit.audit.db import Store, reads
from isoaudit.dashboard import context
from isoaudit.dashboard.pages.run import diagnoses, heatmaps, ids, timelines
from isoaudit.dashboard.pages.run.state import LiveState
from isoaudit.dashboard.pages.run.triggers import on_tick


@dataclass
class StepFigures:
    """The step figures drawn in full, and the state describing what they hold."""

    timelines: go.Figure
    position: go.Figure
    divergence: go.Figure
    diagnoses: go.Figure
    state: LiveState

    def figures(self) -> list[go.Figure]:
        """The figures in the order of the tick's outputs."""
        return [self.timelines, self.position, self.divergence, self.diagnoses]


def draw(store: Store, run_id: str, stat: str = "mean") -> StepFigures:
    """Every step figure of the run page, drawn in full."""
    points = reads.step_series(store, run_id)
    timeline, log_rows = timelines.draw(store, run_id, points)
    position, n_bins = heatmaps.draw_position(points, stat)
    divergence, regions = heatmaps.draw_divergence(points)
    bars, kinds = diagnoses.draw(points)
    state = LiveState(
        run_id=run_id,
        last_step=points[-1].step if points else None,
        log_rows=log_rows,
        stat=stat,
        n_bins=n_bins,
        regions=regions,
        kinds=kinds,
    )
    return StepFigures(timeline, position, divergence, bars, state)


def tick(_n: int | None, state_json: dict[str, Any]) -> tuple[Any, ...]:
    """Append the steps compared since the last tick to the figures (a figure whose shape changed
    is drawn again in full)."""
    store = context.store()
    state = LiveState.from_json(state_json)
    points = reads.step_series(store, state.run_id, after_step=state.last_step)
    if not points:
        return (no_update,) * 5
    if state.last_step is None:
        # The page was drawn before any step was compared: its figures are placeholders with no
        # traces, so there is nothing to extend (a Patch would fail in the browser). Draw them.
        full = draw(store, state.run_id, state.stat)
        return (*full.figures(), full.state.to_json())
    patches: list[Patch | None] = [
        timelines.patch(store, state.run_id, points, state.log_rows),
        heatmaps.position_patch(points, state),
        heatmaps.divergence_patch(points, state),
        diagnoses.patch(points, state),
    ]
    if any(p is None for p in patches):
        full = draw(store, state.run_id, state.stat)
        drawn = full.figures()
        return (*[p if p is not None else drawn[i] for i, p in enumerate(patches)], full.state.to_json())
    state.last_step = points[-1].step
    return (*patches, state.to_json())


def register(app: dash.Dash) -> None:
    on_tick(
        app,
        Output(ids.TIMELINES, "figure"),
        Output(ids.POSITION, "figure"),
        Output(ids.DIVERGENCE, "figure"),
        Output(ids.DIAGNOSES, "figure"),
        Output(ids.STATE, "data"),
    )(tick)
