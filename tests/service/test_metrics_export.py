"""``/metrics`` under each framework's names, threshold variants and lag slices as labels; only the
runs compared within the active window, read by a bounded query; the counters that catch a step
between scrapes; and ``/v1/metric-names`` (the alias registry over HTTP): real app, real HTTP, real
comparison, on SQLite and PostgreSQL."""

from __future__ import annotations

import time
from datetime import timedelta

import httpx
import numpy as np
from isoaudit.audit.alerts import AlertEngine, DatabaseChannel
from isoaudit.audit.alerts.evaluator import breaches_at, breaching_steps
from isoaudit.audit.alerts.rules import AlertRule, save_rule
from isoaudit.audit.api import create_app
from isoaudit.audit.api.live import LiveServer
from isoaudit.audit.api.prometheus import StoreCollector
from isoaudit.audit.db import Store
from isoaudit.audit.db.models import StepResultRow
from isoaudit.audit.records import Batch, utcnow
from isoaudit.audit.settings import Settings
from isoaudit.audit.worker import ComparisonWorker
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import event, update

from tests import factories


def ingest_compared_step(api, store) -> dict[str, float]:
    records = [factories.run()]
    for seed in range(3):
        trainer = factories.sample("trainer", seed=seed, weight_version=5)
        shifted = np.minimum(trainer.logprobs + np.float32(0.02 * (seed + 1)), 0).astype(np.float32)
        records += [trainer, factories.sample("rollout", seed=seed, logprobs=shifted, weight_version=5)]
    reply = api.post("/v1/ingest", content=Batch(records=records).model_dump_json())
    assert reply.status_code == 200, reply.text
    ComparisonWorker(store).run_once("run-1")
    [row] = store.step_results("run-1")
    return row.metrics


def families(api, **params):
    reply = api.get("/metrics", params=params)
    assert reply.status_code == 200, reply.text
    return {f.name: f for f in text_string_to_metric_families(reply.text)}


def value(family, **labels) -> float:
    [sample] = [s for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())]
    return sample.value


def test_metrics_export_framework_names_variants_and_lags(api, store):
    metrics = ingest_compared_step(api, store)
    plain = families(api)
    assert "verl_rollout_corr_k3_kl" not in plain  # only when asked for
    assert value(plain["isoaudit_kl_k3"], length="all") == metrics["kl_k3"]
    assert value(plain["isoaudit_tis_mean"], params="cap=2") == metrics["tis_mean"]
    assert value(plain["isoaudit_tis_mean"], params="cap=3") == metrics["tis_mean[cap=3]"]
    assert value(plain["isoaudit_kl_k3_by_lag"], lag="0") == metrics["kl_k3/lag_0"]

    named = families(api, framework=["verl", "tinker", "nemo-rl", "trl"])
    assert value(named["verl_rollout_corr_k3_kl"], run_id="run-1") == metrics["verl:rollout_corr/k3_kl"]
    assert value(named["tinker_kl_sample_train_v1"], run_id="run-1") == metrics["tinker:kl_sample_train_v1"]
    assert (
        value(named["nemo_rl_token_mult_prob_error"], run_id="run-1")
        == metrics["nemo-rl:token_mult_prob_error"]
    )
    # TRL's default mode is sequence_mask: the ratios of whole sequences, masked outside [0, 3]
    assert (
        value(named["trl_sampling_importance_sampling_ratio_mean"], run_id="run-1")
        == metrics["trl:sampling/importance_sampling_ratio/mean"]
    )
    assert "as its own code computes it" in named["verl_rollout_corr_k3_kl"].documentation
    assert "verl_rollout_corr_rollout_is_mean" not in named  # verl logs no IS figures by default


def test_metrics_refuses_an_unknown_framework_naming_the_field(api):
    reply = api.get("/metrics", params={"framework": "deepspeed-chat"})
    assert reply.status_code == 422
    assert "framework" in reply.text and "verl" in reply.text


def test_metric_names_lists_the_registry(api):
    rows = api.get("/v1/metric-names").json()
    by_key = {row["key"]: row for row in rows}
    assert {a["name"] for a in by_key["kl_k1"]["aliases"]} >= {"kl_sample_train_v1", "vllm_kl"}
    assert by_key["verl:rollout_corr/rollout_is_std"]["aliases"][0]["settings"]
    trl = api.get("/v1/metric-names", params={"framework": "trl"}).json()
    assert {a["key"] for row in trl for a in row["aliases"] if a["framework"] == "trl"} == {
        "trl:sampling/sampling_logp_difference/mean",
        "trl:sampling/sampling_logp_difference/max",
        "trl:sampling/importance_sampling_ratio/min",
        "trl:sampling/importance_sampling_ratio/mean",
        "trl:sampling/importance_sampling_ratio/max",
    }
    assert all(row["definition"] for row in trl)


# ---------------------------------------------------------------------- the active window


def save_steps(store: Store, run_id: str, steps: range, kl: float = 1e-4) -> None:
    """Step results as the worker saves them (no samples: /metrics reads the steps alone)."""
    rows = [
        {
            "run_id": run_id,
            "step": step,
            "n_samples": 2,
            "metrics": {"kl_k3": kl, "exact_match_fraction": 0.5, "bitwise_mismatch_count": 3},
            "diagnoses": {},
        }
        for step in steps
    ]
    store.save_comparison([], rows, [])


def age(store: Store, run_ids: list[str], by: timedelta) -> None:
    """Date the runs' comparisons ``by`` ago (runs that finished then)."""
    with store.engine.begin() as connection:
        connection.execute(
            update(StepResultRow).where(StepResultRow.run_id.in_(run_ids)).values(computed_at=utcnow() - by)
        )


def run_series(store: Store, **kwargs) -> dict[str, list]:
    """The exported series of the collector, by family (the build info left out)."""
    out = {}
    for family in StoreCollector(store, **kwargs).collect():
        if family.name != "isoaudit_build":
            out[family.name] = family.samples
    return out


def test_only_runs_compared_within_the_window_are_exported(store: Store) -> None:
    active = [f"live-{i}" for i in range(3)]
    store.ingest([factories.run(r) for r in active])
    for run_id in active:
        save_steps(store, run_id, range(4))
    before = run_series(store)
    assert {s.labels["run_id"] for s in before["isoaudit_kl_k3"]} == set(active)
    n_before = sum(len(samples) for samples in before.values())

    finished = [f"old-{i}" for i in range(20)]
    store.ingest([factories.run(r) for r in finished])
    for run_id in finished:
        save_steps(store, run_id, range(4), kl=1.0)
    age(store, finished, timedelta(hours=2))
    after = run_series(store)
    assert sum(len(samples) for samples in after.values()) == n_before  # flat in the runs recorded
    assert {s.labels["run_id"] for s in after["isoaudit_last_compared_timestamp_seconds"]} == set(active)
    [stamp] = [
        s.value for s in after["isoaudit_last_compared_timestamp_seconds"] if s.labels["run_id"] == "live-0"
    ]
    assert abs(stamp - time.time()) < 60
    assert {s.value for s in after["isoaudit_compared_steps"]} == {4.0}
    assert {s.value for s in after["isoaudit_bitwise_mismatch_tokens"]} == {3.0}
    assert {s.value for s in after["isoaudit_exact_match_ratio"]} == {0.5}

    # the unbounded export (every run ever compared) has them all; two hours on, none is left
    unbounded = run_series(store, window=None)
    assert len({s.labels["run_id"] for s in unbounded["isoaudit_kl_k3"]}) == 23
    later = run_series(store, now=utcnow() + timedelta(hours=2))
    assert all(not samples for name, samples in later.items() if name != "isoaudit_comparison_queue_samples")


def test_a_scrape_runs_the_same_statements_for_any_history_and_sqlite_uses_the_index(store: Store) -> None:
    store.ingest([factories.run("live")])
    save_steps(store, "live", range(3))

    def statements() -> list[tuple[str, object]]:
        seen: list[tuple[str, object]] = []

        def record(conn, cursor, statement, parameters, context, executemany) -> None:
            seen.append((statement, parameters))

        event.listen(store.engine, "before_cursor_execute", record)
        try:
            list(StoreCollector(store).collect())
        finally:
            event.remove(store.engine, "before_cursor_execute", record)
        return seen

    few = statements()
    old = [f"old-{i}" for i in range(30)]
    store.ingest([factories.run(r) for r in old])
    for run_id in old:
        save_steps(store, run_id, range(3))
    age(store, old, timedelta(days=1))
    many = statements()
    assert [s for s, _ in many] == [s for s, _ in few]
    if store.dialect == "sqlite":
        first, parameters = many[0]
        assert "step_results.computed_at BETWEEN" in first
        with store.engine.connect() as connection:
            plan = " | ".join(
                row[-1] for row in connection.exec_driver_sql(f"EXPLAIN QUERY PLAN {first}", parameters)
            )
        assert "ix_step_results_computed_at" in plan and "SCAN step_results" not in plan, plan


def test_the_window_setting_drops_an_idle_run_from_the_served_metrics(store: Store, monkeypatch) -> None:
    monkeypatch.setenv("ISOAUDIT_METRICS_ACTIVE_WINDOW_S", "1.5")
    settings = Settings.from_env(run_worker=False, require_token_for_reads=False)
    assert settings.metrics_active_window_s == 1.5
    store.ingest([factories.run("brief")])
    with LiveServer(create_app(store, settings)) as server:
        # the server's first scrape sets up its connections and collectors: not inside the window
        assert httpx.get(f"{server.url}/metrics").status_code == 200
        save_steps(store, "brief", range(2))
        compared = time.monotonic()
        assert 'run_id="brief"' in httpx.get(f"{server.url}/metrics").text
        time.sleep(max(0.0, compared + 1.6 - time.monotonic()))
        assert 'run_id="brief"' not in httpx.get(f"{server.url}/metrics").text


# ---------------------------------------------------------------------- counters between scrapes


def test_steps_over_a_rules_threshold_are_counted_once_each(store: Store) -> None:
    save_rule(store, AlertRule(name="kl_mean", metric="kl_k3", threshold=1e-3, window=2, aggregation="mean"))
    store.ingest([factories.run("spiky")])
    engine = AlertEngine(store, [DatabaseChannel()])
    kls = {0: 0.0, 1: 1e-2, 2: 0.0, 3: 0.0, 4: 0.0}  # window means: 0, 5e-3, 5e-3, 0, 0
    for step, kl in kls.items():
        save_steps(store, "spiky", range(step, step + 1), kl=kl)
        engine.evaluate("spiky", step, {"kl_k3": kl})
        engine.evaluate("spiky", step, {"kl_k3": kl})  # a second evaluation of a step counts nothing
    families = run_series(store)
    [over] = [s for s in families["isoaudit_steps_over_threshold"] if s.labels["isoaudit_rule"] == "kl_mean"]
    assert (over.name, over.value) == ("isoaudit_steps_over_threshold_total", 2.0)
    [fired] = [s for s in families["isoaudit_alerts_fired"] if s.labels["isoaudit_rule"] == "kl_mean"]
    assert fired.value == 1.0
    # a step compared late is judged by the window ending at it, and so is the step after it
    save_steps(store, "spiky", range(6, 7), kl=0.0)
    save_steps(store, "spiky", range(5, 6), kl=1e-2)
    engine.evaluate("spiky", 6, {"kl_k3": 0.0})
    engine.evaluate("spiky", 5, {"kl_k3": 1e-2})  # windows ending at 5 and 6 hold it: both over
    [over] = [
        s
        for s in run_series(store)["isoaudit_steps_over_threshold"]
        if s.labels["isoaudit_rule"] == "kl_mean"
    ]
    assert over.value == 4.0


def test_breaching_steps_are_those_whose_window_holds_the_step() -> None:
    rule = AlertRule(name="r", metric="kl_k3", threshold=1.0, window=2, aggregation="max")
    series = [(0, {"kl_k3": 0.0}), (1, {"kl_k3": 2.0}), (2, {"kl_k3": 0.0}), (3, {"kl_k3": 0.0})]
    assert [breaches_at(rule, series, s) for s in range(4)] == [False, True, True, False]
    assert [breaching_steps(rule, series, s) for s in range(4)] == [[1], [1, 2], [2], []]
    assert breaching_steps(rule, series, 7) == [] and not breaches_at(rule, series, 7)  # not in the series
