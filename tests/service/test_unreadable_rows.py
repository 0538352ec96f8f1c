"""Bad input never poisons reads: a value a database cannot give back is refused at the boundary,
naming its field, and a stored row that cannot be read back (planted here straight into SQLite and
PostgreSQL, as another tool or a hand edit would) fails that row alone, never the listing it is in."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta, timezone

import httpx
import pytest
from isoaudit.audit.db import Store, UnreadableRow
from isoaudit.audit.db.reads import run_overview, runs_overview
from isoaudit.audit.records import RecordError, Run, StepStats, validate_record
from pydantic import ValidationError
from sqlalchemy import text

from tests import factories

#: Year 1 with a positive offset: year 0 in UTC, which PostgreSQL keeps (as BC) and Python cannot read.
YEAR_ONE = "0001-01-01T00:00:00+05:00"


def test_values_a_database_cannot_give_back_are_refused_naming_the_field(api: httpx.Client, store: Store):
    with pytest.raises(ValidationError) as raised:
        Run(run_id="r", started_at=datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5))))
    assert raised.value.errors()[0]["loc"] == ("started_at",)
    for record, field in [
        ({"kind": "run", "run_id": "r", "started_at": YEAR_ONE}, "started_at"),
        ({"kind": "run", "run_id": "r", "started_at": "1969-12-31T23:59:59Z"}, "started_at"),
        (
            {**factories.manifest().model_dump(mode="json"), "created_at": "9999-12-31T23:00:00-05:00"},
            "created_at",
        ),
        ({"kind": "step_stats", "run_id": "r", "step": 0, "created_at": YEAR_ONE}, "created_at"),
        ({"kind": "run", "run_id": "r", "config": {"seed": 2**64}}, "config.seed"),
        (
            {**factories.manifest().model_dump(mode="json"), "weight_tensor_digests": {"w\x00": "0"}},
            "weight_tensor_digests",
        ),
        (
            {
                **factories.sample("trainer").model_dump(mode="json"),
                "weight_spans": [{"start": 0, "version": "v\x00"}],
            },
            "weight_spans.0.version",
        ),
    ]:
        with pytest.raises(RecordError) as refused:
            validate_record(record)
        assert refused.value.field == field and str(refused.value).startswith(f"{field}: "), refused.value
        result = store.ingest([record], project="alpha")  # a direct store write: refused by name
        assert [r.field for r in result.rejected] == [field] and not result.stored.total()
    # Kept in UTC, whatever offset it came with (SQLite keeps the wall time it is given).
    assert validate_record(
        {"kind": "run", "run_id": "r", "started_at": "2026-01-01T05:00:00+05:00"}
    ).started_at == (datetime(2026, 1, 1, tzinfo=UTC))

    answer = api.post("/v1/runs", json={"run_id": "r1", "started_at": YEAR_ONE})
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == ["body", "started_at"], (
        answer.text
    )
    answer = api.post(
        "/v1/ingest", json={"records": [{"kind": "run", "run_id": "r1", "started_at": YEAR_ONE}]}
    )
    assert answer.status_code == 200 and answer.json()["rejected"][0]["field"] == "started_at", answer.text
    for body, loc in [
        ({"starts_at": YEAR_ONE, "duration_s": 60}, ["body", "starts_at"]),
        ({"starts_at": "9999-12-31T00:00:00Z", "duration_s": 86400 * 365}, ["body", "ends_at"]),
    ]:
        answer = api.post("/v1/silences", json=body)
        assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == loc, answer.text
    listed = api.get("/v1/runs")
    assert listed.status_code == 200 and listed.json() == []
    past = api.get("/v1/runs", params={"offset": 2**63})  # what no BIGINT holds
    assert past.status_code == 422 and past.json()["detail"][0]["loc"] == ["query", "offset"], past.text


def plant(store: Store, statement: str, **values: object) -> None:
    """Write straight into the database, past every isoaudit boundary."""
    with store.engine.begin() as connection:
        connection.execute(text(statement), values)


def test_a_row_that_cannot_be_read_fails_that_row_not_the_listing(
    api: httpx.Client, store: Store, caplog: pytest.LogCaptureFixture
):
    for run_id in ("good", "bad"):
        runs = [factories.run(run_id=run_id), factories.manifest(run_id=run_id)]
        samples = [
            factories.sample(side, run_id=run_id, seed=i) for i in range(2) for side in ("trainer", "rollout")
        ]
        assert not store.ingest([*runs, *samples, StepStats(run_id=run_id, step=0)], project="alpha").rejected
    postgres = store.dialect == "postgresql"
    # The run's start as the fuzz left it on PostgreSQL (BC), or a year SQLite's text cannot give back.
    plant(
        store,
        "UPDATE runs SET started_at = "
        + ("'0001-12-31 19:00:00+00 BC'::timestamptz" if postgres else "'0000-12-31 19:00:00.000000'")
        + " WHERE run_id = 'bad'",
    )
    # One manifest whose body is no manifest, one sample whose logprobs are cut mid-value, one step's
    # figures stored under a start that cannot be read.
    plant(store, "UPDATE manifests SET body = :body WHERE run_id = 'good'", body='{"kind": "manifest"}')
    key = store.samples("good", 0)[0].sample_key
    plant(
        store,
        "UPDATE samples SET logprobs = :cut WHERE run_id = 'good' AND sample_key = :key AND side = 'trainer'",
        cut=b"\x00\x00\x80",
        key=key,
    )
    plant(
        store,
        "UPDATE step_stats SET created_at = "
        + ("'infinity'::timestamptz" if postgres else "'not a time'")
        + " WHERE run_id = 'good'",
    )

    with caplog.at_level(logging.ERROR, logger="isoaudit.store"):
        listed = api.get("/v1/runs")
        assert listed.status_code == 200, listed.text
        assert [run["run_id"] for run in listed.json()] == ["good"]
        assert [r.run_id for r in runs_overview(store)] == ["good"]
        assert store.manifests("good") == []
        assert [(s.sample_key, s.side) for s in store.samples("good", 0)].count((key, "trainer")) == 0
        assert len(store.samples("good", 0)) == 3
        assert store.step_stats("good") == []
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for what in ("run 'bad'", "manifest #", f"sample '{key}' (trainer)", "step stats of run 'good'"):
        assert what in logged, logged

    # A read of that one row says which row and which field, and the rest of the project answers.
    one = api.get("/v1/runs/bad")
    assert one.status_code == 500 and one.json()["detail"].startswith("started_at: the stored run 'bad'"), (
        one.text
    )
    with pytest.raises(UnreadableRow) as unreadable:
        run_overview(store, "bad")
    assert unreadable.value.field == "started_at"
    assert api.get("/v1/runs/good").status_code == 200
    assert api.post("/v1/runs", json={"run_id": "another"}).status_code == 201
    # Registering the run again, valid, repairs it.
    assert api.post("/v1/runs", json={"run_id": "bad", "name": "bad"}).status_code == 201
    assert sorted(run["run_id"] for run in api.get("/v1/runs").json()) == ["another", "bad", "good"]
