"""The run page's header: the run's name (as text), its status (live or idle) and links to its
contract and the alerts. The status is polled while the run is live; polling stops once it is idle."""

from __future__ import annotations

from typing import Any

import dash
from dash import Output, dcc, html, no_update
from dash.development.base_component import Component
from isoaudit.audit.db import reads
from isoaudit.dashboard import context
from isoaudit.dashboard.components import STATUS_COLOURS, backlog_banner, badge
from isoaudit.dashboard.pages import urls
from isoaudit.dashboard.pages.run import ids
from isoaudit.dashboard.pages.run.remediation import applied_view
from isoaudit.dashboard.pages.run.triggers import on_tick


def banner(run_id: str) -> Component:
    """The banner over the run's steps that wait for comparison with no worker comparing them."""
    store = context.store()
    return backlog_banner(
        store.stalled_backlog(context.stalled_after_s(), run_id=run_id), store.printable_url, ids.BACKLOG
    )


def section(overview: reads.RunOverview) -> html.Div:
    return html.Div(
        [
            html.Div(banner(overview.run_id), id=ids.BACKLOG_SLOT),
            html.H3(overview.name or overview.run_id, id=ids.TITLE, className="d-inline me-2"),
            badge(overview.status, STATUS_COLOURS, ids.STATUS),
            html.Div(
                [
                    html.Span(f"run {overview.run_id} · project {overview.project} · "),
                    dcc.Link("contract", href=urls.contract_path(overview.run_id)),
                    " · ",
                    dcc.Link("alerts", href=urls.ALERTS),
                ],
                className="text-muted small",
            ),
        ],
        className="mb-3",
    )


def tick_status(_n: int | None, state_json: dict[str, Any]) -> tuple[Any, Any, Any, Any]:
    """The run's status, each side's applied mode and the comparison banner; polling stops once the
    run is idle."""
    overview = reads.run_overview(context.store(), state_json["run_id"])
    if overview is None:
        return True, no_update, no_update, no_update
    return overview.status != "live", overview.status, applied_view(overview), banner(overview.run_id)


def register(app: dash.Dash) -> None:
    on_tick(
        app,
        Output(ids.INTERVAL, "disabled"),
        Output(ids.STATUS, "children"),
        Output(ids.APPLIED, "children"),
        Output(ids.BACKLOG_SLOT, "children"),
    )(tick_status)
