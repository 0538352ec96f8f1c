"""What trackers are given: the ``--names`` table's figures, names MLflow accepts, stable W&B ids,
and a clear error naming the extra when a tracker's library is missing."""

from __future__ import annotations

import math
import re
import sys

import pytest
from isoaudit.audit.metric_names import FRAMEWORKS, as_framework, framework_aliases
from isoaudit.audit.trackers import (
    TrackerSettings,
    TrackerUnavailable,
    mlflow_metric_name,
    tracked_figures,
    wandb_run_id,
)
from isoaudit.audit.trackers.base import require
from isoaudit.audit.trackers.figures import source_keys
from isoaudit.audit.trackers.setup import worker_trackers

import isoaudit


def _metrics() -> dict[str, object]:
    """Every key some framework's alias reads, with a few that carry no number."""
    keys = sorted({a.key for f in FRAMEWORKS for a in framework_aliases(f)} | set(source_keys()))
    metrics: dict[str, object] = {key: 0.001 * (i + 1) for i, key in enumerate(keys)}
    metrics.update({"kl_k3": math.nan, "kl_k1": None, "n_samples": 4, "ppl_ratio": math.inf})
    metrics["routing_flip_rate"] = True  # not a figure: a bool is never logged as one
    return metrics


@pytest.mark.parametrize("framework", [*FRAMEWORKS, None])
def test_figures_are_the_names_table_with_only_finite_numbers(framework: str | None) -> None:
    metrics = _metrics()
    figures = tracked_figures(metrics, framework)
    if framework is not None:
        table = as_framework(metrics, framework)  # what `isoaudit compare --names` prints
        assert figures == {k: v for k, v in table.items() if isinstance(v, float) and math.isfinite(v)}
        assert list(figures) == [k for k in table if k in figures]  # in the framework's order
    else:
        assert figures["n_samples"] == 4.0 and "kl_k3" not in figures and "ppl_ratio" not in figures
    assert all(type(v) is float and math.isfinite(v) for v in figures.values())
    assert "routing_flip_rate" not in figures
    # a reader that asks only for source_keys (the API's `names=` filter) gets the same figures
    wanted = {k: metrics[k] for k in source_keys(framework) if k in metrics}
    assert tracked_figures(wanted, framework) == figures


def test_an_unknown_framework_is_refused_naming_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="^names: 'rllib' is not one of verl"):
        tracked_figures({}, "rllib")
    monkeypatch.setenv("ISOAUDIT_TRACKER_NAMES", "rllib")
    with pytest.raises(ValueError, match="ISOAUDIT_TRACKER_NAMES: 'rllib'"):
        TrackerSettings.from_env()
    with pytest.raises(ValueError, match="^tracker_names: 'rllib'"):
        isoaudit.session(
            "r", destination=isoaudit.MemoryDestination(), trackers="mlflow", tracker_names="rllib"
        )
    with pytest.raises(ValueError, match="^trackers: 'comet' is not one of wandb, mlflow"):
        isoaudit.session("r", destination=isoaudit.MemoryDestination(), trackers="wandb,comet")


def test_every_framework_name_is_one_mlflow_accepts() -> None:
    pytest.importorskip("mlflow")
    from mlflow.utils.validation import _validate_metric_name

    names = [f"isoaudit/{a.name}" for f in FRAMEWORKS for a in framework_aliases(f)]
    names += ["isoaudit/tis_mean[cap=3]", "isoaudit/../x", "/lead//double/", "é:ü", "x" * 400, "isoaudit/./."]
    for name in names:
        _validate_metric_name(mlflow_metric_name(name))  # raises MlflowException when refused
    assert mlflow_metric_name("isoaudit/rollout_corr/k3_kl") == "isoaudit/rollout_corr/k3_kl"
    assert mlflow_metric_name("isoaudit/is_filter_ratio:icepop") == "isoaudit/is_filter_ratio_icepop"
    assert mlflow_metric_name("isoaudit/../x") == "isoaudit/_/x"
    assert len(mlflow_metric_name("x" * 400)) == 250


def test_wandb_run_ids_are_stable_distinct_and_valid() -> None:
    ids = [wandb_run_id(r) for r in ("grpo-7", "grpo.7", "grpo:7", "g" * 128)]
    assert ids[0] == wandb_run_id("grpo-7") and ids[0].startswith("isoaudit-grpo-7-")
    assert len(set(ids)) == len(ids)
    assert all(len(i) <= 64 and re.fullmatch(r"[A-Za-z0-9_-]+", i) for i in ids)


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_missing_tracker_library_is_an_error_naming_the_extra(
    tracker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, tracker, None)  # as if not installed: import and find_spec fail
    message = re.escape(f"{tracker} is not installed: pip install 'isoaudit[{tracker}]'")
    with pytest.raises(TrackerUnavailable, match=message):
        require(tracker)
    with pytest.raises(TrackerUnavailable, match=message):
        isoaudit.session("r", destination=isoaudit.MemoryDestination(), trackers=tracker)
    settings = TrackerSettings(wandb_project="p", mlflow_tracking_uri="file:/nowhere")
    with pytest.raises(TrackerUnavailable, match=message):
        worker_trackers(settings=settings)  # `isoaudit worker` and the service refuse to start
    assert isinstance(TrackerUnavailable(message), ImportError)


def test_the_worker_logs_nowhere_unless_told() -> None:
    assert worker_trackers(settings=TrackerSettings()) is None
    fanout = worker_trackers(settings=TrackerSettings(mlflow_tracking_uri="file:/x", names="verl"))
    assert fanout is not None and fanout.trackers == ("mlflow",)
