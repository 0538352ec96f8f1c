"""``/alerts``: open and resolved alerts linking to their step, silences (create for a duration,
expire) and the rules with their thresholds."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import dash
import dash_bootstrap_components as dbc
from dash import ALL, Input, Output, State, dcc, html, no_update
from isoaudit.audit.alerts.silences import SilenceSpec, create_silence, expire_silence
from isoaudit.audit.db import reads as queries
from isoaudit.audit.records import utcnow
from isoaudit.dashboard import context, data
from isoaudit.dashboard.components import STATE_COLOURS, badge, frame_table
from pydantic import ValidationError

DURATIONS = {"1 hour": 3600, "4 hours": 4 * 3600, "1 day": 86400, "1 week": 7 * 86400}


def step_href(run_id: str, step: int) -> str:
    return f"/runs/{quote(run_id, safe='')}?step={int(step)}"


def alerts_table(frame: Any, table_id: str) -> Any:
    if frame.empty:
        return html.P("None.", className="text-muted")
    return frame_table(
        frame.drop(columns=["link_step"]),
        links={"run_id": lambda r: step_href(r["run_id"], frame.loc[r.name, "link_step"])},
        cell={"state": lambda r: badge(r["state"], STATE_COLOURS)},
        table_id=table_id,
    )


def silences_table(frame: Any) -> Any:
    if frame.empty:
        return html.P("No silences.", className="text-muted")

    def expire(row: Any) -> Any:
        if not row["active"]:
            return "expired"
        return dbc.Button(
            "expire", id={"type": "silence-expire", "id": int(row["id"])}, size="sm", color="secondary"
        )

    return frame_table(frame.assign(action=""), cell={"action": expire}, table_id="alerts-silences-table")


def content() -> html.Div:
    view = queries.alerts_view(context.store())
    return html.Div(
        [
            html.H5("Open"),
            alerts_table(data.alerts_frame(view.open), "alerts-open"),
            html.H5("Resolved", className="mt-3"),
            alerts_table(data.alerts_frame(view.resolved), "alerts-resolved"),
            html.H5("Silences", className="mt-3"),
            silences_table(data.silences_frame(view.silences, utcnow())),
            html.H5("Rules", className="mt-3"),
            frame_table(data.rules_frame(view.rules), table_id="alerts-rules"),
        ]
    )


def silence_form() -> dbc.Card:
    rules = [r.name for r in queries.alerts_view(context.store()).rules]
    return dbc.Card(
        dbc.CardBody(
            [
                html.H5("Silence", className="card-title"),
                dbc.Row(
                    [
                        dbc.Col(dcc.Dropdown(id="silence-rule", options=rules, placeholder="any rule"), md=3),
                        dbc.Col(dbc.Input(id="silence-run", placeholder="any run (run id)"), md=3),
                        dbc.Col(
                            dcc.Dropdown(
                                id="silence-duration",
                                options=list(DURATIONS),
                                value="1 hour",
                                clearable=False,
                            ),
                            md=2,
                        ),
                        dbc.Col(dbc.Input(id="silence-comment", placeholder="comment"), md=2),
                        dbc.Col(dbc.Button("silence", id="silence-create", color="primary"), md=2),
                    ],
                    className="g-2",
                ),
                html.Div(id="silence-message", className="small mt-2"),
            ]
        ),
        className="mb-3",
    )


def layout(**_: Any) -> html.Div:
    return html.Div(
        [
            html.H3("Alerts"),
            silence_form(),
            html.Div(content(), id="alerts-content"),
            dcc.Interval(id="alerts-interval", interval=context.live_interval_ms() * 2),
        ]
    )


def create(
    _clicks: int | None, rule: str | None, run_id: str | None, duration: str, comment: str | None
) -> tuple[Any, Any]:
    """Silence the chosen rule / run (either may be left open: it then matches any) for a duration."""
    try:
        spec = SilenceSpec(
            rule=rule or None,
            run_id=(run_id or "").strip() or None,
            duration_s=DURATIONS[duration],
            comment=comment or "",
        )
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return dbc.Alert(problems, color="danger", className="py-1 mb-0"), no_update
    store = context.store()
    project = store.run_project(spec.run_id) if spec.run_id else None
    row = create_silence(store, spec, project=project, created_by=context.user())
    return html.Span(
        f"Silence {row.id} created until {row.ends_at:%Y-%m-%d %H:%M} UTC.", className="text-success"
    ), content()


def expire(clicks: list[int | None], ids: list[dict[str, Any]]) -> Any:
    """End the silence whose button was clicked (the table is redrawn after each click, so only that
    button has clicks)."""
    chosen = [i["id"] for i, n in zip(ids, clicks or [], strict=False) if n]
    if not chosen:
        return no_update
    for silence_id in chosen:
        expire_silence(context.store(), int(silence_id))
    return content()


def refresh(_n: int | None) -> Any:
    return content()


def register(app: dash.Dash) -> None:
    dash.register_page(
        __name__, path="/alerts", name="Alerts", title="isoaudit: alerts", layout=layout, order=4
    )
    app.callback(
        Output("silence-message", "children"),
        Output("alerts-content", "children"),
        Input("silence-create", "n_clicks"),
        State("silence-rule", "value"),
        State("silence-run", "value"),
        State("silence-duration", "value"),
        State("silence-comment", "value"),
        prevent_initial_call=True,
    )(create)
    app.callback(
        Output("alerts-content", "children", allow_duplicate=True),
        Input({"type": "silence-expire", "id": ALL}, "n_clicks"),
        State({"type": "silence-expire", "id": ALL}, "id"),
        prevent_initial_call=True,
    )(expire)
    app.callback(
        Output("alerts-content", "children", allow_duplicate=True),
        Input("alerts-interval", "n_intervals"),
        prevent_initial_call=True,
    )(refresh)
