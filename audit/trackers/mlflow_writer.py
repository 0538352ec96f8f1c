"""isoaudit's figures in MLflow: into the job's active run, or into a run of isoaudit's own.

Everything goes through an ``MlflowClient`` bound to one tracking URI, never through MLflow's
fluent API, whose active run is thread-local (the writers run on a thread of their own). Each
compared step is one ``log_batch`` at ``step=`` isoaudit's step; names are prefixed ``isoaudit/``
and sanitized as MLflow requires (:func:`~isoaudit.audit.trackers.figures.mlflow_metric_name`).
isoaudit's own run for an isoaudit run is found again by its ``isoaudit.run_id`` tag, so a
restarted worker resumes it. MLflow has no alerts: :meth:`MlflowWriter.alert` does nothing.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from isoaudit.audit.trackers.base import Tracker, require
from isoaudit.audit.trackers.figures import PREFIX, RUN_TAG, mlflow_metric_name

#: MLflow's limit of metrics per ``log_batch``.
MAX_BATCH = 1000
#: The experiment isoaudit's own runs go into unless told otherwise.
DEFAULT_EXPERIMENT = "isoaudit"


def client(tracking_uri: str | None) -> Any:
    """An ``MlflowClient`` of ``tracking_uri`` (None: MLflow's default, ``MLFLOW_TRACKING_URI``)."""
    require("mlflow")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


class MlflowWriter:
    """Logs compared steps into the MLflow run ``run_id`` through ``mlflow_client``; build it with
    :meth:`attach` or :meth:`own`."""

    tracker: Tracker = "mlflow"

    def __init__(self, mlflow_client: Any, run_id: str, *, shared: bool) -> None:
        self.client = mlflow_client
        self.target = run_id
        self.shared = shared
        self.logged = 0

    @classmethod
    def attach(cls, mlflow_run_id: str, run_id: str, *, tracking_uri: str | None) -> MlflowWriter:
        """Into the job's active run ``mlflow_run_id`` (as the job's thread saw it)."""
        writer = cls(client(tracking_uri), mlflow_run_id, shared=True)
        writer.client.set_tag(mlflow_run_id, RUN_TAG, run_id)
        return writer

    @classmethod
    def own(
        cls,
        run_id: str,
        *,
        tracking_uri: str | None = None,
        experiment: str = DEFAULT_EXPERIMENT,
        tags: Mapping[str, str] | None = None,
    ) -> MlflowWriter:
        """Into isoaudit run ``run_id``'s own MLflow run in ``experiment`` (created when absent):
        the run tagged ``isoaudit.run_id = run_id``, or a new one so tagged."""
        mlflow_client = client(tracking_uri)
        experiment_id = _experiment_id(mlflow_client, experiment)
        found = mlflow_client.search_runs(
            [experiment_id], filter_string=f"tags.`{RUN_TAG}` = '{run_id}'", max_results=1
        )
        if found:
            mlflow_run_id = found[0].info.run_id
            if found[0].info.status != "RUNNING":
                mlflow_client.update_run(mlflow_run_id, status="RUNNING")
        else:
            created = mlflow_client.create_run(
                experiment_id, run_name=run_id, tags={RUN_TAG: run_id, **(tags or {})}
            )
            mlflow_run_id = created.info.run_id
        return cls(mlflow_client, mlflow_run_id, shared=False)

    def log(self, step: int, figures: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_metric_name(PREFIX + k), v, now, step) for k, v in figures.items()]
        for start in range(0, len(metrics), MAX_BATCH):
            self.client.log_batch(self.target, metrics=metrics[start : start + MAX_BATCH])
        self.logged += 1

    def poll(self) -> None:
        return None

    def alert(self, title: str, text: str, level: str) -> bool:
        return False

    def close(self) -> None:
        """isoaudit's own run is marked finished (a later step resumes it); the job's is the job's."""
        if not self.shared:
            self.client.set_terminated(self.target)


def _experiment_id(mlflow_client: Any, name: str) -> str:
    """The id of experiment ``name``, created if absent (another process may create it meanwhile)."""
    from mlflow.exceptions import MlflowException

    found = mlflow_client.get_experiment_by_name(name)
    if found is not None:
        return str(found.experiment_id)
    try:
        return str(mlflow_client.create_experiment(name))
    except MlflowException:
        found = mlflow_client.get_experiment_by_name(name)
        if found is None:
            raise
        return str(found.experiment_id)
