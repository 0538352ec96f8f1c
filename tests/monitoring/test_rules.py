"""The shipped ``deploy/prometheus/rules.yml`` with its own ``for:`` durations under ``promtool test
rules``: Prometheus' rule evaluator over synthetic series, minute by minute, for the rules the live
test cannot wait for (10-minute ``for:``, an hour's average, a failing scrape). Annotations are left
out of the copy (they never decide whether an alert fires; the live test reads them rendered)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tests.monitoring.binaries import promtool
from tests.monitoring.conftest import DEPLOY

RUN = {"run_id": "r1", "project": "alpha", "job": "isoaudit", "instance": "api:8000"}


def series(metric: str, values: str, **labels: str) -> dict[str, str]:
    shown = ", ".join(f'{k}="{v}"' for k, v in {**RUN, **labels}.items())
    return {"series": f"{metric}{{{shown}}}", "values": values}


def alert(name: str, at: str, *expected: dict[str, str]) -> dict[str, Any]:
    return {"eval_time": at, "alertname": name, "exp_alerts": [{"exp_labels": e} for e in expected]}


def test_the_shipped_rules_fire_as_documented(tmp_path: Path) -> None:
    shipped = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())
    for group in shipped["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(shipped))
    kl = {**RUN, "length": "all"}
    info = {"name": "a run", "engine": "vllm", "framework": "verl", "remediation_desired": "invariant"}
    tests = [
        {  # KL: warning after 10 minutes over 1e-3, critical after 1 minute over 1e-2
            "interval": "1m",
            "input_series": [series("isoaudit_kl_k3", "0.002x14 0.02x5", length="all")],
            "alert_rule_test": [
                alert("IsoauditKLHigh", "9m"),
                alert("IsoauditKLHigh", "11m", {**kl, "severity": "warning"}),
                alert("IsoauditKLCritical", "15m"),
                alert("IsoauditKLCritical", "17m", {**kl, "severity": "critical"}),
            ],
        },
        {  # bits differ while both sides report the invariant kernels; not while they run native ones
            "interval": "1m",
            "input_series": [
                series("isoaudit_bitwise_mismatch_tokens", "3x5", length="all"),
                series("isoaudit_run_info", "1x5", remediation_applied="invariant", **info),
                series("isoaudit_bitwise_mismatch_tokens", "3x5", length="all", run_id="r2"),
                series("isoaudit_run_info", "1x5", remediation_applied="native", **{**info, "run_id": "r2"}),
            ],
            "alert_rule_test": [
                alert("IsoauditBitwiseMismatchUnderInvariantKernels", "3m", {**kl, "severity": "critical"}),
            ],
        },
        {  # the exact fraction halves against its last hour's average
            "interval": "1m",
            "input_series": [series("isoaudit_exact_match_ratio", "0.9x60 0.1x30", length="all")],
            "alert_rule_test": [
                alert("IsoauditExactMatchDropped", "60m"),
                alert("IsoauditExactMatchDropped", "75m", {**kl, "severity": "warning"}),
            ],
        },
        {  # a step over a rule's threshold between two scrapes; two isoaudit alerts of one run
            "interval": "1m",
            "input_series": [
                series("isoaudit_steps_over_threshold_total", "0x5 1x10", isoaudit_rule="kl_high"),
                *(
                    series("isoaudit_alerts", "1x5", isoaudit_rule=rule, severity="warning", state="firing")
                    for rule in ("kl_high", "absdiff_high")
                ),
            ],
            "alert_rule_test": [
                alert("IsoauditStepsOverThreshold", "4m"),
                alert(
                    "IsoauditStepsOverThreshold",
                    "7m",
                    {**RUN, "isoaudit_rule": "kl_high", "severity": "warning"},
                ),
                alert(
                    "IsoauditAlert",
                    "2m",
                    *(
                        {**RUN, "isoaudit_rule": rule, "severity": "warning", "state": "firing"}
                        for rule in ("kl_high", "absdiff_high")
                    ),
                ),
            ],
        },
        {
            "interval": "1m",
            "input_series": [{"series": 'up{job="isoaudit", instance="api:8000"}', "values": "0x10"}],
            "alert_rule_test": [
                alert(
                    "IsoauditScrapeFailing",
                    "6m",
                    {"job": "isoaudit", "instance": "api:8000", "severity": "warning"},
                )
            ],
        },
    ]
    (tmp_path / "rules_test.yml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": tests})
    )
    checked = promtool("test", "rules", str(tmp_path / "rules_test.yml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr
