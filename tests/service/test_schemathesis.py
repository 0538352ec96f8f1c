"""Property-based tests of the whole API from its OpenAPI document (schemathesis), on SQLite and on
PostgreSQL: whatever the generated requests, the service answers without a server error (5xx),
every 4xx says which field is wrong, and nothing partial is stored: an accepted batch accounts for
each of its records (stored, duplicate or rejected by name); a refused request changes nothing.
Runs with a valid token (so requests get past authentication) and a bounded number of examples
(ISOAUDIT_FUZZ_EXAMPLES per operation: 20 by default, about half a minute a database in `make
test`, which sets ISOAUDIT_TEST_POSTGRES_URL so the PostgreSQL half runs too; `make soak` runs 100)."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings
from isoaudit.audit.api import create_app
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store
from isoaudit.audit.db.models import AlertRuleRow, ManifestRow, RunControlRow, RunRow, SampleRow, SilenceRow
from isoaudit.audit.db.schema import upgrade
from isoaudit.audit.settings import Settings
from schemathesis.checks import not_a_server_error
from sqlalchemy import func, select

from tests import factories
from tests.conftest import POSTGRES_URL, postgres_schema_url

#: A 4xx detail that names its field: "run_id: no run 'x'", "Authorization: ...", "body: ...".
NAMED = re.compile(r"^[A-Za-z_][\w.\-]*: ")
COUNTED = (RunRow, SampleRow, ManifestRow, RunControlRow, AlertRuleRow, SilenceRow)


@dataclass
class Service:
    store: Store
    token: str

    def counts(self) -> tuple[int, ...]:
        with self.store.sessions() as session:
            return tuple(session.scalar(select(func.count()).select_from(m)) for m in COUNTED)


def _service(kind: str) -> tuple[object, Service] | None:
    """An app on a throw-away store holding one run with one compare-ready step, and a token of its
    project; built at import (schemathesis reads the schema when tests are collected), removed at exit."""
    if kind == "sqlite":
        directory = Path(tempfile.mkdtemp(prefix="isoaudit-schemathesis-"))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        url = f"sqlite:///{directory / 'store.db'}"
    else:
        if not POSTGRES_URL:
            return None
        urls = postgres_schema_url()
        url = next(urls)
        atexit.register(next, urls, None)  # drops the schema
    upgrade(url)
    store = Store(url)
    atexit.register(store.dispose)
    store.ingest([factories.run(), factories.sample("trainer"), factories.sample("rollout")], project="alpha")
    app = create_app(store, Settings(run_worker=False, max_body_bytes=1 << 20))
    return app, Service(store, create_token(store, "alpha"))


SERVICES = {kind: _service(kind) for kind in ("sqlite", "postgres")}
#: Examples per operation: a bounded pass in `make test`; `make soak` sets ISOAUDIT_FUZZ_EXAMPLES higher.
EXAMPLES = int(os.environ.get("ISOAUDIT_FUZZ_EXAMPLES", "20"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)


def names_a_field(status: int, body: object) -> bool:
    detail = body.get("detail") if isinstance(body, dict) else None
    if status == 422 and isinstance(detail, list):
        return bool(detail) and all(isinstance(e.get("loc"), list) and e["loc"] for e in detail)
    if isinstance(detail, dict):  # 409 on control: {"msg": "version: ...", "current": ...}
        detail = detail.get("msg")
    return isinstance(detail, str) and bool(NAMED.match(detail))


def exercise(case, service: Service) -> None:
    before = service.counts()
    response = case.call(headers={"Authorization": f"Bearer {service.token}"})
    case.validate_response(response, checks=[not_a_server_error])
    try:
        body = response.json()
    except (json.JSONDecodeError, ValueError):
        body = None
    if 400 <= response.status_code < 500:
        assert names_a_field(response.status_code, body), (response.status_code, response.text[:500])
        assert service.counts() == before, "a refused request changed the store"
    elif case.path == "/v1/ingest" and response.status_code == 200:
        sent = json.loads(case.body if isinstance(case.body, str | bytes) else json.dumps(case.body))
        accounted = sum(body["stored"].values()) + sum(body["duplicates"].values()) + len(body["rejected"])
        refused = {r["index"] for r in body["rejected"]}
        # a fingerprints block kept is counted as the per-sample records it stands for
        expected = sum(
            len(record["sample_keys"])
            if i not in refused and record.get("kind") == "fingerprints_block"
            else 1
            for i, record in enumerate(sent["records"])
        )
        assert accounted == expected, body


sqlite_app, sqlite_service = SERVICES["sqlite"]  # type: ignore[misc]


@schemathesis.openapi.from_asgi("/openapi.json", sqlite_app).parametrize()
@SETTINGS
def test_sqlite_no_server_errors_and_every_refusal_names_its_field(case):
    exercise(case, sqlite_service)


if SERVICES["postgres"] is not None:
    postgres_app, postgres_service = SERVICES["postgres"]

    @schemathesis.openapi.from_asgi("/openapi.json", postgres_app).parametrize()
    @SETTINGS
    def test_postgres_no_server_errors_and_every_refusal_names_its_field(case):
        exercise(case, postgres_service)
