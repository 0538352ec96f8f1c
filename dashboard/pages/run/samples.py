"""The samples section: a step picker (typed, or set by a click on the timelines or the diagnosis
bars) and that step's samples, each row opening its sample's page."""

from __future__ import annotations

from typing import Any

import dash
from dash import Input, Output, State, dcc, html, no_update
from dash.development.base_component import Component
from isoaudit.audit.db import reads
from isoaudit.dashboard import context, data
from isoaudit.dashboard.components import data_table
from isoaudit.dashboard.pages import urls
from isoaudit.dashboard.pages.run import ids
from isoaudit.dashboard.pages.run.clicks import clicked
from isoaudit.dashboard.pages.run.triggers import on_page_event

SAMPLE_COLUMNS: list[dict[str, Any]] = [
    {"id": "open", "name": "", "presentation": "markdown"},
    {"id": "sample_key", "name": "sample"},
    {"id": "n_tokens", "name": "tokens", "type": "numeric"},
    {"id": "abs_diff_mean", "name": "mean |Δ|", "type": "numeric", "format": {"specifier": ".3g"}},
    {"id": "abs_diff_max", "name": "max |Δ|", "type": "numeric", "format": {"specifier": ".3g"}},
    {"id": "kl_k3", "name": "kl_k3", "type": "numeric", "format": {"specifier": ".3g"}},
    {"id": "exact_match_fraction", "name": "exact", "type": "numeric", "format": {"specifier": ".1%"}},
    {"id": "first_divergence", "name": "first divergence"},
    {"id": "diagnosis", "name": "diagnosis"},
]


def sample_rows(run_id: str, step: int | None) -> list[dict[str, Any]]:
    """The table's rows of ``step``'s samples, each with a markdown link opening it."""
    if step is None:
        return []
    frame = data.samples_frame(reads.step_samples(context.store(), run_id, step))
    records = frame.to_dict("records")
    for record in records:
        record["open"] = f"[open]({urls.sample_path(run_id, step, record['sample_key'])})"
    return records


def section(run_id: str, step: int | None) -> list[Component]:
    picker = html.Div(
        [
            html.H5("Samples of step ", className="d-inline"),
            dcc.Input(id=ids.STEP, type="number", value=step, min=0, debounce=True, style={"width": "8em"}),
        ],
        className="mt-3 mb-2",
    )
    table = data_table(
        ids.SAMPLES, SAMPLE_COLUMNS, sample_rows(run_id, step), page_size=25, sortable=True, scrolls=True
    )
    return [picker, table]


def select_step(_timeline: dict[str, Any] | None, _bars: dict[str, Any] | None) -> Any:
    """The step of the point clicked on the timelines or the diagnosis bars."""
    point = clicked(dash.ctx.triggered[0]["value"] if dash.ctx.triggered else None)
    return int(point["x"]) if point is not None and point.get("x") is not None else no_update


def step_rows(step: int | None, state_json: dict[str, Any]) -> list[dict[str, Any]]:
    return sample_rows(state_json["run_id"], int(step) if step is not None else None)


def table_click(
    active: dict[str, Any] | None, rows: list[dict[str, Any]], step: int | None, state_json: dict[str, Any]
) -> Any:
    """Clicking a table row's cell opens that sample."""
    if not active or step is None:
        return no_update
    index = active.get("row")
    if index is None or index >= len(rows):
        return no_update
    return urls.sample_path(state_json["run_id"], int(step), rows[index]["sample_key"])


def register(app: dash.Dash) -> None:
    app.callback(
        Output(ids.STEP, "value"),
        Input(ids.TIMELINES, "clickData"),
        Input(ids.DIAGNOSES, "clickData"),
        prevent_initial_call=True,
    )(select_step)
    on_page_event(app, Output(ids.SAMPLES, "data"), Input(ids.STEP, "value"))(step_rows)
    on_page_event(
        app,
        Output(ids.NAV, "href", allow_duplicate=True),
        Input(ids.SAMPLES, "active_cell"),
        State(ids.SAMPLES, "derived_viewport_data"),
        State(ids.STEP, "value"),
    )(table_click)
