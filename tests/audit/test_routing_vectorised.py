"""The vectorised routing comparison: set overlaps (equal cells by one integer compare, the rest
slot pair by slot pair) equal the pairwise count for any expert count (uint8 and uint16 ids, top-k
whose ids do and do not fit one integer, different top-k), and the step aggregate equals the
per-sample counts summed."""

from __future__ import annotations

import numpy as np
import pytest
from isoaudit.audit.records import Routes, SampleLogprobs
from isoaudit.audit.routing import (
    compare_sample_routes,
    set_overlap,
    set_overlap_pairwise,
    step_routing,
)


def _distinct(rng: np.random.Generator, cells: tuple[int, ...], k: int, experts: int) -> np.ndarray:
    keys = rng.random((*cells, experts))
    return np.argsort(keys, axis=-1)[..., :k].astype(np.uint8 if experts <= 256 else np.uint16)


@pytest.mark.parametrize("experts", [2, 8, 64, 65, 128, 256, 1000])
@pytest.mark.parametrize(("ka", "kb"), [(1, 1), (2, 2), (3, 3), (8, 8), (4, 2)])
def test_overlap_equals_pairwise(experts: int, ka: int, kb: int) -> None:
    if max(ka, kb) > experts:
        pytest.skip("top-k above the expert count")
    rng = np.random.default_rng(experts * 100 + ka * 10 + kb)
    a = _distinct(rng, (37, 5), ka, experts)
    b = _distinct(rng, (37, 5), kb, experts)
    b[::3, :, :kb] = a[::3, :, :kb] if ka >= kb else b[::3]  # some equal sets too
    want = set_overlap_pairwise(a, b)
    assert np.array_equal(set_overlap(a, b), want)


def _sample(side: str, tokens: np.ndarray, experts: np.ndarray, positions: np.ndarray) -> SampleLogprobs:
    n_layers = experts.shape[1]
    routes = Routes(
        layers=list(range(0, 2 * n_layers, 2)),
        top_k=experts.shape[2],
        num_experts=16,
        positions=positions.astype(np.int32),
        experts=experts.reshape(positions.size, -1),
    )
    return SampleLogprobs(
        run_id="r",
        step=0,
        side=side,
        prompt_len=4,
        token_ids=tokens,
        logprobs=np.zeros(tokens.size - 4, np.float32),
        routes=routes,
    )


def test_step_aggregate_is_the_sum_of_the_samples() -> None:
    rng = np.random.default_rng(0)
    pairs = []
    for i in range(6):
        n = 10 + 3 * i
        tokens = rng.integers(0, 100, n).astype(np.int32)
        a = _distinct(rng, (n, 3), 2, 16)
        b = a[: n - 1].copy()
        flip = rng.random((n - 1, 3)) < 0.2 * i  # sample 0 agrees everywhere
        b[flip] = _distinct(rng, (int(flip.sum()),), 2, 16)
        pairs.append(
            (_sample("trainer", tokens, a, np.arange(n)), _sample("rollout", tokens, b, np.arange(n - 1)))
        )
    summary = step_routing(pairs)
    assert summary is not None
    comparisons = [compare_sample_routes(t, r) for t, r in pairs]
    for layer in (0, 2, 4):
        entry = summary["layers"][str(layer)]
        per = [c.layer_counts()[layer] for c in comparisons]
        for name in ("tokens", "agree", "flipped_decisions", "first_flips", "decisions"):
            assert entry[name] == sum(p[name] for p in per)
        assert entry["jaccard_sum"] == pytest.approx(sum(p["jaccard_sum"] for p in per))
        flips = [p["tokens"] - p["agree"] for p in per]
        assert entry["example_flips"] == max(flips)
        assert entry["example"] == pairs[int(np.argmax(flips))][0].sample_key
    assert summary["tokens"] == sum(c.positions.size for c in comparisons)
    assert summary["flipped"] == sum(c.flipped_tokens().size for c in comparisons)
