"""The comparison backlog against a real store (SQLite and PostgreSQL): what waits to be compared, and
whether any worker is attending to it (what the dashboard's banner and a closing session read)."""

from __future__ import annotations

import time

from isoaudit.audit.db import Backlog, Store
from isoaudit.audit.worker import ComparisonWorker

from tests import factories as f
from tests.dashboard.records import step_records


def _ingest(store: Store, run_id: str, step: int, samples: int = 3) -> None:
    store.ingest([f.run(run_id), *step_records(run_id, step, samples)])


def test_the_backlog_counts_ready_samples_only(store: Store) -> None:
    assert store.backlog() == Backlog() and not store.backlog()
    _ingest(store, "a", 0)
    _ingest(store, "a", 1, samples=2)
    one_sided = [r for r in step_records("b", 0) if getattr(r, "side", None) == "trainer"]
    store.ingest([f.run("b"), *one_sided])  # the rollout side never came: nothing to compare
    backlog = store.backlog()
    assert (backlog.samples, backlog.steps, backlog.runs) == (5, 2, 1) and backlog.oldest is not None
    assert backlog.oldest.tzinfo is not None
    assert store.backlog("b") == Backlog() and store.backlog("a").steps == 2
    assert store.backlog(queued_before=backlog.oldest) == Backlog()
    ComparisonWorker(store).run_once()
    assert store.backlog() == Backlog() and store.compared_steps("a") == 2 and store.compared_steps("b") == 0


def test_stalled_means_waiting_with_no_worker_comparing(store: Store) -> None:
    _ingest(store, "a", 1)  # older than what follows
    _ingest(store, "b", 0)
    assert store.stalled_backlog(after_s=60) == Backlog()  # fresh: a worker may just be starting
    time.sleep(1.2)
    _ingest(store, "a", 2)
    stalled = store.stalled_backlog(after_s=1.0)
    assert (stalled.steps, stalled.runs) == (2, 2)  # a's step 2 is fresh; a's step 1 and b's step 0 wait
    assert store.stalled_backlog(after_s=1.0, run_id="b").steps == 1

    # A worker holding a live claim anywhere is a worker at work: nothing is called stalled.
    ghost = store.claim_steps("ghost", lease_s=60, max_pairs=3)
    assert [(c.run_id, c.step) for c in ghost] == [("a", 1)]
    assert store.stalled_backlog(after_s=1.0) == Backlog()

    # A run with a step compared within the window has a comparer of its own (a job's session):
    # its older steps are not called stalled; another run's are.
    assert ComparisonWorker(store, name="session-of-a").run_once("a") == 3  # step 2; step 1 is claimed
    store.release_claims("ghost", ghost)
    assert store.backlog("a").steps == 1
    stalled = store.stalled_backlog(after_s=1.0)
    assert (stalled.steps, stalled.runs, stalled.samples) == (1, 1, 3)
    assert store.stalled_backlog(after_s=1.0, run_id="a") == Backlog()
    assert store.stalled_backlog(after_s=1.0, run_id="b").steps == 1

    ComparisonWorker(store).run_once()
    assert store.stalled_backlog(after_s=0.0) == Backlog()
