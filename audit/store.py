"""Transitional re-export for the modules not yet on the data layer (``audit/alerts/*``,
``audit/auth.py``, ``audit/api/prometheus.py``, ``audit/api/routers/alerts.py``); delete it once they
import ``isoaudit.audit.db``."""

from isoaudit.audit.db import Store, StoreError

__all__ = ["Store", "StoreError"]
