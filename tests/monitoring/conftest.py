"""A live isoaudit service with runs of two projects, alerts and a finished run, for the monitoring
tests: records go in over HTTP, the comparison worker and the alert engine run when the test says
(so a test knows which steps were compared between two scrapes)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from isoaudit.audit.alerts import AlertEngine, DatabaseChannel
from isoaudit.audit.alerts.rules import AlertRule, save_rule
from isoaudit.audit.api import create_app
from isoaudit.audit.api.live import LiveServer
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store
from isoaudit.audit.db.models import StepResultRow
from isoaudit.audit.records import Batch, RuntimeFacts, utcnow
from isoaudit.audit.settings import Settings
from isoaudit.audit.worker import ComparisonWorker
from sqlalchemy import update

from tests import factories

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

#: Two rules of one severity: both fire on one run, which Prometheus must tell apart.
RULES = [
    AlertRule(name="kl_high", metric="kl_k3", threshold=1e-3, severity="warning"),
    AlertRule(name="absdiff_high", metric="logprob_abs_diff_mean", threshold=1e-2, severity="warning"),
]
#: Logprob shifts: over both rules' thresholds, and well under them.
HIGH, LOW, SPIKE = 0.05, 0.001, 0.5


@dataclass
class Service:
    """The served app, its store, a token per project (``alpha``'s also in ``token_file``)."""

    store: Store
    server: LiveServer
    alpha: str
    beta: str
    token_file: Path
    worker: ComparisonWorker

    def client(self, token: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.server.url, headers=headers, timeout=30)

    def post(self, token: str, *records: Any) -> None:
        with self.client(token) as client:
            reply = client.post("/v1/ingest", content=Batch(records=list(records)).model_dump_json())
        assert reply.status_code == 200 and not reply.json()["rejected"], reply.text

    def steps(self, token: str, run_id: str, shifts: dict[int, float]) -> None:
        """Record ``shifts`` ({step: logprob shift of the rollout}) of ``run_id`` in one batch, then
        compare and evaluate them in one go (one transaction saves them all)."""
        records = []
        for step, shift in shifts.items():
            for seed in range(3):
                trainer = factories.sample("trainer", run_id=run_id, step=step, seed=seed, weight_version=1)
                shifted = np.minimum(trainer.logprobs + np.float32(shift), 0).astype(np.float32)
                records += [
                    trainer,
                    factories.sample(
                        "rollout", run_id=run_id, step=step, seed=seed, logprobs=shifted, weight_version=1
                    ),
                ]
        self.post(token, *records)
        self.worker.run_once(run_id)

    def metrics(self, token: str | None, **params: Any) -> str:
        with self.client(token) as client:
            reply = client.get("/metrics", params=params)
        assert reply.status_code == 200, reply.text
        return reply.text


@pytest.fixture(autouse=True)
def _steady_heap(steady_heap: None) -> None:
    """Every test here times background threads: full collections of this test process's heap
    stay out of their way (``steady_heap``)."""


@pytest.fixture
def service(store: Store, tmp_path: Path) -> Iterator[Service]:
    """alpha: ``run-a`` (3 steps, both rules firing, invariant kernels desired and reported, engine
    vllm, framework verl), ``run-s`` (one quiet step) and ``run-old`` (firing, compared two hours
    ago: outside the window); beta: ``run-b``. Reads without a token see every project."""
    for rule in RULES:
        save_rule(store, rule)
    settings = Settings(run_worker=False, default_alert_rules=False, require_token_for_reads=False)
    server = LiveServer(create_app(store, settings))
    server.start()
    alpha, beta = create_token(store, "alpha", "prometheus"), create_token(store, "beta", "prometheus")
    token_file = tmp_path / "isoaudit.token"
    token_file.write_text(alpha + "\n")
    worker = ComparisonWorker(store, on_step=AlertEngine(store, [DatabaseChannel()]).evaluate)
    service = Service(store, server, alpha, beta, token_file, worker)
    invariant = {"remediation": "invariant"}
    service.post(
        alpha,
        factories.run("run-a", config={"framework": "verl"}),
        factories.manifest("trainer", runtime=RuntimeFacts(framework="torch", **invariant), run_id="run-a"),
        factories.manifest(
            "rollout", "engine_decode", runtime=RuntimeFacts(framework="vllm", **invariant), run_id="run-a"
        ),
        factories.run("run-s"),
        factories.run("run-old"),
    )
    service.post(beta, factories.run("run-b"))
    with service.client(alpha) as client:
        reply = client.put("/v1/runs/run-a/control", json={"mode": "invariant", "version": 0})
        assert reply.status_code == 200, reply.text
    service.steps(alpha, "run-a", {0: HIGH, 1: HIGH, 2: HIGH})
    service.steps(alpha, "run-s", {0: LOW})
    service.steps(alpha, "run-old", {0: HIGH})
    service.steps(beta, "run-b", {0: HIGH})
    with store.engine.begin() as connection:  # run-old finished two hours ago
        connection.execute(
            update(StepResultRow)
            .where(StepResultRow.run_id == "run-old")
            .values(computed_at=utcnow() - timedelta(hours=2))
        )
    yield service
    server.stop()
