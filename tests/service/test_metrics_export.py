"""``/metrics`` under each framework's names, threshold variants and lag slices as labels, and
``/v1/metric-names`` (the alias registry over HTTP): real app, real HTTP, real comparison."""

from __future__ import annotations

import numpy as np
from isoaudit.audit.records import Batch
from isoaudit.audit.worker import ComparisonWorker
from prometheus_client.parser import text_string_to_metric_families

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
    assert value(named["verl_rollout_corr_k3_kl"], run_id="run-1") == metrics["kl_k3"]
    assert value(named["tinker_kl_sample_train_v1"], run_id="run-1") == metrics["kl_k1"]
    assert value(named["nemo_rl_token_mult_prob_error"], run_id="run-1") == metrics["token_mult_prob_error"]
    assert (
        value(named["trl_sampling_importance_sampling_ratio_mean"], run_id="run-1")
        == metrics["tis_mean[cap=3]"]
    )
    assert "kl_k3" in named["verl_rollout_corr_k3_kl"].documentation


def test_metrics_refuses_an_unknown_framework_naming_the_field(api):
    reply = api.get("/metrics", params={"framework": "deepspeed-chat"})
    assert reply.status_code == 422
    assert "framework" in reply.text and "verl" in reply.text


def test_metric_names_lists_the_registry(api):
    rows = api.get("/v1/metric-names").json()
    by_key = {row["key"]: row for row in rows}
    assert {a["name"] for a in by_key["kl_k3"]["aliases"]} >= {
        "rollout_corr/k3_kl",
        "gen_kl_error",
        "mismatch_kl/all/mean",
    }
    trl = api.get("/v1/metric-names", params={"framework": "trl"}).json()
    assert {row["key"] for row in trl} == {
        "logprob_abs_diff_mean",
        "logprob_abs_diff_max",
        "tis_min[cap=3]",
        "tis_mean[cap=3]",
        "tis_max[cap=3]",
    }
    assert all(row["definition"] for row in trl)
