"""An engine that returns *raw* logprobs (vLLM's default), splits long prompts into chunks and
caches prefixes.

Raw logprobs under temperature 0.7 measure a different distribution from the trainer's processed
ones: the diagnosis must say ``semantics``. A 32-token budget per step makes vLLM prefill the long
prompts in several chunks, mixed with other requests' decode steps: rows must still land on their
request and absolute position. A prompt whose first KV block comes from the prefix cache is not
computed there, so those positions must show as not observed, and the rest still map right.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import isoaudit.collectors.vllm as cv  # noqa: E402
from isoaudit.collectors.sinks import MemorySink  # noqa: E402

from tests.vllm.conftest import RUN, by_key, compare, engine, generate, prompts_of, rows_of, trainer_side  # noqa: E402

pytestmark = pytest.mark.vllm

BUDGET = 32


@pytest.fixture(scope="module")
def collected(tiny_qwen3: Path) -> Iterator[dict[str, Any]]:
    with engine(
        tiny_qwen3,
        logprobs_mode="raw_logprobs",
        enable_chunked_prefill=True,
        max_num_batched_tokens=BUDGET,
        max_num_seqs=4,
        enable_prefix_caching=True,
    ) as llm:
        sink = MemorySink()
        handle = cv.attach(llm, run=RUN, sink=sink, strict=True, validate=True)
        outputs = generate(llm, prompts_of([5, 70, 100], seed=21), max_tokens=10, seed=None)
        handle.record_step(0, outputs)
        # Step 1: a prompt sharing a 140-token prefix with one already run; its first full KV block
        # comes from the prefix cache, so the engine computes (and fingerprints) only what follows.
        shared = prompts_of([140], seed=22)[0]
        generate(llm, [shared + [7, 8]], max_tokens=2, seed=None)
        cached = generate(llm, [shared + [9, 10, 11]], max_tokens=4, seed=None)
        assert cached[0].num_cached_tokens == llm.llm_engine.vllm_config.cache_config.block_size
        handle.record_step(1, cached)
        assert sink.flush(30)
        stats = handle.stats()
        block = llm.llm_engine.vllm_config.cache_config.block_size
        handle.detach()
    trainer = trainer_side(tiny_qwen3, outputs)
    yield {
        "rollout": sink,
        "trainer": trainer,
        "stats": stats,
        "comparisons": compare(trainer, sink),
        "cached": (cached, trainer_side(tiny_qwen3, cached, step=1), block),
    }


def test_raw_logprobs_under_temperature_are_a_semantics_problem(collected: dict[str, Any]) -> None:
    samples = [s for s in collected["rollout"].of_kind("sample") if s.step == 0]
    assert {s.semantics for s in samples} == {"raw"} and len(samples) == 3
    assert collected["rollout"].of_kind("manifest")[0].runtime.logprobs_mode == "raw_logprobs"
    kinds = {key: c.diagnosis.kind for key, c in collected["comparisons"].items()}
    assert set(kinds.values()) == {"semantics"}, kinds
    for comparison in collected["comparisons"].values():
        assert "temperature=0.7" in comparison.diagnosis.sentence


def test_chunked_prefill_rows_map_to_their_positions(collected: dict[str, Any]) -> None:
    samples = {s.sample_key: s for s in collected["rollout"].of_kind("sample") if s.step == 0}
    t_prints, r_prints = (
        by_key(collected["trainer"], "fingerprints"),
        by_key(collected["rollout"], "fingerprints"),
    )
    chunked = [key for key, s in samples.items() if s.prompt_len > BUDGET]
    assert len(chunked) == 2  # these prompts cannot have been prefilled in one step
    assert collected["rollout"].of_kind("manifest")[0].runtime.chunked_prefill is True
    for key, sample in samples.items():
        n, p = sample.token_ids.size, sample.prompt_len
        assert sorted(rows_of(r_prints[key], "embed", "engine_prefill")) == list(range(p))
        assert sorted(rows_of(r_prints[key], "embed", "engine_decode")) == list(range(p, n - 1))
        for region in ("embed", "layers.0.input_norm"):
            engine_rows, trainer_rows = rows_of(r_prints[key], region), rows_of(t_prints[key], region)
            assert engine_rows == {pos: trainer_rows[pos] for pos in engine_rows}, f"{key} {region}"
        # Each chunk's last row yields logits (discarded by vLLM for a partial prompt, still computed).
        logits = sorted(rows_of(r_prints[key], "logits", "engine_prefill"))
        assert logits[-1] == p - 1 and (len(logits) > 1) == (p > BUDGET)
        # The path each sample took is on the sample: the diagnosis blames chunking only where it happened.
        assert (sample.path["prefill_chunks"] > 1) == (p > BUDGET), sample.path
    assert collected["stats"]["engine"][0]["errors"] == 0


def test_prefix_cached_positions_are_not_observed_the_rest_map_right(collected: dict[str, Any]) -> None:
    outputs, trainer, block = collected["cached"]
    rollout = collected["rollout"]
    [sample] = [s for s in rollout.of_kind("sample") if s.step == 1]
    n, p = sample.token_ids.size, sample.prompt_len
    prints = by_key(rollout, "fingerprints", 1)[sample.sample_key]
    computed = sorted(rows_of(prints, "embed", "engine_prefill"))
    assert computed == list(range(block, p)), f"{computed[:3]}... (block size {block}, prompt {p})"
    assert rows_of(prints, "embed") == {
        pos: d
        for pos, d in rows_of(by_key(trainer, "fingerprints", 1)[sample.sample_key], "embed").items()
        if block <= pos < n - 1
    }
    manifest = rollout.of_kind("manifest")[0]
    assert manifest.runtime.prefix_caching is True
    assert sample.path["prefix_cached_tokens"] == block
    # Samples of step 0 ran with caching on but found nothing cached: their path is the ordinary one.
    assert all(s.path["prefix_cached_tokens"] == 0 for s in rollout.of_kind("sample") if s.step == 0)
    comparison = compare(trainer, rollout, step=1)[sample.sample_key]
    assert (
        comparison.grid is not None and comparison.grid.has_unobserved()
    )  # the cached prefix: not observed, never "equal"
