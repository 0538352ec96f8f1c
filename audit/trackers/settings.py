"""Where isoaudit's figures go in W&B and MLflow: explicit values in code and tests, ``ISOAUDIT_*``
variables otherwise. The worker logs into W&B when a project is set and into MLflow when a
tracking URI is set; a session uses the same values for the runs of its own it opens."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal

from isoaudit.audit.trackers.base import Tracker, check_installed
from isoaudit.audit.trackers.figures import check_framework
from isoaudit.audit.trackers.mlflow_writer import DEFAULT_EXPERIMENT
from pydantic import BaseModel, Field, field_validator

WandbMode = Literal["online", "offline", "disabled"]

#: The environment variable behind each setting.
ENV: dict[str, str] = {
    "wandb_project": "ISOAUDIT_WANDB_PROJECT",
    "wandb_entity": "ISOAUDIT_WANDB_ENTITY",
    "wandb_mode": "ISOAUDIT_WANDB_MODE",
    "mlflow_tracking_uri": "ISOAUDIT_MLFLOW_TRACKING_URI",
    "mlflow_experiment": "ISOAUDIT_MLFLOW_EXPERIMENT",
    "names": "ISOAUDIT_TRACKER_NAMES",
}


class TrackerSettings(BaseModel):
    """W&B and MLflow destinations of isoaudit's own runs, and the names figures are logged under."""

    wandb_project: str | None = Field(
        default=None, description="W&B project of isoaudit's own runs; set: the worker logs to W&B"
    )
    wandb_entity: str | None = Field(default=None, description="W&B entity (team); None: W&B's default")
    wandb_mode: WandbMode | None = Field(default=None, description="online, offline or disabled")
    mlflow_tracking_uri: str | None = Field(
        default=None, description="MLflow tracking URI of isoaudit's own runs; set: the worker logs to MLflow"
    )
    mlflow_experiment: str = Field(
        default=DEFAULT_EXPERIMENT, description="MLflow experiment of isoaudit's own runs"
    )
    names: str | None = Field(
        default=None,
        description="log figures under this framework's names (verl, trl, ...: `isoaudit compare --names`); "
        "None: isoaudit's own names",
    )

    @field_validator("names")
    @classmethod
    def _known_framework(cls, value: str | None) -> str | None:
        return check_framework(value or None, ENV["names"])

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> TrackerSettings:
        """Settings from ``ISOAUDIT_*`` variables (empty ones are unset); ``overrides`` (not None) win."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {field: env[var] for field, var in ENV.items() if env.get(var)}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(values)

    def worker_trackers(self) -> tuple[Tracker, ...]:
        """The trackers the worker logs into: W&B when a project is set, MLflow when a tracking URI is."""
        chosen: list[Tracker] = []
        if self.wandb_project:
            chosen.append("wandb")
        if self.mlflow_tracking_uri:
            chosen.append("mlflow")
        for tracker in chosen:
            check_installed(tracker)
        return tuple(chosen)
