"""An engine that returns *raw* logprobs (vLLM's default) and splits long prompts into chunks.

Raw logprobs under temperature 0.7 measure a different distribution from the trainer's processed
ones: the diagnosis must say ``semantics``. A 32-token budget per step makes vLLM prefill the long
prompts in several chunks, mixed with other requests' decode steps: rows must still land on their
request and absolute position.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import collectors.vllm as cv  # noqa: E402
from collectors.sinks import MemorySink  # noqa: E402
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
    ) as llm:
        sink = MemorySink()
        handle = cv.attach(llm, run=RUN, sink=sink, strict=True, validate=True)
        outputs = generate(llm, prompts_of([5, 70, 100], seed=21), max_tokens=10, seed=None)
        handle.record_step(0, outputs)
        assert sink.flush(30)
        stats = handle.stats()
        handle.detach()
    trainer = trainer_side(tiny_qwen3, outputs)
    yield {"rollout": sink, "trainer": trainer, "stats": stats, "comparisons": compare(trainer, sink)}


def test_raw_logprobs_under_temperature_are_a_semantics_problem(collected: dict[str, Any]) -> None:
    samples = collected["rollout"].of_kind("sample")
    assert {s.semantics for s in samples} == {"raw"} and len(samples) == 3
    assert collected["rollout"].of_kind("manifest")[0].runtime.logprobs_mode == "raw_logprobs"
    kinds = {key: c.diagnosis.kind for key, c in collected["comparisons"].items()}
    assert set(kinds.values()) == {"semantics"}, kinds
    for comparison in collected["comparisons"].values():
        assert "temperature=0.7" in comparison.diagnosis.sentence


def test_chunked_prefill_rows_map_to_their_positions(collected: dict[str, Any]) -> None:
    samples = {s.sample_key: s for s in collected["rollout"].of_kind("sample")}
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
    assert collected["stats"]["engine"][0]["errors"] == 0
