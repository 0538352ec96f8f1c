"""The stored steps of a run diagnosed ``quantization`` and their mismatch, for the growth
signature (:mod:`audit.quantization_growth`): how the mismatch of quantized steps moves over a run."""

from __future__ import annotations

from isoaudit.audit.db.models import StepResultRow
from isoaudit.audit.db.store import Store
from sqlalchemy import select

#: How many compared steps before a batch the growth signature reads (step results, newest first).
GROWTH_LOOKBACK = 256


def quantized_steps_before(
    store: Store, run_id: str, before: int, metric: str, lookback: int = GROWTH_LOOKBACK
) -> list[tuple[int, float]]:
    """(step, the step's ``metric``) of the steps before ``before`` with at least one sample diagnosed
    ``quantization``, among the ``lookback`` newest compared ones, oldest first; a step whose figure
    is missing (NaN when stored) is left out."""
    query = (
        select(StepResultRow.step, StepResultRow.metrics, StepResultRow.diagnoses)
        .where(StepResultRow.run_id == run_id, StepResultRow.step < before)
        .order_by(StepResultRow.step.desc())
        .limit(lookback)
    )
    out = []
    with store.sessions() as session:
        for step, metrics, diagnoses in session.execute(query):
            counts = diagnoses.get("counts") if isinstance(diagnoses, dict) else None
            value = metrics.get(metric) if isinstance(metrics, dict) else None
            if isinstance(counts, dict) and counts.get("quantization") and isinstance(value, int | float):
                out.append((int(step), float(value)))
    return sorted(out)
