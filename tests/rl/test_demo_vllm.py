"""``isoaudit demo --engine vllm`` as a user runs it (the real CLI, a real SQLite file, the real
vLLM-CPU engine in-process): after the control switch at step 3 both sides run isoaudit's invariant
kernels in every op, vLLM's attention and rotary included (the manifest names nothing as staying
native), so the remediated steps' mismatch is exactly zero, both sides share one numerical policy,
and the KL alert resolves. The comparator's per-region results: before the switch differences
originate in vLLM's own attention, GEMMs and norms; after it every region, the logits included, is
equal at every position (with the kernels on, the trainer fingerprints the fp32 head its logprobs
come from, as the engine does, not the bf16 ``lm_head`` module's own output)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from isoaudit.audit.alerts.history import list_alerts  # noqa: E402
from isoaudit.audit.contract import handshake  # noqa: E402
from isoaudit.audit.db import Store  # noqa: E402
from isoaudit.audit.grid import EQUAL, RegionGrid  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SWITCH = 3


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, str, str]:
    work = tmp_path_factory.mktemp("demo-vllm")
    url = f"sqlite:///{work / 'demo.db'}"
    env = {**os.environ, "ISOAUDIT_DATABASE_URL": url, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("TRITON_INTERPRET", None)
    cmd = [  # the console script from outside the checkout, as a user runs it (see test_demo.py)
        str(Path(sys.executable).with_name("isoaudit")),
        "demo",
        "--no-serve",
        "--steps",
        "6",
        "--remediate-at",
        str(SWITCH),
    ]
    cmd += ["--engine", "vllm", "--prompts", "2", "--group", "2", "--max-new", "4"]
    cmd += ["--model-dir", str(work / "model")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=work)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    store = Store(url)
    (run,) = store.list_runs()
    return store, run.run_id, done.stdout


def test_remediated_steps_are_exactly_zero_and_the_alert_resolves(demo_run: tuple[Store, str, str]) -> None:
    store, run_id, output = demo_run
    assert "vLLM" in output
    steps = {row.step: row.metrics for row in store.step_results(run_id)}
    assert sorted(steps) == list(range(6))
    assert all(steps[s]["kl_k3"] > 0 and steps[s]["exact_match_fraction"] < 1 for s in range(SWITCH))
    for s in range(SWITCH, 6):
        assert steps[s]["logprob_abs_diff_max"] == 0.0 and steps[s]["exact_match_fraction"] == 1.0
    (alert,) = [a for a in list_alerts(store, run_id=run_id) if a.rule == "demo_kl_k3"]
    assert alert.fired_step is not None and alert.fired_step < SWITCH
    assert alert.state == "resolved" and alert.resolved_step is not None and alert.resolved_step >= SWITCH


def test_both_sides_run_one_numerical_policy_after_the_switch(demo_run: tuple[Store, str, str]) -> None:
    store, run_id, _ = demo_run
    rollout = [m for m in store.manifests(run_id, "rollout") if m.runtime.remediation == "invariant"]
    trainer = [m for m in store.manifests(run_id, "trainer") if m.runtime.remediation == "invariant"]
    assert trainer and {m.case for m in rollout} == {"engine_prefill", "engine_decode"}
    assert all(
        m.runtime.remediation_native_regions == [] and m.runtime.remediation_native is None for m in rollout
    )
    assert len({m.contract.numerical_policy for m in trainer + rollout}) == 1
    assert all(handshake(trainer[-1], m).ok for m in rollout)
    native_t, native_r = store.manifests(run_id, "trainer")[0], store.manifests(run_id, "rollout")[0]
    assert native_r.runtime.remediation == "native"
    assert "layers.0.attn" in handshake(native_t, native_r).differing_regions


def test_every_region_is_equal_after_the_switch(demo_run: tuple[Store, str, str]) -> None:
    store, run_id, _ = demo_run
    before, after = [], []
    for row in store.sample_results(run_id):
        (after if row.step >= SWITCH else before).append(RegionGrid.from_json(row.grid))
    assert len(after) == 3 * 4 and len(before) == 3 * 4
    for grid in after:
        for region in grid.regions:
            state = grid.state[grid.regions.index(region)]
            assert (state >= 0).any(), region
            assert (state[state >= 0] == EQUAL).all(), region
        assert not grid.origins
    # Natively differences originate in vLLM's attention and in its own GEMMs and norms.
    origins = {region for grid in before for region, _ in grid.origins}
    assert "layers.0.attn" in origins and origins - {"layers.0.attn", "layers.1.attn", "logits"}
