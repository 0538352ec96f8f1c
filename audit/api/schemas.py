"""Response and request bodies of the API that are not records (those are ``audit.records``)."""

from __future__ import annotations

from typing import Any, Literal

from isoaudit.audit.control import ControlRecord, RemediationMode, UtcDatetime
from pydantic import BaseModel, ConfigDict, Field

#: A run's desired remediation mode as the API shows it: the control record itself.
Control = ControlRecord


class ControlUpdate(BaseModel):
    """Set the mode; ``version`` must be the current one (optimistic concurrency), else 409."""

    model_config = ConfigDict(extra="forbid")

    mode: RemediationMode
    # The stored version is a 32-bit INTEGER and a successful update writes version + 1.
    version: int = Field(ge=0, le=2**31 - 2)


class RejectedRecord(BaseModel):
    """A record of the batch that was not stored: where it was, what kind, which field, why."""

    index: int = Field(description="position in the batch's records")
    kind: str = Field(description="its kind tag, or 'unknown'")
    field: str = Field(description="the field at fault, dotted for nested ones")
    message: str = Field(description="starts with the field's name")


class IngestResponse(BaseModel):
    stored: dict[str, int]
    duplicates: dict[str, int]
    pending: int = Field(description="samples queued for comparison by this batch")
    rejected: list[RejectedRecord] = Field(
        default_factory=list, description="records refused (nothing of them stored); the others were stored"
    )
    control: Control | None = Field(
        description="the desired mode of the batch's run (null when it names several)"
    )
    controls: dict[str, Control] = Field(description="run_id -> desired mode, for every run the batch names")


class Health(BaseModel):
    status: Literal["ok"]
    database: str
    schema_revision: str | None


class RunOut(BaseModel):
    run_id: str
    project: str
    name: str
    started_at: UtcDatetime
    config: dict[str, Any]
    n_steps: int
    last_step: int | None
    control: Control | None = None


class StepOut(BaseModel):
    step: int
    trainer_samples: int
    rollout_samples: int
    compared_samples: int


class StepMetricsOut(BaseModel):
    step: int
    n_samples: int
    metrics: dict[str, float | None]
    diagnoses: dict[str, Any]
    computed_at: UtcDatetime


class StepStatsOut(BaseModel):
    """The RL loop's own figures of one step, by name (reward_mean, entropy, clip_fraction, ...)."""

    step: int
    figures: dict[str, float]
    created_at: UtcDatetime


class SampleResultOut(BaseModel):
    step: int
    sample_key: str
    n_tokens: int
    metrics: dict[str, float | None]
    diagnosis: str
    diagnosis_detail: dict[str, Any]
    first_divergence_region: str | None
    first_divergence_position: int | None
    grid: dict[str, Any] | None = Field(
        default=None, description="region x position grid (include_grid=true)"
    )
    computed_at: UtcDatetime


class DivergenceOut(BaseModel):
    step: int
    sample_key: str
    region: str | None
    position: int | None
    diagnosis: str
    diagnosis_detail: dict[str, Any]
