"""The figures layer: pure functions from the frames of ``dashboard.data`` to plotly figures.

No Dash and no store here, so every figure is unit-tested on hand-built frames. Text that comes from
users or records (rule names, region names, token text) is HTML-escaped before it reaches plotly,
whose labels understand a few HTML tags: it shows as the characters typed, never as markup.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from isoaudit.dashboard.data import TIMELINE_PANELS
from plotly.subplots import make_subplots

#: log10 floor of |Δ| and relative L2 in colour scales (exact zeros are drawn at the floor).
LOG_FLOOR = -8.0

DIAGNOSIS_COLOURS = {
    "clean": "#2ca02c",
    "contract": "#d62728",
    "weights": "#9467bd",
    "semantics": "#e377c2",
    "inference_path": "#ff7f0e",
    "numerical": "#1f77b4",
    "inconclusive": "#7f7f7f",
    "quantization": "#8c564b",
}
SEVERITY_COLOURS = {"info": "#1f77b4", "warning": "#ff7f0e", "critical": "#d62728"}
SIDE_COLOURS = {"trainer": "#1f77b4", "rollout": "#9467bd"}


def safe(text: object) -> str:
    """Text for a plotly label: escaped, so ``<b>`` shows as typed."""
    return html.escape(str(text), quote=False)


def _base(fig: go.Figure, height: int) -> go.Figure:
    # plotly.js's own defaults (template "none"): a styled template costs tens of milliseconds a figure.
    fig.update_layout(
        height=height,
        margin={"l": 60, "r": 20, "t": 40, "b": 40},
        template="none",
        legend={"orientation": "h", "y": 1.0, "yanchor": "bottom", "x": 1.0, "xanchor": "right"},
    )
    fig.update_xaxes(zeroline=False)
    fig.update_yaxes(zeroline=False, automargin=True)
    return fig


def figure(data: list[dict], layout: dict | None = None) -> go.Figure:
    """A figure from trace dicts, without plotly's per-element validation (it costs seconds for the
    tens of thousands of cells of a 1,000-step heatmap); the builders here set only known properties,
    and the tests read them back."""
    return go.Figure(data=data, layout=layout or {}, _validate=False)


def empty_figure(message: str, height: int = 240) -> go.Figure:
    """A placeholder that says why there is nothing to draw."""
    fig = go.Figure()
    fig.add_annotation(text=safe(message), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return _base(fig, height)


def log_value(value: float) -> float:
    """log10 of a non-negative figure, with exact zeros at :data:`LOG_FLOOR` (NaN stays NaN)."""
    if value is None or not math.isfinite(value):
        return float("nan")
    return max(math.log10(value), LOG_FLOOR) if value > 0 else LOG_FLOOR


# ---------------------------------------------------------------------- runs page


def sparkline(steps: Sequence[int], values: Sequence[float | None]) -> go.Figure:
    """A tiny kl_k3 line for the runs table."""
    fig = go.Figure(
        go.Scatter(
            x=list(steps), y=[np.nan if v is None else v for v in values], mode="lines", line={"width": 1.5}
        )
    )
    fig.update_layout(
        height=40, width=160, margin={"l": 0, "r": 0, "t": 0, "b": 0}, showlegend=False,
        plot_bgcolor="rgba(0,0,0,0)", paper_bgcolor="rgba(0,0,0,0)",
    )  # fmt: skip
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


# ---------------------------------------------------------------------- run page


def loop_figures(loop: pd.DataFrame, mismatch: pd.Series | None = None) -> go.Figure:
    """The RL loop's reward (mean, ±1 std band) against the mismatch (``mismatch``: kl_k3 by step,
    right axis, log), so a user sees whether the drift tracks what the job optimises."""
    if loop.empty or loop["reward_mean"].isna().all():
        return empty_figure("no loop figures recorded (the job calls Session.record_stats per step)")
    steps = plain(loop.index.to_numpy())
    mean = loop["reward_mean"].to_numpy(dtype=float)
    std = np.nan_to_num(loop["reward_std"].to_numpy(dtype=float))
    hover = [
        f"step {s}<br>reward {m:.4g} ± {d:.3g}<br>entropy {e:.4g}<br>clip fraction {c:.3g}"
        f"<br>generation {g:.3g} s, training {t:.3g} s"
        for s, m, d, e, c, g, t in zip(
            steps,
            mean,
            std,
            *(
                loop[k].to_numpy(dtype=float)
                for k in ("entropy", "clip_fraction", "generation_s", "training_s")
            ),
            strict=True,
        )
    ]
    data: list[dict] = [
        {"type": "scatter", "x": steps + steps[::-1], "y": plain(np.concatenate([mean + std, (mean - std)[::-1]])),
         "mode": "lines", "fill": "toself", "fillcolor": "rgba(44,160,44,0.15)", "line": {"width": 0},
         "hoverinfo": "skip",
         "name": "reward ± std", "showlegend": False},
        {"type": "scatter", "x": steps, "y": plain(mean), "mode": "lines+markers", "name": "reward (mean)",
         "line": {"color": "#2ca02c"}, "text": hover, "hoverinfo": "text"},
    ]  # fmt: skip
    layout: dict = {"yaxis": {"title": {"text": "reward"}}, "xaxis": {"title": {"text": "step"}}}
    if mismatch is not None and not mismatch.dropna().empty:
        values = mismatch.reindex(loop.index).to_numpy(dtype=float)
        data.append(
            {"type": "scatter", "x": steps, "y": plain(np.array([log_value(v) for v in values])), "mode": "lines", "yaxis": "y2",
             "name": "kl_k3 (log10)", "line": {"color": "#1f77b4", "dash": "dot"}}
        )  # fmt: skip
        layout["yaxis2"] = {"title": {"text": "log10 kl_k3"}, "overlaying": "y", "side": "right"}
    return _base(figure(data, layout), 280)


def plain(values: np.ndarray) -> list:
    """An array as nested lists with None for NaN. Plotly sends numpy arrays as base64 typed arrays,
    which ``dash.Patch`` cannot extend in the browser: traces that live updates append to hold lists."""
    return (
        [plain(row) for row in values]
        if values.ndim > 1
        else [None if v != v else v for v in values.tolist()]
    )


def _wants_log(values: np.ndarray) -> bool:
    finite = values[np.isfinite(values)]
    return bool(finite.size) and bool((finite > 0).all())


def _axis(row: int) -> str:
    """Plotly's axis suffix of subplot row ``row`` ("" for the first, then "2", "3", ...)."""
    return "" if row == 1 else str(row)


def log_panels(frame: pd.DataFrame) -> list[int]:
    """The timeline rows drawn on a log axis: log panels whose values are all positive."""
    rows = []
    for row, (_, metrics, log) in enumerate(TIMELINE_PANELS, start=1):
        panel = np.concatenate([frame[m].to_numpy(float) for m in metrics if m in frame] or [np.zeros(0)])
        if log and _wants_log(panel):
            rows.append(row)
    return rows


def timeline_decorations(
    thresholds: pd.DataFrame | None,
    intervals: pd.DataFrame | None,
    changes: pd.DataFrame | None,
    log_rows: Sequence[int] = (),
) -> tuple[list[dict], list[dict]]:
    """Shapes and annotations of the timelines: each rule's threshold as a dashed line on its
    metric's panel, firing intervals shaded across all panels, remediation switches as dotted lines.
    Plain dicts, so a live update can replace them without drawing a figure."""
    panel_of = {m: row for row, (_, metrics, _) in enumerate(TIMELINE_PANELS, start=1) for m in metrics}
    shapes: list[dict] = []
    notes: list[dict] = []
    for t in thresholds.itertuples() if thresholds is not None else ():
        row = panel_of.get(t.metric)
        if row is None:
            continue
        ax, colour = _axis(row), SEVERITY_COLOURS.get(t.severity, "#444")
        shapes.append(
            {"type": "line", "xref": f"x{ax} domain", "x0": 0, "x1": 1, "yref": f"y{ax}", "y0": t.threshold,
             "y1": t.threshold, "line": {"dash": "dash", "color": colour, "width": 1}, "name": f"threshold:{t.rule}"}
        )  # fmt: skip
        # Annotations on a log axis are placed by log10 of the value (shapes take the value itself).
        y = math.log10(t.threshold) if row in log_rows and t.threshold > 0 else t.threshold
        notes.append(
            {"text": safe(f"{t.rule} ({t.comparison} {t.threshold:g})"), "xref": f"x{ax} domain", "x": 0,
             "xanchor": "left", "yref": f"y{ax}", "y": y, "yanchor": "bottom", "showarrow": False,
             "font": {"size": 10, "color": colour}}
        )  # fmt: skip
    shapes += interval_shapes(intervals)
    for c in changes.itertuples() if changes is not None else ():
        if c.step is None or (isinstance(c.step, float) and math.isnan(c.step)):
            continue
        colour = SIDE_COLOURS.get(c.side, "#2ca02c")
        for row in range(1, len(TIMELINE_PANELS) + 1):
            ax = _axis(row)
            shapes.append(
                {"type": "line", "xref": f"x{ax}", "x0": int(c.step), "x1": int(c.step), "yref": f"y{ax} domain",
                 "y0": 0, "y1": 1, "line": {"dash": "dot", "color": colour, "width": 1.5}, "name": f"mode:{c.side}"}
            )  # fmt: skip
        notes.append(
            {"text": safe(f"{c.side} → {c.mode}"), "xref": "x", "x": int(c.step), "xanchor": "left",
             "yref": "paper", "y": 1.0, "yanchor": "bottom", "showarrow": False,
             "font": {"size": 10, "color": colour}}
        )  # fmt: skip
    return shapes, notes


@lru_cache(maxsize=1)
def _subplots_layout() -> str:
    """The timelines' subplot grid (axes, domains, panel titles) as JSON, built once."""
    titles = [title for title, _, _ in TIMELINE_PANELS]
    grid = make_subplots(
        rows=len(TIMELINE_PANELS), cols=1, shared_xaxes=True, vertical_spacing=0.035, subplot_titles=titles
    )
    return json.dumps(grid.layout.to_plotly_json())


def timeline_titles() -> list[dict]:
    """The panels' titles (annotations of their own, kept when a live update replaces the others)."""
    return list(json.loads(_subplots_layout()).get("annotations", []))


def timelines(
    frame: pd.DataFrame,
    thresholds: pd.DataFrame | None = None,
    intervals: pd.DataFrame | None = None,
    changes: pd.DataFrame | None = None,
) -> go.Figure:
    """One panel per metric group (``data.TIMELINE_PANELS``), steps on a shared x axis, with
    :func:`timeline_decorations`. Traces follow ``TIMELINE_METRICS`` order (live updates append to them)."""
    layout = json.loads(_subplots_layout())
    steps = frame.index.to_list()
    traces = []
    for row, (_, metrics, _) in enumerate(TIMELINE_PANELS, start=1):
        ax = _axis(row)
        for metric in metrics:
            values = frame[metric].to_numpy(float) if metric in frame else np.full(len(steps), np.nan)
            traces.append(
                {"type": "scatter", "x": steps, "y": plain(values), "mode": "lines+markers", "name": metric,
                 "meta": metric, "marker": {"size": 4}, "xaxis": f"x{ax}", "yaxis": f"y{ax}"}
            )  # fmt: skip
    logs = log_panels(frame)
    for row in logs:
        layout[f"yaxis{_axis(row)}"]["type"] = "log"
    shapes, notes = timeline_decorations(thresholds, intervals, changes, logs)
    layout["shapes"] = shapes
    layout["annotations"] = timeline_titles() + notes
    layout[f"xaxis{_axis(len(TIMELINE_PANELS))}"]["title"] = {"text": "step"}
    fig = _base(figure(traces, layout), 170 * len(TIMELINE_PANELS))
    fig.update_layout(legend={"orientation": "v", "y": 1.0, "yanchor": "top", "x": 1.01, "xanchor": "left"})
    return fig


def interval_shapes(intervals: pd.DataFrame | None) -> list[dict]:
    """Shaded step ranges (all panels) during which an alert was firing."""
    if intervals is None:
        return []
    return [
        {
            "type": "rect",
            "xref": "x",
            "yref": "paper",
            "x0": float(i.start) - 0.5,
            "x1": float(i.end) + 0.5,
            "y0": 0,
            "y1": 1,
            "fillcolor": SEVERITY_COLOURS.get(i.severity, "#d62728"),
            "opacity": 0.12,
            "line": {"width": 0},
            "layer": "below",
            "name": f"firing:{i.rule}",
        }  # fmt: skip
        for i in intervals.itertuples()
    ]


def heatmap_columns(values: np.ndarray) -> tuple[np.ndarray, list[list[str]]]:
    """Colour values (log10, exact zeros at the floor, NaN kept) and hover text of a heatmap's
    cells, shared by full draws and live appends so both show the same thing."""
    values = np.asarray(values, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.maximum(np.where(values > 0, np.log10(values), LOG_FLOOR), LOG_FLOOR)
    z[~np.isfinite(values)] = np.nan
    text = [["—" if v != v else f"{v:.3g}" for v in row] for row in np.atleast_2d(values).tolist()]
    return z, text


def heatmap_column(values: Sequence[float]) -> tuple[list[float | None], list[str]]:
    """One step's column of the position heatmap (see :func:`heatmap_columns`)."""
    z, text = heatmap_columns(np.array([np.nan if v is None else v for v in values], dtype=float))
    return plain(z), text[0]


def position_heatmap(frame: pd.DataFrame, stat: str = "mean") -> go.Figure:
    """Step x response-position |Δ logprob| (``frame``: steps as rows, position bins as columns),
    coloured by log10; hover shows the value. A click names (step, bin) for the page to open."""
    if frame.empty or frame.shape[1] == 0:
        return empty_figure("no compared steps yet")
    z, text = heatmap_columns(frame.to_numpy(float).T)
    trace = {
        "type": "heatmap", "z": plain(z), "x": frame.index.to_list(), "y": list(frame.columns), "text": text,
        "hovertemplate": "step %{x}<br>positions %{y}<br>" + stat + " |Δ logprob| %{text}<extra></extra>",
        "colorscale": "Viridis", "zmin": LOG_FLOOR, "zmax": 1.0, "colorbar": {"title": {"text": f"log10 {stat} |Δ|"}},
    }  # fmt: skip
    layout = {
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"title": {"text": "response position"}, "type": "category"},
    }
    return _base(figure([trace], layout), 380)


def step_count_heatmap(
    frame: pd.DataFrame,
    *,
    empty: str,
    hover: str,
    colorscale: str,
    unit: str,
    rows: str,
    row_px: int,
    min_px: int,
    pad_px: int,
) -> go.Figure:
    """``frame``'s columns (top to bottom) x its steps: a count per cell, zero cells left blank so the
    first row where something happens stands out. ``hover`` ends the cell's hover text, ``unit``
    titles the colour bar, ``rows`` the row axis; the height grows ``row_px`` per row. Without
    columns it says ``empty``."""
    if frame.empty or frame.shape[1] == 0:
        return empty_figure(empty)
    z = np.array(frame.to_numpy(float).T)
    z[z == 0] = np.nan
    trace = {
        "type": "heatmap", "z": plain(z), "x": frame.index.to_list(), "y": [safe(c) for c in frame.columns],
        "hovertemplate": f"step %{{x}}<br>%{{y}}<br>%{{z}} {hover}<extra></extra>",
        "colorscale": colorscale, "zmin": 0, "colorbar": {"title": {"text": unit}}, "xgap": 1, "ygap": 1,
    }  # fmt: skip
    layout = {
        "xaxis": {"title": {"text": "step"}},
        "yaxis": {"title": {"text": rows}, "type": "category", "autorange": "reversed"},
    }
    return _base(figure([trace], layout), max(min_px, row_px * frame.shape[1] + pad_px))


def divergence_heatmap(frame: pd.DataFrame) -> go.Figure:
    """Region (forward order, top to bottom) x step: how many samples first diverge there."""
    return step_count_heatmap(
        frame,
        empty="no first divergences located (no fingerprints, or none differ)",
        hover="samples first diverge here",
        colorscale="OrRd",
        unit="samples",
        rows="first divergence",
        row_px=22,
        min_px=260,
        pad_px=100,
    )


def diagnosis_bars(frame: pd.DataFrame) -> go.Figure:
    """Samples per diagnosis kind, stacked per step (one trace per kind, in ``frame``'s column order)."""
    if frame.empty or frame.shape[1] == 0:
        return empty_figure("no compared samples yet")
    traces = [
        {"type": "bar", "x": frame.index.to_list(), "y": frame[kind].to_list(), "name": kind, "meta": kind,
         "marker": {"color": DIAGNOSIS_COLOURS.get(kind, "#bcbd22")}}
        for kind in frame.columns
    ]  # fmt: skip
    fig = figure(traces)
    fig.update_layout(barmode="stack")
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="samples")
    return _base(fig, 280)


# ---------------------------------------------------------------------- sample page


def delta_strip(frame: pd.DataFrame, show_text_up_to: int = 160) -> go.Figure:
    """Δ logprob (trainer − rollout) per completion token as one coloured strip, centred on zero;
    each cell shows its token (text when decoded, else the id) when the completion is short enough."""
    if frame.empty:
        return empty_figure("no completion tokens")
    hover = [
        f"position {p}<br>token {safe(repr(t))} (id {i})<br>trainer {a:.6g}<br>rollout {b:.6g}<br>Δ {d:+.3g}"
        for p, t, i, a, b, d in zip(
            frame["position"], frame["text"], frame["token_id"], frame["trainer"], frame["rollout"], frame["delta"],
            strict=True,
        )
    ]  # fmt: skip
    delta = frame["delta"].to_numpy(float)
    finite = np.abs(delta[np.isfinite(delta)])
    bound = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
    heat = go.Heatmap(
        z=[delta.tolist()], x=frame["position"].to_list(), y=["Δ"], zmid=0, zmin=-bound, zmax=bound,
        colorscale="RdBu", hovertext=[hover], hoverinfo="text", colorbar={"title": {"text": "Δ"}},
        xgap=1,
    )  # fmt: skip
    if len(frame) <= show_text_up_to:
        heat.update(text=[[safe(t) for t in frame["text"]]], texttemplate="%{text}", textfont={"size": 9})
    fig = go.Figure(heat)
    fig.update_xaxes(title_text="completion position")
    fig.update_yaxes(visible=False)
    return _base(fig, 170)


def grid_values(frame: pd.DataFrame) -> np.ndarray:
    """Colour value of each grid cell: equal at the floor - 1, differs at log10 relative L2 (unknown
    size at the top), not observed NaN (the plot background)."""
    rel = frame["rel_l2"].to_numpy(float)
    state = frame["state"].to_numpy(object)
    with np.errstate(divide="ignore", invalid="ignore"):
        size = np.clip(np.log10(rel), LOG_FLOOR, 1.0)
    size = np.where(np.isfinite(size), size, 1.0)
    return np.where(state == "equal", LOG_FLOOR - 1, np.where(state == "differs", size, np.nan))


def _cell_detail(state: str, rel: float, bits: int) -> str:
    if state != "differs":
        return state
    size = f"rel L2 ≈ {rel:.2g}" if math.isfinite(rel) else "size unknown"
    rung = f"agrees to {bits} mantissa bits" if bits >= 0 else "no ladder rung agrees"
    return f"differs; {size}; {rung}"


def fingerprint_grid(frame: pd.DataFrame, prompt_len: int | None = None) -> go.Figure:
    """Region x position fingerprint grid: green equal, yellow→red differing (by sketch relative L2),
    grey not observed; origins marked ×, the first divergence ★ and named. Hover: state, ladder rung
    (agreeing mantissa bits) and relative L2."""
    if frame.empty:
        return empty_figure("no fingerprints for this sample")
    regions = list(dict.fromkeys(frame["region"]))
    positions = sorted(set(frame["position"]))
    values = grid_values(frame)
    rows = pd.Categorical(frame["region"], categories=regions).codes
    cols = np.searchsorted(np.asarray(positions), frame["position"].to_numpy())
    z = np.full((len(regions), len(positions)), np.nan)
    z[rows, cols] = values
    text = np.full((len(regions), len(positions)), "", dtype=object)
    text[rows, cols] = [
        f"{safe(r)} @ {p}: {_cell_detail(s, rel, int(bits))}"
        for r, p, s, rel, bits in zip(
            frame["region"],
            frame["position"],
            frame["state"],
            frame["rel_l2"],
            frame["agreeing_bits"],
            strict=True,
        )
    ]
    low = (0.0, "#b7e4c7")
    scale = [low, (0.099, "#b7e4c7"), (0.1, "#ffffb2"), (0.55, "#fd8d3c"), (1.0, "#bd0026")]
    fig = figure(
        [
            {"type": "heatmap", "z": z, "x": positions, "y": [safe(r) for r in regions], "text": text.tolist(),
             "hoverinfo": "text", "colorscale": scale, "zmin": LOG_FLOOR - 1, "zmax": 1.0, "xgap": 1, "ygap": 1,
             "name": "grid",
             "colorbar": {"title": {"text": "log10 rel L2"}, "tickvals": [LOG_FLOOR - 1, LOG_FLOOR, -4, 0],
                          "ticktext": ["equal", f"1e{int(LOG_FLOOR)}", "1e-4", "1"]}}
        ]
    )  # fmt: skip
    origins = frame[frame["origin"] & ~frame["first"]]
    if len(origins):
        fig.add_trace(
            go.Scatter(
                x=origins["position"].to_list(), y=[safe(r) for r in origins["region"]], mode="markers",
                marker={"symbol": "x-thin", "size": 9, "line": {"width": 2, "color": "black"}}, name="origin",
                hoverinfo="skip",
            )
        )  # fmt: skip
    first = frame[frame["first"]]
    if len(first):
        r, p = first["region"].iloc[0], int(first["position"].iloc[0])
        fig.add_trace(
            go.Scatter(
                x=[p], y=[safe(r)], mode="markers", name="first divergence", hoverinfo="skip",
                marker={"symbol": "star", "size": 16, "color": "black", "line": {"width": 1, "color": "white"}},
            )
        )  # fmt: skip
        fig.add_annotation(
            x=p,
            y=safe(r),
            text=safe(f"first divergence: {r} @ {p}"),
            showarrow=True,
            arrowhead=2,
            ax=60,
            ay=-30,
        )
    if prompt_len is not None and positions and positions[0] < prompt_len <= positions[-1]:
        fig.add_vline(x=prompt_len - 0.5, line={"dash": "dot", "color": "#555"})
    fig.update_layout(plot_bgcolor="#d9d9d9")
    fig.update_xaxes(title_text="position (prompt ‖ completion)", showgrid=False)
    fig.update_yaxes(type="category", autorange="reversed", showgrid=False)
    return _base(fig, max(280, 18 * len(regions) + 120))


def rank_figure(frame: pd.DataFrame) -> go.Figure:
    """Samples each rank sent per step (``dashboard.data.rank_frame``), one line per side/rank: a
    rank that stopped sending is the line that drops to zero."""
    if frame.empty:
        return empty_figure("no samples recorded yet")
    steps = plain(frame.index.to_numpy())
    data = [
        {"type": "scatter", "x": steps, "y": plain(frame[column].to_numpy()), "mode": "lines+markers",
         "name": safe(column), "line": {"dash": "solid" if column.startswith("trainer") else "dot"}}
        for column in frame.columns
    ]  # fmt: skip
    layout = {
        "yaxis": {"title": {"text": "samples sent"}, "rangemode": "tozero"},
        "xaxis": {"title": {"text": "step"}},
    }
    return _base(figure(data, layout), 260)


# ---------------------------------------------------------------------- MoE routing


def routing_heatmap(frame: pd.DataFrame, what: str = "tokens whose expert set differs") -> go.Figure:
    """MoE layer (top to bottom) x step: routing flips per cell (``what`` they count); cells with
    no flip are left blank, so the first layer where routing breaks stands out."""
    return step_count_heatmap(
        frame,
        empty="no MoE routing recorded on both sides",
        hover=safe(what),
        colorscale="Reds",
        unit="flips",
        rows="MoE layer",
        row_px=24,
        min_px=240,
        pad_px=110,
    )


def sample_routing_grid(frame: pd.DataFrame, prompt_len: int | None = None) -> go.Figure:
    """MoE layer x position of one sample: agreeing sets light, flips dark, each token's first
    flip darkest; the hover names both sides' experts in slot order."""
    if frame.empty:
        return empty_figure("no routing on both sides for this sample")
    positions = sorted(frame["position"].unique().tolist())
    layers = sorted(frame["layer"].unique().tolist())
    col = {p: i for i, p in enumerate(positions)}
    row = {layer: i for i, layer in enumerate(layers)}
    z = np.zeros((len(layers), len(positions)))
    hover = [["" for _ in positions] for _ in layers]
    for r in frame.itertuples(index=False):
        i, j = row[r.layer], col[r.position]
        z[i, j] = 0 if r.agree else (2 if r.first_flip else 1)
        state = "agree" if r.agree else ("first flip" if r.first_flip else "flip")
        replay = "" if r.replayed is None else (" (replayed)" if r.replayed else " (routed by the trainer)")
        hover[i][j] = f"trainer {list(r.trainer)} · rollout {list(r.rollout)}: {state}{replay}"
    trace = {
        "type": "heatmap", "z": plain(z), "x": positions, "y": [f"layer {layer}" for layer in layers],
        "customdata": hover, "hovertemplate": "position %{x}<br>%{y}<br>%{customdata}<extra></extra>",
        "colorscale": [[0, "#e8f4ea"], [0.5, "#f4a582"], [1, "#b2182b"]], "zmin": 0, "zmax": 2,
        "showscale": False, "xgap": 1, "ygap": 1,
    }  # fmt: skip
    layout: dict = {
        "xaxis": {"title": {"text": "position"}},
        "yaxis": {"title": {"text": "MoE layer"}, "type": "category", "autorange": "reversed"},
    }
    if prompt_len is not None and positions and positions[0] < prompt_len <= positions[-1]:
        layout["shapes"] = [
            {"type": "line", "x0": prompt_len - 0.5, "x1": prompt_len - 0.5, "y0": 0, "y1": 1, "yref": "paper",
             "line": {"dash": "dot", "color": "#555"}}
        ]  # fmt: skip
    return _base(figure([trace], layout), max(200, 26 * len(layers) + 110))
