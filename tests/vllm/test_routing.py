"""MoE routing on a real in-process vLLM (CPU build) running a tiny Qwen3-MoE, against the HF
trainer on the same weights, both recorded through ``isoaudit.session`` into a store and
compared by the worker: per token and MoE layer, the experts both sides chose."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")

from isoaudit.audit.db import Store  # noqa: E402
from isoaudit.audit.records import SampleLogprobs  # noqa: E402
from isoaudit.audit.worker import ComparisonWorker  # noqa: E402
from isoaudit.collectors.layout import StepBatch  # noqa: E402
from isoaudit.collectors.routing_vllm import VllmRoutes, moe_routers  # noqa: E402
from isoaudit.collectors.tiny_models import make_tiny_model  # noqa: E402

import isoaudit  # noqa: E402
from tests.vllm.conftest import engine, generate, prompts_of  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LENGTHS = [5, 9, 17, 30]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        "qwen3_moe", tmp_path_factory.mktemp("vllm-moe") / "qwen3_moe", hidden=128, seed=3, dtype="bfloat16"
    )


@pytest.fixture(scope="module")
def llm(tiny_moe: Path) -> Iterator[Any]:
    with engine(tiny_moe) as llm:
        yield llm


@pytest.fixture(scope="module")
def recorded(llm: Any, tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from isoaudit.collectors.tiny_models import load_tiny_model

    url = f"sqlite:///{tmp_path_factory.mktemp('vllm-moe-db') / 'store.db'}"
    model, _ = load_tiny_model(tiny_moe, dtype=torch.bfloat16)
    with isoaudit.session("vllm-moe", database_url=url, strict=True, report=False) as audit:
        rollout = audit.watch_vllm(llm, fingerprint="all")
        routes = audit.watch_routing(rollout)
        assert isinstance(routes, VllmRoutes)
        trainer = audit.watch_trainer(model, async_transfer=False)
        assert audit.watch_routing(trainer) is not None
        outputs = generate(llm, prompts_of(LENGTHS), max_tokens=MAX_TOKENS)
        rollout.record_step(0, outputs)
        prompts = [list(o.prompt_token_ids) for o in outputs]
        completions = [list(o.outputs[0].token_ids) for o in outputs]
        trainer.record_step(0, StepBatch.padded(prompts, completions, temperature=0.7))
        stats = routes.stats()
    store = Store(url)
    ComparisonWorker(store).run_once("vllm-moe")
    return {"store": store, "stats": stats, "routes": routes, "llm": llm}


def test_vllm_records_the_experts_of_every_token_and_moe_layer(recorded: dict[str, Any]) -> None:
    store: Store = recorded["store"]
    samples = store.samples("vllm-moe", 0)
    rollout = [s for s in samples if s.side == "rollout"]
    assert len(rollout) == len(LENGTHS)
    for sample in rollout:
        assert isinstance(sample, SampleLogprobs) and sample.routes is not None
        n = sample.token_ids.size
        # Every position the engine ran: the prompt and each sampled token but the last.
        assert sample.routes.positions.tolist() == list(range(n - 1))
        assert sample.routes.layers == [0, 1] and sample.routes.top_k == 2
        assert sample.routes.experts.dtype == np.uint8 and int(sample.routes.experts.max()) < 8
    assert recorded["stats"]["attached"] == len(LENGTHS) and recorded["stats"]["unmatched"] == 0
    # The router's fp32 logits and the combine are fingerprinted inside vLLM too.
    regions = {p.region for p in store.fingerprints("vllm-moe", 0) if p.side == "rollout"}
    assert {"layers.0.router", "layers.0.combine", "layers.1.router"} <= regions


def test_routing_agreement_between_vllm_and_the_hf_trainer(recorded: dict[str, Any]) -> None:
    store: Store = recorded["store"]
    [step] = store.step_results("vllm-moe")
    m = step.metrics
    assert m["routing_tokens"] == sum(n + MAX_TOKENS - 1 for n in LENGTHS)
    # Same weights, different kernels (vLLM's fused MoE against HF's eager loop): most routing
    # agrees; where a near tie flips, the audit counts it.
    assert 0.5 < m["routing_set_agreement"] <= 1.0
    assert 0.0 <= m["routing_flip_rate"] <= 1.0 - m["routing_set_agreement"] + 1e-12
    results = store.sample_results("vllm-moe", 0)
    causes = sorted(str(r.diagnosis_detail["evidence"].get("cause")) for r in results)
    assert all(r.diagnosis in ("numerical", "clean") for r in results), causes
    if m["routing_flipped_tokens"]:
        # Where vLLM and HF route a token differently, the router logits differ first (fingerprinted
        # on both sides), upstream of or at the router.
        assert any(r.first_divergence_region is not None for r in results)
    print(f"diagnosis causes: {causes}")
    print(
        f"vLLM vs HF Qwen3-MoE: set agreement {m['routing_set_agreement']:.4f}, flip rate "
        f"{m['routing_flip_rate']:.4f}, tokens flipped {m['routing_flipped_tokens']} of {m['routing_tokens']}"
    )


def test_detach_removes_the_capture_functions(recorded: dict[str, Any]) -> None:
    recorded["routes"].detach()
    model = recorded["llm"].llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    assert all(router.capture_fn is None for _, router in moe_routers(model))
