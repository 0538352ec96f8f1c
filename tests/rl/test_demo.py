"""``isoaudit demo`` as a user runs it (the real CLI, a real SQLite file, the reference engine):
the KL alert fires on the native bf16 mismatch, the control switch at step 3 reaches both sides,
the remediated steps' mismatch is exactly zero and the alert resolves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from audit.alerts.history import list_alerts
from audit.store import Store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, str, str]:
    work = tmp_path_factory.mktemp("demo")
    url = f"sqlite:///{work / 'demo.db'}"
    env = {**os.environ, "ISOAUDIT_DATABASE_URL": url}
    env.pop("TRITON_INTERPRET", None)  # the demo's CPU kernels need no Triton interpreter
    cmd = [sys.executable, "-m", "audit.cli", "demo", "--no-serve", "--steps", "6", "--remediate-at", "3"]
    cmd += ["--engine", "reference", "--prompts", "2", "--group", "2", "--max-new", "4"]
    cmd += ["--model-dir", str(work / "model")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=Path.cwd())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    store = Store(url)
    (run,) = store.list_runs()
    return store, run.run_id, done.stdout


def test_kl_alert_fires_before_the_switch_and_resolves(demo_run: tuple[Store, str, str]) -> None:
    store, run_id, output = demo_run
    (alert,) = [a for a in list_alerts(store, run_id=run_id) if a.rule == "demo_kl_k3"]
    assert alert.fired_step is not None and alert.fired_step < 3
    assert alert.state == "resolved" and alert.resolved_step is not None and alert.resolved_step >= 3
    assert "demo_kl_k3" in output and "fired at step" in output


def test_mismatch_is_native_before_and_exactly_zero_after(demo_run: tuple[Store, str, str]) -> None:
    store, run_id, _ = demo_run
    steps = {row.step: row.metrics for row in store.step_results(run_id)}
    assert sorted(steps) == list(range(6))
    assert all(steps[s]["kl_k3"] > 0 and steps[s]["exact_match_fraction"] < 1 for s in range(3))
    for s in range(3, 6):
        assert steps[s]["logprob_abs_diff_max"] == 0.0 and steps[s]["exact_match_fraction"] == 1.0


def test_both_sides_report_the_applied_mode(demo_run: tuple[Store, str, str]) -> None:
    store, run_id, _ = demo_run
    for side in ("trainer", "rollout"):
        modes = [m.runtime.remediation for m in store.manifests(run_id, side)]
        assert modes[0] == "native" and modes[-1] == "invariant", (side, modes)
    assert store.get_control(run_id).mode == "invariant"


def test_loop_figures_are_stored_per_step(demo_run: tuple[Store, str, str]) -> None:
    store, run_id, _ = demo_run
    stats = store.step_stats(run_id)
    assert [s.step for s in stats] == list(range(6))
    assert all(s.reward_mean is not None and 0 <= s.reward_mean <= 1 for s in stats)
    assert all(s.generation_s and s.generation_s > 0 and s.training_s and s.training_s > 0 for s in stats)
