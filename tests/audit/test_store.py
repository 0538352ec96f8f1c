"""The store on SQLite and PostgreSQL: round trips, idempotent re-ingest, all-or-nothing batches."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from isoaudit.audit.db import ForbiddenRun, Store
from isoaudit.audit.db.engine import WAL_AUTOCHECKPOINT_PAGES, defer_wal_checkpoint
from isoaudit.audit.db.models import ManifestRow, RunRow, SampleRow
from isoaudit.audit.records import RuntimeFacts
from isoaudit.audit.worker import ComparisonWorker
from sqlalchemy import func, select

from tests import factories


def count(store: Store, model) -> int:
    with store.sessions() as session:
        return session.scalar(select(func.count()).select_from(model))


def test_every_record_type_round_trips(store: Store):
    run = factories.run(config={"lr": 1e-6, "algo": "grpo"})
    manifest = factories.manifest(
        "rollout",
        "engine_decode",
        runtime=RuntimeFacts(framework="vllm", dtype="bfloat16", prefix_caching=True),
        regions=["embed", "logits"],
        unobserved={"layers.0.attn": "fused kernel"},
        weight_version="7",
    )
    topk_ids = np.arange(12, dtype=np.int32).reshape(6, 2)
    trainer = factories.sample(
        "trainer",
        weight_version=7,
        temperature=0.7,
        top_k=50,
        top_p=0.9,
        topk_ids=topk_ids,
        topk_logprobs=-np.ones((6, 2), np.float32),
    )
    rollout = factories.sample("rollout", semantics="raw")
    prints = factories.fingerprints(trainer, "layers.0.mlp")
    result = store.ingest([run, manifest, trainer, rollout, prints])
    assert dict(result.stored) == {"run": 1, "manifest": 1, "sample": 2, "fingerprints": 1}

    [summary] = store.list_runs()
    assert (summary.run_id, summary.name, summary.config, summary.n_steps) == (
        "run-1",
        "test run",
        run.config,
        1,
    )
    got_trainer, got_rollout = store.sample_pair("run-1", 0, trainer.sample_key)
    for got, want in ((got_trainer, trainer), (got_rollout, rollout)):
        assert got.model_dump(mode="json") == want.model_dump(mode="json")
    [got_prints] = store.fingerprints("run-1", 0, [trainer.sample_key])
    assert got_prints.model_dump(mode="json") == prints.model_dump(mode="json")
    [got_manifest] = store.manifests("run-1")
    assert got_manifest.model_dump(mode="json") == manifest.model_dump(mode="json")
    assert [s.step for s in store.steps("run-1")] == [0]


def test_reingest_is_idempotent(store: Store):
    records = [
        factories.run(),
        factories.manifest(),
        factories.sample("trainer"),
        factories.sample("rollout"),
    ]
    records.append(factories.fingerprints(records[2]))
    store.ingest(records)
    again = store.ingest([r.model_copy(deep=True) for r in records])
    assert sum(again.stored.values()) == 0
    assert dict(again.duplicates) == {"run": 1, "manifest": 1, "sample": 2, "fingerprints": 1}
    assert count(store, SampleRow) == 2 and count(store, ManifestRow) == 1 and count(store, RunRow) == 1


def test_a_malformed_record_is_refused_by_name_and_the_rest_is_stored(store: Store):
    good = factories.sample("trainer").model_dump(mode="json")
    bad = factories.sample("rollout").model_dump(mode="json")
    bad["logprobs"] = factories.sample(n_completion=3).model_dump(mode="json")["logprobs"]
    result = store.ingest([factories.run().model_dump(mode="json"), good, bad, "not a record"])
    assert dict(result.stored) == {"run": 1, "sample": 1}
    assert [(r.index, r.kind, r.field) for r in result.rejected] == [
        (2, "sample", "logprobs"),
        (3, "unknown", "record"),
    ]
    assert result.rejected[0].message.startswith("logprobs: 3 values for 6 completion tokens")
    assert result.as_dict()["rejected"][0] == {
        "index": 2,
        "kind": "sample",
        "field": "logprobs",
        "message": result.rejected[0].message,
    }
    assert count(store, SampleRow) == 1 and count(store, RunRow) == 1


def constructed(record, **changes):
    """The record rebuilt with ``model_construct`` (no validation), as collectors build them."""
    return type(record).model_construct(**{**dict(record), **changes})


def test_constructed_records_are_checked_like_validated_ones(store: Store):
    """Collectors skip pydantic (``model_construct``); the store's boundary still refuses bad values."""
    trainer = factories.sample("trainer")
    lp = trainer.logprobs
    bad = [
        (
            constructed(trainer, logprobs=np.where(np.arange(lp.size) == 2, np.nan, lp).astype(np.float32)),
            "logprobs",
            "NaN at completion index 2",
        ),
        (constructed(trainer, logprobs=np.abs(lp)), "logprobs", "positive value"),
        (constructed(trainer, logprobs=np.full(lp.size, -np.inf, np.float32)), "logprobs", "-inf"),
        (constructed(trainer, prompt_len=99), "prompt_len", "past the end"),
        (constructed(trainer, token_ids=trainer.token_ids.astype(np.int64)), "token_ids", "int32"),
        (constructed(trainer, logprobs=lp.astype(np.float64)), "logprobs", "float32"),
        (constructed(trainer, step=-1), "step", "outside"),
        (constructed(trainer, side="critic"), "side", "critic"),
        (constructed(trainer, run_id="bad id"), "run_id", "bad id"),
    ]
    prints = factories.fingerprints(trainer)
    bad.append((constructed(prints, l2=prints.l2[:3]), "l2", "3 rows for 10 positions"))
    bad.append((constructed(prints, positions=np.zeros(10, np.int32)), "positions", "repeated"))
    mutated = factories.sample("rollout")
    mutated.logprobs[0] = np.float32(0.5)  # validated once, changed afterwards
    bad.append((mutated, "logprobs", "positive value"))

    result = store.ingest([factories.run(), *[record for record, _, _ in bad], constructed(trainer)])
    assert dict(result.stored) == {"run": 1, "sample": 1}
    assert [r.index for r in result.rejected] == list(range(1, len(bad) + 1))
    for rejection, (_, field, words) in zip(result.rejected, bad, strict=True):
        assert rejection.field == field and rejection.message.startswith(f"{field}: ")
        assert words in rejection.message, rejection
    assert count(store, SampleRow) == 1


def test_a_batch_of_only_bad_records_writes_nothing(store: Store):
    result = store.ingest([constructed(factories.sample(), prompt_len=99)])
    assert [r.field for r in result.rejected] == ["prompt_len"] and not result.stored
    assert count(store, RunRow) == 0


def test_a_refused_batch_rolls_back_whole(store: Store):
    store.ingest([factories.run("theirs")], project="other")
    mine = factories.sample("trainer", run_id="mine")
    theirs = factories.sample("trainer", run_id="theirs")
    with pytest.raises(ForbiddenRun, match="theirs"):
        store.ingest([mine, theirs], project="default")
    assert count(store, SampleRow) == 0 and store.run_project("mine") is None


def test_records_before_their_run_register_it(store: Store):
    store.ingest([factories.sample("rollout", run_id="implicit")])
    assert store.run_project("implicit") == "default"
    store.ingest([factories.run("implicit", name="named later")])
    assert store.get_run("implicit").name == "named later"


def test_logprobs_are_one_row_per_sample_not_per_token(store: Store):
    store.ingest(
        [factories.sample("trainer", n_completion=2000), factories.sample("rollout", n_completion=2000)]
    )
    assert count(store, SampleRow) == 2


def test_pending_lists_only_samples_with_both_sides(store: Store):
    trainer = factories.sample("trainer", seed=1)
    only_trainer = factories.sample("trainer", seed=2)
    store.ingest([trainer, only_trainer])
    assert store.pending() == []
    store.ingest([factories.sample("rollout", seed=1)])
    assert store.pending() == [("run-1", 0, trainer.sample_key)]
    store.save_comparison([], [], store.pending())
    assert store.pending() == []
    store.ingest([factories.sample("rollout", seed=1)])  # a duplicate queues nothing
    assert store.pending() == []


def test_two_writers_registering_one_run_at_once_both_store(database_url: str) -> None:
    """A trainer and an engine in two processes often register the same new run at the same
    moment: the one that loses the race stores its batch all the same."""
    import threading

    from isoaudit.audit.db import Store

    from tests import factories

    stores = [Store(database_url) for _ in range(4)]
    barrier = threading.Barrier(len(stores))
    results, errors = [], []

    def write(i: int, store: Store) -> None:
        barrier.wait()
        try:
            results.append(
                store.ingest(
                    [factories.sample("trainer" if i % 2 else "rollout", run_id="raced", seed=i, step=i)]
                )
            )
        except Exception as exc:  # pragma: no cover - the failure this test exists for
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(i, s)) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sum(r.stored["sample"] for r in results) == 4
    assert [r.run_id for r in stores[0].list_runs()] == ["raced"]
    for store in stores:
        store.dispose()


def test_a_batch_naming_one_run_and_implying_another_is_stored(store) -> None:
    """A batch with the Run record of one new run and samples of another new run (no Run record) stores
    both runs (the two new runs' rows are built with the same keys, as one bulk insert needs)."""
    from tests import factories

    result = store.ingest(
        [factories.run(run_id="a-named-run"), factories.sample("rollout", run_id="b-implied-run")]
    )
    assert result.stored["run"] == 1 and result.stored["sample"] == 1
    assert {r.run_id for r in store.list_runs()} >= {"a-named-run", "b-implied-run"}


def _result(step: int, key: str, diagnosis: str = "clean") -> dict:
    return {
        "run_id": "run-1",
        "step": step,
        "sample_key": key,
        "n_tokens": 4,
        "metrics": {"kl_k3": 0.0},
        "diagnosis": diagnosis,
        "diagnosis_detail": {},
        "first_divergence_region": None,
        "first_divergence_position": None,
        "grid": {},
    }


def test_results_come_as_typed_rows_filtered_and_paged_in_sql(store: Store):
    """Step ranges, a set of steps, a diagnosis and a page are the query's, and what comes back is
    the data layer's frozen rows, never ORM objects."""
    import dataclasses

    from isoaudit.audit.db import SampleResult, StepResult

    store.ingest([factories.run()])
    steps = [
        {"run_id": "run-1", "step": n, "n_samples": 2, "metrics": {"kl_k3": n}, "diagnoses": {}}
        for n in range(6)
    ]
    samples = [
        _result(n, key, "numerical" if key == "b" * 32 else "clean")
        for n in range(6)
        for key in ("a" * 32, "b" * 32)
    ]
    store.save_comparison(samples, steps, [])

    assert [r.step for r in store.step_results("run-1", 2, 4)] == [2, 3, 4]
    assert [r.step for r in store.step_results("run-1", from_step=4)] == [4, 5]
    assert [r.step for r in store.step_results("run-1", only={5, 1, 9})] == [1, 5]
    store.ingest([factories.sample("trainer", step=n, seed=n) for n in range(6)])
    assert [s.step for s in store.steps("run-1", 1, 3)] == [1, 2, 3]
    [row, *_] = store.step_results("run-1")
    assert isinstance(row, StepResult) and dataclasses.is_dataclass(row)
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.step = 9  # type: ignore[misc]  # the assignment a frozen row refuses is the point

    numerical = store.sample_results("run-1", diagnosis="numerical")
    assert {(r.step, r.sample_key) for r in numerical} == {(n, "b" * 32) for n in range(6)}
    assert all(isinstance(r, SampleResult) for r in numerical)
    everything = store.sample_results("run-1")
    pages = [store.sample_results("run-1", limit=5, offset=o) for o in range(0, 12, 5)]
    assert [r for page in pages for r in page] == everything and [len(p) for p in pages] == [5, 5, 2]
    assert store.sample_results("run-1", 3, diagnosis="\x00") == []


def test_runs_are_listed_a_page_at_a_time(store: Store):
    from datetime import UTC, datetime

    from isoaudit.audit.db import MAX_PAGE

    store.ingest(
        [factories.run(run_id=f"run-{i}", started_at=datetime(2026, 1, 1 + i, tzinfo=UTC)) for i in range(5)]
    )
    newest_first = [r.run_id for r in store.list_runs()]
    assert newest_first == [f"run-{i}" for i in reversed(range(5))]
    pages = [store.list_runs(limit=2, offset=o) for o in (0, 2, 4)]
    assert [r.run_id for page in pages for r in page] == newest_first
    assert len(store.list_runs(limit=MAX_PAGE + 10)) == 5  # a larger page is capped, not refused


def test_an_unreachable_database_raises_store_unavailable():
    """Callers see the data layer's error, not the driver's (nothing above audit.db imports it)."""
    from isoaudit.audit.db import StoreError, StoreUnavailable

    with pytest.raises(StoreUnavailable) as caught:
        Store("postgresql://nobody@127.0.0.1:1/none", timeout_s=1)
    assert isinstance(caught.value, StoreError) and caught.value.__cause__ is not None


@pytest.mark.parametrize("deferred", [False, True], ids=["at commit", "deferred"])
def test_a_deferred_commit_leaves_the_log_to_the_idle_checkpoint(tmp_path, deferred: bool):
    """SQLite copies a long write-ahead log into the database file inside the commit that passes its
    threshold; a deferred commit leaves it to :meth:`Store.checkpoint`, and its connection
    checkpoints at commit again once back in the pool."""
    path = tmp_path / "wal.db"
    store = Store(f"sqlite:///{path}")
    blob = os.urandom(6 << 20)  # 1,500 pages of the log: past SQLite's 1,000
    try:
        with store.sessions.begin() as session:
            if deferred:
                defer_wal_checkpoint(session)
            connection = session.connection()
            raw = connection.connection.dbapi_connection
            connection.exec_driver_sql("CREATE TABLE scratch (b BLOB)")
            connection.exec_driver_sql("INSERT INTO scratch VALUES (?)", (blob,))
        assert (path.stat().st_size < 1 << 20) is deferred
        assert raw.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == WAL_AUTOCHECKPOINT_PAGES
        store.checkpoint()
        assert path.stat().st_size >= 6 << 20
    finally:
        store.dispose()


def test_the_worker_checkpoints_when_it_is_idle(store: Store, monkeypatch):
    calls = []
    monkeypatch.setattr(store, "checkpoint", lambda: calls.append(True))
    with ComparisonWorker(store, interval=0.05):
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:
            time.sleep(0.02)
    assert calls
