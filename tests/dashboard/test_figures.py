"""Figure builders on hand-made frames: the shape of the data, thresholds drawn, intervals shaded,
origins marked, user text escaped."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from isoaudit.dashboard import data, figures


def _timeline(steps=(0, 1, 2)) -> pd.DataFrame:
    frame = pd.DataFrame(
        {m: [1e-4, 1e-3, 1e-1][: len(steps)] for m in data.TIMELINE_METRICS}, index=list(steps)
    )
    frame.index.name = "step"
    return frame


def test_timelines_one_trace_per_metric_with_thresholds_intervals_and_mode_changes():
    thresholds = pd.DataFrame(
        [
            {
                "rule": "<script>x</script>",
                "metric": "kl_k3",
                "comparison": ">",
                "threshold": 1e-3,
                "severity": "warning",
            }
        ]
    )
    intervals = pd.DataFrame(
        [
            {
                "alert_id": 1,
                "rule": "r",
                "metric": "kl_k3",
                "severity": "critical",
                "state": "firing",
                "start": 1,
                "end": 2,
            }
        ]
    )
    changes = pd.DataFrame([{"side": "rollout", "mode": "invariant", "at": None, "step": 2}])
    fig = figures.timelines(_timeline(), thresholds, intervals, changes)
    assert [t.meta for t in fig.data] == list(data.TIMELINE_METRICS)
    assert list(fig.data[0].x) == [0, 1, 2] and np.allclose(fig.data[0].y, [1e-4, 1e-3, 1e-1])
    lines = [s for s in fig.layout.shapes if s.type == "line"]
    assert any(s.y0 == 1e-3 and s.y1 == 1e-3 for s in lines)  # the threshold
    assert any(s.x0 == 2 and s.x1 == 2 for s in lines)  # the mode change
    rects = [s for s in fig.layout.shapes if s.type == "rect"]
    assert [(r.x0, r.x1) for r in rects] == [(0.5, 2.5)]
    texts = [a.text for a in fig.layout.annotations]
    assert any("&lt;script&gt;" in t for t in texts) and not any("<script>" in t for t in texts)
    assert any("rollout → invariant" in t for t in texts)
    assert fig.layout.yaxis.type == "log"  # kl_k3 is positive everywhere


def test_timelines_stay_linear_when_a_value_is_zero():
    frame = _timeline()
    frame["kl_k3"] = [0.0, 1e-3, 1e-1]
    assert figures.timelines(frame).layout.yaxis.type != "log"


def test_position_heatmap_is_bins_by_steps_on_a_log_scale():
    frame = pd.DataFrame([[0.1, 0.0], [1e-3, np.nan], [0.5, 0.2]], index=[3, 4, 5], columns=["0–15", "16–31"])
    fig = figures.position_heatmap(frame, "max")
    heat = fig.data[0]
    assert list(heat.x) == [3, 4, 5] and list(heat.y) == ["0–15", "16–31"]
    z = np.array(heat.z, dtype=float)
    assert (
        z.shape == (2, 3) and np.isclose(z[0, 0], -1) and z[1, 0] == figures.LOG_FLOOR and np.isnan(z[1, 1])
    )
    assert heat.text[1][1] == "—" and "max" in heat.hovertemplate
    assert figures.position_heatmap(pd.DataFrame()).layout.annotations[0].text == "no compared steps yet"


def test_divergence_heatmap_regions_in_rows_zeros_blank():
    frame = pd.DataFrame({"embed": [0, 2], "layers.1.mlp": [3, 0]}, index=[0, 1])
    heat = figures.divergence_heatmap(frame).data[0]
    assert list(heat.y) == ["embed", "layers.1.mlp"]
    z = np.array(heat.z, dtype=float)
    assert np.isnan(z[0, 0]) and z[0, 1] == 2 and z[1, 0] == 3


def test_diagnosis_bars_stack_one_trace_per_kind():
    frame = pd.DataFrame({"clean": [1, 0], "numerical": [2, 3]}, index=[0, 1])
    fig = figures.diagnosis_bars(frame)
    assert fig.layout.barmode == "stack" and [t.name for t in fig.data] == ["clean", "numerical"]
    assert list(fig.data[1].y) == [2, 3] and fig.data[0].marker.color == figures.DIAGNOSIS_COLOURS["clean"]


def test_delta_strip_centres_on_zero_and_escapes_token_text():
    frame = pd.DataFrame(
        {
            "position": [0, 1],
            "absolute_position": [4, 5],
            "token_id": [7, 8],
            "text": ["<b>", "ok"],
            "trainer": [-1.0, -2.0],
            "rollout": [-1.5, -2.0],
            "delta": [0.5, 0.0],
        }  # fmt: skip
    )
    heat = figures.delta_strip(frame).data[0]
    assert heat.zmid == 0 and heat.zmin == -0.5 and heat.zmax == 0.5
    assert list(heat.text[0]) == ["&lt;b&gt;", "ok"] and "Δ +0.5" in heat.hovertext[0][0]


def test_fingerprint_grid_marks_origins_and_the_first_divergence():
    rows = []
    for region in ("embed", "layers.0.mlp", "logits"):
        for position in range(4):
            differs = region != "embed" and position >= 2
            rows.append(
                {
                    "region": region,
                    "position": position,
                    "state": "differs" if differs else "equal",
                    "rel_l2": 1e-3 if differs else 0.0,
                    "agreeing_bits": 4 if differs else -1,
                    "origin": region == "layers.0.mlp" and position >= 2,
                    "first": region == "layers.0.mlp" and position == 2,
                }  # fmt: skip
            )
    rows.append(
        {
            "region": "final_norm",
            "position": 0,
            "state": "not observed",
            "rel_l2": np.nan,
            "agreeing_bits": -1,
            "origin": False,
            "first": False,
        }
    )
    frame = pd.DataFrame(rows)
    fig = figures.fingerprint_grid(frame, prompt_len=2)
    heat = fig.data[0]
    assert list(heat.y) == ["embed", "layers.0.mlp", "logits", "final_norm"] and list(heat.x) == [0, 1, 2, 3]
    z = np.array(heat.z, dtype=float)
    assert z[0, 0] == figures.LOG_FLOOR - 1 and np.isclose(z[1, 2], -3) and np.isnan(z[3, 0])
    assert "agrees to 4 mantissa bits" in heat.text[1][2] and "rel L2 ≈ 0.001" in heat.text[1][2]
    origin = next(t for t in fig.data if t.name == "origin")
    first = next(t for t in fig.data if t.name == "first divergence")
    assert list(origin.x) == [3] and list(first.x) == [2] and list(first.y) == ["layers.0.mlp"]
    assert any("first divergence: layers.0.mlp @ 2" in a.text for a in fig.layout.annotations)
    assert (
        figures.fingerprint_grid(frame.iloc[0:0]).layout.annotations[0].text
        == "no fingerprints for this sample"
    )


def test_sparkline_has_no_axes():
    fig = figures.sparkline([0, 1], [0.1, None])
    assert fig.layout.xaxis.visible is False and np.isnan(fig.data[0].y[1])


def test_loop_figures_draw_reward_against_the_mismatch() -> None:
    from isoaudit.audit.records import StepStats
    from isoaudit.dashboard import data, figures

    stats = [
        StepStats(run_id="r", step=0, reward_mean=0.1, reward_std=0.05, entropy=5.0, clip_fraction=0.0),
        StepStats(run_id="r", step=1, reward_mean=0.3, reward_std=0.1, generation_s=1.0, training_s=2.0),
    ]
    loop = data.loop_frame(stats)
    assert (
        list(loop.index) == [0, 1]
        and loop.loc[1, "training_s"] == 2.0
        and np.isnan(loop.loc[0, "training_s"])
    )
    mismatch = pd.Series([1e-7, 0.0], index=pd.Index([0, 1], name="step"))
    fig = figures.loop_figures(loop, mismatch)
    names = [t.name for t in fig.data]
    assert "reward (mean)" in names and "kl_k3 (log10)" in names
    reward = next(t for t in fig.data if t.name == "reward (mean)")
    assert list(reward.y) == [0.1, 0.3]
    kl = next(t for t in fig.data if t.name == "kl_k3 (log10)")
    assert kl.y[0] == pytest.approx(-7.0) and kl.y[1] == figures.LOG_FLOOR  # exact zero at the floor
    assert fig.layout.yaxis2.overlaying == "y"
    empty = figures.loop_figures(data.loop_frame([]))
    assert "record_stats" in empty.layout.annotations[0].text
