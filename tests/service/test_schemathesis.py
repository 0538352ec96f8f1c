"""Property-based tests of the whole API from its OpenAPI document (schemathesis): whatever the
generated requests, the service answers without a server error (5xx). Runs on SQLite with a valid
token (so requests get past authentication) and a bounded number of examples per operation."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from audit.api import ApiSettings, create_app
from audit.auth import create_token
from audit.store import Store
from tests import factories


def _app_and_token():
    """An app on a throw-away SQLite store holding one run with one compared-ready step."""
    directory = Path(tempfile.mkdtemp(prefix="isoaudit-schemathesis-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    store = Store(f"sqlite:///{directory / 'store.db'}")
    store.ingest([factories.run(), factories.sample("trainer"), factories.sample("rollout")], project="alpha")
    app = create_app(store, ApiSettings(run_worker=False, max_body_bytes=1 << 20))
    return app, create_token(store, "alpha")


APP, TOKEN = _app_and_token()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
def test_no_server_errors(case):
    response = case.call(headers={"Authorization": f"Bearer {TOKEN}"})
    case.validate_response(response, checks=[not_a_server_error])
