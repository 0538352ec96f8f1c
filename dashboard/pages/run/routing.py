"""The MoE routing section: where the two sides' expert choices flip, MoE layer by step, and the
latest routed step in words (routing replay included). Hidden for a dense model until routes
arrive; a click on a cell opens the sample with the most flips there."""

from __future__ import annotations

from typing import Any

import dash
import plotly.graph_objects as go
from dash import Input, Output, State, dcc, html, no_update
from isoaudit.audit.db import Store, reads
from isoaudit.dashboard import context, data, figures
from isoaudit.dashboard.components import graph, inline_choice, text
from isoaudit.dashboard.pages.run import ids
from isoaudit.dashboard.pages.run.clicks import SampleAt, opens_clicked_sample
from isoaudit.dashboard.pages.run.state import LiveState
from isoaudit.dashboard.pages.run.triggers import on_page_event, on_tick

DEFAULT_VALUE = "flipped_tokens"


def shown(last: int | None) -> dict[str, str]:
    """The section's style: shown once a step carries routes."""
    return {} if last is not None else {"display": "none"}


def routing_figure(store: Store, run_id: str, value: str = DEFAULT_VALUE) -> tuple[go.Figure, int | None]:
    """The layer x step heatmap of routing flips, and the last step it draws."""
    points = reads.routing_series(store, run_id)
    frame = data.routing_frame(points, value)
    return figures.routing_heatmap(frame, data.ROUTING_VALUES[value]), points[-1].step if points else None


def routing_line(point: reads.RoutingStep | None) -> str:
    """The latest routed step's figures in words, replay (R3) included."""
    if point is None:
        return ""
    m = point.metrics
    words = (
        f"step {point.step}: expert sets agree on {text(m.get('routing_set_agreement'))} of (token, layer) "
        f"cells, flip rate {text(m.get('routing_flip_rate'))}, {text(m.get('routing_flipped_tokens'))} of "
        f"{text(m.get('routing_tokens'))} tokens flip in some layer"
    )
    if point.replayed is not None:
        words += (
            f"; routing replay: {text(m.get('routing_replayed_fraction'))} of the trainer's tokens replayed"
        )
        words += f", {point.missing} with missing routes"
        if point.missing_examples:
            first = point.missing_examples[0]
            words += f" (e.g. sample {first['sample_key']} at positions {first['positions'][:8]})"
    return words + "."


def section(store: Store, run_id: str) -> html.Div:
    drawn, last = routing_figure(store, run_id)
    latest = reads.routing_series(store, run_id, after_step=last - 1) if last is not None else []
    return html.Div(
        [
            html.H5("MoE routing flips by layer", className="d-inline me-3 mt-3"),
            inline_choice(ids.ROUTING_VALUE, data.ROUTING_VALUES, DEFAULT_VALUE, class_name="d-inline small"),
            dcc.Store(id=ids.ROUTING_STEPS, data=last),
            html.Div(routing_line(latest[-1] if latest else None), id=ids.ROUTING_LINE, className="small"),
            graph(ids.ROUTING, drawn),
        ],
        id=ids.ROUTING_SECTION,
        style=shown(last),
    )


def redraw_routing(
    value: str | None, state_json: dict[str, Any], drawn_last: int | None, *, changed: bool = False
) -> tuple[Any, Any, Any, Any]:
    """The routing heatmap again when steps after the last drawn one carry routes, or when the
    value shown ``changed`` (the check reads only the new steps' rows); the section shows once
    there are routes."""
    store = context.store()
    run_id = LiveState.from_json(state_json).run_id
    new = reads.routing_series(store, run_id, after_step=drawn_last)
    if not changed and not new:
        return no_update, no_update, no_update, no_update
    drawn, last = routing_figure(store, run_id, value or DEFAULT_VALUE)
    line = routing_line(new[-1]) if new else no_update
    return drawn, last, shown(last), line


def tick_routing(
    _n: int | None, state_json: dict[str, Any], value: str | None, drawn_last: int | None
) -> tuple[Any, Any, Any, Any]:
    """Redraw the routing heatmap on a tick that brings routed steps, or when the value shown changes."""
    return redraw_routing(value, state_json, drawn_last, changed=dash.ctx.triggered_id == ids.ROUTING_VALUE)


def sample_at_routing_cell(point: dict[str, Any], state: LiveState) -> SampleAt | None:
    """A cell of the routing heatmap names the sample with the most flips in that layer and step."""
    if not str(point.get("y", "")).startswith("layer "):
        return None
    step = int(point["x"])
    found = reads.routing_series(context.store(), state.run_id, after_step=step - 1)
    if not found or found[0].step != step:
        return None
    return step, data.routing_example(found[0], int(str(point["y"]).split()[1]))


routing_click = opens_clicked_sample(sample_at_routing_cell)


def register(app: dash.Dash) -> None:
    on_tick(
        app,
        Output(ids.ROUTING, "figure"),
        Output(ids.ROUTING_STEPS, "data"),
        Output(ids.ROUTING_SECTION, "style"),
        Output(ids.ROUTING_LINE, "children"),
        also=(Input(ids.ROUTING_VALUE, "value"), State(ids.ROUTING_STEPS, "data")),
    )(tick_routing)
    on_page_event(app, Output(ids.NAV, "href", allow_duplicate=True), Input(ids.ROUTING, "clickData"))(
        routing_click
    )
