"""A step's per-sample statistics are measured in cache-sized blocks of whole samples
(``audit.metrics.core.per_sample_stats``). Every stored figure must come out bit for bit as from the
one pass over the whole step (``segment_stats``, the comparator's path before the blocks): the
statistics themselves on varied steps (non-finite tokens, |Δ| past the ρ bound in one block only,
empty samples, top-k entropies), and what the comparator makes of them (per-sample rows, diagnoses,
first divergences, step figures with the frameworks' and the distribution's)."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from isoaudit.audit import compare as compare_module
from isoaudit.audit.compare import StepOutcome, compare_samples
from isoaudit.audit.metrics import blocks, core
from isoaudit.audit.metrics.blocks import block_bounds
from isoaudit.audit.metrics.families import LOG_RATIO_BOUND
from isoaudit.audit.records import SampleLogprobs

from tests import factories


def same_bits(a: core.SufficientStats, b: core.SufficientStats) -> None:
    for f in fields(core.SufficientStats):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert x.dtype == y.dtype and x.shape == y.shape, f.name
        assert x.tobytes() == y.tobytes(), f.name


@st.composite
def steps(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[Any, Any]]:
    """A step's concatenated logprobs: 0-12 samples of 0-400 tokens, noise of any size, optionally
    -inf/NaN tokens, a |Δ| beyond the ρ bound, and top-k entropies (NaN where a sample has none)."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    lengths = draw(st.lists(st.integers(0, 400), min_size=0, max_size=12))
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    n = int(offsets[-1])
    rollout = (-rng.exponential(1.0, n)).astype(np.float32)
    scale = draw(st.sampled_from([0.0, 1e-6, 1e-2, 1.0]))
    noisy = rng.random(n) < draw(st.sampled_from([0.0, 0.3, 1.0]))
    trainer = np.minimum(rollout + noisy * rng.normal(0, scale, n), 0).astype(np.float32)
    if n and draw(st.booleans()):
        trainer[rng.integers(0, n, 3)] = -np.inf
        rollout[rng.integers(0, n, 2)] = np.nan
    if n and draw(st.booleans()):  # one token far past the bound: ρ = exp(clamped Δ) for the whole step
        trainer[rng.integers(0, n)] = -(LOG_RATIO_BOUND + 5.0)
    entropies: list[Any] = [None, None]
    for side in range(2):
        if n and draw(st.booleans()):
            e = rng.random(n) * 3
            e[rng.random(n) < 0.2] = np.nan
            entropies[side] = e
    return trainer, rollout, offsets, (entropies[0], entropies[1])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step=steps(), block=st.sampled_from([1, 7, 64, 333, 1 << 15]), clip_eps=st.sampled_from([0.2, 1e-3]))
def test_blocks_give_the_one_pass_statistics_bit_for_bit(
    step: tuple[np.ndarray, np.ndarray, np.ndarray, tuple[Any, Any]], block: int, clip_eps: float
) -> None:
    trainer, rollout, offsets, entropies = step
    blocked = core.per_sample_stats(trainer, rollout, offsets, clip_eps, entropies, block_tokens=block)
    same_bits(blocked, core.segment_stats(trainer, rollout, offsets, clip_eps, entropies))


def test_a_delta_past_the_bound_in_one_block_decides_rho_for_every_block() -> None:
    rng = np.random.default_rng(0)
    offsets = np.arange(0, 4001, 100)
    rollout = (-rng.exponential(1.0, 4000)).astype(np.float32)
    trainer = np.minimum(rollout + rng.normal(0, 0.05, 4000), 0).astype(np.float32)
    trainer[3999] = -(LOG_RATIO_BOUND + 5.0)
    blocked = core.per_sample_stats(trainer, rollout, offsets, 0.2, block_tokens=250)
    same_bits(blocked, core.segment_stats(trainer, rollout, offsets, 0.2))


def test_blocks_cut_at_sample_boundaries() -> None:
    offsets = np.array([0, 5, 5, 20, 21, 60, 61])
    assert block_bounds(offsets, 10) == [0, 2, 3, 4, 5, 6]
    assert block_bounds(offsets, 1000) == [0, 6]
    assert block_bounds(np.array([0]), 10) == [0]


def varied_step(seed: int, n: int) -> tuple[list[tuple[SampleLogprobs, SampleLogprobs]], dict[str, Any]]:
    """Pairs of one step with every kind of evidence the comparator reads per token: noise on some
    samples, one identical pair, one -inf token, top-k logprobs, a |Δ| past the ρ bound in one
    sample, and fingerprints (a grid, its first divergence) for two samples."""
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(n):
        length = int(rng.integers(1, 900))
        trainer = factories.sample("trainer", step=3, seed=1000 * seed + i, n_completion=length)
        lp = trainer.logprobs.copy()
        if i % 4:
            lp = np.minimum(lp + (rng.random(length) < 0.5) * rng.normal(0, 1e-2, length), 0).astype(
                np.float32
            )
        if i == 1:
            lp[0] = -(LOG_RATIO_BOUND + 3.0)
        extra: dict[str, Any] = {}
        if i % 3 == 0:
            ids = rng.integers(0, 1000, (length, 4)).astype(np.int32)
            top = np.sort(-rng.exponential(2.0, (length, 4)), axis=1)[:, ::-1].astype(np.float32)
            extra = {"topk_ids": ids, "topk_logprobs": top}
        rollout = factories.sample(
            "rollout", step=3, seed=1000 * seed + i, n_completion=length, logprobs=lp, **extra
        )
        pairs.append((trainer, rollout))
    prints: dict[str, Any] = {}
    for trainer, rollout in pairs[:2]:
        regions = ["embed", "layers.0.attn", "layers.0.out"]
        prints[trainer.sample_key] = (
            [factories.fingerprints(trainer, r, seed=k) for k, r in enumerate(regions)],
            [
                factories.fingerprints(rollout, r, "engine_prefill", seed=k if k < 2 else 99)
                for k, r in enumerate(regions)
            ],
        )
    return pairs, prints


def outcome(pairs: list[Any], prints: dict[str, Any]) -> str:
    """Everything the worker stores of the step, as JSON (NaN spelled out, so that it compares)."""
    comparisons = compare_samples(pairs, prints)
    result = StepOutcome.of(pairs, comparisons)
    stored = {"samples": result.sample_results(), "step": result.step_result()}
    return json.dumps(stored, sort_keys=True, default=repr)


@pytest.mark.parametrize("one_pass_tokens", [0, 1 << 40], ids=["one pass", "small steps"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_comparator_stores_the_same_with_blocks(
    seed: int, one_pass_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compare_module, "ONE_PASS_TOKENS", one_pass_tokens)
    pairs, prints = varied_step(seed, 24)
    for module in (core, blocks):  # one block: the single pass over the step
        monkeypatch.setattr(module, "BLOCK_TOKENS", 1 << 40)
    whole = outcome(pairs, prints)
    for module in (core, blocks):
        monkeypatch.setattr(module, "BLOCK_TOKENS", 257)
    blocked = outcome(pairs, prints)
    assert blocked == whole
    assert '"numerical"' in whole or '"inconclusive"' in whole  # the step has diagnoses to compare
