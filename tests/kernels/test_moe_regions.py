"""The MoE regions of HF's Qwen3-MoE and Mixtral (``layers.i.router``, ``layers.i.experts``,
``layers.i.combine``) are fingerprinted on the trainer with the invariant kernels on and off (CPU,
fp32), and tapping them never changes a bit of what the model computes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

# The collectors need the service stack (pydantic), which a GPU machine running `tests/kernels -m
# gpu` may lack; these tests are CPU ones, so there the module is skipped, not an error.
pytest.importorskip("pydantic")

import isoaudit.collectors.trainer as trainer
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.sinks import MemorySink
from isoaudit.collectors.tiny_models import load_tiny_model, make_tiny_model
from isoaudit.kernels import moe
from isoaudit.kernels.adapters_moe import ExpertSlots, moe_blocks

from isoaudit import kernels

PROMPTS = [[5, 17, 33, 2, 90], [7, 8, 9], [100, 4, 66, 12, 3, 41, 7]]
COMPLETIONS = [[11, 12, 13], [14, 15, 16, 17], [18, 19]]
MOE = [f"layers.{i}.{sub}" for i in (0, 1) for sub in ("router", "experts", "combine")]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = request.param
    return make_tiny_model(family, tmp_path_factory.mktemp(family) / family, hidden=64, seed=2)


def _fingerprinted(path: Path, enabled: bool) -> tuple[list[str], set[str], dict[str, str]]:
    model, _ = load_tiny_model(path, dtype=torch.float32)
    sink = MemorySink()
    with kernels.enable() if enabled else kernels.disable():
        handle = trainer.attach(
            model, run="moe-regions", sink=sink, remediation_hook=None, async_transfer=False, strict=True
        )
        handle.record_step(0, StepBatch.padded(PROMPTS, COMPLETIONS))
        handle.detach()
    assert sink.flush(10)
    prints = sink.of_kind("fingerprints")
    return handle.regions, {p.region for p in prints}, handle.resolved.unobserved


@pytest.mark.parametrize("enabled", [False, True], ids=["kernels-off", "kernels-on"])
def test_router_experts_and_combine_are_fingerprinted(tiny: Path, enabled: bool) -> None:
    regions, printed, unobserved = _fingerprinted(tiny, enabled)
    assert set(MOE) <= set(regions), regions
    assert set(MOE) <= printed, sorted(set(MOE) - printed)
    assert not any(name.split(".")[-1] in ("router", "experts", "combine") for name in unobserved)


def _taps(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict[int, dict[str, torch.Tensor]]]:
    """The logits and, per MoE layer, what the three region modules output."""
    seen: dict[int, dict[str, torch.Tensor]] = {}
    handles = []
    for i, block in moe_blocks(model):
        seen[i] = {}

        def keep(name: str, layer: int) -> Any:
            def hook(_m: Any, _a: Any, out: Any) -> None:
                seen[layer][name] = (out[0] if isinstance(out, tuple) else out).detach().clone()
                if name == "router":
                    seen[layer]["weights"], seen[layer]["chosen"] = out[1].detach(), out[2].detach()

            return hook

        handles += [
            block.gate.register_forward_hook(keep("router", i)),
            block.experts.slots.register_forward_hook(keep("experts", i)),
            block.experts.register_forward_hook(keep("combine", i)),
        ]
    with torch.no_grad():
        logits = model(ids).logits
    for h in handles:
        h.remove()
    return logits, seen


@pytest.mark.parametrize("enabled", [False, True], ids=["kernels-off", "kernels-on"])
def test_the_taps_hold_the_layer_and_change_no_bit(tiny: Path, enabled: bool) -> None:
    model, _ = load_tiny_model(tiny, dtype=torch.float32)
    ids = torch.tensor([PROMPTS[2] + COMPLETIONS[2]])
    with kernels.enable() if enabled else kernels.disable():
        untapped = model(ids).logits.detach()  # before any region exists
        trainer.attach(model, run="r", sink=MemorySink(), remediation_hook=None).detach()  # adds the tap
        logits, seen = _taps(model, ids)
    assert torch.equal(logits, untapped)
    assert all(isinstance(b.experts.slots, ExpertSlots) for _, b in moe_blocks(model))
    for layer in seen.values():
        t, k = layer["chosen"].shape
        assert layer["router"].dtype == (torch.float32) and layer["router"].shape == (t, 8)
        slots = layer["experts"].reshape(t, k, -1)
        if enabled:  # the invariant combine of exactly these slot outputs, bit for bit
            assert torch.equal(moe.combine(slots, layer["weights"].float(), slots.dtype), layer["combine"])
        else:  # HF's index_add_ of its own weighted slot outputs
            combined = (slots * layer["weights"][..., None]).sum(1)
            torch.testing.assert_close(combined, layer["combine"], rtol=1e-5, atol=1e-6)
