"""Remediation inside vLLM's worker processes (the isoaudit worker extension, ``collective_rpc``):
the control channel's mode reaches the workers, which switch their layers at their next step; the
engine's logprobs and fingerprints then equal an HF trainer's on isoaudit's invariant kernels bit
for bit, also after an in-place weight reload; back to native, they do not.

The evidence is the comparator against the trainer (kernels enabled) on the same tokens and
weights: logprobs exactly equal, and every region, the logits included, equal at every position
(with the kernels on, the trainer fingerprints the fp32 head its logprobs come from, as the engine
does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import isoaudit.collectors.vllm as cv  # noqa: E402
from isoaudit.audit.contract import handshake  # noqa: E402
from isoaudit.audit.grid import EQUAL  # noqa: E402
from isoaudit.collectors.control import FixedControl  # noqa: E402
from isoaudit.collectors.sinks import MemorySink  # noqa: E402

from tests.vllm.conftest import (  # noqa: E402
    RUN,
    compare,
    engine,
    perturbed_weights,
    prompts_of,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = prompts_of([5, 9, 17], seed=3)


def _trainer(path: Path, outputs: Any, step: int, weights: Any = None) -> MemorySink:
    """The HF trainer on isoaudit's invariant kernels, recording as the GRPO recipe does (logprobs
    from the fp32 head, its forward hooked), with the contract it then runs under."""
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
        handle.record_step(step, batch, logprobs=list(torch.split(logprobs, [len(c) for c in completions])))
    assert sink.flush(30)
    handle.detach()
    return sink


def _generate(llm: Any) -> list[Any]:
    """Seeded samples at temperature 1 and without ``min_tokens`` (whose EOS mask would change the
    engine's processed logprobs, and the trainer here applies none)."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=6, logprobs=0, seed=i) for i in range(len(PROMPTS))]
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


@pytest.fixture(scope="module")
def flow(tiny_qwen3: Path) -> dict[str, Any]:
    """One multiprocess engine: a native step, two invariant steps around a weight reload, then
    native again; the engine's records, each step's grids against the trainer and the mode reports."""
    out: dict[str, Any] = {"grids": {}, "modes": {}, "tokens": {}}
    weights = perturbed_weights(tiny_qwen3, seed=5)
    with engine(tiny_qwen3, processes=True) as llm:
        control = FixedControl(RUN)
        sink = MemorySink()
        handle = cv.attach(llm, run=RUN, sink=sink, control=control, contract="auto", strict=True)
        out["link"] = handle.link_mode
        plan = [
            (0, "native", None),
            (1, "invariant", None),
            (2, "invariant", weights),
            (3, "native", weights),
        ]
        for step, mode, new in plan:
            if mode != control.desired().mode:  # type: ignore[union-attr]
                control.set(mode)
            if new is not None and step == 2:
                cv.load_weights(llm, new, version=2)
            handle.begin_step(step)
            outputs = _generate(llm)
            handle.record_step(step, outputs)
            out["modes"][step] = handle.mode_report
            out["tokens"][step] = [list(o.outputs[0].token_ids) for o in outputs]
            trainer = _trainer(tiny_qwen3, outputs, step, weights=new)
            compared = compare(trainer, sink, step)
            out["grids"][step] = {k: c.grid for k, c in compared.items()}
            out.setdefault("metrics", {})[step] = [c.metrics for c in compared.values()]
            out.setdefault("trainer_manifests", {})[step] = trainer.of_kind("manifest")
        assert sink.flush(30)
        out["manifests"] = sink.of_kind("manifest")
        out["stats"] = handle.stats()
        handle.detach()
    return out


def test_the_switch_reaches_the_worker_processes(flow: dict[str, Any]) -> None:
    assert flow["link"] == "worker_extension"
    assert flow["stats"]["errors"] == 0
    modes = flow["modes"]
    assert [modes[s].applied for s in range(4)] == ["native", "invariant", "invariant", "native"]
    assert modes[1].reason is None and modes[3].reason is None  # nothing stays vLLM's own here


def test_invariant_steps_equal_the_trainer_bit_for_bit(flow: dict[str, Any]) -> None:
    for step in (1, 2):  # step 2 runs on reloaded weights: the remediation survives the reload
        metrics = flow["metrics"][step]
        assert len(metrics) == len(PROMPTS)
        assert all(m["logprob_abs_diff_max"] == 0.0 and m["exact_match_fraction"] == 1.0 for m in metrics)
        for grid in flow["grids"][step].values():
            for region in grid.regions:
                row = grid.state[grid.regions.index(region)]
                observed = row[row >= 0]
                assert observed.size, region
                assert (observed == EQUAL).all(), (step, region)
            assert not grid.origins


def test_native_steps_differ_from_the_first_layer_on(flow: dict[str, Any]) -> None:
    for step in (0, 3):
        assert all(m["exact_match_fraction"] < 1.0 for m in flow["metrics"][step])
        origins = {r for g in flow["grids"][step].values() for r, _ in g.origins}
        assert "layers.0.attn" in origins and origins - {"layers.0.attn", "layers.1.attn", "logits"}


def test_the_reload_reached_the_workers(flow: dict[str, Any]) -> None:
    assert flow["tokens"][2] != flow["tokens"][1]


def test_manifests_say_what_runs_and_the_policies_agree(flow: dict[str, Any]) -> None:
    invariant = [m for m in flow["manifests"] if m.runtime.remediation == "invariant"]
    assert {m.case for m in invariant} == {"engine_prefill", "engine_decode"}
    for manifest in invariant:
        assert manifest.runtime.remediation_native_regions == []
        assert manifest.runtime.lm_head_dtype == "float32"
        ops = " ".join(str(v) for k, v in manifest.numerical_policy.items() if k.endswith(".implementation"))
        assert "kernels.cpu.linear" in ops and "kernels.cpu.attention" in ops and "vllm." not in ops
    native = [m for m in flow["manifests"] if m.runtime.remediation == "native"]
    assert native and all(m.contract.numerical_policy for m in native)
    assert invariant[0].contract.numerical_policy != native[0].contract.numerical_policy
    trainer = flow["trainer_manifests"][1][-1]
    assert handshake(trainer, invariant[-1]).ok  # one numerical policy on both sides
    verdict = handshake(trainer, native[-1])
    assert not verdict.ok and "layers.0.attn" in verdict.differing_regions
    assert any(
        r.startswith("regions computed differently: layers.0.input_norm, layers.0.attn")
        for r in verdict.reasons
    )
