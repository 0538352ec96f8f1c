"""``/runs/<run_id>?step=N``: one run's timelines, heatmaps, diagnoses, a step's samples, and the
remediation toggle. Live while the run is being written: each tick appends the new steps only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import dash
import dash_bootstrap_components as dbc
import pandas as pd
import plotly.graph_objects as go
from dash import Input, Output, State, dash_table, dcc, html, no_update
from isoaudit.audit.control import REMEDIATION_MODES, StaleControlVersion
from isoaudit.audit.db import Store
from isoaudit.audit.db import reads as queries
from isoaudit.audit.records import StepStats
from isoaudit.audit.summaries import bin_label
from isoaudit.dashboard import context, data, figures
from isoaudit.dashboard.components import STATUS_COLOURS, ago, badge, graph, not_found, text
from isoaudit.dashboard.live import (
    LiveState,
    diagnosis_patch,
    divergence_patch,
    position_patch,
    timelines_patch,
)

PATH = "/runs/<run_id>"


def sample_href(run_id: str, step: int, sample_key: str) -> str:
    return f"/runs/{quote(run_id, safe='')}/steps/{int(step)}/samples/{sample_key}"


#: The sample a clicked cell names: (step, sample_key), the key ``None`` where the cell names none.
SampleAt = tuple[int, str | None]


@dataclass
class RunFigures:
    timelines: go.Figure
    position: go.Figure
    divergence: go.Figure
    diagnoses: go.Figure
    state: LiveState


def annotations(
    store: Store, run_id: str, last_step: int | None
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """The timelines' thresholds (rules), firing intervals (alerts, open ones up to ``last_step``)
    and remediation switches (manifests) as frames."""
    rules = queries.run_rules(store, run_id)
    alerts = queries.alerts_view(store, run_id=run_id)
    intervals = data.alert_intervals_frame(alerts.open + alerts.resolved, rules, last_step)
    changes = data.mode_changes_frame(queries.mode_changes(store, run_id))
    return data.thresholds_frame(rules), intervals, changes


def draw(store: Store, run_id: str, stat: str = "mean") -> RunFigures:
    """Every figure of the run page, drawn in full."""
    points = queries.step_series(store, run_id)
    last = points[-1].step if points else None
    positions = data.position_frame(points, stat)
    divergence = data.divergence_frame(points)
    diagnoses = data.diagnosis_frame(points)
    timeline = data.timeline_frame(points)
    state = LiveState(
        run_id=run_id,
        last_step=last,
        log_rows=figures.log_panels(timeline),
        stat=stat,
        n_bins=positions.shape[1],
        regions=list(divergence.columns),
        kinds=list(diagnoses.columns),
    )
    return RunFigures(
        figures.timelines(timeline, *annotations(store, run_id, last)),
        figures.position_heatmap(positions, stat),
        figures.divergence_heatmap(divergence),
        figures.diagnosis_bars(diagnoses),
        state,
    )


# ---------------------------------------------------------------------- pieces


def applied_view(overview: queries.RunOverview) -> html.Div:
    """Desired mode (version, who, when) and what each side last reported applying."""
    control = overview.control
    by = f" by {control.updated_by}" if control.updated_by else ""
    when = f", {ago(queries.aware(control.updated_at))}" if control.updated_at else ""
    rows = [
        html.Div(
            [
                html.Strong("desired: "),
                html.Span(control.mode, id="run-desired-mode"),
                f" (version {control.version}{by}{when})",
            ]
        )
    ]
    for side in queries.SIDES:
        applied = overview.applied[side]
        matches = applied.mode == control.mode
        rows.append(
            html.Div(
                [
                    html.Strong(f"{side}: "),
                    html.Span(text(applied.mode), id=f"run-applied-{side}"),
                    f" (reported {ago(applied.at)})" if applied.at else " (no manifest yet)",
                    " ✓" if matches else " … waiting for its next step" if applied.at else "",
                ]
            )
        )
    return html.Div(rows)


def sample_table(run_id: str, step: int | None) -> list[dict[str, Any]]:
    if step is None:
        return []
    frame = data.samples_frame(queries.step_samples(context.store(), run_id, step))
    records = frame.to_dict("records")
    for record in records:
        record["open"] = f"[open]({sample_href(run_id, step, record['sample_key'])})"
    return records


SAMPLE_COLUMNS = [
    {"id": "open", "name": "", "presentation": "markdown"},
    {"id": "sample_key", "name": "sample"},
    {"id": "n_tokens", "name": "tokens", "type": "numeric"},
    {"id": "abs_diff_mean", "name": "mean |Δ|", "type": "numeric", "format": {"specifier": ".3g"}},
    {"id": "abs_diff_max", "name": "max |Δ|", "type": "numeric", "format": {"specifier": ".3g"}},
    {"id": "kl_k3", "name": "kl_k3", "type": "numeric", "format": {"specifier": ".3g"}},
    {"id": "exact_match_fraction", "name": "exact", "type": "numeric", "format": {"specifier": ".1%"}},
    {"id": "first_divergence", "name": "first divergence"},
    {"id": "diagnosis", "name": "diagnosis"},
]


def layout(run_id: str | None = None, step: str | None = None, **_: Any) -> html.Div:
    store = context.store()
    overview = queries.run_overview(store, run_id) if run_id else None
    if overview is None:
        return not_found(f"No run {run_id!r} in this store.")
    drawn = draw(store, overview.run_id)
    loop_stats = store.step_stats(overview.run_id)
    try:
        selected = int(step) if step is not None else drawn.state.last_step
    except ValueError:
        selected = drawn.state.last_step
    run_path = f"/runs/{quote(overview.run_id, safe='')}"
    return html.Div(
        [
            dcc.Store(id="run-state", data=drawn.state.to_json()),
            dcc.Store(
                id="run-control", data={"mode": overview.control.mode, "version": overview.control.version}
            ),
            # Opening a sample loads its page afresh: with client-side navigation a live tick still
            # in flight would land its Patch on figures that are gone (a console TypeError).
            dcc.Location(id="run-nav", refresh=True),
            dcc.Interval(
                id="run-interval", interval=context.live_interval_ms(), disabled=overview.status != "live"
            ),
            html.Div(
                [
                    html.H3(overview.name or overview.run_id, id="run-title", className="d-inline me-2"),
                    badge(overview.status, STATUS_COLOURS, id="run-status"),
                    html.Div(
                        [
                            html.Span(f"run {overview.run_id} · project {overview.project} · "),
                            dcc.Link("contract", href=f"{run_path}/contract"),
                            " · ",
                            dcc.Link("alerts", href="/alerts"),
                        ],
                        className="text-muted small",
                    ),
                ],
                className="mb-3",
            ),
            dbc.Card(
                dbc.CardBody(
                    [
                        html.H5("Remediation", className="card-title"),
                        dbc.RadioItems(
                            id="run-mode",
                            options=[{"label": m, "value": m} for m in REMEDIATION_MODES],
                            value=overview.control.mode,
                            inline=True,
                        ),
                        html.Div(id="run-control-message", className="small mt-1"),
                        html.Div(applied_view(overview), id="run-applied", className="small mt-2"),
                    ]
                ),
                className="mb-3",
            ),
            html.H5("Step metrics"),
            graph("run-timelines", drawn.timelines),
            dbc.Row(
                [
                    dbc.Col(
                        [
                            html.H5("|Δ logprob| by response position", className="d-inline me-3"),
                            dbc.RadioItems(
                                id="run-position-stat",
                                options=[
                                    {"label": "mean", "value": "mean"},
                                    {"label": "max", "value": "max"},
                                ],
                                value="mean",
                                inline=True,
                                className="d-inline",
                            ),
                            graph("run-position", drawn.position),
                        ],
                        lg=6,
                    ),
                    dbc.Col(
                        [html.H5("First divergence by region"), graph("run-divergence", drawn.divergence)],
                        lg=6,
                    ),
                ]
            ),
            html.H5("Diagnoses per step"),
            graph("run-diagnoses", drawn.diagnoses),
            routing_section(store, overview.run_id),
            html.H5("The loop's own figures: reward against the mismatch", className="mt-3"),
            dcc.Store(id="run-loop-steps", data=loop_stats[-1].step if loop_stats else None),
            graph("run-loop", loop_figure(store, overview.run_id, loop_stats)),
            html.H5("Ranks: what each rank sent", className="mt-3"),
            *rank_panel(store, overview.run_id),
            html.Div(
                [
                    html.H5("Samples of step ", className="d-inline"),
                    dcc.Input(
                        id="run-step",
                        type="number",
                        value=selected,
                        min=0,
                        debounce=True,
                        style={"width": "8em"},
                    ),
                ],
                className="mt-3 mb-2",
            ),
            dash_table.DataTable(
                id="run-samples",
                columns=SAMPLE_COLUMNS,
                data=sample_table(overview.run_id, selected),
                sort_action="native",
                page_size=25,
                markdown_options={"html": False},
                style_table={"overflowX": "auto"},
                style_cell={"fontFamily": "monospace", "fontSize": 12},
            ),
        ]
    )


def routing_figure(store: Store, run_id: str, value: str = "flipped_tokens") -> tuple[go.Figure, int | None]:
    """The layer x step heatmap of routing flips, and the last step it draws."""
    points = queries.routing_series(store, run_id)
    frame = data.routing_frame(points, value)
    return figures.routing_heatmap(frame, data.ROUTING_VALUES[value]), points[-1].step if points else None


def routing_line(point: queries.RoutingStep | None) -> str:
    """The latest routed step's figures in words, replay (R3) included."""
    if point is None:
        return ""
    m = point.metrics
    words = (
        f"step {point.step}: expert sets agree on {text(m.get('routing_set_agreement'))} of (token, layer) "
        f"cells, flip rate {text(m.get('routing_flip_rate'))}, {text(m.get('routing_flipped_tokens'))} of "
        f"{text(m.get('routing_tokens'))} tokens flip in some layer"
    )
    if point.replayed is not None:
        words += (
            f"; routing replay: {text(m.get('routing_replayed_fraction'))} of the trainer's tokens replayed"
        )
        words += f", {point.missing} with missing routes"
        if point.missing_examples:
            first = point.missing_examples[0]
            words += f" (e.g. sample {first['sample_key']} at positions {first['positions'][:8]})"
    return words + "."


def routing_section(store: Store, run_id: str) -> html.Div:
    """MoE runs: where routing flips, layer by step (hidden for a dense model until routes arrive)."""
    drawn, last = routing_figure(store, run_id)
    latest = queries.routing_series(store, run_id, after_step=last - 1) if last is not None else []
    return html.Div(
        [
            html.H5("MoE routing flips by layer", className="d-inline me-3 mt-3"),
            dbc.RadioItems(
                id="run-routing-value",
                options=[{"label": label, "value": key} for key, label in data.ROUTING_VALUES.items()],
                value="flipped_tokens",
                inline=True,
                className="d-inline small",
            ),
            dcc.Store(id="run-routing-steps", data=last),
            html.Div(routing_line(latest[-1] if latest else None), id="run-routing-line", className="small"),
            graph("run-routing", drawn),
        ],
        id="run-routing-section",
        style={} if last is not None else {"display": "none"},
    )


def redraw_routing(
    value: str | None, state_json: dict[str, Any], drawn_last: int | None, *, changed: bool = False
) -> tuple[Any, Any, Any, Any]:
    """The routing heatmap again when steps after the last drawn one carry routes, or when the
    value shown ``changed`` (the check reads only the new steps' rows); the section shows once
    there are routes."""
    store = context.store()
    run_id = LiveState.from_json(state_json).run_id
    new = queries.routing_series(store, run_id, after_step=drawn_last)
    if not changed and not new:
        return no_update, no_update, no_update, no_update
    drawn, last = routing_figure(store, run_id, value or "flipped_tokens")
    line = routing_line(new[-1]) if new else no_update
    return drawn, last, {} if last is not None else {"display": "none"}, line


def tick_routing(
    _n: int | None, state_json: dict[str, Any], value: str | None, drawn_last: int | None
) -> tuple[Any, Any, Any, Any]:
    """Redraw the routing heatmap on a tick that brings routed steps, or when the value shown changes."""
    return redraw_routing(value, state_json, drawn_last, changed=dash.ctx.triggered_id == "run-routing-value")


def sample_at_routing_cell(point: dict[str, Any], state: LiveState) -> SampleAt | None:
    """A cell of the routing heatmap names the sample with the most flips in that layer and step."""
    if not str(point.get("y", "")).startswith("layer "):
        return None
    step = int(point["x"])
    found = queries.routing_series(context.store(), state.run_id, after_step=step - 1)
    if not found or found[0].step != step:
        return None
    return step, data.routing_example(found[0], int(str(point["y"]).split()[1]))


# ---------------------------------------------------------------------- callbacks


def tick(_n: int | None, state_json: dict[str, Any]) -> tuple[Any, ...]:
    """Append the steps compared since the last tick to the figures (a figure whose shape changed,
    such as a new region or a wider position range, is redrawn)."""
    store = context.store()
    state = LiveState.from_json(state_json)
    points = queries.step_series(store, state.run_id, after_step=state.last_step)
    if not points:
        return (no_update,) * 5
    if state.last_step is None:
        # The page was drawn before any step was compared: its figures are placeholders with no
        # traces, so there is nothing to extend (a Patch would fail in the browser). Draw them.
        full = draw(store, state.run_id, state.stat)
        return full.timelines, full.position, full.divergence, full.diagnoses, full.state.to_json()
    decorations = figures.timeline_decorations(
        *annotations(store, state.run_id, points[-1].step), state.log_rows
    )
    patches = [
        timelines_patch(points, decorations, state.log_rows),
        position_patch(points, state),
        divergence_patch(points, state),
        diagnosis_patch(points, state),
    ]
    if any(p is None for p in patches):
        full = draw(store, state.run_id, state.stat)
        drawn = [full.timelines, full.position, full.divergence, full.diagnoses]
        return (*[p if p is not None else drawn[i] for i, p in enumerate(patches)], full.state.to_json())
    state.last_step = points[-1].step
    return (*patches, state.to_json())


def loop_figure(store: Store, run_id: str, stats: list[StepStats]) -> go.Figure:
    """The loop's reward (``stats``) against the run's kl_k3 by step."""
    mismatch = data.timeline_frame(queries.step_series(store, run_id))["kl_k3"]
    return figures.loop_figures(data.loop_frame(stats), mismatch)


def tick_loop(_n: int | None, state_json: dict[str, Any], drawn_last: int | None) -> tuple[Any, Any]:
    """Redraw the loop figure only when steps after the last drawn one reported their figures (the
    check reads just those rows, so an idle tick costs one small query)."""
    store = context.store()
    run_id = LiveState.from_json(state_json).run_id
    if not store.step_stats(run_id, from_step=0 if drawn_last is None else drawn_last + 1):
        return no_update, no_update
    stats = store.step_stats(run_id)
    return loop_figure(store, run_id, stats), stats[-1].step


#: The per-rank figure covers this many of the run's latest steps (its query groups their samples).
RANK_WINDOW = 200


def rank_view(store: Store, run_id: str) -> tuple[list[dict[str, Any]], go.Figure]:
    """The per-rank table rows and the samples-per-step figure of the latest :data:`RANK_WINDOW` steps."""
    activity = queries.rank_activity(store, run_id)
    last = max((a.last_step for a in activity), default=0)
    series = queries.rank_series(store, run_id, from_step=max(0, last - RANK_WINDOW + 1))
    return data.rank_rows(activity), figures.rank_figure(data.rank_frame(series))


def rank_panel(store: Store, run_id: str) -> list[Any]:
    rows, figure = rank_view(store, run_id)
    table = dash_table.DataTable(
        id="run-ranks",
        columns=[{"name": name.replace("_", " "), "id": name} for name in data.RANK_COLUMNS],
        data=rows,
        sort_action="native",
        page_size=16,
        style_table={"overflowX": "auto"},
        style_cell={"fontFamily": "monospace", "fontSize": 12},
        style_data_conditional=[
            {"if": {"filter_query": '{status} = "stopped"'}, "backgroundColor": "#f8d7da", "color": "#842029"}
        ],
    )
    return [table, graph("run-rank-figure", figure)]


def tick_ranks(_n: int | None, state_json: dict[str, Any]) -> tuple[Any, Any]:
    """Re-read the per-rank counters (one grouped query each for the table and the figure)."""
    return rank_view(context.store(), LiveState.from_json(state_json).run_id)


def tick_status(_n: int | None, state_json: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The run's status and each side's applied mode; polling stops once the run is idle."""
    overview = queries.run_overview(context.store(), state_json["run_id"])
    if overview is None:
        return True, no_update, no_update
    return overview.status != "live", overview.status, applied_view(overview)


def set_mode(mode: str, control: dict[str, Any], state_json: dict[str, Any]) -> tuple[Any, ...]:
    """Write the desired mode with the version this page last saw; a change made meanwhile by
    someone else is shown, not overwritten."""
    if mode is None or mode == control.get("mode"):
        return no_update, no_update, no_update, no_update
    store = context.store()
    run_id = state_json["run_id"]
    try:
        updated = store.set_control(run_id, mode, int(control["version"]), updated_by=context.user())
    except StaleControlVersion as exc:
        current = exc.current
        message = dbc.Alert(
            f"Not changed: the mode was set to {current.mode} (version {current.version}) by "
            f"{current.updated_by or 'someone'} since this page read it. Choose again to override.",
            color="warning",
            className="py-1 mb-0",
            id="run-control-conflict",
        )
        return current.mode, {"mode": current.mode, "version": current.version}, message, False
    message = html.Span(
        f"Desired mode set to {updated.mode} (version {updated.version}); each side switches at its next step.",
        id="run-control-ok",
        className="text-success",
    )
    return updated.mode, {"mode": updated.mode, "version": updated.version}, message, False


def redraw_position(stat: str, state_json: dict[str, Any]) -> tuple[Any, Any]:
    state = LiveState.from_json(state_json)
    points = queries.step_series(context.store(), state.run_id)
    frame = data.position_frame(points, stat)
    state.stat, state.n_bins = stat, frame.shape[1]
    state.last_step = points[-1].step if points else None
    return figures.position_heatmap(frame, stat), state.to_json()


def _clicked(click: dict[str, Any] | None) -> dict[str, Any] | None:
    points = (click or {}).get("points") or []
    return points[0] if points else None


def _row_of(point: dict[str, Any], labels: list[str]) -> int | None:
    """The heatmap row a click fell in: plotly gives [row, column] as ``pointNumber``."""
    number = point.get("pointNumber")
    if isinstance(number, list) and number:
        return int(number[0])
    return labels.index(point["y"]) if point.get("y") in labels else None


def sample_at_position_cell(point: dict[str, Any], state: LiveState) -> SampleAt | None:
    """A cell of the position heatmap names the sample holding that bin's largest |Δ| at that step."""
    found = queries.step_point(context.store(), state.run_id, int(point["x"]))
    if found is None:
        return None
    labels = [bin_label(i) for i in range(len(found.position_bins.get("max_key", [])))]
    row = _row_of(point, labels)
    return found.step, data.bin_sample(found, row) if row is not None else None


def sample_at_divergence_cell(point: dict[str, Any], state: LiveState) -> SampleAt | None:
    """A cell of the region heatmap names a sample whose first divergence is there."""
    row = _row_of(point, [figures.safe(r) for r in state.regions])
    found = queries.step_point(context.store(), state.run_id, int(point["x"]))
    if row is None or found is None or not 0 <= row < len(state.regions):
        return None
    entry = found.first_divergence.get(state.regions[row])
    return found.step, entry["example"] if entry else None


def opens_clicked_sample(
    sample_at: Callable[[dict[str, Any], LiveState], SampleAt | None],
) -> Callable[[dict[str, Any] | None, dict[str, Any]], Any]:
    """The callback of a heatmap whose cells name samples: a click opens the sample ``sample_at``
    names for the clicked cell, and does nothing where it names none."""

    def open_sample(click: dict[str, Any] | None, state_json: dict[str, Any]) -> Any:
        point = _clicked(click)
        if point is None:
            return no_update
        state = LiveState.from_json(state_json)
        found = sample_at(point, state)
        if found is None or not found[1]:
            return no_update
        return sample_href(state.run_id, found[0], found[1])

    open_sample.__doc__ = sample_at.__doc__
    return open_sample


position_click = opens_clicked_sample(sample_at_position_cell)
divergence_click = opens_clicked_sample(sample_at_divergence_cell)
routing_click = opens_clicked_sample(sample_at_routing_cell)


def select_step(timeline: dict | None, bars: dict | None) -> Any:
    point = _clicked(dash.ctx.triggered[0]["value"] if dash.ctx.triggered else None)
    return int(point["x"]) if point is not None and point.get("x") is not None else no_update


def step_rows(step: int | None, state_json: dict[str, Any]) -> list[dict[str, Any]]:
    return sample_table(state_json["run_id"], int(step) if step is not None else None)


def table_click(
    active: dict[str, Any] | None, rows: list[dict[str, Any]], step: int | None, state_json: dict
) -> Any:
    """Clicking a table row's cell opens that sample."""
    if not active or step is None:
        return no_update
    index = active.get("row")
    if index is None or index >= len(rows):
        return no_update
    return sample_href(state_json["run_id"], int(step), rows[index]["sample_key"])


def on_tick(
    app: dash.Dash, *outputs: Output, also: tuple[Input | State, ...] = ()
) -> Callable[[Callable], Any]:
    """Register a live callback: called at every tick of the page's interval as
    ``(n_intervals, run-state, *also)``."""
    return app.callback(
        *outputs,
        Input("run-interval", "n_intervals"),
        State("run-state", "data"),
        *also,
        prevent_initial_call=True,
    )


def on_page_event(app: dash.Dash, *dependencies: Output | Input | State) -> Callable[[Callable], Any]:
    """Register a callback of a user's action on the page: called with its inputs and states, then
    the page's state (``run-state``)."""
    return app.callback(*dependencies, State("run-state", "data"), prevent_initial_call=True)


#: The heatmaps whose cells open a sample, and the callback that finds it.
SAMPLE_HEATMAPS = {
    "run-position": position_click,
    "run-divergence": divergence_click,
    "run-routing": routing_click,
}


def register(app: dash.Dash) -> None:
    dash.register_page(
        __name__, path_template=PATH, name="Run", title="isoaudit: run", layout=layout, order=3
    )
    on_tick(
        app,
        Output("run-timelines", "figure"),
        Output("run-position", "figure"),
        Output("run-divergence", "figure"),
        Output("run-diagnoses", "figure"),
        Output("run-state", "data"),
    )(tick)
    on_tick(
        app,
        Output("run-loop", "figure"),
        Output("run-loop-steps", "data"),
        also=(State("run-loop-steps", "data"),),
    )(tick_loop)
    on_tick(app, Output("run-ranks", "data"), Output("run-rank-figure", "figure"))(tick_ranks)
    on_tick(
        app,
        Output("run-interval", "disabled"),
        Output("run-status", "children"),
        Output("run-applied", "children"),
    )(tick_status)
    on_tick(
        app,
        Output("run-routing", "figure"),
        Output("run-routing-steps", "data"),
        Output("run-routing-section", "style"),
        Output("run-routing-line", "children"),
        also=(Input("run-routing-value", "value"), State("run-routing-steps", "data")),
    )(tick_routing)
    for heatmap, open_sample in SAMPLE_HEATMAPS.items():
        on_page_event(app, Output("run-nav", "href", allow_duplicate=True), Input(heatmap, "clickData"))(
            open_sample
        )
    on_page_event(
        app,
        Output("run-mode", "value"),
        Output("run-control", "data"),
        Output("run-control-message", "children"),
        Output("run-interval", "disabled", allow_duplicate=True),
        Input("run-mode", "value"),
        State("run-control", "data"),
    )(set_mode)
    on_page_event(
        app,
        Output("run-position", "figure", allow_duplicate=True),
        Output("run-state", "data", allow_duplicate=True),
        Input("run-position-stat", "value"),
    )(redraw_position)
    app.callback(
        Output("run-step", "value"),
        Input("run-timelines", "clickData"),
        Input("run-diagnoses", "clickData"),
        prevent_initial_call=True,
    )(select_step)
    on_page_event(app, Output("run-samples", "data"), Input("run-step", "value"))(step_rows)
    on_page_event(
        app,
        Output("run-nav", "href", allow_duplicate=True),
        Input("run-samples", "active_cell"),
        State("run-samples", "derived_viewport_data"),
        State("run-step", "value"),
    )(table_click)
