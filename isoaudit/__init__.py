"""isoaudit: where a trainer and a rollout engine stop computing the same numbers, and why.

The public API a job types::

    import isoaudit

    with isoaudit.session(run="grpo-7") as audit:
        trainer = audit.watch_trainer(model)
        rollout = audit.watch_vllm(llm)
        ...

``isoaudit.StepBatch`` packs a step's prompts and completions for the trainer. Names are imported
on first use, so ``import isoaudit`` stays cheap (a vLLM worker never loads SQLAlchemy or the
trainer's hooks it does not use). This package is also the composition root: the command line
(:mod:`isoaudit.cli`) wires the parts below it (``audit``, ``collectors``, ``kernels``,
``dashboard``, ``migrations``) and none of them imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from isoaudit.collectors.lazy import lazy_attributes

if TYPE_CHECKING:
    from isoaudit.collectors.control import Control, ControlChannel, FixedControl
    from isoaudit.collectors.layout import StepBatch
    from isoaudit.collectors.sessions import (
        DatabaseDestination,
        Destination,
        MemoryDestination,
        NotIdentical,
        ParityUnverified,
        ServiceDestination,
        Session,
        SideSummary,
        Summary,
        session,
    )

from isoaudit.audit import __version__

_WHERE = {
    "session": "collectors.sessions",
    "Session": "collectors.sessions",
    "Summary": "collectors.sessions",
    "SideSummary": "collectors.sessions",
    "Destination": "collectors.sessions",
    "DatabaseDestination": "collectors.sessions",
    "MemoryDestination": "collectors.sessions",
    "ServiceDestination": "collectors.sessions",
    "NotIdentical": "collectors.sessions",
    "ParityUnverified": "collectors.sessions",
    "StepBatch": "collectors.layout",
    "Control": "collectors.control",
    "ControlChannel": "collectors.control",
    "FixedControl": "collectors.control",
}

__all__ = [
    "Control",
    "ControlChannel",
    "DatabaseDestination",
    "Destination",
    "FixedControl",
    "MemoryDestination",
    "NotIdentical",
    "ParityUnverified",
    "ServiceDestination",
    "Session",
    "SideSummary",
    "StepBatch",
    "Summary",
    "__version__",
    "session",
]

__getattr__ = lazy_attributes(__name__, _WHERE)
