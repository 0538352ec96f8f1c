"""Every endpoint of the API over real HTTP, on SQLite and PostgreSQL: ingest (transactional,
idempotent, validated), authentication and project isolation, size limits, queries, control."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from functools import partial

import httpx
from isoaudit.audit.alerts import AlertEngine, DatabaseChannel
from isoaudit.audit.api import create_app
from isoaudit.audit.api.live import LiveServer
from isoaudit.audit.db import MAX_PAGE, Store
from isoaudit.audit.db.models import RunRow, SampleRow
from isoaudit.audit.db.schema import head_revision
from isoaudit.audit.records import Batch
from isoaudit.audit.settings import Settings
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from tests import factories
from tests.service import workload

#: Small samples (6 completion tokens), three per side unless told.
step_records = partial(workload.step_records, n=3, n_completion=6)


def batch_json(*records) -> str:
    return Batch(records=list(records)).model_dump_json()


def count(store: Store, model=SampleRow) -> int:
    with store.sessions() as session:
        return session.scalar(select(func.count()).select_from(model))


def save_results(store: Store, run_id: str, step: int, kl: float) -> None:
    """Comparison results as the worker would save them (two samples, one diverging)."""
    keys = ["a" * 32, "b" * 32]
    store.save_comparison(
        [
            {
                "run_id": run_id,
                "step": step,
                "sample_key": keys[0],
                "n_tokens": 6,
                "metrics": {"kl_k3": kl, "kl_k1": kl / 2, "is_std": None},
                "diagnosis": "numerical",
                "diagnosis_detail": {"sentence": "layers.1.mlp differs first"},
                "first_divergence_region": "layers.1.mlp",
                "first_divergence_position": 3,
                "grid": {"regions": ["embed"], "cells": [[0]]},
            },
            {
                "run_id": run_id,
                "step": step,
                "sample_key": keys[1],
                "n_tokens": 6,
                "metrics": {"kl_k3": 0.0, "kl_k1": 0.0},
                "diagnosis": "clean",
                "diagnosis_detail": {},
                "first_divergence_region": None,
                "first_divergence_position": None,
                "grid": {},
            },
        ],
        [
            {
                "run_id": run_id,
                "step": step,
                "n_samples": 2,
                "metrics": {"kl_k3": kl, "kl_k1": kl / 2, "ppl_ratio": None, "kl_k3/len_0_256": kl},
                "diagnoses": {"counts": {"numerical": 1, "clean": 1}},
            }
        ],
        [],
    )


# ---------------------------------------------------------------------- health, docs


def test_healthz_and_openapi(anonymous: httpx.Client, store: Store):
    health = anonymous.get("/healthz")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "database": store.dialect, "schema_revision": head_revision()}
    document = anonymous.get("/openapi.json").json()
    assert {"/v1/ingest", "/v1/runs", "/v1/runs/{run_id}/control", "/metrics", "/healthz"} <= set(
        document["paths"]
    )
    ingest_body = document["paths"]["/v1/ingest"]["post"]["requestBody"]["content"]["application/json"][
        "schema"
    ]
    assert ingest_body == {"$ref": "#/components/schemas/Batch"}
    assert "SampleLogprobs" in document["components"]["schemas"]
    assert anonymous.get("/docs").status_code == 200


# ---------------------------------------------------------------------- ingest


def test_ingest_stores_a_batch_and_a_replay_stores_nothing_twice(api: httpx.Client, store: Store):
    body = batch_json(factories.run(), factories.manifest(), *step_records(n=3))
    first = api.post("/v1/ingest", content=body)
    assert first.status_code == 200, first.text
    assert first.json()["stored"] == {"run": 1, "manifest": 1, "sample": 6}
    assert first.json()["pending"] == 3
    assert first.json()["control"] == {"mode": "native", "version": 0, "updated_at": None, "updated_by": ""}
    assert first.json()["controls"]["run-1"]["mode"] == "native"

    replay = api.post("/v1/ingest", content=body)
    assert replay.status_code == 200
    assert sum(replay.json()["stored"].values()) == 0
    assert replay.json()["duplicates"] == {"run": 1, "manifest": 1, "sample": 6}
    assert count(store) == 6
    assert store.run_project("run-1") == "alpha"


def test_ingest_reply_carries_the_desired_mode(api: httpx.Client):
    api.post("/v1/ingest", content=batch_json(factories.run()))
    assert api.put("/v1/runs/run-1/control", json={"mode": "invariant", "version": 0}).status_code == 200
    reply = api.post("/v1/ingest", content=batch_json(*step_records(n=1))).json()
    assert (reply["control"]["mode"], reply["control"]["version"]) == ("invariant", 1)


MALFORMED = [
    (lambda r: r[3].update(side="trainr"), 3, "sample", "side"),
    (lambda r: r[3].update(logprobs="not base64!"), 3, "sample", "logprobs"),
    (lambda r: r[3].update(prompt_len=-1), 3, "sample", "prompt_len"),
    (lambda r: r[3].update(surprise=1), 3, "sample", "surprise"),
    (lambda r: r[0].update(run_id="bad id!"), 0, "run", "run_id"),
    (lambda r: r[3].pop("step"), 3, "sample", "step"),
    (lambda r: r[2].update(kind="nope"), 2, "unknown", "kind"),
    (lambda r: r.__setitem__(1, 7), 1, "unknown", "record"),
]


def test_a_malformed_record_is_refused_by_name_and_the_rest_is_stored(api, store):
    for mutate, index, kind, field in MALFORMED:
        with store.engine.begin() as connection:  # each case starts from an empty store
            connection.execute(SampleRow.__table__.delete())
            connection.execute(RunRow.__table__.delete())
        records = json.loads(batch_json(factories.run(), *step_records(n=2)))["records"]
        mutate(records)
        reply = api.post("/v1/ingest", json={"records": records})
        assert reply.status_code == 200, reply.text
        [rejected] = reply.json()["rejected"]
        assert (rejected["index"], rejected["kind"], rejected["field"]) == (index, kind, field), rejected
        assert rejected["message"].startswith(f"{field}: ")
        assert "AAAA" not in rejected["message"]  # no echo of the (base64) input
        assert count(store) == (3 if index > 0 else 4)
        assert count(store, RunRow) == 1


def test_a_record_that_fails_a_cross_field_check_is_named(api, store):
    records = json.loads(batch_json(*step_records(n=1)))["records"]
    records[0]["prompt_len"] = 9  # one more than fits: logprobs now has the wrong length
    reply = api.post("/v1/ingest", json={"records": records})
    assert reply.status_code == 200
    assert reply.json()["rejected"][0]["message"].startswith("logprobs: 6 values for 1 completion tokens")
    assert reply.json()["stored"] == {"sample": 1}
    assert count(store) == 1


def test_bodies_that_are_not_batches_get_422(api, store):
    for body in (
        b"",
        b"{",
        b"[]",
        b'{"records": 3}',
        b'{"records": [], "extra": 1}',
        b"\xff\xfe",
        b'"\\ud800"',
    ):
        reply = api.post("/v1/ingest", content=body, headers={"Content-Type": "application/json"})
        assert reply.status_code == 422, body
        assert reply.json()["detail"][0]["loc"][0] == "body"
    assert count(store, RunRow) == 0


def test_ingest_without_a_valid_token_gets_401_and_stores_nothing(anonymous, store, server):
    body = batch_json(factories.run(), *step_records(n=1))
    for headers in (
        {},
        {"Authorization": "Bearer iso_0123456789abcdef_wrongwrongwrongwrongwrong"},
        {"Authorization": "Bearer nonsense"},
        {"Authorization": "Basic dXNlcjpwYXNz"},
    ):
        reply = anonymous.post("/v1/ingest", content=body, headers=headers)
        assert reply.status_code == 401, headers
        assert reply.headers["www-authenticate"] == "Bearer"
    assert (count(store), count(store, RunRow)) == (0, 0)


def test_a_revoked_token_gets_401(api, store, token):
    from isoaudit.audit.auth import revoke_token

    assert api.post("/v1/ingest", content=batch_json(factories.run())).status_code == 200
    assert revoke_token(store, token.split("_")[1])
    assert api.post("/v1/ingest", content=batch_json(factories.run("run-2"))).status_code == 401
    assert store.run_project("run-2") is None


def test_projects_cannot_read_or_write_each_others_runs(api, server, other_token, store):
    api.post("/v1/ingest", content=batch_json(factories.run(), *step_records(n=1)))
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {other_token}"}) as beta:
        write = beta.post("/v1/ingest", content=batch_json(*step_records(step=5, n=1)))
        assert write.status_code == 403
        assert "run_id" in write.json()["detail"]
        assert beta.get("/v1/runs").json() == []
        for path in ("", "/steps", "/metrics", "/divergences", "/alerts", "/control", "/steps/0/samples"):
            assert beta.get(f"/v1/runs/run-1{path}").status_code == 404, path
        assert beta.put("/v1/runs/run-1/control", json={"mode": "invariant", "version": 0}).status_code == 404
        assert beta.post("/v1/runs", json={"run_id": "run-1"}).status_code == 403
    assert count(store) == 2
    assert store.get_control("run-1").version == 0


def test_bodies_over_the_limit_get_413(api, store):
    big = batch_json(*[factories.sample("trainer", seed=i, n_completion=200_000) for i in range(4)])
    assert len(big) > 4 << 20
    declared = api.post("/v1/ingest", content=big)
    assert declared.status_code == 413
    assert "limit" in declared.json()["detail"]

    def chunks():  # no Content-Length: the limit is enforced while reading
        for start in range(0, len(big), 1 << 20):
            yield big[start : start + (1 << 20)].encode()

    streamed = api.post("/v1/ingest", content=chunks())
    assert streamed.status_code == 413
    assert count(store) == 0

    def big_run():  # a route whose body FastAPI parses: the limit holds there too
        yield b'{"run_id": "huge", "config": {"blob": "'
        for _ in range(5):
            yield b"x" * (1 << 20)
        yield b'"}}'

    assert (
        api.post("/v1/runs", content=big_run(), headers={"Content-Type": "application/json"}).status_code
        == 413
    )
    assert count(store, RunRow) == 0


# ---------------------------------------------------------------------- runs and queries


def test_post_run_is_idempotent_and_validated(api, store):
    created = api.post("/v1/runs", json={"run_id": "run-9", "name": "grpo", "config": {"lr": 1e-6}})
    assert created.status_code == 201, created.text
    assert created.json()["run_id"] == "run-9"
    assert created.json()["project"] == "alpha"
    assert created.json()["control"]["mode"] == "native"
    assert (
        api.post("/v1/runs", json={"run_id": "run-9", "name": "grpo", "config": {"lr": 1e-6}}).status_code
        == 201
    )
    assert count(store, RunRow) == 1
    bad = api.post("/v1/runs", json={"run_id": "", "name": "x"})
    assert bad.status_code == 422
    assert bad.json()["detail"][0]["loc"] == ["body", "run_id"]
    assert api.post("/v1/runs", json={"run_id": "r", "bogus": 1}).json()["detail"][0]["loc"] == [
        "body",
        "bogus",
    ]


def test_run_queries(api, store):
    api.post(
        "/v1/ingest", content=batch_json(factories.run(), *step_records(n=2), *step_records(step=1, n=1))
    )
    save_results(store, "run-1", 0, kl=2e-3)

    runs = api.get("/v1/runs").json()
    assert [(r["run_id"], r["n_steps"], r["last_step"]) for r in runs] == [("run-1", 2, 1)]
    run = api.get("/v1/runs/run-1").json()
    assert (run["name"], run["project"], run["control"]["version"]) == ("test run", "alpha", 0)
    assert run["started_at"].endswith("Z") or "+00:00" in run["started_at"]

    steps = api.get("/v1/runs/run-1/steps").json()
    assert steps == [
        {"step": 0, "trainer_samples": 2, "rollout_samples": 2, "compared_samples": 2},
        {"step": 1, "trainer_samples": 1, "rollout_samples": 1, "compared_samples": 0},
    ]

    metrics = api.get("/v1/runs/run-1/metrics").json()
    assert len(metrics) == 1
    assert metrics[0]["step"] == 0 and metrics[0]["n_samples"] == 2
    assert math.isclose(metrics[0]["metrics"]["kl_k3"], 2e-3)
    assert metrics[0]["metrics"]["ppl_ratio"] is None
    only = api.get("/v1/runs/run-1/metrics", params={"names": ["kl_k1"], "from_step": 0, "to_step": 0}).json()
    assert only[0]["metrics"] == {"kl_k1": 1e-3}
    assert api.get("/v1/runs/run-1/metrics", params={"from_step": 1}).json() == []

    samples = api.get("/v1/runs/run-1/steps/0/samples").json()
    assert [s["diagnosis"] for s in samples] == ["numerical", "clean"]
    assert samples[0]["metrics"]["is_std"] is None  # "no data"
    assert samples[0]["grid"] is None
    with_grid = api.get(
        "/v1/runs/run-1/steps/0/samples", params={"include_grid": True, "diagnosis": "numerical"}
    )
    assert [s["grid"] for s in with_grid.json()] == [{"regions": ["embed"], "cells": [[0]]}]
    assert api.get("/v1/runs/run-1/steps/7/samples").json() == []

    divergences = api.get("/v1/runs/run-1/divergences").json()
    assert divergences == [
        {
            "step": 0,
            "sample_key": "a" * 32,
            "region": "layers.1.mlp",
            "position": 3,
            "diagnosis": "numerical",
            "diagnosis_detail": {"sentence": "layers.1.mlp differs first"},
        }
    ]
    assert api.get("/v1/runs/run-1/divergences", params={"step": 1}).json() == []

    assert api.get("/v1/runs/nope").status_code == 404
    assert api.get("/v1/runs/nope/steps").status_code == 404
    assert api.get("/v1/runs/bad%20id/steps").status_code == 422


def test_list_reads_are_paginated(api, store):
    """Runs and a step's samples come a page at a time (``limit``/``offset``), in a stable order, and
    a page larger than the data layer's MAX_PAGE is refused."""
    runs = [
        factories.run(run_id=f"run-{i}", started_at=datetime(2026, 1, 1 + i, tzinfo=UTC)) for i in range(3)
    ]
    api.post("/v1/ingest", content=batch_json(*runs, *step_records(n=2)))
    save_results(store, "run-1", 0, kl=2e-3)

    newest_first = [r["run_id"] for r in api.get("/v1/runs").json()]
    assert newest_first == ["run-2", "run-1", "run-0"]
    pages = [api.get("/v1/runs", params={"limit": 2, "offset": offset}).json() for offset in (0, 2)]
    assert [[r["run_id"] for r in page] for page in pages] == [newest_first[:2], newest_first[2:]]

    keys = [s["sample_key"] for s in api.get("/v1/runs/run-1/steps/0/samples").json()]
    assert keys == ["a" * 32, "b" * 32]
    second = api.get("/v1/runs/run-1/steps/0/samples", params={"limit": 1, "offset": 1}).json()
    assert [s["sample_key"] for s in second] == keys[1:]

    for path in ("/v1/runs", "/v1/runs/run-1/steps/0/samples"):
        assert api.get(path, params={"limit": MAX_PAGE + 1}).status_code == 422
        assert api.get(path, params={"limit": 0}).status_code == 422
        assert api.get(path, params={"offset": -1}).status_code == 422


def test_reads_need_a_token_unless_configured_open(anonymous, api, store):
    api.post("/v1/ingest", content=batch_json(factories.run()))
    for path in (
        "/v1/runs",
        "/v1/runs/run-1",
        "/v1/runs/run-1/control",
        "/v1/alerts",
        "/v1/alert-rules",
        "/metrics",
    ):
        assert anonymous.get(path).status_code == 401, path
    with LiveServer(
        create_app(store, Settings(run_worker=False, require_token_for_reads=False))
    ) as open_server:
        with httpx.Client(base_url=open_server.url) as client:
            assert [r["run_id"] for r in client.get("/v1/runs").json()] == ["run-1"]
            assert client.get("/v1/runs/run-1/control").status_code == 200
            assert client.post("/v1/ingest", content=batch_json(factories.run("run-2"))).status_code == 401
            assert (
                client.put("/v1/runs/run-1/control", json={"mode": "native", "version": 0}).status_code == 401
            )


# ---------------------------------------------------------------------- control


def test_control_is_versioned(api, store):
    assert api.get("/v1/runs/run-1/control").status_code == 404
    api.post("/v1/runs", json={"run_id": "run-1"})
    assert api.get("/v1/runs/run-1/control").json()["version"] == 0

    first = api.put("/v1/runs/run-1/control", json={"mode": "invariant", "version": 0})
    assert first.status_code == 200
    assert (first.json()["mode"], first.json()["version"]) == ("invariant", 1)
    assert first.json()["updated_by"].startswith("token:")

    stale = api.put("/v1/runs/run-1/control", json={"mode": "native", "version": 0})
    assert stale.status_code == 409
    assert stale.json()["detail"]["current"] == {"mode": "invariant", "version": 1}
    assert store.get_control("run-1").mode == "invariant"

    back = api.put("/v1/runs/run-1/control", json={"mode": "native", "version": 1})
    assert back.json()["version"] == 2
    assert api.get("/v1/runs/run-1/control").json()["mode"] == "native"

    bad = api.put("/v1/runs/run-1/control", json={"mode": "fast", "version": 2})
    assert bad.status_code == 422
    assert bad.json()["detail"][0]["loc"] == ["body", "mode"]
    assert api.put("/v1/runs/run-1/control", json={"mode": "native"}).json()["detail"][0]["loc"] == [
        "body",
        "version",
    ]
    assert api.put("/v1/runs/nope/control", json={"mode": "native", "version": 0}).status_code == 404
    assert store.get_control("run-1").version == 2


# ---------------------------------------------------------------------- alerts, rules, silences


def test_alert_rule_management(api, server, other_token):
    rules = {r["name"]: r for r in api.get("/v1/alert-rules").json()}
    assert rules["kl_k3_warning"]["for"] == 3 and rules["kl_k3_warning"]["source"] == "default"
    assert rules["kl_k3_critical"]["threshold"] == 1e-2

    rule = {
        "name": "drift",
        "metric": "logprob_abs_diff_mean",
        "comparison": ">=",
        "threshold": 0.05,
        "window": 5,
        "aggregation": "mean",
        "for": 2,
        "keep_firing_for": 1,
        "labels": {"team": "rl"},
    }
    created = api.post("/v1/alert-rules", json=rule)
    assert created.status_code == 201, created.text
    assert created.json()["project"] == "alpha" and created.json()["source"] == "api"
    assert api.post("/v1/alert-rules", json=rule).status_code == 409
    assert api.get("/v1/alert-rules/drift").json()["window"] == 5

    replaced = api.put("/v1/alert-rules/drift", json={**rule, "threshold": 0.1})
    assert replaced.status_code == 200 and replaced.json()["threshold"] == 0.1
    assert api.put("/v1/alert-rules/other", json=rule).status_code == 422  # name differs from the path

    bad = api.post("/v1/alert-rules", json={**rule, "name": "x", "metric": "kl_k4"})
    assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["body", "metric"]
    assert api.post("/v1/alert-rules", json={**rule, "name": "y", "for": -1}).json()["detail"][0]["loc"] == [
        "body",
        "for",
    ]
    assert api.put("/v1/alert-rules/kl_k3_warning", json={**rule, "name": "kl_k3_warning"}).status_code == 403
    assert api.delete("/v1/alert-rules/kl_k3_warning").status_code == 403

    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {other_token}"}) as beta:
        assert "drift" not in {r["name"] for r in beta.get("/v1/alert-rules").json()}
        assert beta.get("/v1/alert-rules/drift").status_code == 404
        assert beta.delete("/v1/alert-rules/drift").status_code == 404
        assert beta.put("/v1/alert-rules/drift", json=rule).status_code == 409

    assert api.delete("/v1/alert-rules/drift").status_code == 204
    assert api.get("/v1/alert-rules/drift").status_code == 404
    assert api.delete("/v1/alert-rules/drift").status_code == 404


def test_alerts_and_notifications_endpoints(api, store, server, other_token):
    api.post("/v1/ingest", content=batch_json(factories.run()))
    engine = AlertEngine(store, [DatabaseChannel()])
    for step, kl in enumerate([5e-2, 0.0]):
        save_results(store, "run-1", step, kl)
        engine.evaluate("run-1", step, {"kl_k3": kl})

    alerts = api.get("/v1/alerts").json()
    critical = next(a for a in alerts if a["rule"] == "kl_k3_critical")
    assert (critical["state"], critical["fired_step"], critical["resolved_step"]) == ("resolved", 0, 1)
    assert critical["labels"]["severity"] == "critical"
    warning = next(a for a in alerts if a["rule"] == "kl_k3_warning")
    assert warning["state"] == "inactive"  # pending at step 0, cleared before firing
    assert api.get("/v1/runs/run-1/alerts", params={"state": "resolved"}).json() == [critical]
    assert api.get("/v1/alerts", params={"state": "firing"}).json() == []
    assert api.get(f"/v1/alerts/{critical['id']}").json() == critical
    notices = api.get(f"/v1/alerts/{critical['id']}/notifications").json()
    assert [(n["event"], n["channel"], n["status"]) for n in notices] == [
        ("firing", "database", "stored"),
        ("resolved", "database", "stored"),
    ]
    assert api.get("/v1/alerts/999999").status_code == 404
    assert api.get("/v1/alerts", params={"state": "bogus"}).status_code == 422
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {other_token}"}) as beta:
        assert beta.get("/v1/alerts").json() == []
        assert beta.get(f"/v1/alerts/{critical['id']}").status_code == 404
        assert beta.get(f"/v1/alerts/{critical['id']}/notifications").status_code == 404


def test_silence_endpoints(api, server, other_token):
    created = api.post("/v1/silences", json={"rule": "kl_k3_warning", "duration_s": 3600, "comment": "known"})
    assert created.status_code == 201, created.text
    silence = created.json()
    assert silence["project"] == "alpha" and silence["rule"] == "kl_k3_warning"
    assert [s["id"] for s in api.get("/v1/silences", params={"active": True}).json()] == [silence["id"]]
    assert api.get(f"/v1/silences/{silence['id']}").json() == silence

    assert api.post("/v1/silences", json={"rule": "x"}).status_code == 422  # no end
    both = api.post("/v1/silences", json={"duration_s": 1, "ends_at": "2030-01-01T00:00:00Z"})
    assert both.status_code == 422
    naive = api.post("/v1/silences", json={"ends_at": "2030-01-01T00:00:00"})
    assert naive.status_code == 422
    past = api.post("/v1/silences", json={"ends_at": "2001-01-01T00:00:00Z"})
    assert past.status_code == 422 and past.json()["detail"][0]["loc"] == ["body", "ends_at"]

    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {other_token}"}) as beta:
        assert beta.get("/v1/silences").json() == []
        assert beta.get(f"/v1/silences/{silence['id']}").status_code == 404
        assert beta.delete(f"/v1/silences/{silence['id']}").status_code == 404

    ended = api.delete(f"/v1/silences/{silence['id']}")
    assert ended.status_code == 200
    assert api.get("/v1/silences", params={"active": True}).json() == []
    assert len(api.get("/v1/silences").json()) == 1
    assert api.delete("/v1/silences/424242").status_code == 404


# ---------------------------------------------------------------------- /metrics


def test_prometheus_metrics(api, store, server, other_token):
    api.post("/v1/ingest", content=batch_json(factories.run(), *step_records(n=2)))
    api.post("/v1/ingest", content=batch_json(*step_records(n=2)))  # all duplicates
    save_results(store, "run-1", 0, kl=2e-2)
    save_results(store, "run-1", 1, kl=3e-2)
    AlertEngine(store, [DatabaseChannel()]).evaluate("run-1", 1, None)

    reply = api.get("/metrics")
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(reply.text)}
    kl = {(s.labels["run_id"], s.labels["length"]): s.value for s in families["isoaudit_kl_k3"].samples}
    assert kl == {("run-1", "all"): 3e-2, ("run-1", "0_256"): 3e-2}
    assert "ppl_ratio" not in str(families.get("isoaudit_ppl_ratio", ""))  # null: not exported
    assert [s.value for s in families["isoaudit_last_compared_step"].samples] == [1.0]
    open_alerts = {  # the kl_k3 defaults; other default rules (other frameworks' figures) may fire too
        (s.labels["isoaudit_rule"], s.labels["state"])
        for s in families["isoaudit_alerts"].samples
        if s.labels["isoaudit_rule"].startswith("kl_k3")
    }
    assert open_alerts == {("kl_k3_critical", "firing"), ("kl_k3_warning", "pending")}
    records = {
        (s.labels["kind"], s.labels["outcome"]): s.value
        for s in families["isoaudit_ingest_records"].samples
        if s.name.endswith("_total")
    }
    assert records[("sample", "stored")] == 4 and records[("sample", "duplicate")] == 4
    assert families["isoaudit_comparison_queue_samples"].samples[0].value == 2

    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {other_token}"}) as beta:
        scoped = {f.name: f for f in text_string_to_metric_families(beta.get("/metrics").text)}
        assert "isoaudit_kl_k3" not in scoped
        assert scoped["isoaudit_alerts"].samples == []
        assert scoped["isoaudit_ingest_records"].samples == []  # alpha's ingest, not beta's


def test_concurrent_clients_creating_the_same_run_store_everything_once(server, token, store):
    """Trainer and rollout collectors of one job race to create its run implicitly; the loser's
    transaction is retried, and every record is stored exactly once."""
    from concurrent.futures import ThreadPoolExecutor

    bodies = [batch_json(*step_records(run_id="shared", step=step, n=2)) for step in range(8)]
    bodies += bodies[:4]  # replays racing with the originals

    def post(body: str) -> httpx.Response:
        with httpx.Client(
            base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=60
        ) as client:
            return client.post("/v1/ingest", content=body)

    with ThreadPoolExecutor(max_workers=8) as pool:
        replies = list(pool.map(post, bodies))
    assert [r.status_code for r in replies] == [200] * len(bodies), [
        r.text for r in replies if r.status_code != 200
    ]
    assert sum(r.json()["stored"].get("sample", 0) for r in replies) == 8 * 4
    assert sum(r.json()["duplicates"].get("sample", 0) for r in replies) == 4 * 4
    assert count(store) == 32 and count(store, RunRow) == 1
