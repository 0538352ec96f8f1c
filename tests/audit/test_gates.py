"""Regression gates (audit.gates, ``isoaudit gate``), ``isoaudit metrics list`` and ``isoaudit compare
--names``, on a real store with real comparisons."""

from __future__ import annotations

import json

import numpy as np
import pytest
from isoaudit.audit.db import Store
from isoaudit.audit.gates import GateError, assert_parity, bounds_of, parse_assignment, parse_steps
from isoaudit.audit.metric_names import ALIASES
from typer.testing import CliRunner

from isoaudit.cli import app
from tests import factories

runner = CliRunner()


def ingest(store: Store, step: int, shift: float) -> None:
    """Three samples; the trainer's logprobs are the rollout's shifted by ``shift`` (0: identical)."""
    records = [factories.run()]
    for seed in range(3):
        rollout = factories.sample("rollout", step=step, seed=seed)
        moved = np.minimum(rollout.logprobs + np.float32(shift), 0).astype(np.float32)
        records += [rollout, factories.sample("trainer", step=step, seed=seed, logprobs=moved)]
    store.ingest(records)


@pytest.fixture
def gated(database_url: str) -> str:
    """Step 0 identical on both sides, step 1 shifted by 0.05 nats per token."""
    store = Store(database_url)
    ingest(store, 0, 0.0)
    ingest(store, 1, -0.05)
    store.dispose()
    return database_url


def test_gate_passes_fails_and_names_each_failure(gated: str) -> None:
    db = ["--database-url", gated]
    ok = runner.invoke(app, ["gate", "run-1", "--steps", "0", "--max", "kl_k3=1e-3", *db])
    assert ok.exit_code == 0, ok.output
    assert "pass" in ok.output

    bad = runner.invoke(
        app,
        [
            "gate",
            "run-1",
            "--max",
            "kl_k3=1e-3",
            "--max",
            "train_rollout_logprob_abs_diff=1e-6",
            "--min",
            "exact_match_fraction=0.99",
            *db,
        ],
    )
    assert bad.exit_code == 2, bad.output
    # step 1 breaks the abs-diff and exact-match gates (|Δ| ≈ 0.05 but k3 ≈ 1.25e-3 > 1e-3 too)
    assert (
        "train_rollout_logprob_abs_diff" in bad.output
        and "slime:train_rollout_logprob_abs_diff" in bad.output
    )
    assert "exact_match_fraction" in bad.output and "fail" in bad.output
    assert "step 0" not in bad.output.lower().replace("steps", "")


def test_gate_bad_input_exits_1_naming_it(gated: str) -> None:
    db = ["--database-url", gated]
    cases = [
        (["gate", "run-1", "--max", "kl_k33=1", *db], "did you mean kl_k3"),
        (["gate", "run-1", "--max", "kl_k3", *db], "METRIC=NUMBER"),
        (["gate", "run-1", "--max", "kl_k3=lots", *db], "not a number"),
        (["gate", "run-1", *db], "at least one"),
        (["gate", "nope", "--max", "kl_k3=1", *db], "no run 'nope'"),
        (["gate", "run-1", "--steps", "7..9", "--max", "kl_k3=1", *db], "no compared step"),
        (["gate", "run-1", "--steps", "x", "--max", "kl_k3=1", *db], "--steps"),
    ]
    for args, message in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 1, (args, result.output)
        assert message in " ".join(result.output.split()), (args, result.output)


def test_assert_parity_is_a_pytest_helper(gated: str) -> None:
    store = Store(gated)
    result = assert_parity(store, "run-1", max={"verl:rollout_corr/k3_kl": 1e-3}, steps="0")
    assert result.passed and result.steps == [0]
    with pytest.raises(
        AssertionError, match=r"step 1: kl_sample_train_v1 \(tinker:kl_sample_train_v1\) <= 0.001"
    ):
        assert_parity(store, "run-1", max={"kl_sample_train_v1": 1e-3})
    with pytest.raises(GateError, match="--min no_such"):
        assert_parity(store, "run-1", min={"no_such": 1.0})


def test_parsing_helpers() -> None:
    assert parse_assignment("tis_mean[cap=3]=1.5", "--max") == ("tis_mean[cap=3]", 1.5)
    assert parse_steps("3") == {3} and parse_steps("1,4") == {1, 4}
    assert (
        parse_steps("2..8") == (2, 8) and parse_steps("5..") == (5, None) and parse_steps("..3") == (None, 3)
    )
    with pytest.raises(GateError, match="empty"):
        parse_steps("8..2")
    [bound] = bounds_of(max={"gen_kl_error": 0.01})
    assert bound.key == "nemo-rl:gen_kl_error" and bound.holds(0.005) and not bound.holds(0.02)


def test_metrics_list_shows_every_alias() -> None:
    table = runner.invoke(app, ["metrics", "list"])
    assert table.exit_code == 0
    for alias in ALIASES:
        assert f"{alias.framework}:{alias.name}" in table.output, alias
    parsed = json.loads(runner.invoke(app, ["metrics", "list", "--json", "--framework", "tinker"]).stdout)
    assert [f["key"] for f in parsed["figures"]] == [
        "tinker:kl_sample_train_v1",
        "tinker:kl_sample_train_v2",
        "tinker:entropy",
    ]
    assert [f["same_as"] for f in parsed["figures"]] == ["kl_k1", "kl_k2", None]
    assert runner.invoke(app, ["metrics", "list", "--framework", "nope"]).exit_code == 1


def test_compare_names_shows_a_frameworks_names(gated: str) -> None:
    db = ["--database-url", gated]
    shown = runner.invoke(app, ["compare", "run-1", "--names", "verl", *db])
    assert shown.exit_code == 3, shown.output  # step 1 differs but has no fingerprints to locate it
    assert "rollout_corr/k3_kl" in shown.output and "verl's names" in shown.output
    parsed = json.loads(runner.invoke(app, ["compare", "run-1", "--names", "tinker", "--json", *db]).stdout)
    step1 = parsed["steps"][1]
    assert step1["as"]["tinker"]["kl_sample_train_v1"] == step1["metrics"]["kl_k1"]
    assert runner.invoke(app, ["compare", "run-1", "--names", "nope", *db]).exit_code == 1
