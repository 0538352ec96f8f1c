"""The job's side: a session logs its run's compared steps into the job's own W&B and MLflow runs
(or runs of isoaudit's own), read back from W&B's offline files and MLflow's file store and checked
against `isoaudit compare --json --names`."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from isoaudit.audit.db import Store
from isoaudit.audit.trackers import mlflow_metric_name, wandb_run_id
from isoaudit.audit.worker import ComparisonWorker

import isoaudit
from tests.trackers.conftest import TwoSides, compare_names, mlflow_figures, wandb_figures
from tests.trackers.wandb_files import offline_run

STEPS = 6


@pytest.fixture
def fast_follow(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sessions read their results every 0.2 s; nothing but the test's own worker compares."""
    import isoaudit.collectors.trackers as trackers

    monkeypatch.setattr(trackers, "INTERVAL_S", 0.2)
    monkeypatch.setenv("ISOAUDIT_COMPARE", "none")


@pytest.fixture
def comparing(database_url: str) -> Iterator[ComparisonWorker]:
    """A comparison worker over the test's database, as `isoaudit worker` would run."""
    store = Store(database_url)
    worker = ComparisonWorker(store, interval=0.05).start()
    yield worker
    worker.stop()
    store.dispose()


def _mlflow_names(figures: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    return {
        step: {mlflow_metric_name("isoaudit/" + k).removeprefix("isoaudit/"): v for k, v in f.items()}
        for step, f in figures.items()
    }


def test_figures_go_into_the_jobs_own_runs_beside_its_rows_and_never_move_its_steps(
    database_url: str,
    comparing: ComparisonWorker,
    wandb_dir: Path,
    mlflow_uri: str,
    fast_follow: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A verl-style job: W&B rows at explicit steps (two logs per step), an active MLflow run. Every
    compared step lands in both under verl's names, equal to `compare --names verl`, on the
    ``isoaudit/step`` axis; every row the job logged is there, at the step it gave."""
    import mlflow
    import wandb

    job = wandb.init(project="job", settings=wandb.Settings(console="off"))
    mlflow.set_tracking_uri(mlflow_uri)
    mlflow.set_experiment("job")
    active = mlflow.start_run()
    with isoaudit.session(
        "rl-job", database_url=database_url, trackers=("wandb", "mlflow"), tracker_names="verl"
    ) as audit:
        sides = TwoSides(audit)
        for step in range(STEPS):
            sides.record(step)
            time.sleep(0.1)  # compared meanwhile
            job.log({"loss": 1.0 / (step + 1)}, step=step)
            time.sleep(0.25)  # isoaudit logs the compared step meanwhile, into the row of this step
            job.log({"reward": float(step)}, step=step)  # kept only if that did not commit the row
    job.finish()
    mlflow.end_run()
    printed = capsys.readouterr().err

    expected = compare_names(database_url, "rl-job", "verl")
    assert sorted(expected) == list(range(STEPS))
    assert all("rollout_corr/k3_kl" in figures for figures in expected.values())

    run = offline_run(wandb_dir, job.id)
    assert wandb_figures(run.rows) == expected
    assert {"glob_name": "isoaudit/*", "step_metric": "isoaudit/step", "name": ""} in run.metrics
    job_rows = [row for row in run.rows if "loss" in row or "reward" in row]
    assert [(row["_step"], row.get("loss"), row.get("reward")) for row in job_rows] == [
        (step, 1.0 / (step + 1), float(step)) for step in range(STEPS)
    ]
    assert mlflow_figures(mlflow_uri, active.info.run_id) == _mlflow_names(expected)
    assert f"wandb: {STEPS} compared steps into the job's run {job.id}" in printed
    assert f"mlflow: {STEPS} compared steps into the job's run {active.info.run_id}" in printed


def test_service_destination_logs_into_a_run_of_its_own_and_raises_wandb_alerts(
    store: Store,
    database_url: str,
    wandb_dir: Path,
    mlflow_uri: str,
    fast_follow: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No W&B run in the job: the session opens isoaudit's own (stable id), logs the compared steps
    the service reports under TRL's names, and turns the default critical KL alert (firing once k3
    passes 1e-2) into a W&B alert. The service's worker logs the same run into MLflow (its own run,
    ``ISOAUDIT_MLFLOW_TRACKING_URI``) under verl's names, through the API's lifespan."""
    from isoaudit.audit.api import create_app
    from isoaudit.audit.api.live import LiveServer
    from isoaudit.audit.auth import create_token
    from isoaudit.audit.settings import Settings
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("ISOAUDIT_MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.setenv("ISOAUDIT_TRACKER_NAMES", "verl")
    live = LiveServer(create_app(store, Settings(run_worker=True, worker_interval_s=0.05)))
    live.start()
    try:
        token = create_token(store, "alpha", "tests")
        with isoaudit.session(
            "svc-job", url=live.url, token=token, spool_dir=None, trackers="wandb", tracker_names="trl"
        ) as audit:
            sides = TwoSides(audit)
            for step in range(STEPS):
                sides.record(step)
                time.sleep(0.1)
    finally:
        live.stop()

    run = offline_run(wandb_dir, wandb_run_id("svc-job"))
    assert run.directories == 1
    assert wandb_figures(run.rows) == compare_names(database_url, "svc-job", "trl")
    rows = run.isoaudit_rows()  # a row per compared step (one compared again is logged again)
    assert [row["_step"] for row in rows] == list(range(len(rows)))
    assert {row["isoaudit/step"] for row in rows} == set(range(STEPS))
    [alert] = [a for a in run.alerts if "kl_k3_critical" in a["title"]]
    assert alert["level"] == "ERROR" and alert["title"] == "isoaudit kl_k3_critical firing on svc-job"
    fired = int(re.search(r"on run svc-job at step (\d+): value", alert["text"]).group(1))
    assert compare_names(database_url, "svc-job", None)[fired]["kl_k3"] > 1e-2  # the default rule's bound

    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("isoaudit")
    [own] = client.search_runs([experiment.experiment_id], filter_string="tags.`isoaudit.run_id` = 'svc-job'")
    assert own.data.tags["isoaudit.project"] == "alpha"
    assert own.info.status == "FINISHED"  # the worker finished it when the service stopped
    assert mlflow_figures(mlflow_uri, own.info.run_id) == _mlflow_names(
        compare_names(database_url, "svc-job", "verl")
    )


def test_a_tracker_that_fails_or_hangs_never_holds_the_job(
    database_url: str,
    comparing: ComparisonWorker,
    wandb_dir: Path,
    mlflow_uri: str,
    fast_follow: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """W&B refuses to open a run, MLflow's logging hangs: the job's calls take no longer, closing
    returns within its timeout, and the summary counts what went wrong."""
    from isoaudit.audit.trackers.mlflow_writer import MlflowWriter
    from isoaudit.audit.trackers.wandb_writer import WandbWriter

    def refuse(*args: object, **kwargs: object) -> WandbWriter:
        raise RuntimeError("W&B is unreachable")

    released = threading.Event()

    def hang(self: MlflowWriter, step: int, figures: object) -> None:
        released.wait(60)

    monkeypatch.setattr(WandbWriter, "own", refuse)
    monkeypatch.setattr(MlflowWriter, "log", hang)
    monkeypatch.setenv("ISOAUDIT_MLFLOW_TRACKING_URI", mlflow_uri)
    took = []
    try:
        audit = isoaudit.session("stuck", database_url=database_url, trackers="wandb mlflow").start()
        sides = TwoSides(audit)
        for step in range(STEPS):
            started = time.perf_counter()
            sides.record(step)
            took.append(time.perf_counter() - started)
            time.sleep(0.15)  # compared and followed meanwhile: the follower is stuck in MLflow
        started = time.perf_counter()
        audit.close(timeout=4.0)
        closing = time.perf_counter() - started
    finally:
        released.set()
        audit._trackers._thread.join(30)  # the follower left behind ends before the database goes
    printed = capsys.readouterr().err
    assert max(took) < 0.5, took
    assert closing < 4.0 + 2.0, closing  # sinks and comparer close quickly; the trackers get 4 s
    assert "wandb: 0 compared steps into isoaudit's run (none opened), 1 errors" in printed
    assert "mlflow: 0 compared steps into isoaudit's run " in printed  # opened; its first log hangs
    assert "isoaudit: trackers still busy after 4 s; left behind" in caplog.messages
