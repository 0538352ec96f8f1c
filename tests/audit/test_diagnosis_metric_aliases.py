"""Framework names: every figure the frameworks log, under its framework's own name, is
shown by ``isoaudit metrics list``, exported by ``/metrics?framework=`` (the scrape collector over
a real store) with the stored key's value, and accepted by an alert rule."""

from __future__ import annotations

import numpy as np
import pytest
from isoaudit.audit.alerts.rules import AlertRule
from isoaudit.audit.api.prometheus import StoreCollector, _sanitize
from isoaudit.audit.db import Store
from isoaudit.audit.metric_names import FRAMEWORKS, resolve
from isoaudit.audit.worker import ComparisonWorker
from typer.testing import CliRunner

from isoaudit.cli import app
from tests import factories
from tests.audit.test_metric_names import LISTED

LISTED_NAMES = [(framework, alias) for framework, aliases in LISTED.items() for alias in aliases]


def test_every_listed_framework_has_its_names() -> None:
    assert set(LISTED) == set(FRAMEWORKS)


def test_metrics_list_shows_every_listed_alias() -> None:
    shown = CliRunner().invoke(app, ["metrics", "list"])
    assert shown.exit_code == 0
    missing = [f"{fw}:{alias}" for fw, alias in LISTED_NAMES if f"{fw}:{alias}" not in shown.output]
    assert not missing


@pytest.mark.parametrize(("framework", "alias"), LISTED_NAMES, ids=[f"{f}:{a}" for f, a in LISTED_NAMES])
def test_an_alert_rule_accepts_the_alias(framework: str, alias: str) -> None:
    rule = AlertRule(name="parity", metric=f"{framework}:{alias}", threshold=1.0)
    assert rule.metric == resolve(f"{framework}:{alias}")


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, dict[str, float]]:
    store = Store(f"sqlite:///{tmp_path_factory.mktemp('aliases') / 'a.db'}")
    records = [factories.run()]
    for seed in range(3):
        trainer = factories.sample("trainer", seed=seed, weight_version=5)
        shifted = np.minimum(trainer.logprobs + np.float32(0.03 * (seed + 1)), 0).astype(np.float32)
        records += [trainer, factories.sample("rollout", seed=seed, logprobs=shifted, weight_version=5)]
    store.ingest(records)
    ComparisonWorker(store).run_once("run-1")
    [row] = store.step_results("run-1")
    return store, row.metrics


def test_metrics_export_carries_every_listed_alias(compared: tuple[Store, dict[str, float]]) -> None:
    """Each listed figure the step has (at each framework's defaults) is exported under its name
    with the stored value; one the framework does not log at its defaults is exported under none."""
    store, metrics = compared
    families = {f.name: f for f in StoreCollector(store, frameworks=tuple(FRAMEWORKS)).collect()}
    exported = []
    for framework, alias in LISTED_NAMES:
        key = resolve(f"{framework}:{alias}")
        family = families.get(_sanitize(f"{framework}_{alias}"))
        stored = metrics.get(key)
        if stored is None or not np.isfinite(stored):
            assert family is None, (framework, alias)  # not logged at defaults, or over zero tokens
            continue
        assert family is not None, (framework, alias, key)
        [sample] = family.samples
        assert sample.value == pytest.approx(stored), (framework, alias)
        exported.append(key)
    assert {"verl:rollout_corr/k3_kl", "tinker:kl_sample_train_v1", "nemo-rl:gen_kl_error"} <= set(exported)
