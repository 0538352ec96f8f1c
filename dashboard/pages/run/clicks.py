"""Clicks on the run page's figures: the point a click names, and heatmaps whose cells open the
sample they name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dash import no_update
from isoaudit.dashboard.pages import urls
from isoaudit.dashboard.pages.run.state import LiveState

#: The sample a clicked cell names: (step, sample_key), the key ``None`` where the cell names none.
SampleAt = tuple[int, str | None]

#: Finds the sample a clicked heatmap cell names (None where the cell names no step).
SampleFinder = Callable[[dict[str, Any], LiveState], SampleAt | None]


def clicked(click: dict[str, Any] | None) -> dict[str, Any] | None:
    """The first point of plotly's ``clickData``, None without one."""
    points = (click or {}).get("points") or []
    return points[0] if points else None


def row_of(point: dict[str, Any], labels: list[str]) -> int | None:
    """The heatmap row a click fell in: plotly gives [row, column] as ``pointNumber``."""
    number = point.get("pointNumber")
    if isinstance(number, list) and number:
        return int(number[0])
    return labels.index(point["y"]) if point.get("y") in labels else None


def opens_clicked_sample(sample_at: SampleFinder) -> Callable[[dict[str, Any] | None, dict[str, Any]], Any]:
    """The callback of a heatmap whose cells name samples: a click opens the sample ``sample_at``
    names for the clicked cell, and does nothing where it names none."""

    def open_sample(click: dict[str, Any] | None, state_json: dict[str, Any]) -> Any:
        point = clicked(click)
        if point is None:
            return no_update
        state = LiveState.from_json(state_json)
        found = sample_at(point, state)
        if found is None or not found[1]:
            return no_update
        return urls.sample_path(state.run_id, found[0], found[1])

    open_sample.__doc__ = sample_at.__doc__
    return open_sample
