"""``/runs/<run_id>/steps/<step>/samples/<sample_key>``: one sample's Δ strip, its fingerprint grid
with origins and the first divergence, and the diagnosis with its evidence."""

from __future__ import annotations

from typing import Any

import dash
import dash_bootstrap_components as dbc
import pandas as pd
from dash import dcc, html
from dash.development.base_component import Component
from isoaudit.audit.db import Store, reads
from isoaudit.dashboard import context, data, figures
from isoaudit.dashboard.components import data_table, graph, not_found, text
from isoaudit.dashboard.pages import urls

# Component ids.
FIRST_DIVERGENCE = "sample-first-divergence"
DIAGNOSIS = "sample-diagnosis"
SENTENCE = "sample-sentence"
DELTA = "sample-delta"
GRID = "sample-grid"
ROUTING = "sample-routing"
ROUTING_SUMMARY = "sample-routing-summary"
ROUTING_FIRST = "sample-routing-first"
ROUTING_GRID = "sample-routing-grid"
ROUTING_FLIPS = "sample-routing-flips"
DISTRIBUTION = "sample-distribution"
DISTRIBUTION_SUMMARY = "sample-distribution-summary"
DISTRIBUTION_TRACE = "sample-distribution-trace"


def first_divergence_line(detail: reads.SampleDetail) -> html.Div:
    if detail.first_divergence is None:
        reason = "no fingerprints" if detail.grid is None else "no region differs with agreeing inputs"
        return html.Div(
            ["First divergence: ", html.Strong("none located", id=FIRST_DIVERGENCE), f" ({reason})."]
        )
    region, position = detail.first_divergence
    return html.Div(
        [
            "First divergence: ",
            html.Strong(f"{region}", id=FIRST_DIVERGENCE),
            f" at position {position}",
            f" (completion token {position - detail.prompt_len})"
            if position >= detail.prompt_len
            else " (prompt)",
            ".",
        ]
    )


def diagnosis_card(detail: reads.SampleDetail) -> dbc.Card:
    items: list[Any] = []
    for name, value in data.evidence_items(detail.evidence):
        items += [
            html.Dt(name, className="col-sm-3"),
            html.Dd(value, className="col-sm-9 font-monospace small"),
        ]
    return dbc.Card(
        dbc.CardBody(
            [
                html.H5(
                    ["Diagnosis: ", html.Span(detail.diagnosis, id=DIAGNOSIS)],
                    className="card-title",
                ),
                html.P(detail.sentence, id=SENTENCE),
                html.Dl(items, className="row mb-0"),
            ]
        ),
        className="mb-3",
    )


def flips_table(flips: pd.DataFrame, limit: int = 200) -> Component:
    """Every (token, MoE layer) whose expert sets differ, with both sides' experts in slot order."""
    if flips.empty:
        return html.Div(id=ROUTING_FLIPS)
    rows = [
        {
            "position": int(r.position),
            "layer": int(r.layer),
            "trainer": str(list(r.trainer)),
            "rollout": str(list(r.rollout)),
            "first": "first flip" if r.first_flip else "",
        }
        for r in flips.sort_values(["position", "layer"]).head(limit).itertuples(index=False)
    ]
    columns = [{"id": c, "name": c} for c in ("position", "layer", "trainer", "rollout", "first")]
    return data_table(ROUTING_FLIPS, columns, rows, page_size=20)


def routing_view(store: Store, detail: reads.SampleDetail) -> html.Div:
    """MoE samples: both sides' experts per token and layer, and where the routing first flips."""
    routing = reads.sample_routing(store, detail.run_id, detail.step, detail.sample_key)
    if routing is None:
        return html.Div(id=ROUTING)
    frame = data.sample_routing_frame(routing)
    flips = frame[~frame["agree"]]
    tokens = int(len(set(flips["position"]))) if not flips.empty else 0
    if flips.empty:
        summary: list[Any] = ["Both sides chose the same experts for every token in every MoE layer."]
    else:
        first = flips.sort_values(["layer", "position"]).iloc[0]
        summary = [
            f"{tokens} of {routing.positions.size} tokens route differently in some MoE layer. First flip: ",
            html.Strong(f"layer {int(first['layer'])}", id=ROUTING_FIRST),
            f" at position {int(first['position'])} (trainer experts {list(first['trainer'])}, rollout "
            f"{list(first['rollout'])}).",
        ]
    if routing.replayed is not None:
        replayed = int(routing.replayed.sum())
        summary.append(
            f" Routing replay: {replayed} of {routing.replayed.size} tokens replayed from the rollout."
        )
    return html.Div(
        [
            html.H5("MoE routing, both sides", className="mt-3"),
            html.Div(summary, id=ROUTING_SUMMARY, className="small"),
            graph(ROUTING_GRID, figures.sample_routing_grid(frame, detail.prompt_len)),
            flips_table(flips),
        ],
        id=ROUTING,
    )


def distribution_view(store: Store, detail: reads.SampleDetail) -> html.Div:
    """Fingerprinted steps: where the two sides' full distributions part, token by token."""
    found = reads.sample_distribution(store, detail.run_id, detail.step, detail.sample_key)
    if found is None:
        return html.Div(id=DISTRIBUTION)
    frame = data.distribution_frame(found)
    differs = int(frame["differs"].sum())
    hidden = int((frame["differs"] & frame["sampled_equal"]).sum())
    if differs == 0:
        summary: list[Any] = [
            f"The distributions agree at all {len(frame)} positions (top-{found.k} and sketch)."
        ]
    else:
        first = int(frame.loc[frame["differs"], "position"].iloc[0])
        summary = [
            f"The distributions differ at {differs} of {len(frame)} positions, first at ",
            html.Strong(f"completion token {first}"),
            f"; at {hidden} of them the sampled token's logprob is bitwise equal.",
        ]
    return html.Div(
        [
            html.H5("Full distribution, both sides", className="mt-3"),
            html.Div(summary, id=DISTRIBUTION_SUMMARY, className="small"),
            graph(DISTRIBUTION_TRACE, figures.distribution_trace(frame, found.k)),
        ],
        id=DISTRIBUTION,
    )


def layout(
    run_id: str | None = None, step: str | None = None, sample_key: str | None = None, **_: object
) -> Component:
    store = context.store()
    try:
        number = int(step) if step is not None else None
    except ValueError:
        number = None
    detail = (
        reads.sample_detail(store, run_id, number, sample_key)
        if run_id and number is not None and sample_key
        else None
    )
    if detail is None:
        return not_found(f"No compared sample {sample_key!r} at step {step!r} of run {run_id!r}.")
    run = store.get_run(detail.run_id)
    tokenizer = data.tokenizer_of(run.config if run else {})
    tokens = data.delta_frame(detail, tokenizer)
    metrics = detail.metrics
    return html.Div(
        [
            html.Div(
                [
                    dcc.Link("← run", href=urls.run_path(detail.run_id, detail.step)),
                    html.H3(f"Sample {detail.sample_key}", className="mt-2"),
                    html.Div(
                        f"run {detail.run_id} · step {detail.step} · {tokens.shape[0]} completion tokens after a "
                        f"{detail.prompt_len}-token prompt · mean |Δ| {text(metrics.get('logprob_abs_diff_mean'))} · "
                        f"max |Δ| {text(metrics.get('logprob_abs_diff_max'))} · kl_k3 {text(metrics.get('kl_k3'))} · "
                        f"exact {text(metrics.get('exact_match_fraction'))}",
                        className="text-muted small",
                    ),
                ],
                className="mb-3",
            ),
            diagnosis_card(detail),
            html.H5("Δ logprob per completion token"),
            html.Div(
                "tokens decoded with the run's tokenizer"
                if tokenizer is not None
                else "token ids (no loadable tokenizer named in the run config)",
                className="text-muted small",
            ),
            graph(DELTA, figures.delta_strip(tokens)),
            html.H5("Fingerprint grid", className="mt-3"),
            first_divergence_line(detail),
            graph(GRID, figures.fingerprint_grid(data.grid_frame(detail), detail.prompt_len)),
            distribution_view(store, detail),
            routing_view(store, detail),
        ]
    )


def register(app: dash.Dash) -> None:
    dash.register_page(
        __name__, path_template=urls.SAMPLE, name="Sample", title="isoaudit: sample", layout=layout, order=1
    )
