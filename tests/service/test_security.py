"""Security over real HTTP, on SQLite and PostgreSQL: a project's token cannot read, write, silence
or control another project's runs through ANY endpoint (the routes are enumerated from the app, so
a new endpoint without a case here fails the test); tokens are stored hashed and a revoked one
stops working at once; SQL-injection strings on every path and query parameter change nothing."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from isoaudit.audit.alerts import AlertEngine, DatabaseChannel
from isoaudit.audit.api.live import LiveServer
from isoaudit.audit.auth import verify_token
from isoaudit.audit.db import Store
from isoaudit.audit.db.models import RunRow, SampleRow
from isoaudit.audit.records import Batch
from sqlalchemy import func, inspect, select, text
from typer.testing import CliRunner

from isoaudit.cli import app as cli
from tests import factories
from tests.service.test_api import save_results
from tests.service.workload import step_records

SECRET = "alpha-secret-marker"  # in alpha's run name, config, rule and silence: never in beta's replies


def batch(*records) -> str:
    return Batch(records=list(records)).model_dump_json()


def alpha_state(api: httpx.Client, store: Store) -> dict[str, Any]:
    """Project alpha: a run with samples, compared steps, a fired alert, a rule, a silence, a control."""
    run = factories.run(name=SECRET, config={"note": SECRET})
    samples = step_records(0, n=2)
    assert api.post("/v1/ingest", content=batch(run, *samples)).status_code == 200
    save_results(store, "run-1", 0, kl=5e-2)
    AlertEngine(store, [DatabaseChannel()]).evaluate("run-1", 0, {"kl_k3": 5e-2})
    rule = {"name": "alpha-rule", "metric": "kl_k3", "threshold": 1.0, "description": SECRET}
    assert api.post("/v1/alert-rules", json=rule).status_code == 201
    silence = api.post("/v1/silences", json={"run_id": "run-1", "duration_s": 3600, "comment": SECRET})
    assert silence.status_code == 201
    assert api.put("/v1/runs/run-1/control", json={"mode": "invariant", "version": 0}).status_code == 200
    [alert] = [a for a in api.get("/v1/alerts").json() if a["rule"] == "kl_k3_critical"]
    ids = {"alert_id": alert["id"], "silence_id": silence.json()["id"], "rule": rule}
    return {**ids, "sample_key": samples[0].sample_key}


def snapshot(api: httpx.Client, store: Store) -> dict[str, Any]:
    """Everything of alpha's that a foreign token could try to change."""
    with store.sessions() as session:
        samples = session.scalar(select(func.count()).select_from(SampleRow))
        runs = sorted(session.execute(select(RunRow.run_id, RunRow.project, RunRow.name)).all())
    return {
        "samples": samples,
        "runs": runs,
        "control": api.get("/v1/runs/run-1/control").json(),
        "rules": api.get("/v1/alert-rules/alpha-rule").json(),
        "silences": api.get("/v1/silences").json(),
        "alerts": api.get("/v1/alerts").json(),
    }


def foreign_requests(ids: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], set[int]]]:
    """(method, path template, request kwargs, statuses allowed) for every route, aimed at alpha."""
    rule = {**ids["rule"], "description": "beta was here"}
    return [
        ("GET", "/healthz", {}, {200}),
        ("GET", "/metrics", {}, {200}),
        ("GET", "/v1/metric-names", {}, {200}),
        ("POST", "/v1/ingest", {"content": batch(*step_records(7, n=1))}, {403}),
        ("POST", "/v1/runs", {"json": {"run_id": "run-1", "name": "taken over"}}, {403}),
        ("GET", "/v1/runs", {}, {200}),
        ("GET", "/v1/runs/{run_id}", {}, {404}),
        ("GET", "/v1/runs/{run_id}/steps", {}, {404}),
        ("GET", "/v1/runs/{run_id}/step-stats", {}, {404}),
        ("GET", "/v1/runs/{run_id}/metrics", {}, {404}),
        ("GET", "/v1/runs/{run_id}/steps/{step}/samples", {}, {404}),
        ("GET", "/v1/runs/{run_id}/divergences", {}, {404}),
        ("GET", "/v1/runs/{run_id}/ranks", {}, {404}),
        ("GET", "/v1/runs/{run_id}/routing", {}, {404}),
        ("GET", "/v1/runs/{run_id}/steps/{step}/samples/{sample_key}/routing", {}, {404}),
        ("GET", "/v1/runs/{run_id}/control", {}, {404}),
        ("GET", "/v1/runs/{run_id}/environment-diff", {}, {404}),
        ("PUT", "/v1/runs/{run_id}/control", {"json": {"mode": "native", "version": 1}}, {404}),
        ("GET", "/v1/alert-rules", {}, {200}),
        ("GET", "/v1/alert-rules/{name}", {}, {404}),
        ("POST", "/v1/alert-rules", {"json": {**rule, "project": "alpha"}}, {403}),
        ("PUT", "/v1/alert-rules/{name}", {"json": rule}, {409}),
        ("DELETE", "/v1/alert-rules/{name}", {}, {404}),
        ("GET", "/v1/alerts", {}, {200}),
        ("GET", "/v1/runs/{run_id}/alerts", {}, {404}),
        ("GET", "/v1/alerts/{alert_id}", {}, {404}),
        ("GET", "/v1/alerts/{alert_id}/notifications", {}, {404}),
        ("GET", "/v1/silences", {}, {200}),
        # beta may silence "run-1" for itself: silences apply to their own project's alerts only
        ("POST", "/v1/silences", {"json": {"run_id": "run-1", "duration_s": 60}}, {201}),
        ("GET", "/v1/silences/{silence_id}", {}, {404}),
        ("DELETE", "/v1/silences/{silence_id}", {}, {404}),
    ]


def test_a_foreign_token_gets_nothing_of_another_project_on_any_endpoint(api, server, other_token, store):
    ids = alpha_state(api, store)
    before = snapshot(api, store)
    values = {"run_id": "run-1", "step": 0, "name": "alpha-rule", **ids}
    cases = foreign_requests(ids)
    routes = {
        (method, route.path)
        for route in server.app.routes
        if isinstance(route, APIRoute)
        for method in route.methods
    }
    assert {(m, p) for m, p, _, _ in cases} == routes, "every endpoint needs a foreign-token case"
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {other_token}"}) as beta:
        for method, template, kwargs, allowed in cases:
            path = template.format(**values)
            reply = beta.request(method, path, **kwargs)
            assert reply.status_code in allowed, (method, path, reply.status_code, reply.text)
            assert SECRET not in reply.text, (method, path)
            if path == "/metrics":
                assert 'run_id="run-1"' not in reply.text, "Prometheus export shows another project's run"
        # ids guessed: every alert and silence id up to well past the ones in use
        for n in range(1, 40):
            for path in (f"/v1/alerts/{n}", f"/v1/alerts/{n}/notifications", f"/v1/silences/{n}"):
                reply = beta.get(path)
                assert reply.status_code == 404 or SECRET not in reply.text, path
            assert beta.delete(f"/v1/silences/{n}").status_code in (200, 404)
    assert snapshot(api, store) == before
    # beta's silence on "run-1" does not mute alpha's notices
    save_results(store, "run-1", 1, kl=0.0)
    AlertEngine(store, [DatabaseChannel()]).evaluate("run-1", 1, {"kl_k3": 0.0})
    notices = api.get(f"/v1/alerts/{ids['alert_id']}/notifications").json()
    assert [n["status"] for n in notices if n["event"] == "resolved"] == ["silenced"]  # alpha's own silence
    assert all("beta" not in s["created_by"] for s in api.get("/v1/silences").json())


def test_tokens_are_stored_hashed(store: Store, token: str, other_token: str):
    """Nothing in any table of the database would let someone authenticate."""
    secrets = [t.split("_", 2)[2] for t in (token, other_token)]
    with store.engine.connect() as connection:
        for table in inspect(connection).get_table_names():
            for row in connection.execute(text(f'SELECT * FROM "{table}"')):
                dumped = repr(tuple(row))
                assert not any(secret in dumped for secret in secrets), table
        stored = set(connection.execute(text("SELECT secret_sha256 FROM api_tokens")).scalars())
    assert stored == {hashlib.sha256(s.encode()).hexdigest() for s in secrets}


def test_isoaudit_tokens_revoke_takes_effect_at_once(api, server, token, database_url):
    assert api.post("/v1/ingest", content=batch(factories.run())).status_code == 200
    token_id = token.split("_")[1]
    revoked = CliRunner().invoke(cli, ["tokens", "revoke", token_id, "--database-url", database_url])
    assert revoked.exit_code == 0, revoked.output
    for method, path in (("POST", "/v1/ingest"), ("GET", "/v1/runs"), ("GET", "/v1/runs/run-1")):
        reply = api.request(method, path, content=batch(factories.run("run-2")) if method == "POST" else None)
        assert reply.status_code == 401, (method, path)
        assert reply.json()["detail"].startswith("Authorization:")


INJECTIONS = [
    "' OR '1'='1",
    "run-1' --",
    "1; DROP TABLE runs; --",
    '" OR ""="',
    "run-1%27%20OR%201%3D1",
    "0 UNION SELECT secret_sha256 FROM api_tokens",
    "\x00",
    "run-1\u202e",  # right-to-left override
    "\U0001f600" * 40,
]


def test_sql_injection_strings_on_every_path_and_query_parameter_change_nothing(api, server, store):
    alpha_state(api, store)
    before = snapshot(api, store)
    gets = [
        route.path
        for route in server.app.routes
        if isinstance(route, APIRoute) and "GET" in route.methods and route.path != "/openapi.json"
    ]
    tried = 0
    for path in gets:
        params = re.findall(r"{(\w+)}", path)
        route = next(r for r in server.app.routes if isinstance(r, APIRoute) and r.path == path)
        queries = [q.name for q in route.dependant.query_params]
        for payload in INJECTIONS:
            for target in [*params, *(f"?{q}" for q in queries)]:
                values = {p: ("run-1" if p == "run_id" else "0") for p in params}
                query = {}
                if target.startswith("?"):
                    query[target[1:]] = payload
                else:
                    values[target] = payload
                url = path.format(**{k: quote(v) for k, v in values.items()})
                reply = api.get(url, params=query)
                tried += 1
                assert reply.status_code < 500, (url, query, reply.status_code, reply.text)
                assert "secret_sha256" not in reply.text.replace("0 UNION SELECT secret_sha256", "")
    assert tried > 100
    for payload in INJECTIONS[:6]:  # names are data, kept verbatim and never executed
        reply = api.post("/v1/runs", json={"run_id": "run-inj", "name": payload})
        assert reply.status_code == 201, reply.text
        assert api.get("/v1/runs/run-inj").json()["name"] == payload
    after = snapshot(api, store)
    assert after["samples"] == before["samples"] and after["control"] == before["control"]
    assert [r for r in after["runs"] if r[0] != "run-inj"] == before["runs"]


def quote(value: str) -> str:
    from urllib.parse import quote as url_quote

    return url_quote(value, safe="")


@pytest.mark.parametrize("payload", ["x" * 129, "a/b", "../../etc/passwd", "run 1"])
def test_run_ids_outside_the_alphabet_are_refused_not_looked_up(api, payload):
    reply = api.get(f"/v1/runs/{quote(payload)}")
    assert reply.status_code in (404, 422)
    if reply.status_code == 422:
        assert reply.json()["detail"][0]["loc"][-1] == "run_id"


def test_bodies_with_nul_or_lone_surrogates_are_refused_by_name(api, store):
    """PostgreSQL text cannot hold NUL; a lone surrogate is not UTF-8: a 4xx naming the field, not a 500."""
    for name in ("a\x00b",):
        reply = api.post("/v1/runs", json={"run_id": "run-nul", "name": name})
        assert reply.status_code == 422, reply.text
        assert reply.json()["detail"][0]["loc"] == ["body", "name"]
    manifest = factories.manifest().model_dump(mode="json")
    manifest["process"] = "host\x00:1"
    reply = api.post("/v1/ingest", json={"records": [factories.run().model_dump(mode="json"), manifest]})
    assert reply.status_code == 200
    assert [(r["kind"], r["field"]) for r in reply.json()["rejected"]] == [("manifest", "process")]
    silence = api.post("/v1/silences", json={"duration_s": 60, "comment": "a\x00b"})
    assert silence.status_code == 422 and silence.json()["detail"][0]["loc"][-1] == "comment"
    raw = b'{"run_id": "run-sur", "name": "\\ud800"}'
    reply = api.post("/v1/runs", content=raw, headers={"Content-Type": "application/json"})
    assert reply.status_code == 422
    assert store.run_project("run-nul") is None and store.run_project("run-sur") is None


def test_foreign_token_cannot_read_with_open_reads_either(store, token, other_token):
    """Open reads let anonymous callers see everything, but a token always limits to its project."""
    from isoaudit.audit.api import create_app
    from isoaudit.audit.settings import Settings

    with LiveServer(create_app(store, Settings(run_worker=False, require_token_for_reads=False))) as live:
        with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {token}"}) as alpha:
            assert alpha.post("/v1/ingest", content=batch(factories.run(name=SECRET))).status_code == 200
        with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {other_token}"}) as beta:
            assert beta.get("/v1/runs").json() == [] and beta.get("/v1/runs/run-1").status_code == 404
    assert verify_token(store, token) is not None
