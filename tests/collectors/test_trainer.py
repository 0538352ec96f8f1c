"""The trainer collector on tiny HF Qwen3 and Llama models (CPU)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from isoaudit.audit.records import RegionFingerprints, SampleLogprobs, sample_key
from isoaudit.audit.regions import canonical_regions
from isoaudit.collectors.control import FixedControl
from isoaudit.collectors.fingerprints import fingerprint_rows
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.sinks import MemorySink
from isoaudit.collectors.trainer import attach
from torch import nn

from tests.collectors.conftest import NUM_LAYERS, random_samples

TEMPERATURE = 0.7

#: Written out here, independently of collectors.regions, so a wrong family map fails these tests.
HF_MODULES = {"embed": "model.embed_tokens", "final_norm": "model.norm", "logits": "lm_head"}
for _i in range(NUM_LAYERS):
    HF_MODULES |= {
        f"layers.{_i}.input_norm": f"model.layers.{_i}.input_layernorm",
        f"layers.{_i}.attn": f"model.layers.{_i}.self_attn.o_proj",
        f"layers.{_i}.post_attn_norm": f"model.layers.{_i}.post_attention_layernorm",
        f"layers.{_i}.mlp": f"model.layers.{_i}.mlp",
        f"layers.{_i}.out": f"model.layers.{_i}",
    }


def make_batch(layout: str, n: int = 5, seed: int = 0) -> StepBatch:
    prompts, completions = random_samples(n, seed)
    if layout == "packed":
        return StepBatch.packed(prompts, completions, temperature=TEMPERATURE)
    return StepBatch.padded(
        prompts, completions, padding_side=layout, pad_token_id=3, temperature=TEMPERATURE
    )


def raw_activations(model: nn.Module, batch: StepBatch) -> dict[str, torch.Tensor]:
    """Each canonical region's output of one forward, captured by hooks of the test's own."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for region, module in HF_MODULES.items():

        def hook(_m, _i, out, region=region):
            tensor = out if isinstance(out, torch.Tensor) else out[0]
            seen[region] = (tensor.float() if region == "logits" else tensor).detach().clone()

        handles.append(model.get_submodule(module).register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(**batch.model_inputs())
    finally:
        for handle in handles:
            handle.remove()
    return seen


def samples_of(records) -> list[SampleLogprobs]:
    return [r for r in records if isinstance(r, SampleLogprobs)]


def prints_of(records) -> list[RegionFingerprints]:
    return [r for r in records if isinstance(r, RegionFingerprints)]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("layout", ["right", "left", "packed"])
def test_logprobs_and_every_region_line_up(load, family: str, layout: str) -> None:
    model = load(family)
    batch = make_batch(layout)
    raw = raw_activations(model, batch)
    handle = attach(model, run="r", sink=MemorySink(), strict=True, keep_records=True, validate=True)
    with torch.no_grad():
        model(**batch.model_inputs())  # the trainer's forward: the hooks see it
    report = handle.record_step(0, batch)
    assert report is not None and not report.own_forward
    samples, prints = samples_of(report.records), prints_of(report.records)
    assert len(samples) == batch.num_samples

    reference = torch.log_softmax(raw["logits"] / TEMPERATURE, dim=-1)
    flat_ref = reference.reshape(-1, reference.shape[-1])
    rows_of = {name: fingerprint_rows(t.reshape(-1, t.shape[-1])) for name, t in raw.items()}
    for i, (span, record) in enumerate(zip(batch.spans, samples, strict=True)):
        start = batch.flat_start(i)
        tokens = batch.input_ids.reshape(-1)[start : start + span.length].numpy()
        assert record.sample_key == sample_key(tokens[: span.prompt_len], tokens[span.prompt_len :])
        np.testing.assert_array_equal(record.token_ids, tokens)
        assert record.prompt_len == span.prompt_len and record.temperature == pytest.approx(TEMPERATURE)
        expected = np.array(
            [flat_ref[start + p - 1, tokens[p]].item() for p in range(span.prompt_len, span.length)],
            np.float32,
        )
        np.testing.assert_array_equal(record.logprobs, np.minimum(expected, 0))  # bit for bit

        mine = {p.region: p for p in prints if p.sample_key == record.sample_key}
        assert sorted(mine) == sorted(canonical_regions(NUM_LAYERS))
        for region, fp in mine.items():
            np.testing.assert_array_equal(fp.positions, np.arange(span.length))
            want = rows_of[region].select(slice(start, start + span.length)).to_host()
            np.testing.assert_array_equal(fp.digest, want.digest, err_msg=region)
            np.testing.assert_array_equal(fp.ladder, want.ladder, err_msg=region)
            np.testing.assert_array_equal(fp.sketch, want.sketch, err_msg=region)
            assert fp.case == "trainer_fwd" and fp.side == "trainer"
    handle.detach()


def test_padded_and_packed_agree_on_positions(load) -> None:
    """The same samples padded either side or packed: the same keys and positions, and the embedding
    rows (a pure lookup, exact in any layout) have the same digests at the same positions."""
    model = load("qwen3")
    by_layout = {}
    for layout in ("right", "left", "packed"):
        sink = MemorySink()
        handle = attach(model, run="r", sink=sink, strict=True, keep_records=True, regions=["embed"])
        report = handle.record_step(0, make_batch(layout))
        handle.detach()
        by_layout[layout] = report.records
    keys = {layout: [s.sample_key for s in samples_of(recs)] for layout, recs in by_layout.items()}
    assert keys["right"] == keys["left"] == keys["packed"]
    for layout in ("left", "packed"):
        for a, b in zip(prints_of(by_layout["right"]), prints_of(by_layout[layout]), strict=True):
            np.testing.assert_array_equal(a.positions, b.positions)
            np.testing.assert_array_equal(a.digest, b.digest)
        for a, b in zip(samples_of(by_layout["right"]), samples_of(by_layout[layout]), strict=True):
            np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_detach_leaves_the_model_bit_identical(load) -> None:
    attached, pristine = load("llama"), load("llama")
    batch = make_batch("right")
    handle = attach(attached, run="r", sink=MemorySink(), strict=True)
    with torch.no_grad():
        during = attached(**batch.model_inputs()).logits
    handle.record_step(0, batch)
    handle.detach()
    assert not handle.attached
    for module in attached.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    with torch.no_grad():
        after = attached(**batch.model_inputs()).logits
        never = pristine(**batch.model_inputs()).logits
    assert torch.equal(after, never)
    assert torch.equal(during, never)  # the hooks read outputs, never change them


def test_given_logprobs_in_every_layout(load) -> None:
    model = load("qwen3")
    batch = make_batch("right")
    with torch.no_grad():
        logits = model(**batch.model_inputs()).logits
    lp_all = torch.log_softmax(logits.float() / TEMPERATURE, -1)
    shifted = lp_all[:, :-1].gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)  # [rows, cols-1]
    tokens = torch.cat([torch.zeros_like(shifted[:, :1]), shifted], dim=1)  # value at the token's position
    per_sample = [tokens[s.row, s.start + s.prompt_len : s.start + s.length] for s in batch.spans]
    completion = torch.zeros(batch.num_samples, max(s.completion_len for s in batch.spans))
    for i, values in enumerate(per_sample):
        completion[i, : values.numel()] = values
    handle = attach(model, run="r", sink=MemorySink(), regions=None, strict=True, keep_records=True)
    computed = samples_of(handle.record_step(0, batch).records)
    for given in (shifted, tokens, completion, per_sample, [v.numpy() for v in per_sample]):
        report = handle.record_step(1, batch, logprobs=given)
        assert not report.own_forward  # nothing to compute: no forward needed
        for a, b in zip(computed, samples_of(report.records), strict=True):
            np.testing.assert_array_equal(a.logprobs, b.logprobs)
    with pytest.raises(ValueError, match="logprobs"):
        handle.record_step(2, batch, logprobs=torch.zeros(3, 3))
    handle.detach()


def test_sample_every_fingerprints_only_sampled_steps_without_extra_forwards(load) -> None:
    model = load("qwen3")
    batch = make_batch("packed", n=3)
    handle = attach(model, run="r", sink=MemorySink(), sample_every=2, strict=True)
    counts = []
    for step in range(4):
        handle.begin_step(step)
        with torch.no_grad():
            model(**batch.model_inputs())
        counts.append(handle.record_step(step, batch).n_fingerprint_records)
    n_regions = len(canonical_regions(NUM_LAYERS))
    assert counts == [3 * n_regions, 0, 3 * n_regions, 0]
    assert handle.counters.own_forwards == 0
    handle.detach()


def test_training_forward_with_grad_and_checkpointing(load) -> None:
    """A real training step (grad, backward through checkpointed layers): recording reads the
    trainer's forward, and recomputation in backward does not disturb the capture."""
    model = load("llama").train()
    model.gradient_checkpointing_enable()
    batch = make_batch("right", n=3)
    handle = attach(model, run="r", sink=MemorySink(), strict=True, keep_records=True)
    out = model(**batch.model_inputs())
    out.logits.float().logsumexp(-1).mean().backward()
    report = handle.record_step(0, batch)
    assert not report.own_forward
    assert report.n_fingerprint_records == 3 * len(canonical_regions(NUM_LAYERS))
    handle.detach()


class ToyLM(nn.Module):
    """Not an HF model: regions come from an explicit map."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU())
        self.head = nn.Linear(16, 64)

    def forward(self, input_ids: torch.Tensor, **_: object) -> torch.Tensor:
        return self.head(self.block(self.emb(input_ids)))


def test_explicit_region_map_on_any_module() -> None:
    torch.manual_seed(0)
    model = ToyLM()
    sink = MemorySink()
    handle = attach(
        model,
        run="toy",
        sink=sink,
        regions={"embed": "emb", "layers.0.mlp": "block", "logits": "head"},
        strict=True,
        keep_records=True,
    )
    assert handle.regions == ["embed", "layers.0.mlp", "logits"]
    assert "layers.0.attn" in handle.manifest.unobserved and handle.manifest.regions == handle.regions
    batch = StepBatch.padded([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]])
    report = handle.record_step(0, batch)
    with torch.no_grad():
        logits = model(batch.input_ids).float()
    lp = torch.log_softmax(logits, -1)
    first = samples_of(report.records)[0]
    np.testing.assert_array_equal(first.logprobs, [lp[0, 2, 6].item(), lp[0, 3, 7].item()])
    assert {p.region for p in prints_of(report.records)} == {"embed", "layers.0.mlp", "logits"}
    handle.detach()


def test_arguments_are_checked_and_named(load) -> None:
    model = load("qwen3")
    with pytest.raises(ValueError, match="regions"):
        attach(model, run="r", sink=MemorySink(), regions={"embed": "model.nope"})
    with pytest.raises(ValueError, match="regions"):
        attach(model, run="r", sink=MemorySink(), regions={"layers.0.feedforward": "model.layers.0.mlp"})
    with pytest.raises(ValueError, match="sample_every"):
        attach(model, run="r", sink=MemorySink(), sample_every=0)
    with pytest.raises(ValueError, match="regions"):
        attach(ToyLM(), run="r", sink=MemorySink())  # no built-in map for it
    with pytest.raises(ValueError, match="prompt_lens"):
        StepBatch.padded([[]], [[1, 2]])
    handle = attach(model, run="r", sink=MemorySink(), strict=True)
    with pytest.raises(ValueError, match="batch"):
        handle.record_step(0, {"input_ids": torch.ones(1, 4, dtype=torch.long)})
    handle.detach()


def test_never_raises_into_the_loop_by_default(load, caplog: pytest.LogCaptureFixture) -> None:
    model = load("qwen3")
    handle = attach(model, run="r", sink=MemorySink())
    with caplog.at_level(logging.WARNING):
        assert handle.record_step(0, {"input_ids": torch.ones(1, 4, dtype=torch.long)}) is None
        assert handle.record_step(1, {"input_ids": torch.ones(1, 4, dtype=torch.long)}) is None
    assert handle.counters.errors == 2
    assert sum("record_step failed" in r.message for r in caplog.records) == 1  # logged once
    handle.detach()


def test_manifest_on_attach_on_change_and_remediation_control(load) -> None:
    model = load("qwen3")
    sink = MemorySink()
    applied: list[str] = []
    control = FixedControl("r")
    handle = attach(
        model,
        run="r",
        sink=sink,
        control=control,
        regions=["embed"],
        strict=True,
        contract={"numerical_policy": "a" * 64},
        remediation_hook=lambda _m, mode: applied.append(mode),
    )
    batch = make_batch("packed", n=2)
    handle.record_step(0, batch)
    handle.record_step(1, batch)
    sink.flush()
    manifests = sink.of_kind("manifest")
    assert len(manifests) == 1 and sink.of_kind("run")[0].run_id == "r"
    first = manifests[0]
    assert first.side == "trainer" and first.case == "trainer_fwd" and first.regions == ["embed"]
    assert first.runtime.dtype == "float32" and first.runtime.remediation == "native"
    assert first.runtime.framework == "transformers" and first.contract.numerical_policy == "a" * 64

    control.set("invariant")  # what the dashboard's toggle does
    handle.record_step(2, batch)
    assert applied == ["invariant"] and handle.mode == "invariant"
    handle.record_step(3, batch)  # the next step reports the applied mode
    handle.record_step(4, batch)
    model.to(torch.bfloat16)
    handle.record_step(5, batch)
    sink.flush()
    manifests = sink.of_kind("manifest")
    assert [(m.runtime.remediation, m.runtime.dtype) for m in manifests] == [
        ("native", "float32"),
        ("invariant", "float32"),
        ("invariant", "bfloat16"),
    ]
    assert applied == ["invariant"]  # the same control version is applied once
    handle.detach()


def test_steps_whose_copy_is_still_travelling_are_finished_later_in_order(load, monkeypatch) -> None:
    """The CUDA path lets a step's arrays travel while training goes on: simulate copies that land
    only after a few polls, and check records arrive complete, in step order, by flush at the latest."""
    import isoaudit.collectors.trainer as trainer_module
    from isoaudit.collectors.transfer import HostCopy

    class SlowCopy(HostCopy):
        def __init__(self, tensors, **kwargs) -> None:
            super().__init__(tensors, **kwargs)
            self.polls = 0

        def ready(self) -> bool:
            self.polls += 1
            return self.polls > 3

    monkeypatch.setattr(trainer_module, "HostCopy", SlowCopy)
    model = load("qwen3")
    sink = MemorySink()
    handle = attach(model, run="r", sink=sink, regions=["embed"], strict=True, max_inflight=2)
    batch = make_batch("packed", n=2)
    reports = [handle.record_step(step, batch) for step in range(5)]
    assert all(r.deferred for r in reports)
    assert handle.flush(10)
    steps = [r.step for r in sink.of_kind("sample")]
    assert steps == sorted(steps) and steps == [s for s in range(5) for _ in range(2)]
    assert len(sink.of_kind("fingerprints")) == 5 * 2 and handle.counters.samples == 10
    handle.record_step(5, batch)
    handle.detach()  # finishes what is in flight
    assert handle.sink.flush(10) and len(sink.of_kind("sample")) == 12
