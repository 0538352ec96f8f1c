"""What changed: every manifest carries the environment that decides the bits (read for real from
this process), ``isoaudit diff`` names a planted library and backend change between two runs, and
the comparison worker names what changed since the last clean step in the verdicts of the steps
that stopped being clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from isoaudit.audit.db import Store
from isoaudit.audit.db.reads.environment import Point, environment_diff
from isoaudit.audit.environment import diff_manifests
from isoaudit.audit.records import Manifest
from isoaudit.audit.worker import ComparisonWorker
from isoaudit.collectors.environment import allowed_env_name, process_environment
from isoaudit.collectors.sinks import MemorySink
from typer.testing import CliRunner

from isoaudit.cli.app import app
from tests import factories
from tests.audit.environment_records import (
    BASE_ATTENTION,
    PLANTED_ATTENTION,
    PLANTED_VLLM,
    drifting_run,
    planted_runs,
)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    store = Store(f"sqlite:///{tmp_path / 'isoaudit.db'}")
    yield store
    store.dispose()


def test_the_environment_holds_versions_backends_flags_and_only_allowed_pins(monkeypatch) -> None:
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASH_ATTN")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    monkeypatch.setenv("ISOAUDIT_TOKEN", "secret")
    monkeypatch.setenv("ISOAUDIT_GEMM_SPLIT_K", "0")
    env = process_environment()
    assert env.versions["torch"] == torch.__version__
    assert {"transformers", "vllm", "triton", "numpy"} <= env.versions.keys()
    assert {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "ISOAUDIT_GEMM_SPLIT_K": "0",
        "NCCL_ALGO": "Ring",
        "VLLM_ATTENTION_BACKEND": "FLASH_ATTN",
        "VLLM_BATCH_INVARIANT": "1",
    }.items() <= env.env.items()
    assert not {"VLLM_API_KEY", "VLLM_LOGGING_LEVEL", "ISOAUDIT_TOKEN"} & env.env.keys()
    assert env.backends["torch.sdpa.math"] is True
    assert env.flags["torch.deterministic_algorithms"] is False
    torch.use_deterministic_algorithms(True)
    try:
        assert process_environment().flags["torch.deterministic_algorithms"] is True
    finally:
        torch.use_deterministic_algorithms(False)
    assert not any(allowed_env_name(n) for n in ("VLLM_API_KEY", "HF_TOKEN", "ISOAUDIT_DATABASE_URL"))


def test_a_trainer_manifest_carries_its_environment(tmp_path: Path) -> None:
    from isoaudit.collectors import trainer
    from isoaudit.collectors.tiny_models import load_tiny_model, make_tiny_model

    path = make_tiny_model("qwen3", tmp_path / "m", num_layers=1, hidden=32, vocab=512, dtype="float32")
    model, _ = load_tiny_model(Path(path), dtype=torch.float32)
    sink = MemorySink()
    handle = trainer.attach(model, run=factories.run("env-trainer"), sink=sink, strict=True)
    try:
        assert sink.flush(30)
        [first, *_] = sink.of_kind("manifest")
        env = first.environment
        assert env is not None and env.versions["transformers"] and env.versions["torch"] == torch.__version__
        assert env.backends["attention"] == model.config._attn_implementation
        assert env.backends["isoaudit.kernels"] == "native"
        torch.use_deterministic_algorithms(True)  # a switch flipped mid-run: a new manifest names it
        try:
            from isoaudit.collectors.layout import StepBatch

            handle.begin_step(1)
            batch = StepBatch.padded([[5, 6, 7]], [[8, 9]], temperature=0.7)
            handle.record_step(1, batch)  # the manifests are checked before the step's records
        finally:
            torch.use_deterministic_algorithms(False)
        assert sink.flush(30)
        last = sink.of_kind("manifest")[-1]
        changes = diff_manifests(first, last).changes
        assert [c.text() for c in changes] == ["torch.deterministic_algorithms false → true"]
    finally:
        handle.detach()


def test_isoaudit_diff_names_the_planted_library_and_backend_change(store: Store) -> None:
    planted_runs(store)
    url = str(store.engine.url)
    runner = CliRunner()
    result = runner.invoke(app, ["diff", "env-a", "env-b", "--json", "--database-url", url])
    assert result.exit_code == 2, result.output
    body = json.loads(result.output)
    by_title = {d["title"]: d for d in body["diffs"]}
    assert by_title["trainer"]["changes"] == {}
    rollout = by_title["rollout"]["changes"]
    assert {
        "key": "vllm",
        "group": "versions",
        "old": process_environment().versions["vllm"],
        "new": PLANTED_VLLM,
    } in rollout["versions"]
    assert {
        "key": "attention",
        "group": "backends",
        "old": BASE_ATTENTION,
        "new": PLANTED_ATTENTION,
    } in rollout["backends"]
    assert set(rollout) == {"versions", "backends"}  # the runtime fact is named once, as a backend
    table = runner.invoke(app, ["diff", "env-a@0", "env-b@0", "--database-url", url])
    assert table.exit_code == 2
    assert f"→ {PLANTED_VLLM}" not in table.output  # a table: old and new in their own columns
    assert PLANTED_VLLM in table.output and PLANTED_ATTENTION in table.output and "versions" in table.output
    same = runner.invoke(app, ["diff", "env-a", "env-a", "--database-url", url])
    assert same.exit_code == 0 and "nothing changed" in same.output
    sides = runner.invoke(app, ["diff", "env-b", "--sides", "--json", "--database-url", url])
    names = {c["key"] for cs in json.loads(sides.output)["diffs"][0]["changes"].values() for c in cs}
    assert {"attention", "batch_invariant"} <= names
    bad = runner.invoke(app, ["diff", "env-a@x", "--database-url", url])
    assert bad.exit_code == 1 and "whole number" in bad.output
    missing = runner.invoke(app, ["diff", "env-a@7", "--database-url", url])
    assert missing.exit_code == 1 and "no records of step 7" in missing.output


@pytest.mark.parametrize("batched", [True, False], ids=["one-batch", "step-by-step"])
def test_a_mismatch_that_appears_at_a_step_names_the_changes_since_the_last_clean_step(
    store: Store, batched: bool
) -> None:
    worker = ComparisonWorker(store)
    drifting_run(store, change_at=3, steps=5, after_step=None if batched else lambda _: worker.run_once())
    worker.run_once()
    results = {r.step: r for r in store.step_results("env-drift")}
    assert [results[s].diagnoses["counts"] for s in range(5)] == [{"clean": 3}] * 3 + [
        {"inconclusive": 3}
    ] * 2  # no fingerprints: not located
    for step in (0, 1, 2):
        assert "environment_changes" not in results[step].diagnoses
    vllm = process_environment().versions["vllm"]
    for step in (3, 4):
        changed = results[step].diagnoses["environment_changes"]
        assert changed["since_step"] == 2
        assert set(changed["sides"]) == {"rollout"}
        keys = {(c["group"], c["key"], c["old"], c["new"]) for c in changed["sides"]["rollout"]}
        assert ("versions", "vllm", vllm, PLANTED_VLLM) in keys
        assert ("backends", "attention", BASE_ATTENTION, PLANTED_ATTENTION) in keys
        for sample in store.sample_results("env-drift", step):
            detail = sample.diagnosis_detail
            assert detail["evidence"]["environment_changes"]["since_step"] == 2
            assert "Changed since the last clean step 2: on the rollout, " in detail["sentence"]
            assert f"vllm {vllm} → {PLANTED_VLLM}" in detail["sentence"]
            assert f"attention {BASE_ATTENTION} → {PLANTED_ATTENTION}" in detail["sentence"]
    report = environment_diff(store, Point("env-drift", 2), Point("env-drift", 3))
    assert [d.title for d in report.diffs if d.diff.changes] == ["rollout"]


def test_nothing_is_named_without_a_clean_step_before(store: Store) -> None:
    drifting_run(store, run_id="env-never", change_at=0, steps=2)
    ComparisonWorker(store).run_once()
    for row in store.step_results("env-never"):
        assert "environment_changes" not in row.diagnoses


def test_manifests_without_an_environment_still_compare_their_runtime() -> None:
    old = factories.manifest(runtime={"dtype": "bfloat16"})
    new = factories.manifest(runtime={"dtype": "float32"})
    diff = diff_manifests(old, new)
    assert [c.text() for c in diff.changes] == ["dtype bfloat16 → float32"]
    assert diff.unrecorded == ["old", "new"]
    assert isinstance(Manifest.model_validate(old.model_dump(mode="json")), Manifest)


def test_a_reference_engine_manifest_carries_its_environment(tmp_path: Path) -> None:
    from isoaudit.collectors.sessions import MemoryDestination
    from isoaudit.collectors.tiny_models import load_tiny_model, make_tiny_model
    from isoaudit.kernels.adapters import HFCausalLM
    from isoaudit.kernels.engine import RolloutEngine

    import isoaudit

    path = make_tiny_model("qwen3", tmp_path / "m", num_layers=1, hidden=32, vocab=512, dtype="float32")
    model, _ = load_tiny_model(Path(path), dtype=torch.float32)
    destination = MemoryDestination()
    with isoaudit.session(factories.run("env-engine"), destination=destination, report=False) as audit:
        audit.watch_engine(RolloutEngine(HFCausalLM(model), max_len=64))
    [manifest, *_] = destination.sinks["rollout"].of_kind("manifest")
    env = manifest.environment
    assert env is not None and env.versions["torch"] == torch.__version__
    assert env.backends["isoaudit.kernels"] == "native" and "torch.num_threads" in env.backends
