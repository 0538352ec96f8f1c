"""Stale engine state in the real vLLM-CPU engine: weights swapped under an unchanged held digest.

Both sides run isoaudit's invariant kernels (one numerical policy, bit-for-bit equal logprobs), so
their canaries must agree whenever the weights they compute with agree. The plant: one reload
where vLLM's post-load processing leaves one linear layer's kept weight copy (the one its forward
reads) on the old values, while the parameter as loaded, and so the held-weight digest the
collector takes, is the new one: the ``weights`` diagnosis has nothing to see, the canary does.
A proper reload afterwards is clean again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import isoaudit.collectors.vllm as cv  # noqa: E402
from isoaudit.audit.stale_state import canary_of  # noqa: E402
from isoaudit.collectors.control import FixedControl  # noqa: E402
from isoaudit.collectors.sinks import MemorySink  # noqa: E402

from tests.vllm.conftest import RUN, compare, engine, perturbed_weights, prompts_of  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = prompts_of([5, 9, 12], seed=21)
#: The layer whose kept copy goes stale (vLLM's module name, the trainer's tensor name).
TARGET = "model.layers.1.mlp.down_proj"


def _model(llm: Any) -> Any:
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()


@contextmanager
def stale_kept_copy(llm: Any, module_name: str) -> Iterator[None]:
    """While inside: vLLM's post-load processing of ``module_name`` ends with its kept weight copy
    (what the invariant GEMM reads) put back to the one from before the reload."""
    from isoaudit.collectors.vllm.worker.remediation import RAW
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    layer = _model(llm).get_submodule(module_name)
    old = vars(layer)[RAW]
    previous = UnquantizedLinearMethod.process_weights_after_loading

    def process_weights_after_loading(self: Any, module: Any) -> None:
        previous(self, module)
        if module is layer:
            object.__setattr__(module, RAW, old)

    UnquantizedLinearMethod.process_weights_after_loading = process_weights_after_loading  # type: ignore[method-assign]
    try:
        yield
    finally:
        UnquantizedLinearMethod.process_weights_after_loading = previous  # type: ignore[method-assign]


def _trainer(path: Path, outputs: Any, step: int, weights: Any, version: str | None) -> MemorySink:
    """The HF trainer on the invariant kernels at weight ``version`` (its canary included)."""
    import torch
    from isoaudit.collectors import trainer
    from isoaudit.collectors.layout import StepBatch
    from isoaudit.collectors.policy import hf_contracts
    from isoaudit.collectors.rl.grpo import policy_logprobs
    from isoaudit.collectors.tiny_models import load_tiny_model

    from isoaudit import kernels

    model, _ = load_tiny_model(path, dtype=torch.bfloat16)
    if weights is not None:
        model.load_state_dict(dict(weights))
    sink = MemorySink()
    prompts = [list(o.prompt_token_ids) for o in outputs]
    completions = [list(o.outputs[0].token_ids) for o in outputs]
    batch = StepBatch.padded(prompts, completions, temperature=1.0)
    with kernels.enable(), torch.no_grad():
        handle = trainer.attach(
            model, run=RUN, sink=sink, strict=True, contract=hf_contracts(model)("invariant")
        )
        handle.begin_step(step, batch)
        logprobs = policy_logprobs(model, batch).logprobs.float()
        handle.record_step(
            step,
            batch,
            logprobs=list(torch.split(logprobs, [len(c) for c in completions])),
            weight_version=version,
        )
    assert sink.flush(30)
    handle.detach()
    return sink


def _generate(llm: Any) -> list[Any]:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=6, logprobs=0, seed=i) for i in range(len(PROMPTS))]
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


@pytest.fixture(scope="module")
def flow(tiny_qwen3: Path) -> dict[str, Any]:
    """Step 0 invariant on the checkpoint; step 1 after a reload that leaves one kept copy stale;
    step 2 after a proper reload. Each step compared against the trainer on the same weights."""
    out: dict[str, Any] = {"compared": {}, "rollout_canary": {}, "trainer_canary": {}}
    loads = {1: perturbed_weights(tiny_qwen3, seed=31), 2: perturbed_weights(tiny_qwen3, seed=32)}
    with engine(tiny_qwen3) as llm:
        control = FixedControl(RUN)
        control.set("invariant")
        sink = MemorySink()
        handle = cv.attach(llm, run=RUN, sink=sink, control=control, contract="auto", strict=True)
        handle.begin_step(0)
        for step in (0, 1, 2):
            if step == 1:
                with stale_kept_copy(llm, TARGET):
                    cv.load_weights(llm, loads[1], version=1)
            elif step == 2:
                cv.load_weights(llm, loads[2], version=2)
            outputs = _generate(llm)
            handle.record_step(step, outputs)
            trainer = _trainer(tiny_qwen3, outputs, step, loads.get(step), str(step) if step else None)
            out["compared"][step] = list(compare(trainer, sink, step).values())
            out["trainer_canary"][step] = canary_of(trainer.of_kind("manifest")[-1])
            out["rollout_canary"][step] = handle.canary
        assert sink.flush(30)
        out["stats"] = handle.stats()
        out["manifests"] = sink.of_kind("manifest")
        handle.detach()
    return out


def test_the_planted_stale_copy_is_stale_engine_state(flow: dict[str, Any]) -> None:
    results = flow["compared"][1]
    assert len(results) == len(PROMPTS)
    for result in results:
        diagnosis = result.diagnosis
        assert diagnosis.kind == "stale_engine_state", diagnosis.sentence
        evidence = diagnosis.evidence
        assert evidence["cause"] == "canaries_differ_under_one_arithmetic"
        assert evidence["weight_version"] == "1" and evidence["held_tensors_agreeing"] > 10
        assert "LLM.generate" in evidence["rollout_canary_path"]
        assert "hold old weights" in diagnosis.sentence
    # the held digests really agree: the plant is invisible to them
    rollout = flow["rollout_canary"][1]
    trainer = flow["trainer_canary"][1]
    assert rollout.output.digest != trainer.output.digest
    assert rollout.arithmetic == trainer.arithmetic is not None


def test_a_proper_reload_is_clean(flow: dict[str, Any]) -> None:
    for step in (0, 2):
        kinds = {r.diagnosis.kind for r in flow["compared"][step]}
        assert kinds == {"clean"}, (step, [r.diagnosis.sentence for r in flow["compared"][step]])
    assert flow["rollout_canary"][2].output.digest == flow["trainer_canary"][2].output.digest


def test_the_canary_is_never_a_sample_and_costs_one_short_forward(flow: dict[str, Any]) -> None:
    assert flow["stats"]["errors"] == 0
    canaries = [m.canary for m in flow["manifests"] if m.canary is not None]
    assert {c.weight_version for c in canaries} >= {"1", "2"}
    assert all(c.error is None and c.seconds is not None and c.seconds < 30 for c in canaries)
