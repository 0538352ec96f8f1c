"""The worker's side: `isoaudit worker` (the real CLI, in its own process) configured by
``ISOAUDIT_WANDB_*`` / ``ISOAUDIT_MLFLOW_*`` logs every run's compared steps into a W&B and an
MLflow run of their own, resumes them after a restart, and sends alerts as W&B alerts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from isoaudit.audit.alerts.history import list_alerts, notifications
from isoaudit.audit.db import Store
from isoaudit.audit.trackers import mlflow_metric_name, wandb_run_id

import isoaudit
from tests.trackers.conftest import TwoSides, compare_names, mlflow_figures, wandb_figures
from tests.trackers.wandb_files import offline_run


def _worker(database_url: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "isoaudit.cli", "worker", "--database-url", database_url]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())


def _stop(worker: subprocess.Popen[bytes]) -> str:
    worker.send_signal(signal.SIGTERM)
    _, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err.decode()[-2000:]
    return err.decode()


def _wait_compared(store: Store, run_id: str, steps: int, worker: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while len(store.step_results(run_id)) < steps:
        assert worker.poll() is None, worker.communicate()[1].decode()[-2000:]
        assert time.monotonic() < deadline, f"{run_id}: not {steps} steps compared within 60 s"
        time.sleep(0.1)


def _record(database_url: str, run_id: str, steps: range) -> None:
    with isoaudit.session(run_id, database_url=database_url, report=False) as audit:
        sides = TwoSides(audit)
        for step in steps:
            sides.record(step)


def test_the_worker_logs_each_run_into_runs_of_its_own_resumed_after_a_restart(
    tmp_path: Path, wandb_dir: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    database_url = f"sqlite:///{tmp_path / 'isoaudit.db'}"
    monkeypatch.setenv("ISOAUDIT_COMPARE", "none")  # the worker below compares, not the sessions
    monkeypatch.setenv("ISOAUDIT_WANDB_PROJECT", "isoaudit-tests")
    monkeypatch.setenv("ISOAUDIT_WANDB_MODE", "offline")
    monkeypatch.setenv("ISOAUDIT_MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.setenv("ISOAUDIT_TRACKER_NAMES", "trl")
    store = Store(database_url)
    try:
        _record(database_url, "w-job", range(5))
        worker = _worker(database_url)
        _wait_compared(store, "w-job", 5, worker)
        _stop(worker)  # finishes its runs, after handing every queued step and alert over
        _record(database_url, "w-job", range(5, 7))
        worker = _worker(database_url)
        _wait_compared(store, "w-job", 7, worker)
        _stop(worker)
        firing = {a.rule: a for a in list_alerts(store, run_id="w-job", states=["firing"])}
        delivered = {(n.channel, n.status) for a in firing.values() for n in notifications(store, a.id)}
    finally:
        store.dispose()

    expected = compare_names(database_url, "w-job", "trl")
    assert sorted(expected) == list(range(7))
    assert all("sampling/sampling_logp_difference/mean" in f for f in expected.values())

    run = offline_run(wandb_dir, wandb_run_id("w-job"))
    assert run.directories == 2  # one per worker process, the same W&B run id: resumed
    assert wandb_figures(run.rows) == expected
    assert run.config["isoaudit.run_id"] == "w-job" and run.config["isoaudit.project"] == "default"
    # the default rules firing on this run (k3 above 1e-2, above 1e-3 for 3 steps, ...): one W&B alert each
    assert {"kl_k3_critical", "kl_k3_warning"} <= set(firing)
    by_title = {a["title"]: a for a in run.alerts}
    assert sorted(by_title) == sorted(f"isoaudit {rule} firing on w-job" for rule in firing)
    for rule, alert in firing.items():
        sent = by_title[f"isoaudit {rule} firing on w-job"]
        assert sent["level"] == {"critical": "ERROR", "warning": "WARN"}[alert.severity]
        assert f"{rule} ({alert.severity}) fired on run w-job at step {alert.fired_step}:" in sent["text"]
    assert delivered >= {("wandb", "sent")} and ("wandb", "failed") not in delivered

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("isoaudit")
    [own] = client.search_runs([experiment.experiment_id])  # resumed by its tag, never a second run
    assert own.data.tags["isoaudit.run_id"] == "w-job" and own.info.status == "FINISHED"
    assert mlflow_figures(mlflow_uri, own.info.run_id) == {
        step: {mlflow_metric_name("isoaudit/" + k).removeprefix("isoaudit/"): v for k, v in f.items()}
        for step, f in expected.items()
    }
