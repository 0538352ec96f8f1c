"""The data layer: the one door into isoaudit's database. Every module reads and writes through
:class:`Store`; nothing outside this package (and the migration scripts) imports SQLAlchemy, and what
comes out of it is typed rows (frozen dataclasses, pydantic models, ``audit.records`` models), never
ORM objects.

``engine`` opens a URL, ``schema`` versions it (Alembic), ``models`` are the ORM tables, and one module
per concern holds the store's parts: ``ingest``, ``runs``, ``records``, ``queue``, ``results``,
``control``, ``steps``; ``reads`` serves the CLI, the API and the dashboard their views.
"""

from isoaudit.audit.db.codec import UnreadableRow
from isoaudit.audit.db.engine import (
    UNAVAILABLE_ERRORS,
    StoreConflict,
    StoreError,
    StoreUnavailable,
    redacted_url,
)
from isoaudit.audit.db.ingest import ForbiddenRun, IngestResult
from isoaudit.audit.db.queue import Backlog, StepClaim
from isoaudit.audit.db.results import SampleResult, StepResult
from isoaudit.audit.db.runs import MAX_OFFSET, MAX_PAGE, RunSummary, StepCounts
from isoaudit.audit.db.store import Store

__all__ = [
    "MAX_OFFSET",
    "MAX_PAGE",
    "Backlog",
    "UNAVAILABLE_ERRORS",
    "ForbiddenRun",
    "IngestResult",
    "RunSummary",
    "SampleResult",
    "StepClaim",
    "StepCounts",
    "StepResult",
    "Store",
    "StoreConflict",
    "StoreError",
    "StoreUnavailable",
    "UnreadableRow",
    "redacted_url",
]
