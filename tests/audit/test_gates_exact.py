"""The fail-closed gate (``isoaudit gate --exact``, ``assert_parity(exact=True)``): one differing token
fails its step, naming the count and max |Δ|; identical steps pass."""

from __future__ import annotations

import numpy as np
import pytest
from isoaudit.audit.db import Store
from isoaudit.audit.gates import EXACT, GateError, assert_parity, bounds_of, check
from isoaudit.audit.metrics import NotIdentical, ParityUnverified
from typer.testing import CliRunner

from isoaudit.cli import app
from tests import factories

runner = CliRunner()


def ingest(store: Store, step: int, moved: dict[int, float]) -> None:
    """Three samples of 6 tokens; sample ``seed``'s token 2 moved by ``moved[seed]`` on the trainer."""
    records = [factories.run()]
    for seed in range(3):
        rollout = factories.sample("rollout", step=step, seed=seed)
        logprobs = rollout.logprobs.copy()
        logprobs[2] -= np.float32(moved.get(seed, 0.0))
        records += [rollout, factories.sample("trainer", step=step, seed=seed, logprobs=logprobs)]
    store.ingest(records)


@pytest.fixture
def exact_run(database_url: str) -> str:
    """Steps 0 and 2 identical; step 1 with one token 0.25 nats apart; step 3 with two tokens."""
    store = Store(database_url)
    ingest(store, 0, {})
    ingest(store, 1, {1: 0.25})
    ingest(store, 2, {})
    ingest(store, 3, {0: 0.5, 2: 0.125})
    store.dispose()
    return database_url


def test_exact_gate_fails_each_step_with_a_differing_token(exact_run: str) -> None:
    store = Store(exact_run)
    result = check(store, "run-1", bounds_of(exact=True))
    assert [f.step for f in result.failures] == [1, 3]
    one, two = result.not_identical()
    assert (one.differing_tokens, one.max_abs_delta, one.n_tokens) == (1, pytest.approx(0.25, rel=1e-6), 18)
    assert (two.differing_tokens, two.max_abs_delta) == (2, pytest.approx(0.5, rel=1e-6))
    assert "step 1: exact (bitwise_mismatch_count) identical: differing tokens: 1 of 18" in result.text()
    assert check(store, "run-1", [EXACT], {0, 2}).passed
    store.dispose()


def test_assert_parity_exact_raises_not_identical_with_step_count_and_max(exact_run: str) -> None:
    store = Store(exact_run)
    assert assert_parity(store, "run-1", exact=True, steps="0").passed
    assert assert_parity(store, "run-1", exact=True, steps={0, 2}, max={"kl_k3": 1.0}).passed
    with pytest.raises(NotIdentical) as raised:
        assert_parity(store, "run-1", exact=True, max={"kl_k3": 1.0})
    assert (raised.value.step, raised.value.differing_tokens, raised.value.failing_steps) == (1, 1, 2)
    assert raised.value.max_abs_delta == pytest.approx(0.25, rel=1e-6)
    assert isinstance(raised.value, AssertionError)  # a pytest failure, not an error
    # a loose bound alone passes the same steps: exactness is what fails them
    assert assert_parity(store, "run-1", max={"logprob_abs_diff_max": 1.0}).passed
    with pytest.raises(GateError, match="--exact"):
        assert_parity(store, "run-1")
    store.dispose()


def test_a_step_without_a_bitwise_count_is_unverified(
    exact_run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(exact_run)
    check(store, "run-1", [EXACT])  # compares the queued steps
    rows = store.step_results("run-1", 0, 0)
    for row in rows:
        row.metrics.pop("bitwise_mismatch_count")
    monkeypatch.setattr(store, "step_results", lambda *a, **k: rows)
    with pytest.raises(ParityUnverified, match="no bitwise count at step 0"):
        assert_parity(store, "run-1", exact=True, steps="0")
    store.dispose()


@pytest.mark.parametrize("flag", ["--exact", "--fail-closed"])
def test_gate_cli_exact(exact_run: str, flag: str) -> None:
    db = ["--database-url", exact_run]
    ok = runner.invoke(app, ["gate", "run-1", flag, "--steps", "0,2", *db])
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(app, ["gate", "run-1", flag, *db])
    assert bad.exit_code == 2, bad.output
    text = " ".join(bad.output.split())
    assert "not identical: 3 differing token(s) on 2 step(s), first at step 1, max |Δ| 0.5" in text
    assert "differing tokens: 1 of 18" in text
    assert runner.invoke(app, ["gate", "run-1", *db]).exit_code == 1  # still needs a gate
