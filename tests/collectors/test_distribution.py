"""Full-distribution comparison on a real HF model: a distribution perturbed off the sampled token,
with every sampled-token logprob equal bit for bit, is caught by the ``dist_*`` metrics, through
the trainer collector, the store (SQLite and PostgreSQL) and the comparison worker."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from isoaudit.audit.distribution import SKETCH_FLOOR, sketch_hellinger
from isoaudit.audit.records import Run, SampleLogprobs
from isoaudit.audit.worker import ComparisonWorker
from isoaudit.collectors.layout import StepBatch
from isoaudit.collectors.logprobs import processed_logprob_rows
from isoaudit.collectors.sinks import MemorySink
from isoaudit.collectors.trainer import attach
from torch import nn

from tests.collectors.conftest import random_samples

TEMPERATURE = 0.7
RUN = "dist-planted"


def make_batch() -> StepBatch:
    prompts, completions = random_samples(6, seed=3)
    return StepBatch.padded(
        prompts, completions, padding_side="right", pad_token_id=3, temperature=TEMPERATURE
    )


def _sampled(rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return rows.gather(1, targets[:, None]).squeeze(1)


def swap_off_sampled(logits: torch.Tensor, batch: StepBatch) -> tuple[torch.Tensor, int]:
    """The planted fault: at every predicting row, swap the logit of one of the 4 most likely tokens
    with one ranked 11th to 24th (neither the sampled token, nor equal), so the top-8 set changes,
    choosing the first pair for which the collector's own arithmetic gives the sampled token's
    logprob unchanged bit for bit. Returns
    the perturbed logits and how many rows were perturbed."""
    predict, target = batch.completion_rows()
    sample_of = np.repeat(np.arange(batch.num_samples), [s.completion_len for s in batch.spans])
    temps = batch.temperature

    def sampled_of(z: torch.Tensor) -> torch.Tensor:
        rows, targets = processed_logprob_rows(z, batch.input_ids, predict, target, temps, sample_of)
        return _sampled(rows, targets)

    want = sampled_of(logits)
    out = logits.clone()
    flat = out.view(-1, out.shape[-1])
    targets = batch.input_ids.reshape(-1)[torch.from_numpy(target)]
    perturbed = 0
    for i, row in enumerate(predict.tolist()):
        s = int(targets[i])
        order = [t for t in torch.argsort(flat[row], descending=True).tolist() if t != s][:24]
        for a, b in itertools.product(order[:4], order[10:24]):
            if flat[row, a] == flat[row, b]:
                continue
            flat[row, a], flat[row, b] = flat[row, b].clone(), flat[row, a].clone()
            if torch.equal(sampled_of(out)[i].view(torch.int32), want[i].view(torch.int32)):
                perturbed += 1
                break
            flat[row, a], flat[row, b] = flat[row, b].clone(), flat[row, a].clone()  # undo, try another
    return out, perturbed


@contextmanager
def planted_head(model: nn.Module, batch: StepBatch) -> Iterator[dict[str, int]]:
    """A forward hook on ``lm_head`` that plants the fault in every forward over ``batch``."""
    seen: dict[str, int] = {}

    def hook(_module: nn.Module, _inputs: object, output: torch.Tensor) -> torch.Tensor:
        changed, n = swap_off_sampled(output, batch)
        seen["perturbed"] = n
        return changed

    handle = model.get_submodule("lm_head").register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def record(model: nn.Module, batch: StepBatch, *, side: str) -> list[SampleLogprobs]:
    """One recorded step of ``model`` over ``batch`` (a fingerprinted step: top-k and sketch)."""
    handle = attach(
        model, run=RUN, sink=MemorySink(), strict=True, keep_records=True, validate=True, distribution_k=8
    )
    with torch.no_grad():
        model(**batch.model_inputs())
    report = handle.record_step(0, batch)
    handle.detach()
    assert report is not None
    samples = [r for r in report.records if isinstance(r, SampleLogprobs)]
    return [s.model_copy(update={"side": side}) for s in samples]


def full_hellinger(model: nn.Module, batch: StepBatch, planted: bool) -> np.ndarray:
    """The exact full-vocabulary Hellinger distance per position between the clean and planted
    distributions (the truth the sketch estimates)."""
    predict, target = batch.completion_rows()
    sample_of = np.repeat(np.arange(batch.num_samples), [s.completion_len for s in batch.spans])
    with torch.no_grad():
        logits = model(**batch.model_inputs()).logits
    clean, _ = processed_logprob_rows(logits, batch.input_ids, predict, target, batch.temperature, sample_of)
    bad, _ = processed_logprob_rows(
        swap_off_sampled(logits, batch)[0] if planted else logits,
        batch.input_ids,
        predict,
        target,
        batch.temperature,
        sample_of,
    )
    p, q = torch.exp(clean.double() / 2), torch.exp(bad.double() / 2)
    return (torch.linalg.vector_norm(p - q, dim=-1) / np.sqrt(2)).numpy()


def test_planted_divergence_with_equal_sampled_logprobs_is_caught(load, store) -> None:
    model = load("qwen3")
    batch = make_batch()
    n_positions = sum(s.completion_len for s in batch.spans)
    trainer = record(model, batch, side="trainer")
    clean_rollout = record(model, batch, side="rollout")
    with planted_head(model, batch) as seen:
        rollout = record(model, batch, side="rollout")
    assert seen["perturbed"] == n_positions  # every position carries the fault

    # the precondition: every sampled-token logprob is bitwise equal; the top-k is not
    for t, r in zip(trainer, rollout, strict=True):
        assert t.sample_key == r.sample_key
        np.testing.assert_array_equal(t.logprobs.view(np.uint32), r.logprobs.view(np.uint32))
        assert t.topk_ids is not None and r.topk_ids is not None and t.topk_ids.shape[1] == 8
        assert t.dist_sketch is not None and r.dist_sketch is not None and t.dist_sketch.shape[1] == 32
    assert any(not np.array_equal(t.topk_ids, r.topk_ids) for t, r in zip(trainer, rollout, strict=True))

    # the sketch's estimate against the exact Hellinger distance of the full distributions
    truth = full_hellinger(model, batch, planted=True)
    estimate = np.concatenate(
        [sketch_hellinger(t.dist_sketch, r.dist_sketch) for t, r in zip(trainer, rollout, strict=True)]
    )
    ratio = estimate / truth
    assert truth.min() > 3 * SKETCH_FLOOR
    assert 0.8 < float(np.median(ratio)) < 1.2 and ratio.min() > 0.3 and ratio.max() < 2.0, ratio
    # the clean pair: the same bits, so the same sketch
    clean = np.concatenate(
        [sketch_hellinger(t.dist_sketch, r.dist_sketch) for t, r in zip(trainer, clean_rollout, strict=True)]
    )
    assert clean.max() == 0.0

    # through the store and the comparison worker: the planted run and a clean run
    store.ingest([Run(run_id=RUN, name="planted"), *trainer, *rollout])
    clean_run = [s.model_copy(update={"run_id": "dist-clean"}) for s in trainer + clean_rollout]
    store.ingest([Run(run_id="dist-clean", name="clean"), *clean_run])
    ComparisonWorker(store).run_once()

    results = store.sample_results(RUN, 0)
    assert len(results) == batch.num_samples
    for result in results:
        m = result.metrics
        assert m["logprob_abs_diff_max"] == 0.0  # the token metrics see nothing
        assert result.diagnosis == "numerical"  # not clean: the distributions differ
        assert result.diagnosis_detail["evidence"]["cause"] == "distribution"
        assert "agrees bit for bit, but the full distributions differ" in result.diagnosis_detail["sentence"]
        assert m["dist_sampled_equal_differs"] == m["dist_positions"] == m["dist_differs_positions"] > 0
        assert m["dist_sampled_equal_differs_fraction"] == 1.0
        assert m["dist_first_differs_position"] == 0
        assert m["dist_topk_overlap"] < 1.0 and m["dist_topk_rank_agreement"] < 1.0
        assert m["dist_union_tv_mean"] > 1e-5 and m["dist_union_kl_mean"] > 0
        assert m["dist_sketch_hellinger_mean"] > 100 * SKETCH_FLOOR
    [step] = store.step_results(RUN, 0, 0)
    assert step.metrics["dist_sampled_equal_differs"] == step.metrics["dist_positions"] == n_positions

    for result in store.sample_results("dist-clean", 0):
        m = result.metrics
        assert m["dist_positions"] > 0 and m["dist_differs_positions"] == 0
        assert result.diagnosis == "clean"
        assert m["dist_topk_overlap"] == m["dist_topk_rank_agreement"] == 1.0
        assert m["dist_union_tv_max"] == 0.0 and m["dist_union_kl_max"] == 0.0
        assert m["dist_sketch_hellinger_max"] == 0.0
        assert m["dist_first_differs_position"] is None


def test_logprobs_only_steps_record_no_distribution(load) -> None:
    """Off fingerprinted steps (``sample_every``) and with ``distribution_k=0`` nothing is added."""
    model = load("qwen3")
    batch = make_batch()
    handle = attach(model, run=RUN, sink=MemorySink(), strict=True, keep_records=True, sample_every=2)
    reports = []
    for step in range(2):
        with torch.no_grad():
            model(**batch.model_inputs())
        reports.append(handle.record_step(step, batch))
    handle.detach()
    on, off = ([r for r in rep.records if isinstance(r, SampleLogprobs)] for rep in reports)
    assert all(s.topk_ids is not None and s.dist_sketch is not None for s in on)
    assert all(s.topk_ids is None and s.dist_sketch is None for s in off)
    with pytest.raises(ValueError, match="distribution_k"):
        attach(model, run=RUN, sink=MemorySink(), distribution_k=-1)


def test_a_sketch_kernel_that_will_not_build_leaves_the_torch_path(monkeypatch, caplog) -> None:
    """A Triton that refuses the one-pass kernel (a version the code was not compiled against):
    the sketch comes from float64 torch from then on, with one warning; forced, the error shows."""
    from isoaudit.collectors import distribution
    from isoaudit.kernels import distribution as kernel

    rows = torch.log_softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(1)), dim=-1)
    want = distribution.sketch_rows(rows, "torch")
    calls = []

    def refuse(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("CompilationError: acc and out_dtype differ")

    monkeypatch.setattr(kernel, "sketch_rows", refuse)
    monkeypatch.setattr(distribution, "_KERNEL_REFUSED", None)
    monkeypatch.setattr(distribution, "resolve", lambda impl, t: impl or "triton")
    with caplog.at_level("WARNING"):
        first = distribution.distribution_rows(rows, 4)["sketch"]
        again = distribution.distribution_rows(rows, 4)["sketch"]
    assert torch.equal(first, want) and torch.equal(again, want)
    assert len(calls) == 1  # not tried again
    assert sum("sketch kernel failed" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="CompilationError"):
        distribution.sketch_rows(rows, "triton")
