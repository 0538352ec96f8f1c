"""The ranks section: what each rank of each side sent (a table of counters, and samples per step
of the latest steps), so a rank that stopped sending shows as its line dropping to zero."""

from __future__ import annotations

from typing import Any

import dash
import plotly.graph_objects as go
from dash import Output, html
from dash.development.base_component import Component
from isoaudit.audit.db import Store, reads
from isoaudit.dashboard import context, data, figures
from isoaudit.dashboard.components import data_table, graph
from isoaudit.dashboard.pages.run import ids
from isoaudit.dashboard.pages.run.state import LiveState
from isoaudit.dashboard.pages.run.triggers import on_tick

#: The per-rank figure covers this many of the run's latest steps (its query groups their samples).
RANK_WINDOW = 200

#: A rank that stopped sending: its row in red.
STOPPED_RANK = {
    "if": {"filter_query": '{status} = "stopped"'},
    "backgroundColor": "#f8d7da",
    "color": "#842029",
}


def rank_view(store: Store, run_id: str) -> tuple[list[dict[str, Any]], go.Figure]:
    """The per-rank table rows and the samples-per-step figure of the latest :data:`RANK_WINDOW` steps."""
    activity = reads.rank_activity(store, run_id)
    last = max((a.last_step for a in activity), default=0)
    series = reads.rank_series(store, run_id, from_step=max(0, last - RANK_WINDOW + 1))
    return data.rank_rows(activity), figures.rank_figure(data.rank_frame(series))


def section(store: Store, run_id: str) -> list[Component]:
    rows, figure = rank_view(store, run_id)
    table = data_table(
        ids.RANKS,
        [{"name": name.replace("_", " "), "id": name} for name in data.RANK_COLUMNS],
        rows,
        page_size=16,
        sortable=True,
        scrolls=True,
        row_styles=[STOPPED_RANK],
    )
    return [html.H5("Ranks: what each rank sent", className="mt-3"), table, graph(ids.RANK_FIGURE, figure)]


def tick_ranks(_n: int | None, state_json: dict[str, Any]) -> tuple[list[dict[str, Any]], go.Figure]:
    """Re-read the per-rank counters (one grouped query each for the table and the figure)."""
    return rank_view(context.store(), LiveState.from_json(state_json).run_id)


def register(app: dash.Dash) -> None:
    on_tick(app, Output(ids.RANKS, "data"), Output(ids.RANK_FIGURE, "figure"))(tick_ranks)
