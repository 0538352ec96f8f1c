"""``/metrics`` is clean by Prometheus' own linter (Debian's real ``promtool check metrics``) on every
variant a scrape can ask for, and every series is scoped to the reader's project."""

from __future__ import annotations

from isoaudit.audit import __version__
from isoaudit.audit.metric_names import FRAMEWORKS
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tests.monitoring.binaries import promtool
from tests.monitoring.conftest import Service


def _families(text: str) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_promtool_passes_every_metrics_variant(service: Service) -> None:
    variants = {
        "all projects": (None, {}),
        "alpha's token": (service.alpha, {}),
        "beta's token": (service.beta, {}),
        **{f"framework={f}": (service.alpha, {"framework": f}) for f in FRAMEWORKS},
        "every framework": (None, {"framework": list(FRAMEWORKS)}),
    }
    for variant, (token, params) in variants.items():
        text = service.metrics(token, **params)
        checked = promtool("check", "metrics", stdin=text)
        assert checked.returncode == 0 and not checked.stdout + checked.stderr, (
            variant,
            checked.stdout + checked.stderr,
        )
        assert "alertname" not in text, variant
        for family in text_string_to_metric_families(text):
            label_sets = {tuple(sorted(set(s.labels) - {"le"})) for s in family.samples}
            assert len(label_sets) <= 1, (variant, family.name, label_sets)


def test_every_series_is_scoped_to_the_tokens_project(service: Service) -> None:
    everything = service.metrics(None)
    assert 'project="alpha"' in everything and 'project="beta"' in everything
    for token, mine, other in ((service.alpha, "alpha", "beta"), (service.beta, "beta", "alpha")):
        text = service.metrics(token, framework=list(FRAMEWORKS))
        assert f'project="{other}"' not in text, f"{mine}'s token sees {other}'s series"
        families = _families(text)
        ingest = [s for s in families["isoaudit_ingest_records"].samples if s.name.endswith("_total")]
        assert ingest and {s.labels["project"] for s in ingest} == {mine}
        assert {s.labels["project"] for s in families["isoaudit_comparison_queue_samples"].samples} == {mine}
    families = _families(everything)
    assert [s.labels for s in families["isoaudit_build_info"].samples] == [{"version": __version__}]
