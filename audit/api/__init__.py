"""The isoaudit HTTP service (FastAPI): ingest, queries, remediation control, alerts and /metrics.

``create_app(store, settings)`` builds it; ``isoaudit serve`` runs it under uvicorn.
"""

from isoaudit.audit.api.app import create_app
from isoaudit.audit.settings import Settings

__all__ = ["Settings", "create_app"]
