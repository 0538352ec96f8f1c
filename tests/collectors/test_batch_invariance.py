"""Acceptance: the same tokens at batch size 1 and at batch size 8 — the comparator, fed by the
collector, names exactly the regions and positions whose bits differ, and nothing where they agree.

The ground truth is the raw activations of both forwards, captured by the test's own hooks and
compared bit for bit, region by region, position by position.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from isoaudit.audit.compare import compare_sample
from isoaudit.audit.grid import DIFFERS, EQUAL
from isoaudit.audit.records import RegionFingerprints, SampleLogprobs
from isoaudit.audit.regions import canonical_regions
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.sinks import MemorySink
from isoaudit.collectors.trainer import attach

from tests.collectors.conftest import NUM_LAYERS, random_samples
from tests.collectors.test_trainer import HF_MODULES


def run_and_capture(model, batch: StepBatch, sample: int):
    """Collector records of ``sample`` and the raw region rows of that sample (test's own hooks)."""
    raw: dict[str, torch.Tensor] = {}
    handles = []
    for region, module in HF_MODULES.items():

        def hook(_m, _i, out, region=region):
            tensor = out if isinstance(out, torch.Tensor) else out[0]
            raw[region] = (tensor.float() if region == "logits" else tensor).detach().clone()

        handles.append(model.get_submodule(module).register_forward_hook(hook))
    collector = attach(model, run="inv", sink=MemorySink(), strict=True, keep_records=True)
    try:
        with torch.no_grad():
            model(**batch.model_inputs())
        report = collector.record_step(0, batch)
    finally:
        collector.detach()
        for handle in handles:
            handle.remove()
    key = report.sample_keys[sample]
    records = [r for r in report.records if getattr(r, "sample_key", None) == key]
    span, start = batch.spans[sample], batch.flat_start(sample)
    rows = {name: t.reshape(-1, t.shape[-1])[start : start + span.length] for name, t in raw.items()}
    return records, rows


def as_rollout(records):
    return [r.model_copy(update={"side": "rollout"}) for r in records]


def bit_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> set[tuple[str, int]]:
    out = set()
    for region in a:
        x, y = a[region], b[region]
        ints = {2: torch.int16, 4: torch.int32}[x.element_size()]
        differs = (x.view(ints) != y.view(ints)).any(dim=-1)
        out |= {(region, int(p)) for p in torch.nonzero(differs).flatten()}
    return out


def check_grid(alone, batched, raw_alone, raw_batched):
    """Compare as trainer (batch 1) vs rollout (batch 8); assert the grid is exactly the bit truth."""
    trainer = [r for r in alone if isinstance(r, SampleLogprobs)][0]
    rollout = [r for r in as_rollout(batched) if isinstance(r, SampleLogprobs)][0]
    t_prints = [r for r in alone if isinstance(r, RegionFingerprints)]
    r_prints = [r for r in as_rollout(batched) if isinstance(r, RegionFingerprints)]
    result = compare_sample(trainer, rollout, t_prints, r_prints)
    grid = result.grid
    assert grid is not None
    assert sorted(grid.regions) == sorted(HF_MODULES)
    np.testing.assert_array_equal(grid.positions, np.arange(trainer.token_ids.size))
    truth = bit_differences(raw_alone, raw_batched)
    assert set(grid.differing_cells()) == truth
    assert ((grid.state == EQUAL) | (grid.state == DIFFERS)).all()  # every cell observed on both sides
    assert int((grid.state == EQUAL).sum()) == grid.state.size - len(truth)
    if truth:
        assert grid.first_divergence in truth
    else:
        assert grid.first_divergence is None and result.metrics["logprob_abs_diff_max"] == 0
    return truth, grid


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_1_vs_batch_8(load, dtype: torch.dtype) -> None:
    model = load("qwen3").to(dtype)
    prompts, completions = random_samples(8, seed=3)
    alone, raw_alone = run_and_capture(model, StepBatch.padded(prompts[:1], completions[:1]), 0)
    batched, raw_batched = run_and_capture(model, StepBatch.padded(prompts, completions), 0)
    truth, _ = check_grid(alone, batched, raw_alone, raw_batched)
    print(f"{dtype}: {len(truth)} differing cells, first in {sorted({r for r, _ in truth})[:3]}")


def test_one_flipped_bit_is_located(load) -> None:
    """A known difference: one mantissa bit of one element of layer 1's MLP output at one position, in the
    second of two batch-8 runs. The grid shows it there first, then wherever it propagates, and only
    there (never at earlier positions: attention is causal)."""
    model = load("qwen3")
    prompts, completions = random_samples(8, seed=3)
    position = len(prompts[0]) + 1

    def flip(_m, _i, out):
        out = out.clone()
        bits = out[0, position, 5].view(torch.int32)
        out[0, position, 5] = (bits ^ (1 << 20)).view(
            torch.float32
        )  # a mantissa bit that survives the residual add
        return out

    alone, raw_alone = run_and_capture(model, StepBatch.padded(prompts, completions), 0)
    handle = model.get_submodule("model.layers.1.mlp").register_forward_hook(flip)
    try:
        batched, raw_batched = run_and_capture(model, StepBatch.padded(prompts, completions), 0)
    finally:
        handle.remove()
    truth, grid = check_grid(alone, batched, raw_alone, raw_batched)
    assert grid.first_divergence == ("layers.1.mlp", position)
    regions = canonical_regions(NUM_LAYERS)
    first = regions.index("layers.1.mlp")
    assert ("layers.1.mlp", position) in truth
    assert all(regions.index(region) >= first and pos >= position for region, pos in truth)
    assert ("logits", position) in truth  # it reaches the logprob of the next token
