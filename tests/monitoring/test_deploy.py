"""The shipped monitoring set-up holds together: Alertmanager's config passes ``amtool`` and runs in
the real binary, the Grafana provisioning names the datasource the dashboard queries, and
``docker compose --profile monitoring`` mounts each shipped file where its config expects it
(validated by the real ``docker-compose config``; no Docker engine is needed)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.monitoring.binaries import alertmanager, amtool
from tests.monitoring.conftest import DEPLOY

ROOT = DEPLOY.parent


def test_the_alertmanager_config_passes_amtool_and_runs(tmp_path: Path) -> None:
    config = DEPLOY / "alertmanager" / "alertmanager.yml"
    checked = amtool("check-config", str(config))
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout, checked.stdout + checked.stderr
    with alertmanager(tmp_path, yaml.safe_load(config.read_text())) as manager:
        assert manager.alerts() == []


def test_grafana_provisioning_serves_the_dashboard_from_the_datasource_it_names() -> None:
    [source] = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())[
        "datasources"
    ]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    dashboard = json.loads((DEPLOY / "grafana/dashboards/isoaudit.json").read_text())
    used = {p["datasource"]["uid"] for p in dashboard["panels"]} | {
        t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]
    }
    assert used == {source["uid"]}
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for wanted in ("kl", "|δ", "exact", "alerts", "remediation mode"):
        assert wanted in titles, wanted
    [provider] = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/isoaudit.yml").read_text())[
        "providers"
    ]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_the_monitoring_profile_mounts_the_shipped_files(tmp_path: Path) -> None:
    result = subprocess.run(
        ["docker-compose", "--profile", "monitoring", "config"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    for name in ("prometheus", "alertmanager", "grafana"):
        assert services[name]["profiles"] == ["monitoring"], name

    def mounts(service: str) -> dict[str, Path]:
        out = {}
        for volume in services[service]["volumes"]:
            spec = volume if isinstance(volume, str) else f"{volume['source']}:{volume['target']}"
            source, target = spec.split(":")[:2]
            if source.startswith("/"):
                out[target] = Path(source)
        return out

    prometheus = mounts("prometheus")
    config = yaml.safe_load(prometheus["/etc/prometheus/prometheus.yml"].read_text())
    assert prometheus["/etc/prometheus/prometheus.yml"] == DEPLOY / "prometheus/prometheus.yml"
    for rule_file in config["rule_files"]:
        assert prometheus[f"/etc/prometheus/{rule_file}"] == DEPLOY / "prometheus" / rule_file
    secret = services["prometheus"]["secrets"][0]
    name = secret if isinstance(secret, str) else secret["source"]
    assert config["scrape_configs"][0]["authorization"]["credentials_file"] == f"/run/secrets/{name}"
    assert [
        t for c in config["alerting"]["alertmanagers"] for s in c["static_configs"] for t in s["targets"]
    ] == ["alertmanager:9093"]
    assert [t for s in config["scrape_configs"][0]["static_configs"] for t in s["targets"]] == ["api:8000"]
    assert (
        mounts("alertmanager")["/etc/alertmanager/alertmanager.yml"]
        == DEPLOY / "alertmanager/alertmanager.yml"
    )
    grafana = mounts("grafana")
    assert grafana["/etc/grafana/provisioning"] == DEPLOY / "grafana/provisioning"
    assert grafana["/var/lib/grafana/dashboards"] == DEPLOY / "grafana/dashboards"
    # bound to localhost only
    for name in ("prometheus", "alertmanager", "grafana"):
        for port in services[name]["ports"]:
            published = port if isinstance(port, str) else f"{port.get('host_ip')}:{port['published']}"
            assert str(published).startswith("127.0.0.1:"), (name, port)
