"""The remediation toggle: the desired mode, written with the version this page last read (a change
made meanwhile by someone else is shown, not overwritten), and the mode each side last reported
applying (each switches at its next step boundary)."""

from __future__ import annotations

from typing import Any

import dash
import dash_bootstrap_components as dbc
from dash import Input, Output, State, dcc, html, no_update
from dash.development.base_component import Component
from isoaudit.audit.control import REMEDIATION_MODES, StaleControlVersion
from isoaudit.audit.db import reads
from isoaudit.dashboard import context
from isoaudit.dashboard.components import ago, inline_choice, text
from isoaudit.dashboard.pages.run import ids
from isoaudit.dashboard.pages.run.triggers import on_page_event


def applied_view(overview: reads.RunOverview) -> html.Div:
    """Desired mode (version, who, when) and what each side last reported applying."""
    control = overview.control
    by = f" by {control.updated_by}" if control.updated_by else ""
    when = f", {ago(reads.aware(control.updated_at))}" if control.updated_at else ""
    rows = [
        html.Div(
            [
                html.Strong("desired: "),
                html.Span(control.mode, id=ids.DESIRED_MODE),
                f" (version {control.version}{by}{when})",
            ]
        )
    ]
    for side in reads.SIDES:
        applied = overview.applied[side]
        matches = applied.mode == control.mode
        rows.append(
            html.Div(
                [
                    html.Strong(f"{side}: "),
                    html.Span(text(applied.mode), id=ids.applied_mode(side)),
                    f" (reported {ago(applied.at)})" if applied.at else " (no manifest yet)",
                    " ✓" if matches else " … waiting for its next step" if applied.at else "",
                ]
            )
        )
    return html.Div(rows)


def control_data(mode: str, version: int) -> dict[str, Any]:
    """What :data:`ids.CONTROL` keeps: the desired mode and version this page last read."""
    return {"mode": mode, "version": version}


def section(overview: reads.RunOverview) -> list[Component]:
    card = dbc.Card(
        dbc.CardBody(
            [
                html.H5("Remediation", className="card-title"),
                inline_choice(ids.MODE, {m: m for m in REMEDIATION_MODES}, overview.control.mode),
                html.Div(id=ids.CONTROL_MESSAGE, className="small mt-1"),
                html.Div(applied_view(overview), id=ids.APPLIED, className="small mt-2"),
            ]
        ),
        className="mb-3",
    )
    return [
        dcc.Store(id=ids.CONTROL, data=control_data(overview.control.mode, overview.control.version)),
        card,
    ]


def set_mode(mode: str | None, control: dict[str, Any], state_json: dict[str, Any]) -> tuple[Any, ...]:
    """Write the desired mode with the version this page last saw; a change made meanwhile by
    someone else is shown, not overwritten. Writing a mode also restarts the live tick."""
    if mode is None or mode == control.get("mode"):
        return no_update, no_update, no_update, no_update
    store = context.store()
    run_id = state_json["run_id"]
    try:
        updated = store.set_control(run_id, mode, int(control["version"]), updated_by=context.user())
    except StaleControlVersion as exc:
        current = exc.current
        message = dbc.Alert(
            f"Not changed: the mode was set to {current.mode} (version {current.version}) by "
            f"{current.updated_by or 'someone'} since this page read it. Choose again to override.",
            color="warning",
            className="py-1 mb-0",
            id=ids.CONTROL_CONFLICT,
        )
        return current.mode, control_data(current.mode, current.version), message, False
    message = html.Span(
        f"Desired mode set to {updated.mode} (version {updated.version}); each side switches at its next step.",
        id=ids.CONTROL_OK,
        className="text-success",
    )
    return updated.mode, control_data(updated.mode, updated.version), message, False


def register(app: dash.Dash) -> None:
    on_page_event(
        app,
        Output(ids.MODE, "value"),
        Output(ids.CONTROL, "data"),
        Output(ids.CONTROL_MESSAGE, "children"),
        Output(ids.INTERVAL, "disabled", allow_duplicate=True),
        Input(ids.MODE, "value"),
        State(ids.CONTROL, "data"),
    )(set_mode)
