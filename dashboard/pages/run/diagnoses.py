"""The diagnoses section: how many of each step's samples got each diagnosis, stacked per step."""

from __future__ import annotations

from collections.abc import Sequence

import plotly.graph_objects as go
from dash import Patch, html
from dash.development.base_component import Component
from isoaudit.audit.db import reads
from isoaudit.dashboard import data, figures
from isoaudit.dashboard.components import graph
from isoaudit.dashboard.pages.run import ids
from isoaudit.dashboard.pages.run.state import LiveState


def draw(points: Sequence[reads.StepPoint]) -> tuple[go.Figure, list[str]]:
    """The bars of ``points`` in full, and the diagnosis kinds they draw (one trace each)."""
    frame = data.diagnosis_frame(points)
    return figures.diagnosis_bars(frame), list(frame.columns)


def patch(points: Sequence[reads.StepPoint], state: LiveState) -> Patch | None:
    """Append to each kind's bars, or None when a new kind appears."""
    seen = {k for p in points for k in p.diagnoses}
    if not state.kinds or not seen <= set(state.kinds):
        return None
    frame = data.diagnosis_frame(points, state.kinds)
    update = Patch()
    for j, kind in enumerate(state.kinds):
        update["data"][j]["x"].extend(frame.index.to_list())
        update["data"][j]["y"].extend([int(v) for v in frame[kind]])
    return update


def section(figure: go.Figure) -> list[Component]:
    return [html.H5("Diagnoses per step"), graph(ids.DIAGNOSES, figure)]
