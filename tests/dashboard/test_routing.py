"""The routing views of the dashboard: the run page's layer x step heatmap of routing flips (drawn,
live-redrawn, clicked) and a token's routing on both sides on the sample page, on records with
flips planted at known places (``tests.audit.routing_records``)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from dash import no_update
from isoaudit.dashboard import create_app, data
from isoaudit.dashboard.pages import sample
from isoaudit.dashboard.pages.run import ids, page, routing

from tests import factories as f
from tests.audit.routing_records import routed_run
from tests.dashboard.test_callbacks import _find, _text


@pytest.fixture
def app(store) -> Iterator:
    dash_app = create_app(store, live_interval_ms=1000)
    with dash_app.server.test_request_context("/"):
        yield dash_app


def _z(figure) -> np.ndarray:
    return np.asarray(figure.data[0].z, dtype=float)


def test_run_page_heatmap_of_routing_flips_by_layer_and_step(app, store):
    keys = routed_run(store)
    run_page = page.layout(run_id="moe-run")
    assert _find(run_page, ids.ROUTING_SECTION).style == {}
    figure = _find(run_page, ids.ROUTING).figure
    assert list(figure.data[0].x) == [0, 1, 2] and list(figure.data[0].y) == ["layer 0", "layer 2"]
    z = _z(figure)  # rows: layers; no flip is blank (NaN)
    assert np.isnan(z[:, 0]).all()
    assert np.isnan(z[0, 1]) and z[1, 1] == 1  # step 1: one token flips in layer 2
    assert (z[0, 2], z[1, 2]) == (1, 2)  # step 2: token 3 in layers 0 and 2, token 7 in layer 2
    state = _find(run_page, ids.STATE).data
    assert routing.routing_click({"points": [{"x": 2, "y": "layer 2"}]}, state) == (
        f"/runs/moe-run/steps/2/samples/{keys[2]}"
    )
    assert routing.routing_click({"points": [{"x": 0, "y": "layer 0"}]}, state) is no_update  # no flip there
    assert routing.routing_click(None, state) is no_update

    # Live: nothing new, nothing drawn; a new step with routes redraws; another value redraws.
    last = _find(run_page, ids.ROUTING_STEPS).data
    assert last == 2
    assert routing.redraw_routing("flipped_tokens", state, last) == (no_update,) * 4
    assert "step 2: expert sets agree on 0.8333" in _find(run_page, ids.ROUTING_LINE).children
    routed_run(store, steps=4)  # steps 0-2 again (duplicates) and step 3, agreeing everywhere
    drawn, new_last, style, line = routing.redraw_routing("flipped_tokens", state, last)
    assert new_last == 3 and list(drawn.data[0].x) == [0, 1, 2, 3] and style == {}
    assert line.startswith("step 3: expert sets agree on 1 ")
    drawn, _, _, _ = routing.redraw_routing("first_flips", state, new_last, changed=True)
    firsts = _z(drawn)
    assert (firsts[0, 2], firsts[1, 2]) == (1, 1)  # token 3 first flips in layer 0, token 7 in 2
    assert "first flips" in drawn.data[0].hovertemplate


def test_a_dense_run_hides_the_routing_section(app, store):
    store.ingest([f.run("dense"), f.sample("trainer", run_id="dense"), f.sample("rollout", run_id="dense")])
    run_page = page.layout(run_id="dense")
    assert _find(run_page, ids.ROUTING_SECTION).style == {"display": "none"}
    assert data.routing_frame([]).empty


def test_sample_page_shows_a_tokens_routing_on_both_sides(app, store):
    keys = routed_run(store)
    sample_page = sample.layout(run_id="moe-run", step="2", sample_key=keys[2])
    assert _find(sample_page, sample.ROUTING_FIRST).children == "layer 0"
    assert "2 of 9 tokens route differently" in _text(_find(sample_page, sample.ROUTING_SUMMARY))
    grid = _find(sample_page, sample.ROUTING_GRID).figure
    z = _z(grid)
    assert z.shape == (2, 9)
    assert (z[0, 3], z[1, 3], z[1, 7]) == (2, 1, 2)  # first flips darkest, a later layer's flip lighter
    assert (z == 0).sum() == 18 - 3
    flips = _find(sample_page, sample.ROUTING_FLIPS).data
    assert [(r["position"], r["layer"], r["first"]) for r in flips] == [
        (3, 0, "first flip"),
        (3, 2, ""),
        (7, 2, "first flip"),
    ]
    hover = grid.data[0].customdata[0][3]
    assert hover.startswith("trainer [") and "rollout [" in hover and hover.endswith("first flip")
    agreeing = sample.layout(run_id="moe-run", step="0", sample_key=keys[0])
    assert "same experts for every token" in _text(_find(agreeing, sample.ROUTING_SUMMARY))


def test_the_routing_line_reports_replay_and_missing_routes():
    from isoaudit.audit.db.reads import RoutingStep

    point = RoutingStep(
        step=4,
        metrics={"routing_set_agreement": 1.0, "routing_flip_rate": 0.0, "routing_flipped_tokens": 0,
                 "routing_tokens": 40, "routing_replayed_fraction": 0.75},
        layers=[],
        replayed=30,
        missing=10,
        missing_examples=[{"sample_key": "ab" * 16, "positions": list(range(12))}],
    )  # fmt: skip
    line = routing.routing_line(point)
    assert "routing replay: 0.75 of the trainer's tokens replayed, 10 with missing routes" in line
    assert f"sample {'ab' * 16} at positions [0, 1, 2, 3, 4, 5, 6, 7]" in line
    assert routing.routing_line(None) == ""
