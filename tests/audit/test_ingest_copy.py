"""PostgreSQL ingest at COPY speed: a batch of new records goes by binary COPY straight into its table,
anything else (keys already stored, a key twice in the batch, a concurrent writer's key) by the staging
table's ``ON CONFLICT DO NOTHING``; every way stores each record once and reads back what was sent."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from isoaudit.audit.db import Store
from isoaudit.audit.db.codec import sample_row
from isoaudit.audit.db.ingest import IngestResult
from isoaudit.audit.db.models import FingerprintRow, SampleRow
from isoaudit.audit.records import Run
from sqlalchemy import func, select, text

from tests import factories
from tests.conftest import postgres_schema_url


@pytest.fixture
def pg_store() -> Iterator[Store]:
    for url in postgres_schema_url():
        store = Store(url, upgrade=True)
        yield store
        store.dispose()


def rows(store: Store, model) -> int:
    with store.sessions() as session:
        return session.scalar(select(func.count()).select_from(model))


def staged(store: Store) -> bool:
    """Whether a connection of this store created a staging table (the fallback path ran)."""
    with store.sessions() as session:
        return bool(session.connection().connection.info.get("isoaudit_staging"))


def test_new_records_go_straight_in_and_read_back_exactly(pg_store: Store) -> None:
    samples = [factories.sample(side, seed=i, step=0) for i in range(3) for side in ("trainer", "rollout")]
    prints = [factories.fingerprints(s) for s in samples[:2]]
    result = pg_store.ingest([*samples, *prints])
    assert result.stored["sample"] == 6 and not +result.duplicates and result.pending == 3
    assert not staged(pg_store)  # the direct COPY took them all
    back = pg_store.samples_of_steps([("run-1", 0)])[("run-1", 0)]
    sent = {(s.sample_key, s.side): s for s in samples}
    assert len(back) == 6
    for record in back:
        original = sent[(record.sample_key, record.side)]
        assert np.array_equal(record.token_ids, original.token_ids)
        assert record.logprobs.tobytes() == original.logprobs.tobytes()
    stored = pg_store.fingerprints_of_steps([("run-1", 0)])[("run-1", 0)]
    assert len(stored) == 2 and rows(pg_store, FingerprintRow) == 2
    for got, want in zip(
        sorted(stored, key=lambda p: p.side), sorted(prints, key=lambda p: p.side), strict=True
    ):
        assert got.digest.tobytes() == want.digest.tobytes() and got.sketch.tobytes() == want.sketch.tobytes()


def test_a_retried_or_overlapping_batch_stores_only_what_is_new(pg_store: Store) -> None:
    first = [factories.sample(side, seed=i) for i in range(2) for side in ("trainer", "rollout")]
    pg_store.ingest(first)
    again = pg_store.ingest(first)
    assert again.stored["sample"] == 0 and again.duplicates["sample"] == 4
    more = [*first[:2], factories.sample("trainer", seed=7)]
    result = pg_store.ingest(more)
    assert result.stored["sample"] == 1 and result.duplicates["sample"] == 2
    assert rows(pg_store, SampleRow) == 5


def test_a_record_twice_in_one_batch_is_stored_once(pg_store: Store) -> None:
    record = factories.sample("trainer", seed=3)
    result = pg_store.ingest([record, record, factories.sample("rollout", seed=3)])
    assert result.stored["sample"] == 2 and result.duplicates["sample"] == 1
    assert rows(pg_store, SampleRow) == 2


def test_a_writer_racing_on_a_key_loses_it_and_stores_the_rest(pg_store: Store) -> None:
    """Writer A holds a key uncommitted; writer B's batch (that key and a new one) finds nothing stored,
    so it COPYs straight in and waits on A's key; A commits; B's COPY meets the unique key, its
    savepoint rolls back and the staging path stores only the new one."""
    pg_store.ingest([Run(run_id="run-1", name="run-1")])
    shared, new = factories.sample("trainer", seed=1), factories.sample("rollout", seed=1)
    other = Store(str(pg_store.engine.url.render_as_string(hide_password=False)))
    outcome: list[IngestResult | BaseException] = []
    try:
        with pg_store.sessions.begin() as session:
            pg_store._copy_new(session, SampleRow, [sample_row(shared)], "sample", IngestResult())
            holder = session.connection().connection.driver_connection.info.backend_pid

            def write() -> None:
                try:
                    outcome.append(other.ingest([shared, new]))
                except BaseException as exc:  # pragma: no cover - the failure this test exists for
                    outcome.append(exc)

            thread = threading.Thread(target=write)
            thread.start()
            with pg_store.engine.connect() as watch:  # wait until B is blocked on A's key
                deadline = time.monotonic() + 120
                while not watch.execute(
                    text("SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"),
                    {"pid": holder},
                ).scalar():
                    assert time.monotonic() < deadline and thread.is_alive(), "writer B never waited on A"
                    time.sleep(0.05)
        thread.join()
        assert staged(other)  # B went the direct way first, then fell back
    finally:
        other.dispose()
    result = outcome[0]
    assert isinstance(result, IngestResult), result
    assert result.stored["sample"] == 1 and result.duplicates["sample"] == 1 and result.pending == 1
    assert rows(pg_store, SampleRow) == 2
