"""The settings of every process that reads the store (the service, `isoaudit worker`, a session's own
comparer): explicit values in code and tests, ``ISOAUDIT_*`` variables otherwise."""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel, Field


def _env_bool(value: str) -> bool:
    if value.strip().lower() in {"1", "true", "yes", "on"}:
        return True
    if value.strip().lower() in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"not a boolean: {value!r}")


#: The environment variable behind each setting.
_ENV: dict[str, str] = {
    "database_url": "ISOAUDIT_DATABASE_URL",
    "database_timeout_s": "ISOAUDIT_DATABASE_TIMEOUT_S",
    "require_token_for_reads": "ISOAUDIT_REQUIRE_TOKEN_FOR_READS",
    "max_body_bytes": "ISOAUDIT_MAX_BODY_BYTES",
    "run_worker": "ISOAUDIT_RUN_WORKER",
    "worker_interval_s": "ISOAUDIT_WORKER_INTERVAL_S",
    "worker_lease_s": "ISOAUDIT_WORKER_LEASE_S",
    "worker_processes": "ISOAUDIT_WORKER_PROCESSES",
    "alert_rules_file": "ISOAUDIT_ALERT_RULES",
    "default_alert_rules": "ISOAUDIT_DEFAULT_ALERT_RULES",
    "webhook_url": "ISOAUDIT_ALERT_WEBHOOK_URL",
    "alertmanager_url": "ISOAUDIT_ALERTMANAGER_URL",
    "dashboard_url": "ISOAUDIT_DASHBOARD_URL",
    "dashboard_step_path": "ISOAUDIT_DASHBOARD_STEP_PATH",
    "metrics_active_window_s": "ISOAUDIT_METRICS_ACTIVE_WINDOW_S",
}


class Settings(BaseModel):
    """Everything the service, a worker or a comparer can be told. Defaults are safe: reads need a
    token too."""

    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; None = ISOAUDIT_DATABASE_URL or SQLite"
    )
    database_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="how long a request waits for the database (a locked SQLite file, a PostgreSQL "
        "connection) before answering 503; ingest retries within this time",
    )
    require_token_for_reads: bool = Field(
        default=True, description="GET endpoints need a bearer token as well"
    )
    max_body_bytes: int = Field(default=256 << 20, gt=0, description="larger request bodies get 413")
    run_worker: bool = Field(
        default=True, description="run the comparison worker (and alerts) in the background"
    )
    worker_interval_s: float = Field(
        default=0.5, gt=0, description="how often the worker looks for pending samples"
    )
    worker_lease_s: float = Field(
        default=60.0,
        gt=0,
        description="how long a comparison worker holds the steps it claimed: another replica's "
        "worker retakes them after this if it died",
    )
    worker_processes: int = Field(
        default=1,
        ge=0,
        description="processes measuring a large step's tokens beside the comparison worker when a "
        "core is idle (0: none; audit.metrics.block_pool)",
    )
    alert_rules_file: str | None = Field(default=None, description="YAML rules loaded at start-up")
    default_alert_rules: bool = Field(default=True, description="install the default kl_k3 rules at start-up")
    webhook_url: str | None = Field(default=None, description="Slack-compatible webhook for alert notices")
    alertmanager_url: str | None = Field(
        default=None,
        description="Alertmanager base URL(s) for alert notices (posted to /api/v2/alerts, re-posted while firing)",
    )
    dashboard_url: str = Field(default="http://localhost:8050", description="base URL the notices link to")
    dashboard_step_path: str = Field(
        default="/runs/{run_id}?step={step}", description="path of a step's page below dashboard_url"
    )
    metrics_active_window_s: float = Field(
        default=3600.0,
        gt=0,
        description="/metrics exports the runs compared within this many seconds; idle and finished "
        "runs drop out, so the series do not grow with the runs ever recorded",
    )
    ingest_retries: int = Field(default=8, ge=1, description="attempts of a batch that lost a write race")

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        """Settings from ``ISOAUDIT_*`` environment variables; ``overrides`` (not None) win."""
        values: dict[str, Any] = {}
        for field_name, variable in _ENV.items():
            raw = os.environ.get(variable)
            if raw is None:
                continue
            annotation = cls.model_fields[field_name].annotation
            try:
                values[field_name] = _env_bool(raw) if annotation is bool else raw
            except ValueError as exc:
                raise ValueError(f"{variable}: {exc}") from exc
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls.model_validate(values)
