"""The compiled-engine flow both compiled test modules run: vLLM with its default compilation (no
``enforce_eager``), every region recorded through the graph taps, a native step, an invariant step
(recompiled at the step boundary), native again; each step compared with an HF trainer on the same
tokens and weights, with isoaudit's kernels on for the invariant step, and once more against a
trainer carrying a planted fault: one mantissa bit of one element of ``layers.1.mlp`` at one
position of the first sample."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from isoaudit.collectors.sinks import MemorySink

from tests.vllm.conftest import RUN, compare, engine, prompts_of

PROMPTS = prompts_of([5, 9, 17], seed=3)
FAULT_REGION = "layers.1.mlp"
FAULT_MODULE = "model.layers.1.mlp"


def fault_position() -> int:
    """Where the planted fault sits in the first sample: its second completion token."""
    return len(PROMPTS[0]) + 1


def trainer_records(
    path: Path, outputs: Any, step: int, *, invariant: bool, fault: bool = False
) -> MemorySink:
    """The HF trainer's records of the engine's samples (logprobs from the fp32 head, its forward
    hooked); ``invariant``: on isoaudit's kernels; ``fault``: with the planted bit flip."""
    from contextlib import nullcontext

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
    start, position = batch.flat_start(0), fault_position()

    def flip(_m: Any, _i: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        flat = out.view(-1, out.shape[-1])
        bits = flat[start + position, 5].view(torch.int16)
        flat[start + position, 5] = (bits ^ (1 << 4)).view(torch.bfloat16)
        return out

    handles = [model.get_submodule(FAULT_MODULE).register_forward_hook(flip)] if fault else []
    try:
        with kernels.enable() if invariant else nullcontext(), torch.no_grad():
            handle = trainer.attach(model, run=RUN, sink=sink, strict=True)
            handle.begin_step(step, batch)
            logprobs = policy_logprobs(model, batch).logprobs.float()
            handle.record_step(
                step, batch, logprobs=list(torch.split(logprobs, [len(c) for c in completions]))
            )
    finally:
        for h in handles:
            h.remove()
    assert sink.flush(30)
    handle.detach()
    return sink


def _generate(llm: Any) -> list[Any]:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=6, logprobs=0, seed=i) for i in range(len(PROMPTS))]
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def run_flow(path: Path, *, processes: bool) -> dict[str, Any]:
    """Steps native, invariant, native on one compiled engine; what each produced."""
    import isoaudit.collectors.vllm as cv
    from isoaudit.collectors.control import FixedControl

    out: dict[str, Any] = {"compared": {}, "modes": {}, "faulted": {}}
    with engine(path, processes=processes, enforce_eager=False) as llm:
        control = FixedControl(RUN)
        sink = MemorySink()
        handle = cv.attach(llm, run=RUN, sink=sink, control=control, contract="auto", strict=True)
        out["regions"] = list(handle.regions)
        out["refusal"] = handle.refusal
        for step, mode in enumerate(("native", "invariant", "native")):
            if mode != control.desired().mode:  # type: ignore[union-attr]
                control.set(mode)
            handle.begin_step(step)
            outputs = _generate(llm)
            handle.record_step(step, outputs)
            out["modes"][step] = handle.mode_report
            invariant = mode == "invariant"
            out["compared"][step] = compare(
                trainer_records(path, outputs, step, invariant=invariant), sink, step
            )
            if invariant:
                faulty = trainer_records(path, outputs, step, invariant=True, fault=True)
                out["faulted"][step] = compare(faulty, sink, step)
                out["first_key"] = next(
                    r.sample_key
                    for r in faulty.of_kind("sample")
                    if list(r.token_ids[: len(PROMPTS[0])]) == PROMPTS[0]
                )
        assert sink.flush(30)
        out["manifests"] = sink.of_kind("manifest")
        out["stats"] = handle.stats()
        out["graph"] = dict(handle.graph_state)
        handle.detach()
        # Attached again: the tapped native variant compiled above runs again (no recompile) and
        # writes the first step's fingerprints, bit for bit.
        again = MemorySink()
        handle = cv.attach(llm, run=RUN, sink=again, strict=True)
        handle.begin_step(0)
        handle.record_step(0, _generate(llm))
        assert again.flush(30)
        out["again"], out["again_graph"] = again, dict(handle.graph_state)
        out["first"] = sink
        handle.detach()
    return out


def print_rows(sink: MemorySink, step: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Every fingerprint row of ``step`` as (region, positions, digests), sorted: comparable across
    attaches (whose sample keys differ)."""
    return sorted(
        (r.region, tuple(r.positions.tolist()), tuple(r.digest.tolist()))
        for r in sink.of_kind("fingerprints")
        if r.step == step
    )
