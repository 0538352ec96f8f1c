"""Bounded storage: the partitioning revision keeps every record of a populated store, and retention
frees space without touching a compared result, a summary or an alert; the dashboard's reads still
draw the run."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import numpy as np
import pytest
from isoaudit.audit.alerts import AlertEngine, AlertRule, DatabaseChannel, save_rule
from isoaudit.audit.db import Store, reads
from isoaudit.audit.db.engine import make_engine
from isoaudit.audit.db.models import Base
from isoaudit.audit.db.schema import current_revision, head_revision, upgrade
from isoaudit.audit.records import utcnow
from isoaudit.audit.worker import ComparisonWorker
from sqlalchemy import Engine, text

from tests import factories

RESULT_TABLES = ("sample_results", "step_results", "step_summaries", "alerts", "rule_breaches", "step_stats")


def step_records(run_id: str, steps: int, per_step: int = 4) -> list[Any]:
    """Both sides of ``per_step`` samples a step, each side fingerprinted: even samples agree bit for
    bit (judged clean), odd ones differ."""
    records: list[Any] = [factories.run(run_id)]
    for step in range(steps):
        for k in range(per_step):
            trainer = factories.sample(
                "trainer", run_id=run_id, step=step, seed=k, prompt_len=8, n_completion=64
            )
            delta = np.float32(0.0 if k % 2 == 0 else 0.25)
            rollout = factories.sample(
                "rollout",
                run_id=run_id,
                step=step,
                seed=k,
                prompt_len=8,
                n_completion=64,
                logprobs=trainer.logprobs - delta,
            )
            records += [
                trainer,
                rollout,
                factories.fingerprints(trainer, seed=k),
                factories.fingerprints(rollout, seed=k if k % 2 == 0 else 100 + k),
            ]
    return records


def populate(store: Store, run_id: str = "run-1", steps: int = 6) -> list[Any]:
    """Ingest ``steps`` steps and compare them with an alert rule that fires on the differing ones."""
    save_rule(store, AlertRule(name=f"kl-{run_id}", metric="kl_k3", threshold=0.0))
    records = step_records(run_id, steps)
    result = store.ingest(records)
    assert not result.rejected
    worker = ComparisonWorker(store, on_step=AlertEngine(store, [DatabaseChannel()]).evaluate)
    assert worker.run_once() == steps * 4
    return records


def snapshot(engine: Engine, tables: tuple[str, ...] | None = None) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of ``tables`` (default: every table of the ORM but retention_policies), in key order."""
    out = {}
    with engine.connect() as connection:
        for table in Base.metadata.sorted_tables:
            if (tables is None and table.name != "retention_policies") or (tables and table.name in tables):
                keys = ", ".join(f'"{c.name}"' for c in table.primary_key.columns)
                rows = connection.execute(text(f"SELECT * FROM {table.name} ORDER BY {keys}"))
                out[table.name] = [tuple(row) for row in rows]
    return out


def test_the_partitioning_revision_keeps_every_record_of_a_populated_store(blank_database_url, monkeypatch):
    engine = make_engine(blank_database_url)
    upgrade(engine, "0012")
    # The store's code writes into the revision-0012 schema, as a deployment at that revision did.
    monkeypatch.setattr("isoaudit.audit.db.store.ensure_schema", lambda *_a, **_k: None)
    old = Store(engine=engine)
    records = populate(old, steps=3)
    old.ingest([factories.run("run-2"), *step_records("run-2", 1)[1:]])  # one step queued, not compared
    before = snapshot(engine)
    assert len(before["samples"]) == 32 and len(before["fingerprints"]) == 32
    assert before["sample_results"] and before["step_summaries"] and before["alerts"]
    monkeypatch.undo()

    upgrade(engine)
    assert current_revision(engine) == head_revision()
    assert snapshot(engine) == before  # every row, ids included
    if engine.dialect.name == "postgresql":
        with engine.connect() as connection:
            for table in ("samples", "fingerprints"):
                parts = connection.execute(
                    text(f"SELECT count(*) FROM pg_inherits WHERE inhparent = '{table}'::regclass")
                ).scalar_one()
                assert parts == 16, table
            storage = connection.execute(
                text(
                    "SELECT attstorage FROM pg_attribute WHERE attrelid = 'samples_p00'::regclass AND attname = 'logprobs'"
                )
            ).scalar_one()
            assert storage == "e"  # arrays out of line, no compression attempt, partitions included

    store = Store(engine=engine)
    again = store.ingest(records)
    assert not again.stored["sample"] and again.duplicates["sample"] == 24  # idempotent across the move
    more = store.ingest(step_records("run-1", 4)[1:][-16:])  # step 3: new rows, ids after the old ones
    assert more.stored["sample"] == 8 and more.stored["fingerprints"] == 8
    ids = [row[0] for row in snapshot(engine, ("samples",))["samples"]]
    assert len(set(ids)) == len(ids) == 40
    assert ComparisonWorker(store).run_once() == 4 + 4  # run-1's step 3 and run-2's queued step
    engine.dispose()


def test_retention_frees_space_and_leaves_results_summaries_and_alerts(store: Store):
    populate(store, "run-1", steps=6)
    populate(store, "run-keep", steps=2)
    with store.engine.begin() as connection:  # run-keep belongs to another project, with no policy
        connection.execute(text("UPDATE runs SET project = 'other' WHERE run_id = 'run-keep'"))
    results_before = snapshot(store.engine, RESULT_TABLES)
    assert results_before["alerts"] and results_before["rule_breaches"]
    use_before = {use.run_id: use for use in store.disk_use()}
    steps_before = store.step_disk_use("run-1")
    assert [s.step for s in steps_before] == list(range(6))
    assert all(s.sample_bytes > 0 and s.fingerprint_bytes > 0 for s in steps_before)
    assert use_before["run-1"].steps == 6
    assert use_before["run-1"].bytes_per_step == pytest.approx(use_before["run-1"].total_bytes / 6)

    # No policy: nothing goes.
    outcome = store.apply_retention("default")
    assert (outcome.samples_deleted, outcome.fingerprints_deleted, outcome.bytes_freed) == (0, 0, 0)

    # Fingerprints: the newest 2 steps keep all; older steps keep the diverged samples' and one clean control.
    store.set_retention_policy("default", raw_days=None, fingerprint_steps=2)
    outcome = store.apply_retention("default")
    assert outcome.fingerprints_deleted == 4 * 2  # steps 0-3: of 2 clean samples x 2 sides, 1 sample goes
    assert outcome.samples_deleted == 0
    after = {s.step: s for s in store.step_disk_use("run-1")}
    assert [after[s].fingerprints for s in range(6)] == [6, 6, 6, 6, 8, 8]
    assert outcome.bytes_after < outcome.bytes_before
    assert outcome.bytes_freed == sum(
        steps_before[s].fingerprint_bytes - after[s].fingerprint_bytes for s in range(6)
    )

    # Raw arrays older than 7 days go; seen from 8 days on, every compared step's samples are old.
    store.set_retention_policy("default", raw_days=7, fingerprint_steps=2)
    assert store.apply_retention("default").samples_deleted == 0  # nothing is a week old yet
    outcome = store.apply_retention("default", now=utcnow() + timedelta(days=8))
    assert outcome.samples_deleted == 6 * 8
    assert outcome.bytes_freed == use_before["run-1"].sample_bytes
    use_after = {use.run_id: use for use in store.disk_use()}
    assert (
        use_after["run-1"].sample_bytes == 0 and use_after["run-1"].steps == 6
    )  # compared steps still count
    assert use_after["run-keep"] == use_before["run-keep"]  # another project's run is untouched

    assert snapshot(store.engine, RESULT_TABLES) == results_before

    # The dashboard's data layer still draws the run.
    series = reads.step_series(store, "run-1")
    assert [point.step for point in series] == list(range(6))
    assert reads.last_compared_step(store, "run-1") == 5
    verdicts = reads.step_samples(store, "run-1", 0)
    assert len(verdicts) == 4 and {v.diagnosis for v in verdicts} >= {"clean"}
    assert reads.sample_detail(store, "run-1", 0, verdicts[0].sample_key) is None  # its arrays are gone
    overview = reads.run_overview(store, "run-1")
    assert overview is not None
    view = reads.alerts_view(store, run_id="run-1")
    assert view.open or view.resolved


def test_workers_apply_each_due_policy_once(store: Store):
    populate(store, "run-1", steps=3)
    store.set_retention_policy("default", raw_days=None, fingerprint_steps=0)
    store.set_retention_policy("idle", raw_days=None, fingerprint_steps=None)
    other = Store(engine=store.engine)
    done = store.apply_due_retention()
    assert [o.project for o in done] == ["default"] and done[0].fingerprints_deleted == 3 * 2
    assert other.apply_due_retention() == []  # applied within the hour by the first
    assert store.retention_policy("default").applied_at is not None
    assert store.retention_policy("idle").applied_at is None
    with pytest.raises(ValueError, match="raw_days: must be 0 or more"):
        store.set_retention_policy("default", raw_days=-1, fingerprint_steps=None)
