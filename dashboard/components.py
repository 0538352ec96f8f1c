"""Small layout pieces shared by the pages. Every value is placed as a text child, never as markup."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any, cast

import dash_bootstrap_components as dbc
import pandas as pd
import plotly.graph_objects as go
from dash import dcc, html
from dash.dash_table.DataTable import DataTable
from dash.development.base_component import Component
from isoaudit.audit.db import Backlog
from isoaudit.audit.records import utcnow

STATUS_COLOURS = {"live": "success", "idle": "secondary"}
STATE_COLOURS = {"firing": "danger", "pending": "warning", "resolved": "success", "inactive": "secondary"}


def text(value: Any) -> str:
    """A cell's text: numbers to 4 significant digits, times in UTC, None as a dash."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, datetime | pd.Timestamp):
        return value.strftime("%Y-%m-%d %H:%M:%S")
    return str(value)


def ago(value: datetime | None, now: datetime | None = None) -> str:
    """``12 s ago``, ``3 min ago``..."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "never"
    seconds = max(0.0, ((now or utcnow()) - value).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def badge(label: str, colours: Mapping[str, str], component_id: str | None = None) -> dbc.Badge:
    """``label`` in the colour ``colours`` gives it (grey for a label it does not know)."""
    named = {"id": component_id} if component_id is not None else {}
    return dbc.Badge(label, color=colours.get(label, "secondary"), className="me-1", **named)


def inline_choice(
    component_id: str, options: Mapping[str, str], value: str, class_name: str | None = None
) -> dbc.RadioItems:
    """Radio buttons in a line: ``options`` maps each value to its label."""
    styled = {"className": class_name} if class_name is not None else {}
    return dbc.RadioItems(
        id=component_id,
        options=[{"label": label, "value": key} for key, label in options.items()],
        value=value,
        inline=True,
        **styled,
    )


def frame_table(
    frame: pd.DataFrame,
    *,
    links: Mapping[str, Callable[[pd.Series], str | None]] | None = None,
    row_class: Callable[[pd.Series], str | None] | None = None,
    cell: Mapping[str, Callable[[pd.Series], Any]] | None = None,
    headers: Mapping[str, str] | None = None,
    table_id: str | None = None,
) -> dbc.Table:
    """A frame as a bootstrap table: ``links`` make a column's text a link (href from the row),
    ``cell`` replaces a column's content by a component, ``row_class`` styles rows."""
    links, cell, headers = links or {}, cell or {}, headers or {}
    head = html.Thead(html.Tr([html.Th(headers.get(c, c)) for c in frame.columns]))
    body = []
    for _, row in frame.iterrows():
        tds = []
        for column in frame.columns:
            if column in cell:
                content: Any = cell[column](row)
            else:
                content = text(row[column])
                href = links[column](row) if column in links else None
                if href:
                    content = dcc.Link(content, href=href)
            tds.append(html.Td(content))
        body.append(html.Tr(tds, className=row_class(row) if row_class else None))
    kwargs = {"id": table_id} if table_id else {}
    return dbc.Table(
        [head, html.Tbody(body)], bordered=False, hover=True, size="sm", responsive=True, **kwargs
    )


def data_table(
    table_id: str,
    columns: Sequence[Mapping[str, Any]],
    rows: Sequence[Mapping[str, Any]],
    *,
    page_size: int,
    sortable: bool = False,
    scrolls: bool = False,
    row_styles: Sequence[Mapping[str, Any]] = (),
) -> DataTable:
    """A paged table in monospace: ``sortable`` by any column in the browser, scrolling sideways
    when wider than the page (``scrolls``), ``row_styles`` as Dash's conditional styles. Markdown
    columns render their cells as text, never as HTML."""
    options: dict[str, Any] = {}
    if any(column.get("presentation") == "markdown" for column in columns):
        options["markdown_options"] = {"html": False}
    if sortable:
        options["sort_action"] = "native"
    if scrolls:
        options["style_table"] = {"overflowX": "auto"}
    if row_styles:
        options["style_data_conditional"] = list(row_styles)
    return DataTable(
        id=table_id,
        # Dash types columns as TypedDicts and rows as dicts of narrow cells; ours are plain dicts.
        columns=cast(Any, list(columns)),
        data=cast(Any, list(rows)),
        page_size=page_size,
        style_cell={"fontFamily": "monospace", "fontSize": 12},
        **options,
    )


def graph(graph_id: str, figure: go.Figure) -> dcc.Graph:
    """A figure without plotly's logo in its mode bar."""
    return dcc.Graph(id=graph_id, figure=figure, config={"displaylogo": False})


def not_found(message: str) -> dbc.Alert:
    return dbc.Alert(message, color="warning")


def no_run(run_id: str | None) -> dbc.Alert:
    """What a run's page shows for a run id the store does not hold."""
    return not_found(f"No run {run_id!r} in this store.")


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def backlog_banner(backlog: Backlog, database_url: str, component_id: str) -> Component:
    """What a page says of steps that wait for comparison with no worker comparing them: how many,
    since when, and the command that compares them (an empty placeholder when none wait)."""
    if not backlog:
        return html.Div(id=component_id)
    runs = f" of {plural(backlog.runs, 'run')}" if backlog.runs > 1 else ""
    return dbc.Alert(
        [
            html.Strong("Steps wait for comparison. "),
            f"{plural(backlog.steps, 'step')}{runs} ({plural(backlog.samples, 'sample')}) have both sides "
            f"stored, the oldest queued {ago(backlog.oldest)}, and no comparison worker is comparing them "
            '(the job ran with compare="none", or ended before its comparer caught up). Compare them, '
            "and later ones, with ",
            html.Code(f"isoaudit worker --database-url '{database_url}'"),
            " (add --once to compare what is there and exit).",
        ],
        color="info",
        id=component_id,
    )
