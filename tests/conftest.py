"""Shared fixtures: a fresh store on SQLite and, when ISOAUDIT_TEST_POSTGRES_URL is set, on PostgreSQL."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import pytest

# Without CUDA the invariant kernels run under Triton's interpreter, which only works when the variable
# is set before anything imports triton (vLLM and transformers may): hence here, first of all.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: The suites that test the product as a user runs it on a CPU (the service, its monitoring, the
#: dashboard, the framework integrations, the RL demo, the trackers, the CLI and the README): their
#: kernels take the torch path a CPU user gets. The interpreter stays on for the suites that test
#: the Triton kernels' structure (kernels, collectors, vllm, audit); under it the collector's own
#: kernels take many times the torch path's time, which timing tests would measure instead of the
#: collector.
USERS_CPU_SUITES = ("service", "monitoring", "dashboard", "integrations", "rl", "trackers")
USERS_CPU_MODULES = ("test_readme.py", "test_cli.py", "test_cli_errors.py", "test_installed_layout.py")


def pytest_configure(config: pytest.Config) -> None:
    """Under the interpreter, ``tl.dot`` computes each output element alone, the same bits on every
    machine (:mod:`tests.triton_interpreter`)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        try:
            import triton.runtime.interpreter  # noqa: F401
        except ImportError:  # no Triton: the kernel tests skip
            return
        from tests import triton_interpreter

        triton_interpreter.install()


if TYPE_CHECKING:
    from isoaudit.audit.db import Store

# The store's imports (SQLAlchemy, pydantic) are deferred to the fixtures that need them, so suites
# such as tests/kernels run on a GPU machine that has torch and triton but not the service stack.

POSTGRES_URL = os.environ.get("ISOAUDIT_TEST_POSTGRES_URL")


def postgres_schema_url() -> Iterator[str]:
    """A URL whose connections live in a schema of their own, dropped afterwards, so concurrent test
    runs against the one server never see each other's tables."""
    if not POSTGRES_URL:
        pytest.skip("ISOAUDIT_TEST_POSTGRES_URL is not set (make test sets it)")
    from sqlalchemy import create_engine, text

    schema = f"isoaudit_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL)
    with admin.begin() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def blank_database_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[str]:
    """An empty database: no schema at all."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'isoaudit.db'}"
    else:
        yield from postgres_schema_url()


@pytest.fixture
def database_url(blank_database_url: str) -> str:
    """A database a store can open, as a deployment has it: PostgreSQL upgraded explicitly (as
    `isoaudit db upgrade` does); SQLite left empty, since the embedded store upgrades itself."""
    if not blank_database_url.startswith("sqlite"):
        from isoaudit.audit.db.schema import upgrade

        upgrade(blank_database_url)
    return blank_database_url


@pytest.fixture
def store(database_url: str) -> Iterator[Store]:
    from isoaudit.audit.db import Store

    store = Store(database_url)
    yield store
    store.dispose()


@pytest.fixture(scope="module", autouse=True)
def _kernels_as_users_run_them(request: pytest.FixtureRequest) -> Iterator[None]:
    """The torch path for CPU tensors in the modules of :data:`USERS_CPU_SUITES` and
    :data:`USERS_CPU_MODULES`, from before their module-scoped fixtures (an engine, a model) run.
    The variable is read at each kernel call (``kernels._triton.use_triton``); helper functions
    decorated under the interpreter at import are then never called."""
    relative = request.path.relative_to(request.config.rootpath / "tests").parts
    if len(relative) == 1:  # a module at the top of tests/
        users = relative[0] in USERS_CPU_MODULES
    else:
        users = relative[0] in USERS_CPU_SUITES
    if not users or os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def steady_heap() -> Iterator[None]:
    """Keep full garbage collections short while the test runs, as in a deployed process.

    By the time the service and monitoring tests run, this process has imported torch, vLLM,
    transformers and Dash and kept what earlier tests left: well over a million tracked objects. A
    full collection walks them all with every thread stopped, over a second on a loaded core, and
    lands wherever an allocation makes it due; a background thread (the outbox, the server, the
    sink) then misses a deadline that no deployed process, holding a fraction of that, would.
    What exists before the test is moved out of the walk for its duration, as an attached
    collector does in a job (:func:`isoaudit.collectors.heap.hold`, released afterwards)."""
    from isoaudit.collectors import heap

    held = heap.hold()
    try:
        yield
    finally:
        if held:
            heap.release()


@contextmanager
def flask_proxies_bound() -> Iterator[None]:
    """Start a vLLM engine here even when Dash (so Flask) is imported in this process.

    vLLM's CPU platform scans every module's attributes with ``hasattr(value, "__dict__")`` when an
    engine starts (``vllm/triton_utils/dispatcher.py``, ``_rebind_kernels``); Flask's context-local
    proxies (``current_app``, ``request``, ``g``, ``session``) raise RuntimeError there outside a
    context, so the engine fails to start once the dashboard tests have imported Dash. Binding the
    proxies to a throwaway app while the engine starts is enough (its workers fork inside it)."""
    if "flask" not in sys.modules:
        yield
        return
    import flask

    with flask.Flask("isoaudit-vllm-start").test_request_context():
        yield
