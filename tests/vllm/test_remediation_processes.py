"""Remediation inside vLLM's worker processes (the isoaudit worker extension, ``collective_rpc``):
the control channel's mode reaches the workers, which switch their layers at their next step, and
the engine's fingerprints then match an HF trainer on isoaudit's invariant kernels in every region
vLLM lets a worker replace, also after an in-place weight reload; back to native, they do not.

The evidence is the comparator's region grid against the trainer (kernels enabled) on the same
tokens and weights: every origin of a difference lies in the regions the manifest names as not
replaced (the attention), every region before it is equal, and at position 0 (where attention
reads one key and is exact on both sides) every region up to the final norm is equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import collectors.vllm as cv  # noqa: E402
from audit.compare import EQUAL  # noqa: E402
from audit.contract import handshake  # noqa: E402
from collectors.control import FixedControl  # noqa: E402
from collectors.sinks import MemorySink  # noqa: E402
from tests.vllm.conftest import (  # noqa: E402
    RUN,
    compare,
    engine,
    generate,
    perturbed_weights,
    prompts_of,
    trainer_side,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = prompts_of([5, 9, 17], seed=3)
NOT_REPLACED = ["layers.0.attn", "layers.1.attn"]


def _trainer(path: Path, outputs: Any, step: int, weights: Any = None) -> MemorySink:
    """The HF trainer on isoaudit's invariant kernels, with the contract it then runs under."""
    import torch

    import kernels
    from collectors.policy import hf_contracts
    from collectors.tiny_models import load_tiny_model

    model, _ = load_tiny_model(path, dtype=torch.bfloat16)
    with kernels.enable():
        contract = hf_contracts(model)("invariant")
        return trainer_side(path, outputs, step=step, weights=weights, contract=contract)


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
            outputs = generate(llm, PROMPTS, max_tokens=6)
            handle.record_step(step, outputs)
            out["modes"][step] = handle.mode_report
            out["tokens"][step] = [list(o.outputs[0].token_ids) for o in outputs]
            trainer = _trainer(tiny_qwen3, outputs, step, weights=new)
            out["grids"][step] = {k: c.grid for k, c in compare(trainer, sink, step).items()}
            out.setdefault("trainer_manifests", {})[step] = trainer.of_kind("manifest")
        assert sink.flush(30)
        out["manifests"] = sink.of_kind("manifest")
        out["stats"] = handle.stats()
        handle.detach()
    return out


def _positions_equal(grid: Any, position: int, regions: list[str]) -> bool:
    col = list(grid.positions).index(position)
    return all(grid.state[grid.regions.index(r), col] == EQUAL for r in regions)


def test_the_switch_reaches_the_worker_processes(flow: dict[str, Any]) -> None:
    assert flow["link"] == "worker_extension"
    assert flow["stats"]["errors"] == 0
    modes = flow["modes"]
    assert [modes[s].applied for s in range(4)] == ["native", "invariant", "invariant", "native"]
    reason = modes[1].reason or ""
    assert "attention" in reason and "CPU_ATTN" in reason and "rotary" in reason
    assert modes[3].reason is None


def test_invariant_steps_differ_only_from_the_regions_not_replaced(flow: dict[str, Any]) -> None:
    for step in (1, 2):  # step 2 runs on reloaded weights: the remediation survives the reload
        grids = flow["grids"][step]
        assert len(grids) == len(PROMPTS)
        for grid in grids.values():
            assert grid.origins, "the attention stays native: some cell differs"
            assert {region for region, _ in grid.origins} <= set(NOT_REPLACED), grid.origins
            first = grid.regions.index(grid.first_divergence[0])
            for region in grid.regions[:first]:
                row = grid.state[grid.regions.index(region)]
                assert (row[row >= 0] == EQUAL).all(), region
            # Position 0 attends to itself only: exact on both sides, so every replaced region agrees.
            assert _positions_equal(grid, 0, [r for r in grid.regions if r != "logits"]), step


def test_native_steps_differ_in_replaced_regions_too(flow: dict[str, Any]) -> None:
    for step in (0, 3):
        origins = {r for g in flow["grids"][step].values() for r, _ in g.origins}
        assert origins - set(NOT_REPLACED), (step, origins)  # vLLM's own GEMMs/norms differ too


def test_the_reload_reached_the_workers(flow: dict[str, Any]) -> None:
    assert flow["tokens"][2] != flow["tokens"][1]


def test_manifests_name_what_stays_native_and_the_contract_differs_there(flow: dict[str, Any]) -> None:
    invariant = [m for m in flow["manifests"] if m.runtime.remediation == "invariant"]
    assert {m.case for m in invariant} == {"engine_prefill", "engine_decode"}
    for manifest in invariant:
        assert manifest.runtime.remediation_native_regions == NOT_REPLACED
        assert manifest.runtime.lm_head_dtype == "float32"
        ops = " ".join(str(v) for k, v in manifest.numerical_policy.items() if k.endswith(".implementation"))
        assert "kernels.cpu.linear" in ops and "vllm.attention.CPU_ATTN" in ops
    native = [m for m in flow["manifests"] if m.runtime.remediation == "native"]
    assert native and all(m.contract.numerical_policy for m in native)
    assert invariant[0].contract.numerical_policy != native[0].contract.numerical_policy
    trainer = flow["trainer_manifests"][1][-1]
    verdict = handshake(trainer, invariant[-1])
    assert not verdict.ok and verdict.differing_regions == NOT_REPLACED
    assert verdict.reasons[0] == f"regions computed differently: {', '.join(NOT_REPLACED)}"
