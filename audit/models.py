"""Transitional re-export for the modules not yet on the data layer (see ``audit/store.py``); delete it
once they import ``isoaudit.audit.db.models``."""

from isoaudit.audit.db.models import PendingComparisonRow, RunRow, StepResultRow

__all__ = ["PendingComparisonRow", "RunRow", "StepResultRow"]
