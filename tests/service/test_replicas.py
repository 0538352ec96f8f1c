"""Several API replicas on one PostgreSQL: two real `isoaudit serve` processes, each with its own
comparison worker and alert engine, take ingest from collectors spread over both. The workers share
the comparison queue through leased step claims, so every step is compared exactly once (its
``revision`` is 1 and the work is split between the two), and each alert is evaluated and announced
once (one firing notice per run at the webhook)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from isoaudit.audit.api.live import free_port
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store
from isoaudit.audit.db.models import ComparisonClaimRow, PendingComparisonRow, SampleResultRow, StepResultRow
from isoaudit.audit.records import Run
from sqlalchemy import func, select

from tests.service.processes import serve
from tests.service.receiver import Receiver
from tests.service.workload import reconcile, step_records

HttpSink = pytest.importorskip("isoaudit.collectors.sinks").HttpSink

RUNS, STEPS, SAMPLES = 3, 24, 8
BREACH_FROM = 10  # steps from here on have kl_k3 ~ 4.8e-3, above the rule's 1e-3

RULES = """
rules:
  - name: replica_kl
    metric: kl_k3
    comparison: ">"
    threshold: 1.0e-3
    for: 1
    severity: critical
"""


def count(store: Store, model, *where) -> int:
    with store.sessions() as session:
        return session.scalar(select(func.count()).select_from(model).where(*where)) or 0


@pytest.mark.slow
@pytest.mark.parametrize("blank_database_url", ["postgres"], indirect=True)
def test_two_replicas_compare_every_step_once_and_alert_once(database_url: str, tmp_path: Path):
    store = Store(database_url)
    token = create_token(store, "alpha")
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    with Receiver() as hook:
        env = {
            "ISOAUDIT_DEFAULT_ALERT_RULES": "0",
            "ISOAUDIT_ALERT_RULES": str(rules),
            "ISOAUDIT_ALERT_WEBHOOK_URL": hook.url,
            "ISOAUDIT_WORKER_INTERVAL_S": "0.05",
            "ISOAUDIT_WORKER_LEASE_S": "30",
        }
        ports = [free_port(), free_port()]
        replicas = [serve(database_url, port, worker=True, env=env) for port in ports]
        sinks = [
            HttpSink(
                f"http://127.0.0.1:{ports[i % 2]}",
                token,
                spool_dir=tmp_path / f"spool-{i}",
                backoff_initial=0.05,
                backoff_max=0.5,
            )
            for i in range(RUNS)
        ]
        sent: list = []
        lock = threading.Lock()

        def collector(i: int) -> None:  # run i sends to replica i % 2, one step every 40 ms
            run_id = f"replica-{i}"
            sinks[i].send([Run(run_id=run_id, name=run_id)])
            for step in range(STEPS):
                batch = step_records(
                    step, 0.1 if step >= BREACH_FROM else 0.0, run_id=run_id, n=SAMPLES, n_completion=128
                )
                with lock:
                    sent.extend(batch)
                sinks[i].send(batch)
                time.sleep(0.04)

        try:
            threads = [threading.Thread(target=collector, args=(i,)) for i in range(RUNS)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            for sink in sinks:
                assert sink.flush(60)
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and (
                count(store, StepResultRow) < RUNS * STEPS or count(store, PendingComparisonRow) > 0
            ):
                time.sleep(0.2)
            deadline = time.monotonic() + 20  # background delivery of the notices
            while time.monotonic() < deadline and len(hook.messages) < RUNS:
                time.sleep(0.1)
            time.sleep(1.0)  # a second notice, were one coming, would arrive meanwhile
        finally:
            for sink in sinks:
                sink.close(10)
            for process in replicas:
                process.terminate()
                process.wait(30)

    counts = reconcile(store, sent)
    assert (counts["lost"], counts["extra"], counts["doubled"]) == (0, 0, 0), counts
    with store.sessions() as session:
        steps = session.execute(
            select(
                StepResultRow.run_id, StepResultRow.step, StepResultRow.revision, StepResultRow.compared_by
            )
        ).all()
    assert len(steps) == RUNS * STEPS
    revisions = Counter(revision for _, _, revision, _ in steps)
    assert revisions == {1: RUNS * STEPS}, revisions  # no step compared twice
    by_worker = Counter(worker for *_, worker in steps)
    assert len(by_worker) == 2, by_worker  # both replicas' workers took a share
    assert count(store, SampleResultRow) == RUNS * STEPS * SAMPLES
    assert count(store, PendingComparisonRow) == 0 and count(store, ComparisonClaimRow) == 0
    notices = Counter((m["isoaudit"]["run_id"], m["isoaudit"]["event"]) for m in hook.messages)
    assert notices == {(f"replica-{i}", "firing"): 1 for i in range(RUNS)}, notices
    firing_steps = sorted(m["isoaudit"]["step"] for m in hook.messages)
    assert all(step >= BREACH_FROM for step in firing_steps), firing_steps
    print(
        f"\ntwo replicas: {len(steps)} steps compared once each, split {dict(by_worker.most_common())}; "
        f"{sum(notices.values())} notices for {RUNS} alerts; {counts}"
    )
    store.dispose()
