"""MoE routing end to end: a tiny HF Qwen3-MoE (and Mixtral) run as the trainer and inside the
reference engine through ``isoaudit.session``, stored, compared by the worker.

Kernels off (bf16): the two sides' native arithmetic differs and some routing decisions flip; the
routing figures, the first flip and the ``routing`` sub-cause are reported. Kernels on: the
invariant router and combine make both sides route every token identically (exactly 0 flips) and
every logprob bitwise equal. Routing replay (R3): the trainer takes the rollout's routes, the
manifest says so, and the audit reports the replayed fraction and the missing routes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from isoaudit.audit.db import Store
from isoaudit.audit.db.reads import routing_series
from isoaudit.audit.records import Manifest, SampleLogprobs, sample_key
from isoaudit.audit.worker import ComparisonWorker
from isoaudit.collectors import trainer as trainer_module
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.rl.grpo import policy_logprobs
from isoaudit.collectors.routing import TrainerRoutes, replay_tensors, routes_from_vllm, watch_routing
from isoaudit.collectors.sinks import MemorySink
from isoaudit.collectors.tiny_models import make_tiny_model

import isoaudit
from isoaudit import kernels

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 42, 9, 100, 7], [3, 8, 250, 11], [60, 61, 62, 63, 64, 65, 66, 67], [400, 12, 5]]
MAX_NEW = [24, 30, 20, 28]


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        "qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3_moe", hidden=128, seed=3, dtype="bfloat16"
    )


def _load(path: Path, attention: str = "sdpa") -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation=attention
    ).eval()


def _run(path: Path, url: str, run_id: str, *, steps: int = 2, enabled: bool = False) -> Store:
    """Both sides of ``steps`` rollout steps of a tiny MoE, recorded through one session into ``url``."""
    from isoaudit.kernels.adapters_moe import HFMoECausalLM
    from isoaudit.kernels.engine import RolloutEngine

    # The trainer's native attention is HF's eager one (bf16 probabilities times V), the engine's its
    # own: the kind of kernel difference that flips close routing calls downstream.
    trainer_model, engine_model = _load(path, "eager"), _load(path)
    with kernels.enable() if enabled else kernels.disable():
        engine = RolloutEngine(HFMoECausalLM(engine_model), max_len=64, cuda_graphs=False)
        with isoaudit.session(run_id, database_url=url, strict=True, report=False) as audit:
            rollout = audit.watch_engine(engine, remediation_hook=None)
            trainer = audit.watch_trainer(trainer_model, remediation_hook=None, async_transfer=False)
            assert audit.watch_routing(rollout) is not None and audit.watch_routing(trainer) is not None
            for step in range(steps):
                completions = engine.generate(PROMPTS, MAX_NEW, seed=step)
                rollout.record_step(step, completions)
                batch = StepBatch.padded([c.prompt for c in completions], [c.tokens for c in completions])
                with torch.no_grad():  # the job's own forward and head (the collector reuses it)
                    logprobs = policy_logprobs(trainer_model, batch).logprobs.float()
                trainer.record_step(step, batch, logprobs=list(torch.split(logprobs, MAX_NEW)))
    store = Store(url)
    ComparisonWorker(store).run_once(run_id)
    return store


def _step_metrics(store: Store, run_id: str) -> list[dict[str, Any]]:
    return [row.metrics for row in store.step_results(run_id)]


def test_kernels_off_some_routing_flips_and_the_audit_reports_them(qwen3_moe: Path, tmp_path: Path) -> None:
    store = _run(qwen3_moe, f"sqlite:///{tmp_path / 'off.db'}", "moe-off", steps=2)
    metrics = _step_metrics(store, "moe-off")
    assert len(metrics) == 2
    for m in metrics:
        assert m["routing_tokens"] == sum(len(p) + n - 1 for p, n in zip(PROMPTS, MAX_NEW, strict=True))
        assert 0.0 < m["routing_set_agreement"] <= 1.0
        assert 0.0 <= m["routing_flip_rate"] < 0.5
    flips = sum(m["routing_flipped_tokens"] for m in metrics)
    assert flips > 0, "bf16 native arithmetic on the two sides should flip some routing decisions"
    routed = [s for s in store.samples("moe-off", 0) if s.routes is not None]
    assert {s.side for s in routed} == {"trainer", "rollout"}
    trainer = next(s for s in routed if s.side == "trainer")
    assert trainer.routes.experts.dtype == np.uint8  # type: ignore[union-attr]
    assert trainer.routes.layers == [0, 1]  # type: ignore[union-attr]
    results = store.sample_results("moe-off")
    causes = [r.diagnosis_detail["evidence"].get("cause") for r in results]
    assert "routing" in causes, causes
    # The router's fp32 logits and the combine are fingerprinted regions of their own on both sides.
    regions = results[0].grid["regions"]
    assert {"layers.0.router", "layers.0.combine", "layers.1.router"} <= set(regions)
    routed = next(r for r in results if r.diagnosis_detail["evidence"].get("cause") == "routing")
    flip = routed.diagnosis_detail["evidence"]["routing"]
    assert flip["trainer_experts"] != flip["rollout_experts"]
    assert "flipped the routing of MoE layer" in routed.diagnosis_detail["sentence"]
    manifests = store.manifests("moe-off", "trainer")
    assert manifests[-1].runtime.router_replay == "off"


def test_kernels_on_zero_flips_and_bitwise_equal_logprobs(qwen3_moe: Path, tmp_path: Path) -> None:
    store = _run(qwen3_moe, f"sqlite:///{tmp_path / 'on.db'}", "moe-on", steps=1, enabled=True)
    [m] = _step_metrics(store, "moe-on")
    assert m["routing_flipped_tokens"] == 0
    assert m["routing_set_agreement"] == 1.0 and m["routing_flip_rate"] == 0.0
    assert m["bitwise_mismatch_count"] == 0


def test_routing_replay_reports_replayed_fraction_and_missing_routes(qwen3_moe: Path) -> None:
    """R3: the trainer replays the rollout's routes on all but one token of a sequence; that token
    is reported as a missing route, the rest as replayed, and the manifest names the replay."""
    model = _load(qwen3_moe)
    sink = MemorySink()
    handle = trainer_module.attach(
        model, run="r3", sink=sink, regions=None, strict=True, async_transfer=False
    )
    recorder = watch_routing(handle)
    assert isinstance(recorder, TrainerRoutes)
    batch = StepBatch.padded([[5, 17, 42, 9]], [[100, 7, 8]])
    with torch.no_grad():
        model(**batch.model_inputs())
    native = recorder.recent[-1].experts
    rows = batch.input_ids.numel()
    replayed = {layer: torch.from_numpy((native[layer].astype(np.int64) + 1) % 8) for layer in native}
    mask = torch.ones(rows, dtype=torch.bool)
    mask[2] = False  # no route for position 2
    with recorder.replay(replayed, mask, source="verl_router_replay"):
        handle.begin_step(0)
        with torch.no_grad():
            model(**batch.model_inputs())
        handle.record_step(0, batch)
    handle.flush()
    [sample] = [r for r in sink.records if isinstance(r, SampleLogprobs)]
    assert sample.routes is not None and sample.routes.replayed is not None
    assert sample.routes.replayed.tolist() == [1, 1, 0, 1, 1, 1, 1]
    experts = sample.routes.layer_experts()
    assert np.array_equal(experts[0, 0], replayed[0][0].numpy())  # position 0 took the replayed route
    manifests = [r for r in sink.records if isinstance(r, Manifest)]
    assert manifests[-1].runtime.router_replay == "verl_router_replay"
    handle.detach()


def test_replaying_the_rollouts_routes_end_to_end(qwen3_moe: Path, tmp_path: Path) -> None:
    """R3 with the reference engine as the rollout: the trainer replays each sample's rollout routes
    (one sample's are missing), through isoaudit.session into a store. Replayed samples agree on
    every token; the replayed fraction and the missing routes are reported; the manifest says so."""
    from isoaudit.kernels.adapters_moe import HFMoECausalLM
    from isoaudit.kernels.engine import RolloutEngine

    url = f"sqlite:///{tmp_path / 'r3.db'}"
    trainer_model, engine_model = _load(qwen3_moe, "eager"), _load(qwen3_moe)
    with kernels.disable():
        engine = RolloutEngine(HFMoECausalLM(engine_model), max_len=64, cuda_graphs=False)
        with isoaudit.session("moe-r3", database_url=url, strict=True, report=False) as audit:
            rollout = audit.watch_engine(engine, remediation_hook=None)
            trainer = audit.watch_trainer(trainer_model, remediation_hook=None, async_transfer=False)
            engine_routes, trainer_routes = watch_routing(rollout), watch_routing(trainer)
            assert isinstance(trainer_routes, TrainerRoutes) and engine_routes is not None
            completions = engine.generate(PROMPTS, MAX_NEW, seed=0)
            rollout.record_step(0, completions)
            sequences = [np.asarray(c.prompt + c.tokens, dtype=np.int32) for c in completions]
            given = [engine_routes.routes_for(s) for s in sequences]  # what the job got from its rollout
            given[1] = None  # the rollout sent no routes for sample 1
            batch = StepBatch.padded([c.prompt for c in completions], [c.tokens for c in completions])
            with trainer_routes.replay(*replay_tensors(batch, given), source="vllm_routed_experts"):
                trainer.begin_step(0)
                with torch.no_grad():
                    logprobs = policy_logprobs(trainer_model, batch).logprobs.float()
                trainer.record_step(0, batch, logprobs=list(torch.split(logprobs, MAX_NEW)))
    store = Store(url)
    ComparisonWorker(store).run_once("moe-r3")
    [m] = _step_metrics(store, "moe-r3")
    needed = [len(p) + n - 1 for p, n in zip(PROMPTS, MAX_NEW, strict=True)]
    assert m["routing_missing_routes"] == needed[1]
    assert m["routing_replayed_fraction"] == pytest.approx(1 - needed[1] / sum(needed))
    results = {r.sample_key: r for r in store.sample_results("moe-r3")}
    for i, sequence in enumerate(sequences):
        metrics = results[sample_key(sequence)].metrics
        if i != 1:
            assert metrics["routing_set_agreement"] == 1.0 and metrics["routing_missing_routes"] == 0
        else:
            assert metrics["routing_replayed_fraction"] == 0.0
            assert metrics["routing_missing_routes"] == needed[1]
    [latest] = [x for x in store.manifests("moe-r3", "trainer")][-1:]
    assert latest.runtime.router_replay == "vllm_routed_experts"
    series = routing_series(store, "moe-r3")
    assert series[0].missing == needed[1] and series[0].missing_examples[0]["positions"][:3] == [0, 1, 2]


def test_routes_from_vllms_routed_experts_output() -> None:
    """vLLM's routed-experts array ([positions, layers, top_k]; returned by its model runner V2, not
    on the CPU build) becomes a sample's routes, one byte a choice."""
    routed = np.asarray([[[3, 1], [0, 2]], [[4, 5], [6, 7]], [[1, 0], [2, 3]]], dtype=np.int32)
    routes = routes_from_vllm(routed, [1, 3], num_experts=8)
    assert routes.layers == [1, 3] and routes.positions.tolist() == [0, 1, 2]
    assert routes.experts.dtype == np.uint8 and routes.layer_experts()[1, 1].tolist() == [6, 7]
    with pytest.raises(ValueError, match="layers: 1 indices for 2 layers"):
        routes_from_vllm(routed, [0], num_experts=8)


@pytest.mark.parametrize("enabled", [False, True], ids=["kernels-off", "kernels-on"])
def test_mixtral_routes_on_both_sides(tmp_path: Path, enabled: bool) -> None:
    """HF's Mixtral family through the same path: routes on both sides; kernels on, 0 flips."""
    path = make_tiny_model("mixtral", tmp_path / "mixtral", hidden=128, seed=5, dtype="bfloat16")
    store = _run(path, f"sqlite:///{tmp_path / 'mixtral.db'}", "mixtral", steps=1, enabled=enabled)
    [m] = _step_metrics(store, "mixtral")
    assert m["routing_tokens"] == sum(len(p) + n - 1 for p, n in zip(PROMPTS, MAX_NEW, strict=True))
    if enabled:
        assert m["routing_flipped_tokens"] == 0 and m["bitwise_mismatch_count"] == 0
    routed = [s for s in store.samples("mixtral", 0) if s.routes is not None]
    assert len(routed) == 2 * len(PROMPTS)


def test_a_dense_model_has_no_routing_to_record(tmp_path: Path) -> None:
    from isoaudit.collectors.tiny_models import load_tiny_model, make_tiny_model

    model, _ = load_tiny_model(make_tiny_model("qwen3", tmp_path / "dense"))
    handle = trainer_module.attach(model, run="dense", sink=MemorySink(), regions=None)
    assert watch_routing(handle) is None
    handle.detach()


def test_a_framework_that_replays_by_itself_only_marks_the_rows(qwen3_moe: Path) -> None:
    """verl's router_replay swaps routes inside its own MoE layers: the recorder only marks which
    rows were replayed (and the manifest names the source); the routes recorded are the ones used."""
    model = _load(qwen3_moe)
    sink = MemorySink()
    handle = trainer_module.attach(
        model, run="verl", sink=sink, regions=None, strict=True, async_transfer=False
    )
    recorder = watch_routing(handle)
    assert isinstance(recorder, TrainerRoutes)
    batch = StepBatch.padded([[5, 17, 42, 9]], [[100, 7, 8]])
    mask = torch.tensor([True, True, True, True, True, True, False])
    with recorder.replay(None, mask, source="verl_router_replay"):
        handle.begin_step(0)
        handle.record_step(0, batch)
    handle.flush()
    [sample] = [r for r in sink.records if isinstance(r, SampleLogprobs)]
    assert sample.routes is not None and sample.routes.replayed.tolist() == mask.int().tolist()  # type: ignore[union-attr]
    assert [r for r in sink.records if isinstance(r, Manifest)][
        -1
    ].runtime.router_replay == "verl_router_replay"
    with pytest.raises(ValueError, match="mask: say which rows"), recorder.replay(None):
        pass
    handle.detach()
