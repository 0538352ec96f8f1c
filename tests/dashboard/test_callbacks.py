"""The pages' callbacks called directly (inside a request of the app, as Dash calls them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from dash import Patch, no_update
from isoaudit.audit.alerts import AlertEngine, DatabaseChannel, install_rules, parse_rules
from isoaudit.audit.db import reads
from isoaudit.audit.worker import ComparisonWorker
from isoaudit.dashboard import create_app, data
from isoaudit.dashboard.pages import alerts, contract, runs, sample
from isoaudit.dashboard.pages.run import header, heatmaps, ids, live, loop, page, remediation, samples
from isoaudit.dashboard.pages.run.state import LiveState
from typer.testing import CliRunner

from tests import factories as f
from tests.dashboard.records import DIVERGING, fill, step_records

RULES = parse_rules(
    "rules:\n  - {name: mismatch, metric: exact_match_fraction, comparison: '<', threshold: 1.0}\n"
)


@pytest.fixture
def app(store) -> Iterator:
    install_rules(store, RULES, "yaml", replace=True)
    fill(store, steps=3, samples=3, name="<img src=x onerror=alert(1)>")
    AlertEngine(store, channels=[DatabaseChannel()]).evaluate("run-1", 2)
    dash_app = create_app(store, live_interval_ms=1000)
    with dash_app.server.test_request_context("/"):
        yield dash_app


def _find(component, component_id):
    """The component of a layout with this id (depth first)."""
    if getattr(component, "id", None) == component_id:
        return component
    children = getattr(component, "children", None)
    for child in children if isinstance(children, list) else [children] if children is not None else []:
        found = _find(child, component_id)
        if found is not None:
            return found
    return None


def _text(component) -> str:
    """All text of a layout, as it would render."""
    if isinstance(component, str | int | float):
        return str(component)
    children = getattr(component, "children", None)
    if children is None:
        return ""
    return " ".join(_text(c) for c in (children if isinstance(children, list) else [children]))


def test_pages_lay_out(app, store):
    assert "<img src=x onerror=alert(1)>" in _text(runs.layout())
    run_page = page.layout(run_id="run-1", step="1")
    assert _find(run_page, ids.TITLE).children == "<img src=x onerror=alert(1)>"
    assert _find(run_page, ids.INTERVAL).disabled is False  # just written: live
    assert len(_find(run_page, ids.SAMPLES).data) == 3 and _find(run_page, ids.STEP).value == 1
    state = LiveState.from_json(_find(run_page, ids.STATE).data)
    assert state.last_step == 2 and state.regions == [DIVERGING] and state.n_bins == 2
    assert "No run" in _text(page.layout(run_id="nope"))
    key = next(r.sample_key for r in reads.step_samples(store, "run-1", 1) if r.first_divergence_region)
    sample_page = sample.layout(run_id="run-1", step="1", sample_key=key)
    assert _find(sample_page, sample.FIRST_DIVERGENCE).children == DIVERGING
    assert "No compared sample" in _text(sample.layout(run_id="run-1", step="x", sample_key=key))
    contract_page = contract.layout(run_id="run-1")
    assert "runtime.dtype" in _text(_find(contract_page, contract.FIELDS)) and "Handshake" in _text(
        contract_page
    )
    assert "mismatch" in _text(alerts.layout())


def test_tick_appends_only_new_steps(app, store):
    state = LiveState.from_json(_find(page.layout(run_id="run-1"), ids.STATE).data)
    assert live.tick(1, state.to_json()) == (no_update,) * 5
    assert header.tick_status(1, state.to_json())[:2] == (False, "live")
    store.ingest(step_records("run-1", 3))
    ComparisonWorker(store, on_step=AlertEngine(store, channels=[DatabaseChannel()]).evaluate).run_once()
    timelines, position, divergence, diagnoses, new_state = live.tick(2, state.to_json())
    assert all(isinstance(p, Patch) for p in (timelines, position, divergence, diagnoses))
    assert new_state["last_step"] == 3
    ops = timelines.to_plotly_json()["operations"]
    extends = [op for op in ops if op["operation"] == "Extend"]
    assert len(extends) == 2 * len(data.TIMELINE_METRICS) and extends[0]["params"]["value"] == [3]
    # The firing interval grows to the new step: the shapes are replaced.
    shapes = next(op for op in ops if op["operation"] == "Assign" and op["location"] == ["layout", "shapes"])
    assert any(s["type"] == "rect" and s["x1"] == 3.5 for s in shapes["params"]["value"])
    # A step reaching a wider position range than drawn redraws that figure in full.
    wide = [r for r in step_records("run-1", 4, samples=5)]
    store.ingest(wide)
    ComparisonWorker(store).run_once()
    out = live.tick(3, new_state)
    assert (
        isinstance(out[0], Patch)
        and not isinstance(out[1], Patch)
        and out[1]["data"][0]["x"][-1] == 4
        and out[4]["n_bins"] == 3
    )


def test_a_page_drawn_before_any_comparison_is_drawn_in_full_at_its_first_compared_step(app, store):
    """The placeholders have no traces: extending them fails in the browser ("undefined does not
    have a method named concat"), so the first tick that brings steps draws every figure."""
    store.ingest(step_records("run-early", 0))  # stored, not compared yet
    state = LiveState.from_json(_find(page.layout(run_id="run-early"), ids.STATE).data)
    assert state.last_step is None
    ComparisonWorker(store).run_once()
    *drawn, new_state = live.tick(1, state.to_json())
    assert not any(isinstance(f, Patch) for f in drawn)
    assert all(len(f["data"]) >= 1 for f in drawn) and new_state["last_step"] == 0


def test_the_toggle_writes_with_the_version_it_read_and_shows_a_conflict(app, store):
    state = {"run_id": "run-1"}
    mode, control, message, disabled = remediation.set_mode(
        "invariant", {"mode": "native", "version": 0}, state
    )
    assert mode == "invariant" and control == {"mode": "invariant", "version": 1} and disabled is False
    assert store.get_control("run-1").updated_by == "dashboard" and message.id == ids.CONTROL_OK
    store.set_control("run-1", "native", 1, updated_by="someone-else")
    mode, control, message, _ = remediation.set_mode("native", {"mode": "invariant", "version": 1}, state)
    assert mode == "native" and control["version"] == 2 and message.id == ids.CONTROL_CONFLICT
    assert "someone-else" in _text(message) and store.get_control("run-1").version == 2
    assert remediation.set_mode("native", {"mode": "native", "version": 2}, state) == (no_update,) * 4


def test_the_toggle_records_the_basic_auth_user(store):
    fill(store, steps=1)
    dash_app = create_app(store, auth=("alice", "secret"))
    with dash_app.server.test_request_context("/", headers={"Authorization": "Basic YWxpY2U6c2VjcmV0"}):
        remediation.set_mode("invariant", {"mode": "native", "version": 0}, {"run_id": "run-1"})
    assert store.get_control("run-1").updated_by == "dashboard:alice"
    client = dash_app.server.test_client()
    assert client.get("/").status_code == 401
    assert client.get("/", headers={"Authorization": "Basic YWxpY2U6c2VjcmV0"}).status_code == 200


def test_heatmap_and_table_clicks_open_a_sample(app, store):
    state = _find(page.layout(run_id="run-1"), ids.STATE).data
    href = heatmaps.position_click({"points": [{"x": 1, "y": "0–15", "pointNumber": [0, 1]}]}, state)
    point = reads.step_point(store, "run-1", 1)
    assert href == f"/runs/run-1/steps/1/samples/{point.position_bins['max_key'][0]}"
    href = heatmaps.divergence_click({"points": [{"x": 2, "y": DIVERGING, "pointNumber": [0, 2]}]}, state)
    example = reads.step_point(store, "run-1", 2).first_divergence[DIVERGING]["example"]
    assert href == f"/runs/run-1/steps/2/samples/{example}"
    assert heatmaps.position_click(None, state) is no_update
    rows = samples.step_rows(1, state)
    assert samples.table_click({"row": 1, "column": 0}, rows, 1, state).endswith(rows[1]["sample_key"])
    assert rows[0]["open"].startswith("[open](/runs/run-1/steps/1/samples/")
    figure, new_state = heatmaps.redraw_position("max", state)
    assert new_state["stat"] == "max" and "max" in figure.data[0].hovertemplate


def test_silence_create_and_expire(app, store):
    message, _ = alerts.create(1, "mismatch", "run-1", "1 hour", "maintenance")
    assert "created" in _text(message)
    [silence] = reads.alerts_view(store).silences
    assert silence.created_by == "dashboard" and silence.run_id == "run-1"
    bad, content = alerts.create(1, None, "not a run id!", "1 hour", None)
    assert "run_id" in _text(bad) and content is no_update
    assert alerts.expire([None], [alerts.expire_button_id(silence.id)]) is no_update
    alerts.expire([1], [alerts.expire_button_id(silence.id)])
    assert reads.alerts_view(store).silences[0].ends_at < silence.ends_at


def test_cli_refuses_a_public_bind_without_credentials(tmp_path):
    from isoaudit.cli import app as cli

    result = CliRunner().invoke(
        cli, ["dashboard", "--host", "0.0.0.0", "--database-url", f"sqlite:///{tmp_path}/x.db"]
    )
    assert result.exit_code == 2 and "without credentials" in result.output
    result = CliRunner().invoke(cli, ["dashboard", "--host", "0.0.0.0", "--auth", "nopassword"])
    assert result.exit_code != 0 and "user:password" in result.output


def test_cli_parses_auth():
    from isoaudit.cli.dashboard import is_loopback, parse_auth

    assert parse_auth("a:b:c") == ("a", "b:c") and parse_auth(None) is None and parse_auth("") is None
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")
    assert f.run().run_id == "run-1"


def test_loop_tick_redraws_only_when_new_steps_report(app, store):
    from isoaudit.audit.records import StepStats

    run_page = page.layout(run_id="run-1")
    state = _find(run_page, ids.STATE).data
    drawn_last = _find(run_page, ids.LOOP_STEPS).data
    assert drawn_last is None and loop.tick_loop(1, state, drawn_last) == (no_update, no_update)
    store.ingest([StepStats(run_id="run-1", step=s, reward_mean=0.1 * s) for s in (0, 1)])
    fig, drawn_last = loop.tick_loop(2, state, drawn_last)
    assert drawn_last == 1
    assert [t.name for t in fig.data if t.name == "reward (mean)"] == ["reward (mean)"]
    assert loop.tick_loop(3, state, drawn_last) == (no_update, no_update)
    store.ingest([StepStats(run_id="run-1", step=2, reward_mean=0.3)])
    assert loop.tick_loop(4, state, drawn_last)[1] == 2


def test_pages_say_when_steps_wait_with_no_worker_and_how_to_compare_them(store):
    """Stored on both sides, never compared, nothing comparing: the runs list and the run page say
    so with the command that compares them; once compared (or while still fresh), they say nothing."""
    from isoaudit.dashboard.pages.run import header

    store.ingest([f.run("waits"), *step_records("waits", 0), *step_records("waits", 1)])
    command = f"isoaudit worker --database-url '{store.printable_url}'"
    fresh = create_app(store)  # the default threshold: a worker may still be starting
    with fresh.server.test_request_context("/"):
        assert _text(_find(runs.layout(), runs.BACKLOG)) == ""
    dash_app = create_app(store, stalled_after_s=0.0)
    with dash_app.server.test_request_context("/"):
        banner = _text(_find(runs.layout(), runs.BACKLOG))
        assert "2 steps (6 samples) have both sides stored" in banner and command in banner
        run_banner = _find(page.layout(run_id="waits"), ids.BACKLOG)
        assert run_banner.color == "info" and command in _text(run_banner)
        state = LiveState.from_json(_find(page.layout(run_id="waits"), ids.STATE).data)
        assert command in _text(header.tick_status(1, state.to_json())[3])  # the live tick keeps it current
        ComparisonWorker(store).run_once()
        assert _text(_find(runs.layout(), runs.BACKLOG)) == ""
        assert _text(_find(page.layout(run_id="waits"), ids.BACKLOG)) == ""
        assert _text(header.tick_status(2, state.to_json())[3]) == ""
