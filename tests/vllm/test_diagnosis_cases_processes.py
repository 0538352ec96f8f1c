"""The diagnosis cases that need an engine of another kind: vLLM's default ``raw_logprobs`` mode, with
its workers in other processes (the held-weight digests and request facts then come back through
the worker extension and ``collective_rpc``). One engine for the module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")

import isoaudit.collectors.vllm as cv  # noqa: E402

from tests.vllm.conftest import engine, perturbed_weights  # noqa: E402
from tests.vllm.test_diagnosis_cases import (  # noqa: E402
    SAMPLES,
    Engine,
    fresh,
    kinds,
    rollout_step,
    set_weights,
    sides,
    trainer_step,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def eng(tiny_qwen3: Path) -> Iterator[Engine]:
    from isoaudit.collectors.tiny_models import load_tiny_model
    from safetensors.torch import load_file

    with engine(
        tiny_qwen3, processes=True, logprobs_mode="raw_logprobs", enable_prefix_caching=True, block_size=32
    ) as llm:
        model, _ = load_tiny_model(tiny_qwen3, dtype=torch.bfloat16)
        base = load_file(str(tiny_qwen3 / "model.safetensors"))
        yield Engine(llm, tiny_qwen3, base, perturbed_weights(tiny_qwen3), model)


def test_raw_logprobs_under_temperature(eng: Engine) -> None:
    """vLLM's default returns the logprobs before the temperature; the trainer scores processed ones."""
    with sides(eng, "raw") as (rollout, trainer, case):
        assert rollout.link_mode == "worker_extension"
        set_weights(eng, rollout, trainer, engine_w=eng.base, engine_v="0", trainer_w=eng.base, trainer_v="0")
        outputs = rollout_step(eng, rollout, 0, fresh(20), temperature=0.7)
        trainer_step(trainer, 0, outputs, temperature=0.7)
        outputs = rollout_step(eng, rollout, 1, fresh(21), temperature=1.0)  # control: raw == processed
        trainer_step(trainer, 1, outputs, temperature=1.0)
    found = case.diagnoses(0)
    assert kinds(found) == ["semantics"] * SAMPLES, [d.sentence for d in found]
    assert all(
        d.evidence["cause"] == "raw_vs_processed" and d.evidence["raw_side"] == "rollout" for d in found
    )
    assert "temperature=0.7" in found[0].sentence
    control = case.diagnoses(1)
    assert set(kinds(control)) <= {"numerical", "clean"}, [d.sentence for d in control]


def test_held_digests_through_worker_processes_name_the_stale_tensor(eng: Engine) -> None:
    stale = "model.layers.0.mlp.gate_proj.weight"  # inside vLLM's fused gate_up_proj
    sent = {**eng.next, stale: eng.base[stale]}
    with sides(eng, "stale-processes") as (rollout, trainer, case):
        set_weights(eng, rollout, trainer, engine_w=sent, engine_v="1", trainer_w=eng.next, trainer_v="1")
        outputs = rollout_step(eng, rollout, 0, fresh(22), temperature=1.0)
        trainer_step(trainer, 0, outputs, temperature=1.0)
    found = case.diagnoses(0)
    assert kinds(found) == ["weights"] * SAMPLES, [d.sentence for d in found]
    assert all(d.evidence["differing_tensors"] == [stale] for d in found)
    rm = case.destination.sinks["rollout"].of_kind("manifest")[-1]
    assert "weight_digests_form" in rm.runtime.model_extra


def test_prefix_cache_staleness_through_worker_processes(eng: Engine) -> None:
    prompts = fresh(23)
    with sides(eng, "prefix-processes") as (rollout, trainer, case):
        set_weights(eng, rollout, trainer, engine_w=eng.base, engine_v="0", trainer_w=eng.next, trainer_v="1")
        rollout_step(eng, rollout, 0, prompts, temperature=1.0)
        cv.load_weights(eng.llm, eng.next, "1")
        outputs = rollout_step(eng, rollout, 1, prompts, temperature=1.0, seed=50)
        trainer_step(trainer, 1, outputs, temperature=1.0)
    assert all(s.path["prefix_cache_stale_tokens"] >= 32 for s in case.rollout_samples(1))
    found = case.diagnoses(1)
    assert all(d.evidence["cause"] == "prefix_cache_crossed_weight_update" for d in found), [
        d.sentence for d in found
    ]
