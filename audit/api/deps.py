"""What the routers take from the application: the store, the settings and the ingest counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request
from isoaudit.audit.db import Store
from isoaudit.audit.settings import Settings

if TYPE_CHECKING:
    from isoaudit.audit.api.telemetry import Telemetry


def get_store(request: Request) -> Store:
    return request.app.state.store


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_telemetry(request: Request) -> Telemetry:
    return request.app.state.telemetry
