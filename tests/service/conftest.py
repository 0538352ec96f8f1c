"""Fixtures of the service tests: the real app served over real HTTP on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from isoaudit.audit.api import create_app
from isoaudit.audit.api.live import LiveServer
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store
from isoaudit.audit.settings import Settings


@pytest.fixture(autouse=True)
def _steady_heap(steady_heap: None) -> None:
    """Every test here times background threads: full collections of this test process's heap
    stay out of their way (``steady_heap``)."""


@pytest.fixture
def server(store: Store) -> Iterator[LiveServer]:
    """The API on ``store`` (no background worker: tests drive comparisons themselves)."""
    live = LiveServer(create_app(store, Settings(run_worker=False, max_body_bytes=4 << 20)))
    live.start()
    yield live
    live.stop()


@pytest.fixture
def token(store: Store) -> str:
    return create_token(store, "alpha", "tests")


@pytest.fixture
def other_token(store: Store) -> str:
    return create_token(store, "beta", "tests")


@pytest.fixture
def api(server: LiveServer, token: str) -> Iterator[httpx.Client]:
    """A client of project ``alpha``."""
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=30
    ) as client:
        yield client


@pytest.fixture
def anonymous(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client
