"""Full-distribution comparison through the real vLLM engine (CPU build, in this process).

The rollout collector keeps the engine's top-k per position from ``SamplingParams(logprobs=k)`` and,
with ``logprobs=-1``, the full-vocabulary sketch. The planted fault is a real vLLM logits processor
that swaps the logits of two tokens that are not the greedy choice, picked so that vLLM's own
log-softmax gives the sampled token's logprob unchanged bit for bit: the same tokens, the same
sampled logprobs, another distribution, and the ``dist_*`` metrics name it.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from isoaudit.audit.compare import compare_samples
from isoaudit.audit.distribution import SKETCH_FLOOR
from isoaudit.audit.records import SampleLogprobs

from tests.vllm.conftest import engine, prompts_of, trainer_side

pytest.importorskip("vllm")
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor  # noqa: E402

#: Read by the processor inside the engine (which runs in this process).
PLANT = {"on": False, "rows": 0, "perturbed": 0}


class SwapOffArgmax(LogitsProcessor):
    """While ``PLANT["on"]``: in every row, swap the logit of one of the 4 most likely tokens after
    the argmax with one ranked 11th to 24th after it (so the top-8 set changes), the first such
    pair for which ``log_softmax`` at the argmax keeps every bit."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return False  # greedy requests must see it too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not PLANT["on"]:
            return logits
        for row in range(logits.shape[0]):
            PLANT["rows"] += 1
            values = logits[row]
            best = int(torch.argmax(values))
            want = values.log_softmax(dim=-1, dtype=torch.float32)[best]
            order = [t for t in torch.argsort(values, descending=True).tolist() if t != best][:24]
            for a, b in itertools.product(order[:4], order[10:24]):
                if values[a] == values[b]:
                    continue
                values[a], values[b] = values[b].clone(), values[a].clone()
                got = values.log_softmax(dim=-1, dtype=torch.float32)
                if int(torch.argmax(values)) == best and torch.equal(
                    got[best].view(torch.int32), want.view(torch.int32)
                ):
                    PLANT["perturbed"] += 1
                    break
                values[a], values[b] = values[b].clone(), values[a].clone()
        return logits


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path) -> Any:
    with engine(tiny_qwen3, max_logprobs=-1, logits_processors=[SwapOffArgmax]) as llm:
        yield llm


def run_step(
    llm: Any, prompts: list[list[int]], *, step: int, logprobs: int, plant: bool, min_tokens: int = 8
) -> tuple[list[Any], list[SampleLogprobs]]:
    """One greedy generate recorded by the real rollout collector."""
    from isoaudit.collectors.sinks import MemorySink
    from isoaudit.collectors.vllm import attach
    from vllm import SamplingParams

    handle = attach(
        llm,
        run="vllm-dist",
        sink=MemorySink(),
        regions=None,
        fingerprint=None,
        keep_records=True,
        strict=True,
        validate=True,
    )
    PLANT.update(on=plant, rows=0, perturbed=0)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=min_tokens, logprobs=logprobs)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        PLANT["on"] = False
    report = handle.record_step(step, outputs)
    handle.detach()
    assert report is not None
    return outputs, [r for r in report.records if isinstance(r, SampleLogprobs)]


def as_trainer(samples: list[SampleLogprobs]) -> list[SampleLogprobs]:
    return [s.model_copy(update={"side": "trainer"}) for s in samples]


@pytest.mark.parametrize("logprobs", [-1, 8])
def test_planted_divergence_through_the_engine(llm: Any, logprobs: int) -> None:
    prompts = prompts_of([5, 9, 3, 12])
    _, clean = run_step(llm, prompts, step=0, logprobs=logprobs, plant=False)
    _, planted = run_step(llm, prompts, step=0, logprobs=logprobs, plant=True)
    assert PLANT["perturbed"] == PLANT["rows"] > 0  # every decode row carries the fault
    n_positions = sum(s.logprobs.size for s in clean)
    for a, b in zip(clean, planted, strict=True):
        assert a.sample_key == b.sample_key  # the same tokens
        np.testing.assert_array_equal(a.logprobs.view(np.uint32), b.logprobs.view(np.uint32))
        assert a.topk_ids is not None and a.topk_ids.shape[1] == 8
        assert (a.dist_sketch is not None) == (logprobs == -1)

    results = compare_samples(list(zip(as_trainer(clean), planted, strict=True)))
    for result in results:
        m = result.metrics
        assert m["logprob_abs_diff_max"] == 0.0
        assert result.diagnosis.kind == "numerical" and result.diagnosis.evidence["cause"] == "distribution"
        assert m["dist_sampled_equal_differs"] == m["dist_positions"] == m["dist_differs_positions"] > 0
        assert (
            m["dist_topk_overlap"] < 1.0
            and m["dist_topk_rank_agreement"] < 1.0
            and m["dist_union_tv_mean"] > 0
        )
        if logprobs == -1:
            assert m["dist_sketch_hellinger_mean"] > 3 * SKETCH_FLOOR
        else:
            assert m["dist_sketch_hellinger_mean"] != m["dist_sketch_hellinger_mean"]  # NaN: no sketch
    assert sum(r.metrics["dist_positions"] for r in results) == n_positions

    # the clean run against itself: nothing differs
    again = compare_samples(list(zip(as_trainer(clean), clean, strict=True)))
    assert all(
        r.metrics["dist_differs_positions"] == 0 and r.metrics["dist_union_tv_max"] == 0 for r in again
    )


def test_engine_against_the_hf_trainer(llm: Any, tiny_qwen3: Path) -> None:
    """The real pairing: vLLM's top-k and sketch (logprobs=-1) against the HF trainer's own, on the
    same bf16 weights. Numerics alone part the distributions a little (Hellinger ~5e-4); the engine's
    ``min_tokens`` masks the end-of-sequence token out of its processed distribution, which the
    trainer does not know of: the sketch sees that mass (H ≈ √(p_eos/2)), the top-k does not."""

    def figures(min_tokens: int) -> list[dict[str, Any]]:
        prompts = prompts_of([5, 9, 3, 12], seed=1)
        outputs, rollout = run_step(llm, prompts, step=0, logprobs=-1, plant=False, min_tokens=min_tokens)
        trainer = trainer_side(tiny_qwen3, outputs, temperature=0.0).of_kind("sample")
        by_key = {s.sample_key: s for s in trainer}
        pairs = [(by_key[r.sample_key], r) for r in rollout]
        assert all(t.topk_ids is not None and t.dist_sketch is not None for t, _ in pairs)
        return [r.metrics for r in compare_samples(pairs)]

    plain, masked = figures(0), figures(8)
    for m in plain + masked:
        assert m["dist_positions"] > 0 and m["dist_topk_overlap"] >= 0.75
    assert max(m["dist_sketch_hellinger_max"] for m in plain) < 3e-3
    assert min(m["dist_sketch_hellinger_mean"] for m in masked) > 5 * max(
        m["dist_sketch_hellinger_mean"] for m in plain
    )


def test_top_k_read_in_rank_order_with_the_sampled_token_outside() -> None:
    """vLLM's per-position dict holds the top-k plus the sampled token when it ranks lower: the
    top-k is the ranked prefix, cut to the shortest any position has."""
    from types import SimpleNamespace

    from isoaudit.collectors.vllm.outputs import read_completions
    from vllm.logprobs import Logprob

    entries = [
        {7: Logprob(-0.1, rank=1), 3: Logprob(-2.5, rank=2), 9: Logprob(-4.0, rank=5)},  # 9 sampled, rank 5
        {4: Logprob(-0.7, rank=2), 5: Logprob(-0.6, rank=1)},  # sampled 4 is in the top-2
        {1: Logprob(-0.3, rank=1), 2: Logprob(-1.5, rank=2), 6: Logprob(-1.5, rank=2)},  # a tie, sampled 6
    ]
    output = SimpleNamespace(
        request_id="r",
        prompt_token_ids=[1, 2],
        outputs=[SimpleNamespace(index=0, token_ids=[9, 4, 6], logprobs=entries)],
    )
    [completion] = read_completions([output], vocab=16, k=8)
    np.testing.assert_array_equal(completion.logprobs, np.float32([-4.0, -0.7, -1.5]))
    assert completion.topk_ids is not None and completion.topk_logprobs is not None
    np.testing.assert_array_equal(completion.topk_ids, [[7, 3], [5, 4], [1, 2]])
    np.testing.assert_array_equal(
        completion.topk_logprobs, np.float32([[-0.1, -2.5], [-0.6, -0.7], [-0.3, -1.5]])
    )
    assert completion.dist_sketch is None  # not the whole vocabulary
    [none] = read_completions([output], vocab=16, k=0)
    assert none.topk_ids is None
