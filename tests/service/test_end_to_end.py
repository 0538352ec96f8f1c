"""End to end over real HTTP, on SQLite and PostgreSQL: the trainer collector's ``HttpSink`` posts
to the served app, the app's background worker compares, the alert engine fires and resolves
through a real webhook receiver, ``/metrics`` shows it, and the control mode reaches the sink. The
sink survives an outage of the service (spool, then replay) with every record stored once."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import numpy as np
import pytest
from isoaudit.audit.api import create_app
from isoaudit.audit.api.live import LiveServer
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store
from isoaudit.audit.db.models import SampleRow
from isoaudit.audit.settings import Settings
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from tests import factories
from tests.service.receiver import Receiver
from tests.service.workload import step_records

HttpSink = pytest.importorskip("isoaudit.collectors.sinks").HttpSink


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the service")
        time.sleep(0.05)


def test_http_sink_worker_alerts_metrics_and_control(store: Store, tmp_path):
    token = create_token(store, "alpha")
    with Receiver() as receiver:
        settings = Settings(run_worker=True, worker_interval_s=0.05, webhook_url=receiver.url)
        with (
            LiveServer(create_app(store, settings)) as server,
            httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"}) as api,
        ):
            controls = []  # what the sink hands to the session's control channel
            sink = HttpSink(server.url, token, spool_dir=tmp_path / "spool", on_control=controls.append)
            sink.send([factories.run()])
            deltas = [
                0.0,
                0.2,
                0.2,
                0.0,
                0.0,
            ]  # kl_k3 0, 0.0187, 0.0187, 0, 0: the critical rule fires, resolves
            for step, delta in enumerate(deltas):
                sink.send(step_records(step, delta))
                assert sink.flush(30)

                def compared(step=step) -> bool:
                    steps = api.get("/v1/runs/run-1/steps").json()
                    return len(steps) == step + 1 and steps[-1]["compared_samples"] == 4

                wait_for(compared)
                wait_for(lambda step=step: api.get("/v1/runs/run-1/metrics").json()[-1]["step"] == step)

            metrics = api.get("/v1/runs/run-1/metrics").json()
            kl = [m["metrics"]["kl_k3"] for m in metrics]
            assert kl[0] == 0.0 and kl[1] == pytest.approx(np.exp(-0.2) + 0.2 - 1, rel=1e-3)

            def kl_k3_notices() -> list[tuple[str, str, int]]:  # other default rules notify too
                return [
                    (m["isoaudit"]["rule"], m["isoaudit"]["event"], m["isoaudit"]["step"])
                    for m in receiver.messages
                    if m["isoaudit"]["rule"].startswith("kl_k3")
                ]

            wait_for(lambda: len(kl_k3_notices()) >= 2)
            assert kl_k3_notices() == [
                ("kl_k3_critical", "firing", 1),
                ("kl_k3_critical", "resolved", 3),
            ]
            alerts = {a["rule"]: a for a in api.get("/v1/runs/run-1/alerts").json()}
            assert alerts["kl_k3_critical"]["state"] == "resolved"
            assert alerts["kl_k3_warning"]["state"] == "inactive"  # pending for two steps, never firing

            divergences = api.get("/v1/runs/run-1/divergences", params={"step": 1}).json()
            assert len(divergences) == 4
            samples = api.get("/v1/runs/run-1/steps/0/samples").json()
            assert {s["diagnosis"] for s in samples} == {"clean"}

            families = {f.name: f for f in text_string_to_metric_families(api.get("/metrics").text)}
            [latest] = [s for s in families["isoaudit_kl_k3"].samples if s.labels["length"] == "all"]
            assert (latest.labels["run_id"], latest.value) == ("run-1", 0.0)

            # The dashboard asks for invariant kernels; the sink learns it from its next ingest reply.
            assert (
                api.put("/v1/runs/run-1/control", json={"mode": "invariant", "version": 0}).status_code == 200
            )
            sink.send(step_records(5, 0.0, n=1))
            assert sink.flush(30)
            assert (controls[-1].mode, controls[-1].version) == ("invariant", 1)
            sink.close()


def test_http_sink_spools_through_an_outage_and_everything_is_stored_once(store: Store, tmp_path):
    token = create_token(store, "alpha")
    server = LiveServer(create_app(store, Settings(run_worker=False)))
    server.start()
    sink = HttpSink(server.url, token, spool_dir=tmp_path / "spool", backoff_initial=0.05, backoff_max=0.2)
    try:
        sink.send([factories.run(), *step_records(0, 0.0)])
        assert sink.flush(30)
        server.stop()  # outage: records go to the spool
        sink.send(step_records(1, 0.0))
        sink.send(step_records(2, 0.0))
        time.sleep(0.5)
        server.start()  # same port
        sink.send(step_records(3, 0.0))
        assert sink.flush(60)
        sink.send(step_records(0, 0.0))  # a replay of what is already stored
        assert sink.flush(30)
    finally:
        sink.close()
        server.stop()
    with store.sessions() as session:
        assert session.scalar(select(func.count()).select_from(SampleRow)) == 4 * 8
        per_step = dict(session.execute(select(SampleRow.step, func.count()).group_by(SampleRow.step)).all())
    assert per_step == {0: 8, 1: 8, 2: 8, 3: 8}
