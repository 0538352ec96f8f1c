"""Live updates of the run page: append only the steps compared since the last tick, as
``dash.Patch`` operations on the figures already in the browser, or say that a figure must be
redrawn (a wider position range, a new region or diagnosis kind, an alert that changed state).

The page keeps a small :class:`LiveState` (in a ``dcc.Store``) describing what its figures hold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dash import Patch
from isoaudit.audit.db import reads as queries
from isoaudit.dashboard import data, figures


@dataclass
class LiveState:
    """What the run page's figures were drawn with."""

    run_id: str
    last_step: int | None = None
    stat: str = "mean"
    n_bins: int = 0
    regions: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    log_rows: list[int] = field(default_factory=list)  # timeline panels drawn on a log axis

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> LiveState:
        return cls(**body)


def _json(values: Sequence[float]) -> list[float | None]:
    """NaN as null (JSON has no NaN)."""
    return [None if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in values]


def timelines_patch(
    points: Sequence[queries.StepPoint],
    decorations: tuple[list[dict], list[dict]] | None = None,
    log_rows: Sequence[int] = (),
) -> Patch | None:
    """Append ``points`` to every timeline trace (traces are in ``data.TIMELINE_METRICS`` order);
    with ``decorations`` (``figures.timeline_decorations``), replace the thresholds, firing intervals
    and mode switches (a firing interval grows with every step). None when a value of a panel
    drawn on a log axis is 0 or less (remediation reaches exact zeros): redraw it on a linear one."""
    frame = data.timeline_frame(points)
    log_metrics = [m for row in log_rows for m in data.TIMELINE_PANELS[row - 1][1]]
    if any((frame[m] <= 0).any() for m in log_metrics):
        return None
    patch = Patch()
    if decorations is not None:
        shapes, notes = decorations
        patch["layout"]["shapes"] = shapes
        patch["layout"]["annotations"] = figures.timeline_titles() + notes
    steps = frame.index.to_list()
    for i, metric in enumerate(data.TIMELINE_METRICS):
        patch["data"][i]["x"].extend(steps)
        patch["data"][i]["y"].extend(_json(frame[metric].to_list()))
    return patch


def position_patch(points: Sequence[queries.StepPoint], state: LiveState) -> Patch | None:
    """Append one column per new step, or None when a step reaches past the drawn bins."""
    frame = data.position_frame(points, state.stat)
    if state.n_bins == 0 or frame.shape[1] > state.n_bins:
        return None
    frame = data.position_frame(points, state.stat, n_bins=state.n_bins)
    patch = Patch()
    patch["data"][0]["x"].extend(frame.index.to_list())
    columns = [figures.heatmap_column(list(frame.iloc[i].to_numpy(float))) for i in range(len(frame))]
    for b in range(state.n_bins):
        patch["data"][0]["z"][b].extend(_json([c[0][b] for c in columns]))
        patch["data"][0]["text"][b].extend([c[1][b] for c in columns])
    return patch


def divergence_patch(points: Sequence[queries.StepPoint], state: LiveState) -> Patch | None:
    """Append one column per new step, or None when a new region appears."""
    seen = {r for p in points for r in p.first_divergence}
    if not state.regions or not seen <= set(state.regions):
        return None if seen else Patch()
    frame = data.divergence_frame(points, state.regions)
    patch = Patch()
    patch["data"][0]["x"].extend(frame.index.to_list())
    for r, region in enumerate(state.regions):
        patch["data"][0]["z"][r].extend([None if v == 0 else int(v) for v in frame[region]])
    return patch


def diagnosis_patch(points: Sequence[queries.StepPoint], state: LiveState) -> Patch | None:
    """Append to each kind's bars, or None when a new kind appears."""
    seen = {k for p in points for k in p.diagnoses}
    if not state.kinds or not seen <= set(state.kinds):
        return None
    frame = data.diagnosis_frame(points, state.kinds)
    patch = Patch()
    for j, kind in enumerate(state.kinds):
        patch["data"][j]["x"].extend(frame.index.to_list())
        patch["data"][j]["y"].extend([int(v) for v in frame[kind]])
    return patch
