"""Debian's real Prometheus scraping a live isoaudit service every second with a project's bearer-token
file, by the shipped ``deploy/prometheus/prometheus.yml`` and ``rules.yml`` (only ``for:`` set to 1s,
the one value the rules file says to fit to a cadence), sending to a real Alertmanager; and every
panel query of the shipped Grafana dashboard run against it."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.monitoring.binaries import Prometheus, alertmanager, prometheus, promtool
from tests.monitoring.conftest import DEPLOY, LOW, SPIKE, Service

RULES = DEPLOY / "prometheus" / "rules.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "isoaudit.json"


def shipped_config(service: Service, alertmanager_url: str) -> dict[str, Any]:
    """``deploy/prometheus/prometheus.yml`` pointed at this test's service, token file and Alertmanager,
    scraping and evaluating every second."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert config["rule_files"] == ["rules.yml"]
    config.pop("rule_files")  # binaries.prometheus lists the copy it makes
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    [job] = config["scrape_configs"]
    assert job["authorization"]["credentials_file"] == "/run/secrets/isoaudit_token"
    job["authorization"]["credentials_file"] = str(service.token_file)
    job["static_configs"] = [{"targets": [f"{service.server.host}:{service.server.port}"]}]
    [manager] = config["alerting"]["alertmanagers"]
    manager["static_configs"] = [{"targets": [alertmanager_url.removeprefix("http://")]}]
    return config


def rules_with_for(source: Path, target: Path, duration: str) -> Path:
    """The shipped rules with every ``for:`` set to ``duration``, nothing else changed."""
    document = yaml.safe_load(source.read_text())
    for group in document["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = duration
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(yaml.safe_dump(document, sort_keys=False))
    return target


def value(prom: Prometheus, expr: str) -> float:
    [sample] = prom.wait_for(expr)
    return float(sample["value"][1])


def wait_until(prom: Prometheus, expr: str, timeout: float = 30.0) -> list[dict[str, Any]]:
    result = prom.wait_for(expr, timeout)
    assert result, f"no data for {expr} within {timeout}s"
    return result


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of the shipped dashboard, its variables set to "All"
    (``.*``) and Grafana's interval variables to durations."""
    dashboard = json.loads(DASHBOARD.read_text())
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert names == {"project", "run"}
    substitutions = {"$project": ".*", "$run": ".*", "$__rate_interval": "30s", "$__range": "5m"}
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, replacement in substitutions.items():
                expr = expr.replace(variable, replacement)
            assert "$" not in expr, (panel["title"], expr)
            out.append((panel["title"], expr))
    return out


def test_shipped_rules_pass_promtool() -> None:
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS" in checked.stdout


def test_prometheus_scrapes_alerts_and_the_dashboard_reads(service: Service, tmp_path: Path) -> None:
    with (
        alertmanager(tmp_path / "alertmanager") as manager,
        prometheus(
            tmp_path / "prometheus",
            shipped_config(service, manager.url),
            [rules_with_for(RULES, tmp_path / "rules" / "rules.yml", "1s")],
        ) as prom,
    ):
        # the right KL, read with alpha's token; beta's run and the finished run are not there
        [stored] = [r for r in service.store.step_results("run-a") if r.step == 2]
        assert value(prom, 'isoaudit_kl_k3{run_id="run-a", length="all"}') == pytest.approx(
            stored.metrics["kl_k3"], rel=1e-12
        )
        [target] = prom.targets()
        assert target["health"] == "up", target
        assert prom.query('{run_id="run-b"}') == [] and prom.query('{project="beta"}') == []
        assert prom.query('{run_id="run-old"}') == []
        assert value(prom, 'isoaudit_last_compared_step{run_id="run-a"}') == 2
        assert value(prom, 'isoaudit_compared_steps_total{run_id="run-a"}') == 3
        assert time.time() - value(prom, 'isoaudit_last_compared_timestamp_seconds{run_id="run-a"}') < 120
        [info] = wait_until(prom, 'isoaudit_run_info{run_id="run-a"}')
        assert {k: info["metric"][k] for k in ("engine", "framework")} == {
            "engine": "vllm",
            "framework": "verl",
        }
        assert info["metric"]["remediation_desired"] == info["metric"]["remediation_applied"] == "invariant"

        # two isoaudit alerts of one severity on one run: two Prometheus alerts, no collision
        bridged = wait_until(prom, 'ALERTS{alertname="IsoauditAlert", alertstate="firing", run_id="run-a"}')
        assert {a["metric"]["isoaudit_rule"] for a in bridged} == {"kl_high", "absdiff_high"}
        groups = httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        for rule in (r for g in groups for r in g["rules"]):
            assert rule["health"] == "ok" and not rule.get("lastError"), rule

        # the shipped KL rule (and the bitwise one: invariant kernels reported, bits differ) reach
        # Alertmanager, labelled with the run
        for name in ("IsoauditKLHigh", "IsoauditBitwiseMismatchUnderInvariantKernels"):
            deadline = time.monotonic() + 30
            while not (received := manager.alerts(alertname=name)) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert [a["labels"]["run_id"] for a in received] == ["run-a"], name
            assert received[0]["labels"]["project"] == "alpha"
            assert "run-a" in received[0]["annotations"]["summary"]
        assert not [a for a in manager.alerts() if a["labels"].get("run_id") == "run-old"]

        # a one-step spike between two scrapes: the latest-step gauge never shows it, the counter does
        over = 'isoaudit_steps_over_threshold_total{run_id="run-s", isoaudit_rule="kl_high"}'
        assert value(prom, over) == 0
        wait_until(prom, f"count_over_time({over}[1m]) >= 2")  # scraped at 0 a few times
        service.steps(service.alpha, "run-s", {1: SPIKE, 2: LOW})
        wait_until(prom, f"{over} == 1")
        wait_until(prom, f"increase({over}[1m]) > 0")
        wait_until(prom, 'ALERTS{alertname="IsoauditStepsOverThreshold", run_id="run-s"}')
        seen = value(prom, 'max_over_time(isoaudit_kl_k3{run_id="run-s", length="all"}[1m])')
        assert seen < 1e-3, "the spike's step was never the latest at a scrape"

        # every panel of the shipped Grafana dashboard has data
        for title, expr in panel_queries():
            assert prom.wait_for(expr, timeout=20), f"panel {title!r}: no data for {expr}"


def test_the_shipped_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    token = tmp_path / "token"
    token.write_text("iso_x_y\n")
    config["scrape_configs"][0]["authorization"]["credentials_file"] = str(token)
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "rules.yml").write_text(RULES.read_text())
    checked = promtool("check", "config", str(tmp_path / "prometheus.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert re.search(r"SUCCESS: \d+ rules found", checked.stdout), checked.stdout
