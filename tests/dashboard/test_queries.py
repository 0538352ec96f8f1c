"""The dashboard's read queries (audit.queries) and frames (dashboard.data), on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest
from isoaudit.audit.alerts import AlertEngine, DatabaseChannel, install_rules, parse_rules
from isoaudit.audit.alerts.silences import SilenceSpec, create_silence
from isoaudit.audit.db import reads
from isoaudit.audit.records import utcnow
from isoaudit.dashboard import data

from tests import factories as f
from tests.dashboard.records import DIVERGING, fill, step_records

RULES = parse_rules(
    """
rules:
  - {name: mismatch, metric: exact_match_fraction, comparison: "<", threshold: 1.0, for: 1}
  - {name: kl_high, metric: kl_k3, comparison: ">", threshold: 1.0e-3}
"""
)


@pytest.fixture
def filled(store):
    install_rules(store, RULES, "yaml", replace=True)
    fill(store, steps=3, samples=3, name="<b>bold</b>")
    engine = AlertEngine(store, channels=[DatabaseChannel()])
    for step in range(3):
        engine.evaluate("run-1", step)
    return store


def test_runs_overview(filled):
    [run] = reads.runs_overview(filled)
    assert run.run_id == "run-1" and run.name == "<b>bold</b>"
    assert run.status == "live" and run.last_step == 2 and run.last_ingest_at is not None
    assert [s for s, _ in run.sparkline] == [0, 1, 2] and run.kl_k3 == run.sparkline[-1][1] > 0
    assert 0 < run.exact_match_fraction < 1
    assert run.open_alerts == 1  # "mismatch" fires; kl_k3 of a 0.01 offset stays under 1e-3
    assert run.control.mode == "native" and run.control.version == 0
    assert run.applied["trainer"].mode == "native" and run.applied["rollout"].mode == "native"
    later = reads.runs_overview(filled, now=utcnow() + reads.LIVE_WITHIN + timedelta(seconds=1))
    assert later[0].status == "idle"
    frame = data.runs_frame([run])
    assert frame.loc[0, "desired_mode"] == "native" and frame.loc[0, "spark_steps"] == [0, 1, 2]


def test_step_series_and_live_append(filled):
    points = reads.step_series(filled, "run-1")
    assert [p.step for p in points] == [0, 1, 2]
    assert points[0].first_divergence[DIVERGING]["count"] == 1
    assert sum(points[0].diagnoses.values()) == 3 and points[0].position_bins["max"]
    assert [p.step for p in reads.step_series(filled, "run-1", after_step=1)] == [2]
    assert reads.step_point(filled, "run-1", 1).step == 1 and reads.step_point(filled, "run-1", 9) is None
    timeline = data.timeline_frame(points)
    assert list(timeline.index) == [0, 1, 2] and set(data.TIMELINE_METRICS) <= set(timeline.columns)
    positions = data.position_frame(points, "max")
    assert positions.shape == (3, 2) and list(positions.columns) == ["0–15", "16–31"]
    assert np.isclose(positions.iloc[0, 0], 0.01, rtol=1e-3)
    assert data.position_frame(points, "mean", n_bins=4).shape == (3, 4)
    with pytest.raises(ValueError, match="stat"):
        data.position_frame(points, "median")
    divergence = data.divergence_frame(points)
    assert list(divergence.columns) == [DIVERGING] and divergence[DIVERGING].tolist() == [1, 1, 1]
    diagnoses = data.diagnosis_frame(points)
    assert diagnoses.sum(axis=1).tolist() == [3, 3, 3]
    assert data.bin_sample(points[0], 0) is not None and data.bin_sample(points[0], 99) is None


def test_step_samples_and_sample_detail(filled):
    rows = reads.step_samples(filled, "run-1", 1)
    assert len(rows) == 3
    diverged = [r for r in rows if r.first_divergence_region == DIVERGING]
    assert len(diverged) == 1 and diverged[0].abs_diff_max == pytest.approx(0.01, rel=1e-3)
    detail = reads.sample_detail(filled, "run-1", 1, diverged[0].sample_key)
    assert detail is not None and detail.first_divergence == (DIVERGING, 0)
    assert detail.delta.shape == detail.completion_ids.shape and np.allclose(detail.delta, 0.01, rtol=1e-3)
    assert detail.grid is not None and detail.diagnosis and detail.sentence
    assert reads.sample_detail(filled, "run-1", 1, "0" * 32) is None
    grid = data.grid_frame(detail)
    assert grid["first"].sum() == 1 and grid[grid["first"]]["region"].item() == DIVERGING
    assert set(grid["state"]) <= {"equal", "differs", "not observed"}
    tokens = data.delta_frame(detail)
    assert tokens["text"].tolist() == [str(i) for i in detail.completion_ids]
    frame = data.samples_frame(rows)
    assert frame.shape[0] == 3 and (frame["first_divergence"] == f"{DIVERGING} @ 0").sum() == 1


def test_contract_view_and_mode_changes(filled):
    view = reads.contract_view(filled, "run-1")
    differing = {c.name for c in view.fields if c.differs}
    assert differing == {"runtime.dtype"}
    assert view.handshake is not None and not view.handshake.ok  # no contract declared
    filled.ingest(
        [f.manifest("rollout", "engine_decode", runtime={"remediation": "invariant", "dtype": "float16"})]
    )
    filled.ingest(step_records("run-1", 3))
    from isoaudit.audit.worker import ComparisonWorker

    ComparisonWorker(filled).run_once()
    history = reads.manifest_history(filled, "run-1")
    assert history[-1].changed == ["runtime.remediation"] and history[0].changed == []
    changes = reads.mode_changes(filled, "run-1")
    assert [(c.side, c.mode, c.step) for c in changes] == [("rollout", "invariant", 3)]
    assert reads.applied_modes(filled.manifests("run-1"))["rollout"].mode == "invariant"
    frame = data.contract_frame(reads.contract_view(filled, "run-1"))
    assert frame.loc[0, "field"] in {"runtime.dtype", "runtime.remediation"} and frame.loc[0, "differs"]


def test_alerts_view(filled):
    create_silence(filled, SilenceSpec(rule="mismatch", duration_s=60), project=None, created_by="me")
    view = reads.alerts_view(filled)
    assert [a.rule for a in view.open] == ["mismatch"] and view.resolved == []
    assert {r.name for r in view.rules} == {"mismatch", "kl_high"} and len(view.silences) == 1
    intervals = data.alert_intervals_frame(view.open, view.rules, 2)
    fired = view.open[0].fired_step
    assert intervals[["rule", "metric", "start", "end"]].values.tolist() == [
        ["mismatch", "exact_match_fraction", fired, 2]
    ]
    thresholds = data.thresholds_frame(reads.run_rules(filled, "run-1"))
    assert set(thresholds["metric"]) == {"exact_match_fraction", "kl_k3"}
    silences = data.silences_frame(view.silences, utcnow())
    assert silences.loc[0, "active"] and silences.loc[0, "created_by"] == "me"
    assert data.alerts_frame(view.open).loc[0, "link_step"] == fired
