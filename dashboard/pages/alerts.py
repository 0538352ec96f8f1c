"""``/alerts``: open and resolved alerts linking to their step, silences (create for a duration,
expire) and the rules with their thresholds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import dash
import dash_bootstrap_components as dbc
import pandas as pd
from dash import ALL, Input, Output, State, dcc, html, no_update
from dash.development.base_component import Component
from isoaudit.audit.alerts.silences import SilenceSpec, create_silence, expire_silence
from isoaudit.audit.db import reads
from isoaudit.audit.records import utcnow
from isoaudit.dashboard import context, data
from isoaudit.dashboard.components import STATE_COLOURS, badge, frame_table
from isoaudit.dashboard.pages import urls
from pydantic import ValidationError

# Component ids.
CONTENT = "alerts-content"
INTERVAL = "alerts-interval"
OPEN = "alerts-open"
RESOLVED = "alerts-resolved"
SILENCES = "alerts-silences-table"
RULES = "alerts-rules"
SILENCE_RULE = "silence-rule"
SILENCE_RUN = "silence-run"
SILENCE_DURATION = "silence-duration"
SILENCE_COMMENT = "silence-comment"
SILENCE_CREATE = "silence-create"
SILENCE_MESSAGE = "silence-message"
SILENCE_EXPIRE = "silence-expire"  # the type of each silence's expire button (see expire_button_id)


def expire_button_id(silence_id: object) -> dict[str, Any]:
    """The id of the button that expires silence ``silence_id`` (or, with ``ALL``, of every such button)."""
    return {"type": SILENCE_EXPIRE, "id": silence_id}


DURATIONS = {"1 hour": 3600, "4 hours": 4 * 3600, "1 day": 86400, "1 week": 7 * 86400}


def alerts_table(frame: pd.DataFrame, table_id: str) -> Component:
    """Alerts, each run id linking to the run page at the alert's step."""
    if frame.empty:
        return html.P("None.", className="text-muted")
    return frame_table(
        frame.drop(columns=["link_step"]),
        links={"run_id": lambda r: urls.run_path(r["run_id"], frame.loc[r.name, "link_step"])},
        cell={"state": lambda r: badge(r["state"], STATE_COLOURS)},
        table_id=table_id,
    )


def silences_table(frame: pd.DataFrame) -> Component:
    """Silences, an active one with a button that expires it."""
    if frame.empty:
        return html.P("No silences.", className="text-muted")

    def expire(row: pd.Series) -> Component | str:
        if not row["active"]:
            return "expired"
        return dbc.Button("expire", id=expire_button_id(int(row["id"])), size="sm", color="secondary")

    return frame_table(frame.assign(action=""), cell={"action": expire}, table_id=SILENCES)


def content() -> html.Div:
    view = reads.alerts_view(context.store())
    return html.Div(
        [
            html.H5("Open"),
            alerts_table(data.alerts_frame(view.open), OPEN),
            html.H5("Resolved", className="mt-3"),
            alerts_table(data.alerts_frame(view.resolved), RESOLVED),
            html.H5("Silences", className="mt-3"),
            silences_table(data.silences_frame(view.silences, utcnow())),
            html.H5("Rules", className="mt-3"),
            frame_table(data.rules_frame(view.rules), table_id=RULES),
        ]
    )


def silence_form() -> dbc.Card:
    rules = [r.name for r in reads.alerts_view(context.store()).rules]
    return dbc.Card(
        dbc.CardBody(
            [
                html.H5("Silence", className="card-title"),
                dbc.Row(
                    [
                        dbc.Col(dcc.Dropdown(id=SILENCE_RULE, options=rules, placeholder="any rule"), md=3),
                        dbc.Col(dbc.Input(id=SILENCE_RUN, placeholder="any run (run id)"), md=3),
                        dbc.Col(
                            dcc.Dropdown(
                                id=SILENCE_DURATION,
                                options=list(DURATIONS),
                                value="1 hour",
                                clearable=False,
                            ),
                            md=2,
                        ),
                        dbc.Col(dbc.Input(id=SILENCE_COMMENT, placeholder="comment"), md=2),
                        dbc.Col(dbc.Button("silence", id=SILENCE_CREATE, color="primary"), md=2),
                    ],
                    className="g-2",
                ),
                html.Div(id=SILENCE_MESSAGE, className="small mt-2"),
            ]
        ),
        className="mb-3",
    )


def layout(**_: object) -> html.Div:
    return html.Div(
        [
            html.H3("Alerts"),
            silence_form(),
            html.Div(content(), id=CONTENT),
            dcc.Interval(id=INTERVAL, interval=context.live_interval_ms() * 2),
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


def redraws_content(app: dash.Dash, *dependencies: Input | State) -> Callable[[Callable[..., Any]], Any]:
    """A callback that draws the alerts, silences and rules again."""
    return app.callback(
        Output(CONTENT, "children", allow_duplicate=True), *dependencies, prevent_initial_call=True
    )


def register(app: dash.Dash) -> None:
    dash.register_page(
        __name__, path=urls.ALERTS, name="Alerts", title="isoaudit: alerts", layout=layout, order=4
    )
    app.callback(
        Output(SILENCE_MESSAGE, "children"),
        Output(CONTENT, "children"),
        Input(SILENCE_CREATE, "n_clicks"),
        State(SILENCE_RULE, "value"),
        State(SILENCE_RUN, "value"),
        State(SILENCE_DURATION, "value"),
        State(SILENCE_COMMENT, "value"),
        prevent_initial_call=True,
    )(create)
    redraws_content(app, Input(expire_button_id(ALL), "n_clicks"), State(expire_button_id(ALL), "id"))(expire)
    redraws_content(app, Input(INTERVAL, "n_intervals"))(refresh)
