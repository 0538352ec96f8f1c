"""``/``: every run with its status, latest mismatch, open alerts and remediation modes."""

from __future__ import annotations

import dash
import pandas as pd
from dash import Input, Output, dcc, html
from dash.development.base_component import Component
from isoaudit.audit.db import reads
from isoaudit.audit.records import utcnow
from isoaudit.dashboard import context, data, figures
from isoaudit.dashboard.components import STATUS_COLOURS, ago, backlog_banner, badge, frame_table, text
from isoaudit.dashboard.pages import urls

# Component ids.
TABLE = "runs-table"  # what the interval redraws
TABLE_BODY = "runs-table-body"
BACKLOG = "runs-backlog"  # the banner over steps no worker compares
INTERVAL = "runs-interval"


def runs_table(frame: pd.DataFrame) -> Component:
    """The runs table (name and id as text, links to each run)."""
    if frame.empty:
        return html.P("No runs recorded yet.", className="text-muted")
    now = utcnow()
    shown = pd.DataFrame(
        {
            "run": frame["name"],
            "run_id": frame["run_id"],
            "status": frame["status"],
            "last step": frame["last_step"],
            "last record": frame["last_ingest_at"],
            "kl_k3": frame["kl_k3"],
            "kl_k3 trend": frame["run_id"],
            "exact match": frame["exact_match_fraction"],
            "open alerts": frame["open_alerts"],
            "desired mode": frame["desired_mode"],
            "trainer applied": frame["applied_trainer"],
            "rollout applied": frame["applied_rollout"],
        }
    )
    by_id = frame.set_index("run_id")

    def spark(row: pd.Series) -> dcc.Graph:
        source = by_id.loc[row["run_id"]]
        return dcc.Graph(
            figure=figures.sparkline(source["spark_steps"], source["spark_kl_k3"]),
            config={"staticPlot": True},
            style={"height": "40px", "width": "160px"},
        )

    return frame_table(
        shown,
        links={"run": lambda r: urls.run_path(r["run_id"])},
        cell={
            "status": lambda r: badge(r["status"], STATUS_COLOURS),
            "last record": lambda r: ago(r["last record"], now),
            "kl_k3 trend": spark,
            "open alerts": lambda r: (
                dcc.Link(text(r["open alerts"]), href=urls.ALERTS) if r["open alerts"] else "0"
            ),
            "desired mode": lambda r: f"{r['desired mode']} (v{by_id.loc[r['run_id'], 'control_version']})",
        },
        table_id=TABLE_BODY,
    )


def render() -> Component:
    """The banner over steps that no worker compares (when some wait), then the runs table."""
    store = context.store()
    banner = backlog_banner(store.stalled_backlog(context.stalled_after_s()), store.printable_url, BACKLOG)
    return html.Div([banner, runs_table(data.runs_frame(reads.runs_overview(store)))])


def layout(**_: object) -> html.Div:
    return html.Div(
        [
            html.H3("Runs"),
            html.Div(render(), id=TABLE),
            dcc.Interval(id=INTERVAL, interval=context.live_interval_ms() * 2),
        ]
    )


def refresh(_n: int | None) -> Component:
    return render()


def register(app: dash.Dash) -> None:
    dash.register_page(__name__, path=urls.RUNS, name="Runs", title="isoaudit: runs", layout=layout, order=0)
    app.callback(Output(TABLE, "children"), Input(INTERVAL, "n_intervals"), prevent_initial_call=True)(
        refresh
    )
