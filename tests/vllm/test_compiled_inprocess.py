"""Acceptance on vLLM's default compilation (no ``enforce_eager``), engine in this process: regions
are recorded through the graph taps, the planted fault is found at its exact region and position,
and remediation, compiled in at the step boundary, makes every region equal and the logprobs
identical."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from isoaudit.audit.grid import EQUAL  # noqa: E402
from isoaudit.audit.regions import canonical_regions  # noqa: E402
from isoaudit.collectors.fingerprint_op import INT_WIDTH  # noqa: E402
from isoaudit.collectors.fingerprints import FLOAT_WIDTH  # noqa: E402

from tests.vllm.compiled_flow import (  # noqa: E402
    FAULT_REGION,
    PROMPTS,
    fault_position,
    print_rows,
    run_flow,
)
from tests.vllm.conftest import HIDDEN, NUM_LAYERS  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROCESSES = False


@pytest.fixture(scope="module")
def flow(tiny_qwen3: Path) -> Iterator[dict[str, Any]]:
    """In this process the CPU stage is turned off: every selected row is fingerprinted inside the
    compiled graph, as on a GPU (the worker-process test runs the stage, the CPU default)."""
    from isoaudit.collectors.vllm.worker import graph

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(graph, "CPU_STAGE_ROWS", 0)
        yield run_flow(tiny_qwen3, processes=PROCESSES)


def check_compiled_flow(flow: dict[str, Any]) -> None:
    """Every acceptance check of one compiled engine's flow."""
    assert flow["refusal"] is None
    assert flow["regions"] == canonical_regions(NUM_LAYERS)
    assert flow["stats"]["errors"] == 0
    assert [flow["modes"][s].applied for s in range(3)] == ["native", "invariant", "native"]
    # Native: the engine's own kernels; regions observed inside the compiled decoder, and they differ.
    for step in (0, 2):
        compared = flow["compared"][step]
        assert len(compared) == len(PROMPTS)
        for c in compared.values():
            grid = c.grid
            assert grid is not None
            embed = grid.state[grid.regions.index("embed")]
            assert (embed[embed >= 0] == EQUAL).all() and (embed >= 0).sum() == embed.size - 1
            assert grid.origins  # vLLM's kernels are not the trainer's
        assert any(c.metrics["exact_match_fraction"] < 1.0 for c in compared.values())
    # Invariant, compiled in: every region equal at every position, logprobs identical.
    compared = flow["compared"][1]
    assert len(compared) == len(PROMPTS)
    for c in compared.values():
        assert c.metrics["logprob_abs_diff_max"] == 0.0 and c.metrics["exact_match_fraction"] == 1.0
        grid = c.grid
        assert grid is not None and sorted(grid.regions) == sorted(canonical_regions(NUM_LAYERS))
        # every position the engine computes (all but the last sampled token's) in every hidden-state
        # region; the logits where the engine samples from them
        hidden = [i for i, r in enumerate(grid.regions) if r != "logits"]
        assert (grid.state[hidden, :-1] >= 0).all()
        observed = grid.state[grid.state >= 0]
        assert (observed == EQUAL).all()
        assert not grid.origins
    # The planted fault, on the trainer side: found exactly where it is, in the faulted sample only.
    faulted = flow["faulted"][1]
    first = faulted[flow["first_key"]]
    assert first.grid is not None and first.grid.first_divergence == (FAULT_REGION, fault_position())
    for key, c in faulted.items():
        if key != flow["first_key"]:
            assert c.grid is not None and not c.grid.origins
    # The manifests say what the decoder has compiled in, and what one recompile cost.
    graphs = [m.runtime.model_dump().get("compiled_graph") for m in flow["manifests"]]
    states = {tuple(g["compiled_state"]) for g in graphs if g}
    assert (True, "invariant") in states and (True, "native") in states
    assert all(g["recompile_s"] is None or g["recompile_s"] > 0 for g in graphs if g)
    invariant = [m for m in flow["manifests"] if m.runtime.remediation == "invariant"]
    assert invariant and all(m.runtime.compilation_mode for m in invariant)
    # The kernels' launch settings of the mode the workers run: the split policy the contract
    # handshake compares, stated in the invariant mode and gone in the native one.
    for m in flow["manifests"]:
        extra = m.runtime.model_extra or {}
        if m.runtime.remediation == "invariant":
            assert isinstance(extra.get("gemm_split"), str) and "gemm_split_k" in extra
        else:
            assert "gemm_split" not in extra
    # Detach and attach again: no recompile, the same fingerprints as the first native step.
    assert flow["again_graph"]["compiles"] == flow["graph"]["compiles"] >= 2
    assert print_rows(flow["again"], 0) == print_rows(flow["first"], 0) != []
    # The graph taps' buffers, sized once: fingerprint rows (144 bytes) for every row of a forward,
    # and on the CPU a bf16 stage of CPU_STAGE_ROWS rows for decode-sized selections; bytes stated.
    tapped = [g for g in graphs if g and g["compiled_state"][0]]
    assert tapped and all(
        g["tap_buffer_bytes"]
        == g["tap_slots"]
        * (g["tap_rows"] * (INT_WIDTH * 8 + FLOAT_WIDTH * 4) + g["tap_stage_rows"] * HIDDEN * 2)
        for g in tapped
    )


def test_compiled_engine_regions_fault_and_remediation(flow: dict[str, Any]) -> None:
    check_compiled_flow(flow)
