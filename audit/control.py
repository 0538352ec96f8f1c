"""The control record: the remediation mode a run's collectors should apply, versioned.

Defined once here and used by the data layer (which stores it), the API (which serves it), the
dashboard (which sets it) and the collectors (which apply it).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

#: What a run's collectors can be asked to run on: their native kernels, the invariant ones, or the
#: invariant ones with every linear layer in W8A8 block-FP8 (``invariant-fp8``: FP8 rollouts whose
#: trainer recomputes in the same FP8 arithmetic; :mod:`isoaudit.kernels.fp8`).
RemediationMode = Literal["native", "invariant", "invariant-fp8"]
REMEDIATION_MODES: tuple[RemediationMode, ...] = get_args(RemediationMode)

#: A timestamp as UTC with its zone: SQLite hands back naive datetimes of what were UTC ones.
UtcDatetime = Annotated[
    datetime, AfterValidator(lambda d: d if d.tzinfo is not None else d.replace(tzinfo=UTC))
]


class ControlRecord(BaseModel):
    """A run's desired remediation mode; ``version`` grows by one with every change (0: nobody has
    set it, ``native``)."""

    model_config = ConfigDict(frozen=True)

    mode: RemediationMode
    version: int = Field(ge=0)
    updated_at: UtcDatetime | None = None
    updated_by: str = ""


class StaleControlVersion(Exception):
    """An update named a version other than the current one (someone else changed it first)."""

    def __init__(self, run_id: str, current: ControlRecord) -> None:
        super().__init__(f"version: {run_id} is at version {current.version}, not the one given")
        self.current = current
