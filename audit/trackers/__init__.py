"""isoaudit's figures in the experiment trackers RL jobs already log to: W&B and MLflow.

Per compared step, the figures under the user's framework names (``isoaudit compare --names``)
go into the job's own tracker run (:mod:`isoaudit.collectors.trackers`, the session's side) or
into a run of isoaudit's own per isoaudit run (:mod:`isoaudit.audit.trackers.fanout`, the
worker's side, ``ISOAUDIT_WANDB_*`` / ``ISOAUDIT_MLFLOW_*``); alerts become W&B alerts. W&B and
MLflow are optional extras, imported only when a writer opens.
"""

from isoaudit.audit.trackers.base import TRACKERS, Tracker, TrackerUnavailable, TrackerWriter, check_installed
from isoaudit.audit.trackers.figures import (
    PREFIX,
    STEP_KEY,
    mlflow_metric_name,
    tracked_figures,
    wandb_run_id,
)
from isoaudit.audit.trackers.settings import TrackerSettings

__all__ = [
    "PREFIX",
    "STEP_KEY",
    "TRACKERS",
    "Tracker",
    "TrackerSettings",
    "TrackerUnavailable",
    "TrackerWriter",
    "check_installed",
    "mlflow_metric_name",
    "tracked_figures",
    "wandb_run_id",
]
