"""The run page's layout: the header, then each section in page order."""

from __future__ import annotations

from dash import dcc, html
from dash.development.base_component import Component
from isoaudit.audit.db import reads
from isoaudit.dashboard import context
from isoaudit.dashboard.components import no_run
from isoaudit.dashboard.pages.run import (
    diagnoses,
    header,
    heatmaps,
    ids,
    live,
    loop,
    ranks,
    remediation,
    routing,
    samples,
    timelines,
)


def chosen_step(step: str | None, last: int | None) -> int | None:
    """The step whose samples the page opens at: ``?step=N``, else (or when N is no number) the last."""
    try:
        return int(step) if step is not None else last
    except ValueError:
        return last


def layout(run_id: str | None = None, step: str | None = None, **_: object) -> Component:
    """``/runs/<run_id>?step=N``: ``run_id`` from the path, ``step`` from the query string (Dash
    passes any other query parameter too; the page reads none)."""
    store = context.store()
    overview = reads.run_overview(store, run_id) if run_id else None
    if overview is None:
        return no_run(run_id)
    drawn = live.draw(store, overview.run_id)
    return html.Div(
        [
            dcc.Store(id=ids.STATE, data=drawn.state.to_json()),
            # Opening a sample loads its page afresh: with client-side navigation a live tick still
            # in flight would land its Patch on figures that are gone (a console TypeError).
            dcc.Location(id=ids.NAV, refresh=True),
            dcc.Interval(
                id=ids.INTERVAL, interval=context.live_interval_ms(), disabled=overview.status != "live"
            ),
            header.section(overview),
            *remediation.section(overview),
            *timelines.section(drawn.timelines),
            heatmaps.section(drawn.position, drawn.divergence),
            *diagnoses.section(drawn.diagnoses),
            routing.section(store, overview.run_id),
            *loop.section(store, overview.run_id),
            *ranks.section(store, overview.run_id),
            *samples.section(overview.run_id, chosen_step(step, drawn.state.last_step)),
        ]
    )
