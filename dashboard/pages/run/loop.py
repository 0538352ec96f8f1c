"""The loop section: the RL job's own figures (reward, from ``Session.record_stats``) against the
run's mismatch, so a user sees whether the drift tracks what the job optimises."""

from __future__ import annotations

from typing import Any

import dash
import plotly.graph_objects as go
from dash import Output, State, dcc, html, no_update
from dash.development.base_component import Component
from isoaudit.audit.db import Store, reads
from isoaudit.audit.records import StepStats
from isoaudit.dashboard import context, data, figures
from isoaudit.dashboard.components import graph
from isoaudit.dashboard.pages.run import ids
from isoaudit.dashboard.pages.run.state import LiveState
from isoaudit.dashboard.pages.run.triggers import on_tick


def loop_figure(store: Store, run_id: str, stats: list[StepStats]) -> go.Figure:
    """The loop's reward (``stats``) against the run's kl_k3 by step."""
    mismatch = data.timeline_frame(reads.step_series(store, run_id))["kl_k3"]
    return figures.loop_figures(data.loop_frame(stats), mismatch)


def section(store: Store, run_id: str) -> list[Component]:
    stats = store.step_stats(run_id)
    return [
        html.H5("The loop's own figures: reward against the mismatch", className="mt-3"),
        dcc.Store(id=ids.LOOP_STEPS, data=stats[-1].step if stats else None),
        graph(ids.LOOP, loop_figure(store, run_id, stats)),
    ]


def tick_loop(_n: int | None, state_json: dict[str, Any], drawn_last: int | None) -> tuple[Any, Any]:
    """Redraw the loop figure only when steps after the last drawn one reported their figures (the
    check reads just those rows, so an idle tick costs one small query)."""
    store = context.store()
    run_id = LiveState.from_json(state_json).run_id
    if not store.step_stats(run_id, from_step=0 if drawn_last is None else drawn_last + 1):
        return no_update, no_update
    stats = store.step_stats(run_id)
    return loop_figure(store, run_id, stats), stats[-1].step


def register(app: dash.Dash) -> None:
    on_tick(
        app,
        Output(ids.LOOP, "figure"),
        Output(ids.LOOP_STEPS, "data"),
        also=(State(ids.LOOP_STEPS, "data"),),
    )(tick_loop)
