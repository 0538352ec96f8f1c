"""The comparison worker killed mid-step: a real `isoaudit serve` process is SIGKILLed
while it holds the claim of a large step it has not saved yet; a restarted service retakes the step
once the lease runs out and compares it exactly once. Also: a lease that runs out under a slow
worker hands the step to another, and the slow worker's late save is refused, not doubled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from isoaudit.audit.api.live import free_port
from isoaudit.audit.db import Store
from isoaudit.audit.db.models import ComparisonClaimRow, PendingComparisonRow, SampleResultRow, StepResultRow
from isoaudit.audit.worker import ComparisonWorker
from sqlalchemy import func, select

from tests import factories
from tests.service.processes import serve
from tests.service.workload import step_records

LEASE_S = 3.0
BIG = 384  # samples of the step the worker is killed in: long enough to compare that the kill lands inside
BIG_COMPLETION = 8192  # tokens each (3.1 M in the step: at 2,048 the worker saved before the kill landed)


def count(store: Store, model, *where) -> int:
    with store.sessions() as session:
        return session.scalar(select(func.count()).select_from(model).where(*where)) or 0


def claim_of(store: Store, step: int) -> str | None:
    with store.sessions() as session:
        return session.scalar(select(ComparisonClaimRow.worker).where(ComparisonClaimRow.step == step))


def results(store: Store) -> list[tuple[int, int, str | None]]:
    with store.sessions() as session:
        rows = session.execute(
            select(StepResultRow.step, StepResultRow.revision, StepResultRow.compared_by).order_by(
                StepResultRow.step
            )
        )
        return [tuple(row) for row in rows]


@pytest.mark.slow
def test_worker_sigkilled_mid_step_then_restarted_compares_the_step_once(database_url: str):
    store = Store(database_url)
    store.ingest([factories.run()])
    store.ingest(step_records(0, 0.01, n=BIG, n_completion=BIG_COMPLETION))
    for step in (1, 2):
        store.ingest(step_records(step, 0.01, n=8, n_completion=64))
    port = free_port()
    env = {"ISOAUDIT_WORKER_INTERVAL_S": "0.05", "ISOAUDIT_WORKER_LEASE_S": str(LEASE_S)}
    process = serve(database_url, port, worker=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while (killed_worker := claim_of(store, 0)) is None and time.monotonic() < deadline:
            time.sleep(0.005)
        assert killed_worker is not None, "the worker never claimed step 0"
        process.send_signal(signal.SIGKILL)  # it holds the claim, and has saved nothing of the batch
        process.wait(10)
        killed = time.monotonic()
        assert results(store) == [], "the batch was saved before the kill: make the step larger"
        assert count(store, PendingComparisonRow) == BIG + 16  # the queue is intact
        process = serve(database_url, port, worker=True, env=env)
        deadline = time.monotonic() + 120
        while len(results(store)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        recovered = time.monotonic() - killed
        time.sleep(0.5)  # a second comparison, were one coming, would land meanwhile
    finally:
        process.kill()
        process.wait(10)
    steps = results(store)
    assert [(step, revision) for step, revision, _ in steps] == [(0, 1), (1, 1), (2, 1)], steps
    assert all(by != killed_worker for *_, by in steps)  # the restarted worker did them
    assert count(store, SampleResultRow) == BIG + 16
    assert count(store, PendingComparisonRow) == 0 and count(store, ComparisonClaimRow) == 0
    assert recovered >= LEASE_S * 0.9  # retaken when the lease ran out, not before
    print(
        f"\nworker SIGKILLed mid-step: step of {BIG} samples compared once, {recovered:.1f} s after the kill"
    )
    store.dispose()


def test_a_lapsed_lease_goes_to_another_worker_and_the_late_save_is_refused(store: Store):
    store.ingest([factories.run(), *step_records(0, n=4)])
    slow = ComparisonWorker(store, lease_s=0.2, name="slow")
    [claim] = store.claim_steps("slow", lease_s=0.2)
    assert store.claim_steps("fast", lease_s=30) == []  # held
    time.sleep(0.3)
    fast = ComparisonWorker(store, lease_s=30, name="fast")
    assert fast.run_once() == 4  # the lapsed lease is retaken
    assert slow._compare_batch([claim]) == 0  # its late save is refused: the step is fast's now
    assert results(store) == [(0, 1, "fast")]
    # New records of a compared step queue it again: compared a second time, and counted so.
    store.ingest(step_records(0, n=6)[8:])
    assert fast.run_once() == 2
    assert results(store) == [(0, 2, "fast")]
    assert count(store, SampleResultRow) == 6 and count(store, ComparisonClaimRow) == 0


def test_samples_still_waiting_for_their_other_side_do_not_block_the_queue(store: Store):
    """The claim checks only the head of the queue (4 x max_pairs rows): a head full of samples whose
    other side never comes is sent to the back, so a ready pair behind it is still reached."""
    store.ingest([factories.run()])
    for step in range(6):  # six trainer-only samples, queued first
        store.ingest([factories.sample("trainer", step=step, seed=step)])
    store.ingest(step_records(9, n=1))
    claims = []
    for _ in range(4):
        claims = store.claim_steps("w", lease_s=30, max_pairs=1)
        if claims:
            break
    assert [(c.step, len(c.sample_keys)) for c in claims] == [(9, 1)]
    assert count(store, PendingComparisonRow) == 7  # nothing waiting was dropped


@pytest.mark.slow
def test_isoaudit_worker_compares_without_the_api_and_stops_on_sigterm(database_url: str):
    """`isoaudit worker`: the comparison worker and alert evaluation as their own process, beside
    `isoaudit serve --no-worker` replicas (a worker inside the API shares its GIL with ingest)."""
    store = Store(database_url)
    store.ingest([factories.run(), *step_records(0, 0.01, n=8), *step_records(1, 0.01, n=8)])
    command = [sys.executable, "-m", "isoaudit.cli", "worker", "--database-url", database_url]
    env = {**os.environ, "ISOAUDIT_WORKER_INTERVAL_S": "0.05", "ISOAUDIT_DEFAULT_ALERT_RULES": "0"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(results(store)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [(step, revision) for step, revision, _ in results(store)] == [(0, 1), (1, 1)]
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output
    assert "compared 16 samples in 2 steps" in output, output
    store.dispose()
