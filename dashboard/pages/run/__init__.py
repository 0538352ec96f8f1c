"""``/runs/<run_id>?step=N``: one run's timelines, heatmaps, diagnoses, MoE routing, loop figures,
ranks, a step's samples and the remediation toggle. Live while the run is being written.

One module per section (its layout, its figures' live updates and its callbacks); :mod:`.ids` names
every component, :mod:`.page` lays the sections out and :func:`register` wires them into an app."""

from __future__ import annotations

import dash
from isoaudit.dashboard.pages import urls
from isoaudit.dashboard.pages.run import header, heatmaps, live, loop, ranks, remediation, routing, samples
from isoaudit.dashboard.pages.run.page import layout

#: The sections with callbacks, each registering its own on the app.
SECTIONS = (live, header, remediation, heatmaps, routing, loop, ranks, samples)


def register(app: dash.Dash) -> None:
    dash.register_page(
        __name__, path_template=urls.RUN, name="Run", title="isoaudit: run", layout=layout, order=3
    )
    for section in SECTIONS:
        section.register(app)
