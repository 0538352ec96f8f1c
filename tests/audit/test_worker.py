"""The comparison worker against a real store: automatic, idempotent, persisted for the dashboard."""

from __future__ import annotations

import json
import time

import numpy as np
from isoaudit.audit.db import Store
from isoaudit.audit.grid import RegionGrid
from isoaudit.audit.worker import ComparisonWorker
from typer.testing import CliRunner

from isoaudit.cli import app
from tests import factories
from tests.audit.causal_stack import run_stack

runner = CliRunner()


def ingest_step(
    store: Store, step: int = 0, *, n: int = 3, perturb: bool = True, rollout: bool = True
) -> list[str]:
    keys = []
    for i in range(n):
        trainer = factories.sample("trainer", step=step, seed=i, n_completion=12)
        noise = np.float32(1.001) if perturb and i == 0 else np.float32(1.0)
        records = [trainer, *run_stack(trainer, "trainer", num_layers=2)]
        if rollout:
            other = factories.sample(
                "rollout", step=step, seed=i, n_completion=12, logprobs=trainer.logprobs * noise
            )
            records += [
                other,
                *run_stack(
                    other,
                    "rollout",
                    num_layers=2,
                    perturb=("layers.1.mlp", 7) if perturb and i == 0 else None,
                ),
            ]
        store.ingest(records)
        keys.append(trainer.sample_key)
    return keys


def test_worker_compares_pending_samples_once(store: Store):
    keys = ingest_step(store)
    steps = []
    worker = ComparisonWorker(
        store, on_step=lambda run, step, metrics: steps.append((run, step, metrics["kl_k3"]))
    )
    assert worker.run_once() == 3
    results = {r.sample_key: r for r in store.sample_results("run-1", 0)}
    assert set(results) == set(keys)
    assert results[keys[0]].diagnosis == "numerical"
    assert (results[keys[0]].first_divergence_region, results[keys[0]].first_divergence_position) == (
        "layers.1.mlp",
        7,
    )
    assert results[keys[1]].diagnosis == "clean" and results[keys[1]].first_divergence_region is None
    grid = RegionGrid.from_json(results[keys[0]].grid)
    assert grid.first_divergence == ("layers.1.mlp", 7)
    [step] = store.step_results("run-1")
    assert step.n_samples == 3 and step.diagnoses["counts"] == {"clean": 2, "numerical": 1}
    assert step.metrics["kl_k3"] > 0 and steps == [("run-1", 0, step.metrics["kl_k3"])]
    # Nothing is pending any more; a second pass compares nothing and changes nothing.
    assert worker.run_once() == 0 and store.pending() == []
    # Re-sending the same records queues nothing; new records re-queue only their sample.
    ingest_step(store)
    assert store.pending() == []


def test_one_sided_samples_wait_for_their_other_side(store: Store):
    ingest_step(store, rollout=False)
    assert ComparisonWorker(store).run_once() == 0
    assert store.sample_results("run-1") == []


def test_background_worker_picks_up_new_steps(store: Store):
    with ComparisonWorker(store, interval=0.05) as worker:
        ingest_step(store, step=5, perturb=False)
        deadline = time.monotonic() + 20
        while not store.step_results("run-1") and time.monotonic() < deadline:
            time.sleep(0.05)
    [step] = store.step_results("run-1")
    assert step.step == 5 and step.metrics["kl_k3"] == 0.0 and worker.failures == 0


def test_cli_compare_exit_codes_and_json(database_url: str):
    store = Store(database_url)
    ingest_step(store, step=0, perturb=False)
    ingest_step(store, step=1, perturb=True)
    store.ingest([factories.sample("trainer", run_id="lonely")])
    store.dispose()
    args = ["--database-url", database_url]

    clean = runner.invoke(app, ["compare", "run-1", "--step", "0", *args])
    assert clean.exit_code == 0, clean.output
    assert "clean" in clean.output

    divergent = runner.invoke(app, ["compare", "run-1", *args])
    assert divergent.exit_code == 2, divergent.output
    assert "layers.1.mlp @ 7" in divergent.output

    body = runner.invoke(app, ["compare", "run-1", "--json", *args])
    parsed = json.loads(body.stdout)
    assert parsed["exit_code"] == 2 and [s["step"] for s in parsed["steps"]] == [0, 1]
    firsts = [s["first_divergence"] for s in parsed["steps"][1]["samples"] if s["first_divergence"]]
    assert firsts == [{"region": "layers.1.mlp", "position": 7}]

    assert runner.invoke(app, ["compare", "lonely", *args]).exit_code == 3
    missing = runner.invoke(app, ["compare", "nope", *args])
    assert missing.exit_code == 1 and "nope" in missing.output
    assert runner.invoke(app, ["compare", "run-1", "--step", "9", *args]).exit_code == 1


def test_worker_reads_the_runs_off_policy_declaration(store: Store) -> None:
    """A one-step lag the run declares is off_policy; the same lag in an undeclared run is weights."""
    for run_id, config in (("declared", {"off_policy": {"max_staleness": 1}}), ("undeclared", {})):
        trainer = factories.sample("trainer", run_id=run_id, weight_version="5", n_completion=8)
        rollout = factories.sample(
            "rollout", run_id=run_id, weight_version="4", n_completion=8, logprobs=trainer.logprobs * 1.01
        )
        store.ingest([factories.run(run_id, config=config), trainer, rollout])
    ComparisonWorker(store).run_once()
    kinds = {run_id: store.sample_results(run_id)[0].diagnosis for run_id in ("declared", "undeclared")}
    assert kinds == {"declared": "off_policy", "undeclared": "weights"}


def test_a_compared_step_is_measured_once(store: Store, monkeypatch):
    """One step outcome per compared step: the worker compares each sample's routes once, and the
    step's result and its dashboard summary are projections of that one outcome (no second pass)."""
    from isoaudit.audit import compare, routing

    from tests.audit.routing_records import routed_run

    compared: list[tuple[int, str | None]] = []
    original = routing.compare_sample_routes

    def counting(trainer, rollout):
        compared.append((trainer.step, trainer.sample_key))
        return original(trainer, rollout)

    monkeypatch.setattr(compare, "compare_sample_routes", counting)
    monkeypatch.setattr(routing, "compare_sample_routes", counting)
    keys = routed_run(store, steps=3)
    assert sorted(compared) == sorted(keys.items())  # each sample once, never again for the step
    results = {r.step: r for r in store.step_results("moe-run")}
    assert all(results[step].metrics.get("routing_set_agreement") is not None for step in keys)


def stored_outcome(store: Store) -> list[tuple]:
    return [
        (
            r.sample_key,
            r.diagnosis,
            r.first_divergence_region,
            r.first_divergence_position,
            json.dumps(r.metrics),
        )
        for r in store.sample_results("run-1", 0)
    ]


def test_fingerprints_read_on_a_thread_or_in_turn_store_the_same(database_url: str, monkeypatch) -> None:
    """With an idle core the worker reads a step's fingerprints on a thread while it measures the
    tokens; on busy cores one after the other. Both store the same results."""
    from isoaudit.audit import worker as worker_module

    outcomes = []
    for idle in (1, 2):
        monkeypatch.setattr(worker_module, "idle_threads", lambda idle=idle: idle)
        store = Store(database_url)
        try:
            with store.sessions.begin() as session:  # a fresh database for each way
                from isoaudit.audit.db.models import Base

                for table in reversed(Base.metadata.sorted_tables):
                    session.execute(table.delete())
            ingest_step(store)
            assert ComparisonWorker(store).run_once() == 3
            outcomes.append(stored_outcome(store))
        finally:
            store.dispose()
    assert outcomes[0] == outcomes[1] and outcomes[0]
    assert any(region == "layers.1.mlp" for _, _, region, _, _ in outcomes[0])  # the grids were read


def test_a_failed_fingerprint_read_on_a_thread_saves_nothing(store: Store, monkeypatch) -> None:
    from isoaudit.audit import worker as worker_module

    monkeypatch.setattr(worker_module, "idle_threads", lambda: 2)
    ingest_step(store)

    def broken(steps):
        raise RuntimeError("the database went away mid-read")

    monkeypatch.setattr(store, "fingerprints_of_steps", broken)
    worker = ComparisonWorker(store)
    assert worker.run_once() == 0
    assert worker.failures == 1 and store.sample_results("run-1", 0) == []
    monkeypatch.undo()  # the database is back: the released claims are taken again
    assert ComparisonWorker(store).run_once() == 3


def test_a_big_step_measured_with_the_block_pool_stores_the_same(database_url: str, monkeypatch) -> None:
    """A step of more than two blocks, its tokens measured partly in the worker's block-pool process
    when a core is idle, stores what one thread stores; ``stop`` ends the process."""
    from isoaudit.audit import worker as worker_module
    from isoaudit.audit.db.models import Base

    monkeypatch.setattr(worker_module, "idle_threads", lambda: 2)
    outcomes = []
    for processes in (0, 1):
        store = Store(database_url)
        try:
            with store.sessions.begin() as session:  # a fresh database for each way
                for table in reversed(Base.metadata.sorted_tables):
                    session.execute(table.delete())
            rng = np.random.default_rng(7)
            for i in range(6):  # 6 x 30k tokens: three blocks
                trainer = factories.sample("trainer", seed=i, n_completion=30_000)
                noise = (rng.random(30_000) < 0.3) * rng.normal(0, 1e-2, 30_000)
                rollout_lp = np.minimum(trainer.logprobs + noise, 0).astype(np.float32)
                store.ingest(
                    [trainer, factories.sample("rollout", seed=i, n_completion=30_000, logprobs=rollout_lp)]
                )
            worker = ComparisonWorker(store, processes=processes)
            assert worker.run_once() == 6
            assert (worker._pool is not None) == (processes == 1)
            if worker._pool is not None:
                assert worker._pool.failures == 0, worker._pool.last_failure
                assert worker._pool.blocks > 0
            worker.stop()
            assert worker._pool is None
            outcomes.append(stored_outcome(store))
        finally:
            store.dispose()
    assert outcomes[0] == outcomes[1] and len(outcomes[0]) == 6


def test_a_step_whose_grid_fails_fails_alone(store: Store, monkeypatch) -> None:
    """The grids are compared on the reader thread beside the token pass; one that raises there is
    compared again on the comparison's path, where it fails its step alone, as the other steps save."""
    from isoaudit.audit import compare as compare_module
    from isoaudit.audit import worker as worker_module

    monkeypatch.setattr(worker_module, "idle_threads", lambda: 2)  # the read (and grids) on a thread
    ingest_step(store, step=0)
    ingest_step(store, step=1)
    original = compare_module.compare_fingerprints

    def broken_at_step_1(trainer, rollout):
        if trainer and trainer[0].step == 1:
            raise ValueError("a malformed fingerprint record")
        return original(trainer, rollout)

    monkeypatch.setattr(compare_module, "compare_fingerprints", broken_at_step_1)
    worker = ComparisonWorker(store)
    assert worker.run_once() == 3
    assert worker.failures == 1
    assert {r.step for r in store.step_results("run-1")} == {0}
    assert any(r.first_divergence_region == "layers.1.mlp" for r in store.sample_results("run-1", 0))
