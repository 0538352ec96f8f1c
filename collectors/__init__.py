"""Hooks that record what a trainer or a rollout engine computed, and the sinks that ship those records.

The public API is one call: ``with collectors.session(run="grpo-7") as audit:``, then
``audit.watch_trainer(model)``, ``audit.watch_vllm(llm)`` or ``audit.watch_engine(engine)``, and one
``record_step`` per step on each handle (:mod:`collectors.sessions`). Names are imported on first
use, so ``import collectors`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from collectors.lazy import lazy_attributes

if TYPE_CHECKING:
    from collectors.control import Control, ControlChannel, FixedControl
    from collectors.layout import StepBatch
    from collectors.sessions import (
        DatabaseDestination,
        Destination,
        MemoryDestination,
        ServiceDestination,
        Session,
        SideSummary,
        Summary,
        session,
    )

_WHERE = {
    "session": "sessions",
    "Session": "sessions",
    "Summary": "sessions",
    "SideSummary": "sessions",
    "Destination": "sessions",
    "DatabaseDestination": "sessions",
    "MemoryDestination": "sessions",
    "ServiceDestination": "sessions",
    "StepBatch": "layout",
    "Control": "control",
    "ControlChannel": "control",
    "FixedControl": "control",
}

__all__ = [
    "Control",
    "ControlChannel",
    "DatabaseDestination",
    "Destination",
    "FixedControl",
    "MemoryDestination",
    "ServiceDestination",
    "Session",
    "SideSummary",
    "StepBatch",
    "Summary",
    "session",
]


__getattr__ = lazy_attributes(__name__, _WHERE)
