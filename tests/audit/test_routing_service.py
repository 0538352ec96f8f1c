"""Routing agreement through the service: the run's routing route and a sample's, ``/metrics``
(Prometheus names) and an alert rule on a routing metric, over the real app, store and worker."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from isoaudit.audit.alerts import AlertEngine, AlertRule, DatabaseChannel
from isoaudit.audit.alerts.history import list_alerts
from isoaudit.audit.alerts.rules import save_rule
from isoaudit.audit.api import create_app
from isoaudit.audit.api.live import LiveServer
from isoaudit.audit.auth import create_token
from isoaudit.audit.db import Store
from isoaudit.audit.settings import Settings

from tests.audit.routing_records import LAYERS, N, routed_run


@pytest.fixture
def api(store: Store) -> Iterator[httpx.Client]:
    live = LiveServer(create_app(store, Settings(run_worker=False)))
    live.start()
    token = create_token(store, "alpha", "tests")
    with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
        yield client
    live.stop()


def test_routing_route_per_step_and_layer(api: httpx.Client, store: Store) -> None:
    keys = routed_run(store, project="alpha")
    response = api.get("/v1/runs/moe-run/routing")
    assert response.status_code == 200, response.text
    steps = response.json()
    assert [s["step"] for s in steps] == [0, 1, 2]
    assert steps[0]["metrics"]["routing_set_agreement"] == 1.0
    assert steps[0]["metrics"]["routing_first_flip_layer"] is None  # NaN: no flip
    two = steps[2]
    assert two["metrics"]["routing_set_agreement"] == pytest.approx(15 / 18)
    assert two["metrics"]["routing_flip_rate"] == pytest.approx(3 / 36)
    assert two["metrics"]["routing_jaccard_mean"] == pytest.approx(16 / 18)
    assert two["metrics"]["routing_first_flip_layer"] == 0
    by_layer = {layer["layer"]: layer for layer in two["layers"]}
    assert set(by_layer) == set(LAYERS)
    assert (by_layer[0]["flipped_tokens"], by_layer[2]["flipped_tokens"]) == (1, 2)
    assert (by_layer[0]["first_flips"], by_layer[2]["first_flips"]) == (1, 1)  # token 3 first flips in 0
    assert by_layer[2]["example"] == keys[2]
    assert two["replayed"] is None and two["missing_routes"] == 0
    assert [s["step"] for s in api.get("/v1/runs/moe-run/routing", params={"after_step": 1}).json()] == [2]

    sample = api.get(f"/v1/runs/moe-run/steps/2/samples/{keys[2]}/routing")
    assert sample.status_code == 200, sample.text
    body = sample.json()
    assert body["layers"] == LAYERS and body["positions"] == list(range(N - 1))
    assert body["first_flip_layer"][3] == 0 and body["first_flip_layer"][7] == 2
    assert set(body["trainer"][3][0]) != set(body["rollout"][3][0])
    missing = api.get(f"/v1/runs/moe-run/steps/2/samples/{'0' * 32}/routing")
    assert missing.status_code == 404 and "sample_key" in missing.json()["detail"]

    [result] = [r for r in store.sample_results("moe-run", 2)]
    assert result.diagnosis == "numerical"
    assert result.diagnosis_detail["evidence"]["cause"] == "routing"
    assert result.diagnosis_detail["evidence"]["routing"]["layer"] == 0


def test_metrics_export_and_an_alert_rule_on_routing_flips(api: httpx.Client, store: Store) -> None:
    routed_run(store, project="alpha")
    text = api.get("/metrics").text
    lines = [line for line in text.splitlines() if line.startswith("isoaudit_routing_flip_rate{")]
    assert lines and 'run_id="moe-run"' in lines[0]
    assert float(lines[0].rsplit(" ", 1)[1]) == pytest.approx(3 / 36)  # the latest step's
    assert "# HELP isoaudit_routing_set_agreement" in text

    rule = AlertRule(name="routing_flips", metric="routing_flip_rate", threshold=0.05, for_steps=0)
    save_rule(store, rule, "api")
    engine = AlertEngine(store, [DatabaseChannel()])
    for row in store.step_results("moe-run"):
        engine.evaluate("moe-run", row.step, row.metrics)
    [alert] = [a for a in list_alerts(store, run_id="moe-run") if a.rule == "routing_flips"]
    assert alert.state == "firing" and alert.fired_step == 2


def test_routes_travel_over_http_ingest_and_come_back_equal(api: httpx.Client, store: Store) -> None:
    import numpy as np
    from isoaudit.audit.records import Routes
    from isoaudit.collectors.sinks.base import encode_batch

    from tests import factories

    sample = factories.sample("trainer", run_id="wire", prompt_len=3, n_completion=2)
    sample.routes = Routes(
        layers=[1, 4],
        top_k=2,
        num_experts=300,  # past one byte: uint16 on the wire
        positions=np.arange(5, dtype=np.int32),
        experts=np.asarray([[299, 0, 5, 6]] * 5, dtype=np.uint16),
        replayed=np.asarray([1, 1, 1, 0, 0], dtype=np.uint8),
    )
    body = encode_batch([factories.run("wire"), sample])
    response = api.post("/v1/ingest", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 200, response.text
    [stored] = store.samples("wire", 0)
    assert stored.routes is not None and stored.routes.layers == [1, 4]
    assert stored.routes.experts.dtype == np.uint16
    assert np.array_equal(stored.routes.experts, sample.routes.experts)
    assert stored.routes.replayed.tolist() == [1, 1, 1, 0, 0]  # type: ignore[union-attr]
    bad = body.replace(b'"num_experts":300', b'"num_experts":8')
    refused = api.post("/v1/ingest", content=bad, headers={"Content-Type": "application/json"})
    assert "routes.experts" in refused.text
