"""A mismatch that appears at a step, reported with the change since the last clean step, on the real
vLLM engine (CPU build, in this process) against the HF trainer on isoaudit's invariant kernels.

The rollout runs isoaudit's kernels inside vLLM for two steps (bit for bit the trainer's: clean),
then goes back to vLLM's own kernels at step 2 (its kernel configuration changes, as a backend
switch or a wheel bump would change it): the comparison worker diagnoses step 2 and names, in its
verdicts and its step result, what changed in the rollout's environment since step 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import isoaudit.collectors.vllm as cv  # noqa: E402
from isoaudit.audit.db import Store  # noqa: E402
from isoaudit.audit.worker import ComparisonWorker  # noqa: E402
from isoaudit.collectors.control import FixedControl  # noqa: E402
from isoaudit.collectors.sinks import MemorySink  # noqa: E402

from tests.vllm.conftest import engine, prompts_of  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RUN = "vllm-env-change"
PROMPTS = prompts_of([5, 9, 17], seed=4)
#: The rollout's mode per step: clean while both sides run isoaudit's kernels, then not.
PLAN = ["invariant", "invariant", "native"]


def _trainer(path: Path, outputs: Any, step: int) -> MemorySink:
    """The HF trainer on isoaudit's invariant kernels, recording as the GRPO recipe does."""
    import torch
    from isoaudit.collectors import trainer
    from isoaudit.collectors.layout import StepBatch
    from isoaudit.collectors.rl.grpo import policy_logprobs
    from isoaudit.collectors.tiny_models import load_tiny_model

    from isoaudit import kernels

    model, _ = load_tiny_model(path, dtype=torch.bfloat16)
    sink = MemorySink()
    prompts = [list(o.prompt_token_ids) for o in outputs]
    completions = [list(o.outputs[0].token_ids) for o in outputs]
    batch = StepBatch.padded(prompts, completions, temperature=1.0)
    with kernels.enable(), torch.no_grad():
        handle = trainer.attach(model, run=RUN, sink=sink, strict=True)
        handle.begin_step(step, batch)
        logprobs = policy_logprobs(model, batch).logprobs.float()
        handle.record_step(step, batch, logprobs=list(torch.split(logprobs, [len(c) for c in completions])))
    assert sink.flush(30)
    handle.detach()
    return sink


@pytest.fixture(scope="module")
def results(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from vllm import SamplingParams

    store = Store(f"sqlite:///{tmp_path_factory.mktemp('env-change') / 'isoaudit.db'}")
    worker = ComparisonWorker(store)
    with engine(tiny_qwen3) as llm:
        control = FixedControl(RUN)
        rollout = MemorySink()
        handle = cv.attach(llm, run=RUN, sink=rollout, control=control, fingerprint="all", strict=True)
        stored = 0
        for step, mode in enumerate(PLAN):
            if mode != control.desired().mode:  # type: ignore[union-attr]
                control.set(mode)
            handle.begin_step(step)
            params = [
                SamplingParams(temperature=1.0, max_tokens=6, logprobs=0, seed=i) for i in range(len(PROMPTS))
            ]
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            handle.record_step(step, outputs)
            assert rollout.flush(30)
            trainer = _trainer(tiny_qwen3, outputs, step)
            # Into the store in the order the sinks sent them, as a job's direct writers would.
            fresh = rollout.records[stored:]
            stored = len(rollout.records)
            assert not store.ingest(fresh).rejected
            assert not store.ingest(trainer.records).rejected
            worker.run_once()
        handle.detach()
    out = {
        "steps": {r.step: r for r in store.step_results(RUN)},
        "samples": {s: store.sample_results(RUN, s) for s in range(len(PLAN))},
    }
    store.dispose()
    return out


def test_clean_until_the_rollout_changes_its_kernels(results: dict[str, Any]) -> None:
    counts = [results["steps"][s].diagnoses["counts"] for s in range(len(PLAN))]
    assert counts[0] == counts[1] == {"clean": len(PROMPTS)}, counts
    assert "clean" not in counts[2], counts


def test_the_step_where_it_appears_names_the_change_since_the_last_clean_step(
    results: dict[str, Any],
) -> None:
    changed = results["steps"][2].diagnoses["environment_changes"]
    assert changed["since_step"] == 1
    rollout = {(c["group"], c["key"]): (c["old"], c["new"]) for c in changed["sides"]["rollout"]}
    assert rollout[("backends", "isoaudit.kernels")] == ("invariant", "native")
    assert "trainer" not in changed["sides"]
    for sample in results["samples"][2]:
        assert sample.diagnosis != "clean"
        sentence = sample.diagnosis_detail["sentence"]
        assert (
            "Changed since the last clean step 1: on the rollout, isoaudit.kernels invariant → native"
            in sentence
        )
    for step in (0, 1):
        assert "environment_changes" not in results["steps"][step].diagnoses
